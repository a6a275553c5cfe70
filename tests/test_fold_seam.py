"""fold's seam marker leaves nothing of itself in what the draft computes: the loop sees the seed's own
lists, dicts, tensor identities and layouts while Dynamo traces it, and wherever the marker is not
removed by the seed fold (the fold off, a force_eager stance, a fold traced inside another compiled
region) the loop reads the seed's values, not copies. Each case below gave other results than
`loop(*seed(...))` before (a review of fold on patterns of public draft workers)."""

import collections
import functools
import warnings

import pytest
import torch

import draftfuse

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

torch.manual_seed(0)
HEAD = torch.randn(8, 16)


def pick(h):
    return torch.softmax(h @ HEAD, -1).topk(1, -1)[1]


def _calls(draft, eager, make_args, calls=3):
    """Each call's result and arguments, draftfuse's and eager's, on fresh arguments per call."""
    for _ in range(calls):
        args, twin = make_args(), None
        twin = [a.clone() if isinstance(a, torch.Tensor) else _copy(a) for a in args]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield draft(*args), eager(*twin), args, twin


def _copy(value):
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value.clone() if isinstance(value, torch.Tensor) else value


def _seed_then_loop(seed, loop):
    return lambda *args: loop(*seed(*args))


# ---- containers: the caller's list and dict, mutated by the loop ----


def list_seed(x, tokens, meta):
    tokens.append(pick(x))
    return x, tokens, meta


def list_loop(x, tokens, meta):
    for _ in range(3):
        x = torch.tanh(x + 1)
        tokens.append(pick(x))
    meta["seq_lens"] = meta["seq_lens"] + 3
    return x


def test_the_loop_appends_to_the_callers_list_and_sets_its_dict():
    draft = draftfuse.fold(list_seed, list_loop)
    make = lambda: (torch.randn(2, 8), [], {"seq_lens": torch.tensor([5, 6])})  # noqa: E731
    for got, want, args, twin in _calls(draft, _seed_then_loop(list_seed, list_loop), make):
        torch.testing.assert_close(got, want)
        assert len(args[1]) == len(twin[1]) == 4
        assert all(torch.equal(a, b) for a, b in zip(args[1], twin[1]))
        assert torch.equal(args[2]["seq_lens"], twin[2]["seq_lens"])


def state_seed(x, state):  # a worker's state object, passed in and returned by the seed
    state["h"] = torch.tanh(x)
    state["n"] = torch.ones(())
    return pick(state["h"]), state


def state_loop(token, state):
    tokens = [token]
    for _ in range(3):
        state["h"] = torch.tanh(state["h"] + 1)
        state["n"] = state["n"] + 1
        tokens.append(pick(state["h"]))
    return torch.cat(tokens, 1)


@pytest.mark.parametrize("make", [collections.OrderedDict, lambda: collections.defaultdict(int)], ids=["OrderedDict", "defaultdict"])
def test_the_loop_writes_reach_the_callers_dict_subclass(make):
    """A dict subclass went through torch's pytree, which handed the loop a copy: the caller's state kept
    the seed's values (n = 1, not 4), and a server reusing it drafted other tokens (helper-65)."""
    draft = draftfuse.fold(state_seed, state_loop)
    for got, want, args, twin in _calls(draft, _seed_then_loop(state_seed, state_loop), lambda: (torch.randn(2, 8), make())):
        assert torch.equal(got, want)
        assert type(args[1]) is not dict and float(args[1]["n"]) == float(twin[1]["n"]) == 4.0  # the caller's own object
        torch.testing.assert_close(args[1]["h"], twin[1]["h"])


def pop_seed(x, kind):
    h = torch.tanh(x)
    return (pick(h), [h * 0.5, h]) if kind == "list" else (pick(h), {"half": h * 0.5, "h": h})


def pop_loop(token, hs):
    h = hs.pop() if isinstance(hs, list) else hs.pop("h")  # the loop takes an entry out of the seed's container
    tokens = [token]
    for _ in range(2):
        h = torch.tanh(h + 1)
        tokens.append(pick(h))
    return torch.cat(tokens, 1), hs


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_the_loop_may_remove_entries_of_the_seeds_containers(kind):
    """Putting the seed's objects back after the loop looked them up where the seed had them: a loop that
    popped one raised IndexError / KeyError, reported at draftfuse's own line as the draft's (helper-65)."""
    draft = draftfuse.fold(pop_seed, pop_loop)
    for got, want, _, _ in _calls(draft, _seed_then_loop(pop_seed, pop_loop), lambda: (torch.randn(2, 8), kind)):
        assert torch.equal(got[0], want[0])
        left = got[1] if kind == "list" else list(got[1].values())
        assert len(left) == 1
        torch.testing.assert_close(left[0], (want[1] if kind == "list" else list(want[1].values()))[0])


# ---- identity and layout of the seed's outputs, read by the loop's Python ----


def twice_seed(x):
    h = torch.tanh(x @ HEAD[:, :8])
    return h, h, pick(h)


def twice_loop(last, hidden, token):
    step = 1.0 if last is hidden else -1.0  # an MTP worker's outputs: one tensor under two names
    tokens = [token]
    for _ in range(3):
        hidden = torch.tanh(hidden + step)
        tokens.append(pick(hidden))
    return torch.cat(tokens, 1)


def strided_seed(x):
    wide = torch.tanh(torch.cat([x, x * 2], 1))
    return wide[:, ::2], pick(x)  # a strided view, as a slice of a fused projection's output is


def strided_loop(h, token):
    step = 1.0 if h.is_contiguous() else -1.0
    tokens = [token]
    for _ in range(3):
        h = torch.tanh(h + step * h.stride(-1))
        tokens.append(pick(h))
    return torch.cat(tokens, 1)


@pytest.mark.parametrize("seed, loop", [(twice_seed, twice_loop), (strided_seed, strided_loop)], ids=["same tensor twice", "strided view"])
def test_the_loop_sees_the_seeds_identities_and_layouts(seed, loop):
    draft = draftfuse.fold(seed, loop)
    for got, want, _, _ in _calls(draft, _seed_then_loop(seed, loop), lambda: (torch.randn(3, 8),)):
        assert torch.equal(got, want)


# ---- where the marker is not folded away ----


def position_seed(x, positions):
    positions.add_(1)
    return x, positions


def position_loop(x, positions):
    tokens = []
    for _ in range(2):
        positions.add_(1)
        x = torch.tanh(x + positions[:, None])
        tokens.append(pick(x))
    return torch.cat(tokens, 1)


def _position_args():
    return torch.randn(3, 8), torch.zeros(3)


def _check_positions(draft, calls=3):
    eager = _seed_then_loop(position_seed, position_loop)
    positions, twin = torch.zeros(3), torch.zeros(3)
    for _ in range(calls):  # the same buffers every call, as a server's
        x = torch.randn(3, 8)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, want = draft(x.clone(), positions), eager(x.clone(), twin)
        assert torch.equal(got, want) and torch.equal(positions, twin), (positions, twin)


def test_with_the_seed_fold_off_the_loop_writes_the_seeds_values():
    _check_positions(draftfuse.fold(position_seed, position_loop, options={"seed_fold": False}))


def test_under_a_force_eager_stance_the_loop_writes_the_seeds_values():
    draft = draftfuse.fold(position_seed, position_loop)
    with torch.compiler.set_stance("force_eager"):
        _check_positions(draft)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_fold_inside_another_compiled_region_writes_the_seeds_values(backend):
    draft = draftfuse.fold(position_seed, position_loop)
    _check_positions(torch.compile(lambda x, p: draft(x, p), backend=backend, fullgraph=True))


# ---- the seed's defaults, through decorators ----


class DecoratedWorker:
    @torch.no_grad()
    def seed(self, x, scale=2.0):
        return x * scale, pick(x * scale)


@torch.inference_mode()
def decorated_seed(x, scale=2.0):
    return x * scale, pick(x * scale)


def scaled_seed(bias, x, scale=2.0):
    return x * scale + bias, pick(x * scale)


def steps(x, token):
    tokens = [token]
    for _ in range(2):
        x = torch.tanh(x + 1)
        tokens.append(pick(x))
    return torch.cat(tokens, 1)


@pytest.mark.parametrize(
    "seed",
    [DecoratedWorker().seed, decorated_seed, functools.partial(scaled_seed, 0.5)],
    ids=["no_grad method", "inference_mode function", "partial"],
)
def test_a_decorated_seeds_default_is_used_when_the_argument_is_left_out(seed):
    draft = draftfuse.fold(seed, steps)
    for got, want, _, _ in _calls(draft, _seed_then_loop(seed, steps), lambda: (torch.randn(2, 8),)):
        assert torch.equal(got, want)
