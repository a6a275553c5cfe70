"""The selection ops (torch.ops.draftfuse.argmax_prob / topk_prob) against their torch references.

- CPU: the references against softmax + topk/argmax (with and without a scale), the scale's rules,
  the ops' schemas and fake implementations (torch.library.opcheck), a Dynamo + AOT capture; the k > 1
  kernel compiled for sm_90 (PTX, nothing run) prefetching into L2 from 16-bit logits only.
- Triton's interpreter (TRITON_INTERPRET=1, on CPU): the kernel against the references on every
  dtype, ragged and large vocabularies, forced and automatic splits, k from 1 to 16, ties, NaN,
  +-inf, -0.0, all-equal rows, per-row scales of every sign (0 and NaN too) and a 0-d one, little
  room for k > 1's candidates, and 40 random draws over those hazards; pass 2's floor moved from
  y = x * s to u = x * sign(s) (_u_floor) on 20000 random float32 pairs over the whole range; after it
  the shared workspace must be back to its idle state. Triton reads that variable when a kernel is
  defined, so these cases run in a subprocess started with it (`python -m tests.test_kernels DTYPE...`
  runs them by hand). The interpreter runs programs one after another, so the first program of a
  row always sees no other's slots and the last sees all: both ends of pass 2's floor. Cases are
  spread over the dtypes, in one subprocess, to stay near 30 s on a 2-core CPU. Skipped, saying
  why, where Triton is not installed.
- `cuda`: the same on the GPU at the benchmark's sizes, with and without scales, other tilings,
  PDL on and off, the workspace's idle state, CUDA-graph capture (with and without a workspace made
  before it) and torch.compile.
"""

import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

from draftfuse.kernels import argmax_prob_reference, selection_kernels_available, topk_prob_reference
from draftfuse.kernels import selection as _selection

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAN, INF = float("nan"), float("inf")
INT32_MIN = -(2**31)
# one scale per special row (10 rows): both signs, 0, NaN, tiny, and large enough to overflow y
SPECIAL_SCALES = (1.0, -1.0, 0.0, 0.5, -2.0, NAN, 3.0, -0.5, 1e-3, 1e30)


def special_rows(vocab: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Rows that exercise the order and the special values; every row has `vocab` elements."""
    g = torch.Generator().manual_seed(vocab)
    randn = lambda: torch.randn(vocab, generator=g)  # noqa: E731
    rows = [randn() * 3]
    rows.append(torch.randint(0, 3, (vocab,), generator=g).float())  # many exact ties
    rows.append(torch.full((vocab,), 0.5))  # all equal
    row = randn(); row[vocab // 3] = row[-1] = NAN; rows.append(row)  # NaN wins, first one
    row = randn(); row[vocab // 2] = row[vocab // 5] = INF; rows.append(row)  # first +inf; prob NaN
    row = torch.full((vocab,), -INF); row[-1] = 1.0; row[vocab // 2] = 1.0; rows.append(row)  # -inf elsewhere
    rows.append(torch.full((vocab,), -INF))  # all -inf: index 0, prob NaN
    row = torch.zeros(vocab); row[::2] = -0.0; rows.append(row)  # -0.0 ties with +0.0
    row = randn(); row[-1] = 100.0; rows.append(row)  # max in the ragged tail
    row = randn() * 200; rows.append(row)  # large logits: most exp terms underflow
    return torch.stack(rows).to(dtype).to(device)


def special_scales(rows: int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor([SPECIAL_SCALES[i % len(SPECIAL_SCALES)] for i in range(rows)], device=device)


def rounding_ties(device: str = "cpu") -> torch.Tensor:
    """float32 rows of distinct values whose products with 0.75 round to ties (x in [1.5, 2): the
    products' spacing is 3/4 of an ulp), ascending and shuffled: x * s must not decide the order."""
    x = 1.5 + torch.arange(4096, dtype=torch.float64) * 2.0**-23
    g = torch.Generator().manual_seed(1)
    return torch.stack([x, x[torch.randperm(4096, generator=g)], -x]).float().to(device)


def check_selection(
    logits: torch.Tensor, k: int, log: bool, prob: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None = None
) -> str:
    """'' if (prob, index) from the kernels equal the reference (run where the logits are), else what
    differs."""
    want_prob, want_index = topk_prob_reference(logits, k, log, scale)
    want_prob, want_index = want_prob.cpu(), want_index.cpu()
    prob, index = prob.cpu().reshape(want_prob.shape), index.cpu().reshape(want_index.shape)
    if not torch.equal(index, want_index):
        rows = (index != want_index).any(-1).nonzero().flatten().tolist()
        return f"index differs in rows {rows[:8]}: {index[rows[0]].tolist()} != {want_index[rows[0]].tolist()}"
    # float32 sums in another order and ex2.approx: a few ulp of float32 on each term; a log-probability
    # near 0 (a near-certain token) is -log(sum) for a sum near 1: its error is absolute, ~1 ulp of 1
    if not torch.allclose(prob, want_prob, rtol=2e-5, atol=1e-6 if log else 1e-30, equal_nan=True):
        err = ((prob - want_prob).abs() / want_prob.abs()).nan_to_num(nan=INF).max().item()
        return f"prob differs: max relative error {err:.3g}"
    return ""


def _interpreter_cases(dtype: torch.dtype) -> list[tuple]:
    """(name, logits, k, log, splits, scale) for the interpreter, sized for a 2-core CPU (each case
    is spread over the dtypes rather than repeated for each)."""
    g = torch.Generator().manual_seed(0)
    randn = lambda rows, vocab: (torch.randn(rows, vocab, generator=g) * 4).to(dtype)  # noqa: E731
    if dtype == torch.bfloat16:
        s1000 = special_rows(1000, dtype)
        return [
            ("special-v1-k1", special_rows(1, dtype), 1, False, None, None),
            ("special-v1000-k1-log", s1000, 1, True, None, None),
            ("special-v4099-k1-3-splits", special_rows(4099, dtype), 1, False, 3, None),
            ("special-v4099-k16-2-splits", special_rows(4099, dtype), 16, False, 2, None),
            ("special-v1000-k4-scaled", s1000, 4, False, None, special_scales(10)),
            ("random-b1-v32000-k16", randn(1, 32000), 16, False, None, None),
            # every program's elements tie: the row's room for candidates runs out in every program
            ("constant-b1-v32000-k16-64-splits", torch.full((1, 32000), 0.25).to(dtype), 16, False, 64, None),
            ("ties-b8-v64-k4-log", torch.randint(-2, 3, (8, 64), generator=g).to(dtype), 4, True, None, None),
            # a temperature of 0 as 1 / T: y = x * s is NaN at the zeros, the order u = x * sign(s)'s
            ("zero-tail-v5000-k16-infinite-scales", randn(2, 5000).index_fill_(1, torch.arange(4000, 5000), 0.0), 16, True,
             None, torch.tensor([INF, -INF])),
        ]
    if dtype == torch.float32:
        ties = rounding_ties()
        return [
            ("special-v2100-k1-scaled-2-splits", special_rows(2100, dtype), 1, True, 2, special_scales(10)),
            ("special-v2100-k8-scaled-2-splits", special_rows(2100, dtype), 8, False, 2, special_scales(10)),
            ("special-v1000-k16-scaled-log", special_rows(1000, dtype), 16, True, None, special_scales(10)),
            ("rounding-ties-k1", ties, 1, False, 2, torch.tensor([0.75, 0.75, -0.75])),
            ("rounding-ties-k4", ties, 4, False, 2, torch.tensor([0.75, -0.75, 0.75])),
            ("random-b1-v40000-k1-0d-scale", randn(1, 40000), 1, False, None, torch.tensor(-0.7)),
            # 79 tiles in one chunk, most of the top k past tile 32 (its record of tile maxima must reach them)
            ("random-b1-v40000-k4-one-split", randn(1, 40000), 4, False, 1, None),
            # 46 candidates at or above the floor, the top 16 both of some lanes' two: ranked 64 at once
            ("three-a-lane-v512-k16-one-split", three_a_lane(), 16, False, 1, None),
            # the k-th largest alone in the last chunk: a program's floor must not pass it
            ("kth-apart-v2048-k4-4-splits", kth_apart(4), 4, False, 4, None),
            ("kth-apart-v2048-k16-4-splits", kth_apart(16), 16, False, 4, None),  # one tile a program: read again
            # the k-th largest u under fl(y / |s|) for its own y: pass 2's floor in u must sit below that
            ("kth-under-its-y-floor-k4", kth_under_its_y_floor(), 4, False, None, torch.tensor([0.75, -0.75])),
        ]
    return [  # float16
        ("special-v7-k4-scaled-log", special_rows(7, dtype), 4, True, None, special_scales(10)),
        ("special-v1000-k2-one-split", special_rows(1000, dtype), 2, False, 1, None),
        ("random-b2-v5000-k16-scaled", randn(2, 5000), 16, False, None, torch.tensor([2.0, 0.0])),
    ]


def kth_under_its_y_floor() -> torch.Tensor:
    """float32 rows whose 4th largest u = x * sign(s), 1.5 + 2 * 2**-23, gives y = fl(u * 0.75) whose quotient
    fl(y / 0.75) is above u (1.5 + 3 * 2**-23): a floor in u taken as that quotient misses it. The top 4 sit
    in four lanes (each the max of its lane's slot), the rest under them; the second row is the first's
    negation (scale -0.75)."""
    u = 1.5 + 2 * 2.0**-23
    assert torch.tensor(u) < (torch.tensor(u) * 0.75) / 0.75  # the rounding this row is about (float32)
    row = torch.linspace(-1.0, 0.0, 2048)
    row[[0, 40, 80, 120]] = torch.tensor([5.0, 4.0, 3.0, u])
    return torch.stack([row, -row])


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """The kernels' order keys of float32 values, in torch (NaN: 2**31 - 1)."""
    bits = x.view(torch.int32)
    bits = torch.where(bits == INT32_MIN, 0, bits)
    return torch.where(x.isnan(), 2**31 - 1, torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits))


if importlib.util.find_spec("triton") is not None:  # the kernel of u_floor_failures (Triton's interpreter runs it)
    import triton
    import triton.language as tl

    from draftfuse.kernels._triton_keys import _u_floor

    @triton.jit
    def u_floor_kernel(floor_ptr, s_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, _u_floor(tl.load(floor_ptr + i), tl.load(s_ptr + i)))


def u_floor_failures(count: int = 20000, seed: int = 0) -> list[str]:
    """_u_floor (pass 2's floor moved from y = fl(u * |s|) to u) run by Triton's interpreter on random
    float32 pairs over the whole range (denormals, 0, +-FLT_MAX, +-inf; |s| from 1e-45 to 3e38): for the
    floor at each pair's own y, that u and its three float32 neighbours below must reach the moved floor
    wherever their y reaches y's key."""
    g = torch.Generator().manual_seed(seed)
    uniform = lambda lo, hi: lo + (hi - lo) * torch.rand(count, generator=g, dtype=torch.float64)  # noqa: E731
    sign = torch.where(torch.rand(count, generator=g) < 0.5, -1.0, 1.0).double()
    u = (sign * 10.0 ** uniform(-46, 38.5)).float()
    u[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, INF, -INF])
    s = (10.0 ** uniform(-45, 38.5)).float()
    s[8:16] = torch.tensor([1e-45, 3.4028235e38, 1.0, 0.75, 1e-45, 0.75, 3.0, 1e-38])
    y = u * s
    keep = ~y.isnan() & (s > 0)
    u, s, y = u[keep], s[keep], y[keep]
    n = triton.next_power_of_2(u.numel())
    floor = torch.full((n,), INT32_MIN, dtype=torch.int32)
    floor[: u.numel()] = _order_keys(y)
    scale = torch.ones(n)
    scale[: u.numel()] = s
    out = torch.empty(n, dtype=torch.int32)
    u_floor_kernel[(1,)](floor, scale, out, N=n)
    out = out[: u.numel()]
    failures = []
    below = u
    for step in range(4):  # u, then the float32 values just under it
        reach = _order_keys(below * s) >= _order_keys(y)
        missed = (reach & (_order_keys(below) < out)).nonzero().flatten()
        for i in missed[:3].tolist():
            failures.append(f"_u_floor: u = {below[i].item()!r} (step {step}), s = {s[i].item()!r}: y reaches the floor, "
                            f"u's key {_order_keys(below[i:i + 1]).item()} < moved floor {out[i].item()}")
        below = torch.nextafter(below, torch.tensor(-INF))
    return failures


def three_a_lane() -> torch.Tensor:
    """[1, 512] float32, one tile (lane L holds elements 4L .. 4L + 3 and 128 + 4L .. of each 128): lanes
    0-15 at -8, lane 16 at 10 (k = 16's floor: the 16th largest lane max) then 0, 0; lanes 17-31 three
    values each above 10. 46 reach the floor, appended in lane order at places 0-45, so the last program's
    lanes 0-13 hold two (places p and p + 32). The top 16: places 33-40 (their lanes' best), place 1 (lane
    1's second), places 14-20 (alone in their lanes): a rank that leaves out the other kind of candidate
    moves some of them, and leaves a place of the output unwritten or written twice."""
    x = torch.full((1, 512), -8.0)
    x[0, 64:67] = torch.tensor([10.0, 0.0, 0.0])
    value = {**{p: 50.0 + p for p in range(33, 41)}, 1: 51.0, **{p: 26.0 + p for p in range(14, 21)}}
    for lane in range(17, 32):
        for i in range(3):
            place = 1 + 3 * (lane - 17) + i
            x[0, 4 * lane + i] = value.get(place, 10.0 + place / 64)
    return x


def kth_apart(k: int) -> torch.Tensor:
    """[8, 2048] float32 for 4 chunks of one tile: small values, but the top k - 1 (20, 19, ...) in lanes
    0 .. k - 2 of one end chunk and the k-th (1) in lane k - 1 of the other (even rows: the top first, odd
    rows: last). The k-th largest slot is then exactly the k-th element: a program whose floor is any
    higher (the (k-1)-th largest slot, say) drops it, whichever end chunk runs its second pass last.
    Eight rows: k = 16 then reads the slots again in its second pass (_RESNAP_MIN_ROWS)."""
    x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(3)) * 0.1
    for row in range(8):
        top, kth = (0, 1536) if row % 2 == 0 else (1536, 0)
        x[row, top + 4 * torch.arange(k - 1)] = 20.0 - torch.arange(k - 1.0)  # lane L holds 4L .. 4L + 3
        x[row, kth + 4 * (k - 1)] = 1.0
    return x


def _random_hazard_cases(seed: int, count: int) -> list[tuple]:
    """(name, logits, k, splits, scale, candidates) drawn at random over the kernels' hazards: ties (few
    distinct values, rounded), mostly -inf rows, NaN, constant rows (all past the floor: the row's room
    for candidates runs out), forced splits, scales of both signs, 0 and +-inf, little room for candidates; k = 1
    (the argmax kernel: per-lane firsts, the NaN re-read) in about 2 of 7."""
    import random

    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        rows, vocab, k = rng.choice([1, 2, 3]), rng.choice([17, 100, 513, 1000, 2049, 5000]), rng.choice([1, 1, 2, 3, 4, 8, 16])
        if k > vocab:
            continue
        kind = rng.choice(["randn", "few", "rounded", "mostly -inf", "nan", "constant"])
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        if kind == "randn":
            x = torch.randn(rows, vocab, generator=g) * 3
        elif kind == "few":
            x = torch.randint(0, rng.choice([2, 3, 5]), (rows, vocab), generator=g).float()
        elif kind == "rounded":
            x = torch.randn(rows, vocab, generator=g).round()
        elif kind == "mostly -inf":
            at = torch.randint(0, vocab, (rows, rng.choice([1, 3, 20])), generator=g)
            x = torch.full((rows, vocab), -INF).scatter_(1, at, torch.randn(at.shape, generator=g))
        elif kind == "nan":
            x = torch.randn(rows, vocab, generator=g)
            x[:, torch.randint(0, vocab, (3,), generator=g)] = NAN
        else:
            x = torch.full((rows, vocab), rng.choice([0.0, -1.5, -INF]))
        dtype = rng.choice(list(DTYPES.values()))
        scale = torch.tensor([rng.choice([0.5, -1.0, 2.0, 0.0, INF, -INF]) for _ in range(rows)]) if rng.random() < 0.3 else None
        splits, candidates = rng.choice([None, 1, 2, 3, 5]), rng.choice([None, 32, 64])
        name = f"random {kind} {dtype} {rows}x{vocab} k={k} splits={splits} candidates={candidates} scaled={scale is not None}"
        cases.append((name, x.to(dtype), k, splits, scale, candidates))
    return cases


def run_interpreter_cases(dtype: torch.dtype) -> list[str]:
    """Runs the kernel under Triton's interpreter; returns the failures."""
    kernels = _selection._triton_selection()
    failures = []
    for name, logits, k, log, splits, scale in _interpreter_cases(dtype):
        prob = torch.full((logits.shape[0], k), -7.0)  # poisoned: every element must be written
        index = torch.full((logits.shape[0], k), -7, dtype=torch.int64)
        kernels.launch_selection(logits, k, log, prob, index, scale, splits=splits)
        if problem := check_selection(logits, k, log, prob, index, scale):
            failures.append(f"{dtype}, {name}: {problem}")
    if dtype == torch.float16:
        for name, logits, k, splits, scale, candidates in _random_hazard_cases(seed=0, count=56):
            prob, index = torch.full((logits.shape[0], k), -7.0), torch.full((logits.shape[0], k), -7, dtype=torch.int64)
            kernels.launch_selection(logits, k, False, prob, index, scale, splits=splits, candidates=candidates)
            if problem := check_selection(logits, k, False, prob, index, scale):
                failures.append(f"{name}: {problem}")
        # the ops' CUDA-path wrapper: leading dims that don't flatten to one stride, a strided last
        # dim, a per-row scale over those leading dims
        logits = special_rows(1000, dtype).reshape(2, 5, 1000).transpose(0, 1)
        scale = special_scales(10).reshape(2, 5).transpose(0, 1)
        for k, s in ((1, None), (3, scale)):
            prob = torch.empty(*logits.shape[:-1], k)
            index = torch.empty(*logits.shape[:-1], k, dtype=torch.int64)
            _selection._run_kernels(logits, k, False, prob, index, s)
            if problem := check_selection(logits, k, False, prob, index, s):
                failures.append(f"{dtype}, 3-d logits, k={k}: {problem}")
        # float32 scales that are views with a row stride other than 1: a column of a table of temperatures
        # (stride 2) and one temperature expanded to every row (stride 0); the kernel reads row * 1
        x = special_rows(600, dtype)
        table = torch.stack([special_scales(10), torch.full((10,), 100.0)], 1)
        for name, s in (("strided", table[:, 0]), ("expanded", torch.tensor([-0.5]).expand(10))):
            for k in (1, 3):
                prob, index = torch.empty(10, k), torch.empty(10, k, dtype=torch.int64)
                _selection._run_kernels(x, k, False, prob, index, s)
                if problem := check_selection(x, k, False, prob, index, s):
                    failures.append(f"{dtype}, {name} float32 scale, k={k}: {problem}")
    if dtype == torch.float32:
        failures += u_floor_failures()
    if dtype == torch.bfloat16:
        # k > 1 with room for only 32 candidates a row: most programs keep some of theirs (the merge
        # reads both); random rows (few past the floor) and special ones (all-equal, all -inf: all past)
        g = torch.Generator().manual_seed(3)
        for name, logits, k in (
            ("random-b3-v9000-k16", torch.randn(3, 9000, generator=g).to(dtype), 16),
            ("special-v3000-k5", special_rows(3000, dtype), 5),
        ):
            prob, index = torch.empty(logits.shape[0], k), torch.empty(logits.shape[0], k, dtype=torch.int64)
            kernels.launch_selection(logits, k, False, prob, index, splits=4, candidates=32)
            if problem := check_selection(logits, k, False, prob, index):
                failures.append(f"{dtype}, {name}, 32 candidates: {problem}")
        # more than 128 chunks a row (157 of 256 elements): the last program reads 256 partials; a merge
        # that read only the first 128 picks the wrong index for two of the special rows
        for name, logits, k in (("special-v40000-k1", special_rows(40000, dtype), 1),
                                ("random-b2-v40000-k4", torch.randn(2, 40000, generator=g).to(dtype), 4)):
            prob, index = torch.empty(logits.shape[0], k), torch.empty(logits.shape[0], k, dtype=torch.int64)
            kernels.launch_selection(logits, k, False, prob, index, splits=160, block=256)
            if problem := check_selection(logits, k, False, prob, index):
                failures.append(f"{dtype}, {name}, 157 chunks: {problem}")
        # a per-call workspace (what a CUDA-graph capture without the shared one fills and uses)
        logits = special_rows(1000, dtype)
        prob, index = torch.empty(10, 4), torch.empty(10, 4, dtype=torch.int64)
        fresh = kernels._fresh_workspace(10, logits.device)
        kernels.launch_selection(logits, 4, False, prob, index, splits=2, workspace=fresh)
        if problem := check_selection(logits, 4, False, prob, index):
            failures.append(f"{dtype}, per-call workspace: {problem}")
        if not bool((fresh == INT32_MIN).all()):
            failures.append("the per-call workspace is not idle after its launch")
    # every launch leaves the counters and slots as it found them
    for ws in kernels._workspaces.values():
        if not bool((ws == INT32_MIN).all()):
            failures.append(f"{dtype}: workspace not idle after the launches: {(ws != INT32_MIN).nonzero()[:4].tolist()}")
    return failures


@pytest.mark.slow
def test_kernels_in_triton_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed, so the selection kernels can't run in its interpreter (pip install triton)")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(  # one process for every dtype: each start costs seconds
        [sys.executable, "-m", "tests.test_kernels", *DTYPES],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]


def test_reference_matches_softmax_then_topk():
    x = torch.randn(6, 50, 300, dtype=torch.float64).float()  # distinct values: no tie order involved
    p = torch.softmax(x, dim=-1)
    index, prob = argmax_prob_reference(x)
    torch.testing.assert_close(prob, p.max(-1).values, rtol=1e-6, atol=0)
    assert torch.equal(index, p.argmax(-1))
    _, log_prob = argmax_prob_reference(x, log=True)
    torch.testing.assert_close(log_prob, torch.log_softmax(x, -1).max(-1).values, rtol=1e-5, atol=1e-6)
    prob, index = topk_prob_reference(x, 5)
    want = torch.topk(p, 5)
    torch.testing.assert_close(prob, want.values, rtol=1e-6, atol=0)
    assert torch.equal(index, want.indices)
    log_prob, _ = topk_prob_reference(x, 5, log=True)
    torch.testing.assert_close(log_prob, torch.topk(torch.log_softmax(x, -1), 5).values, rtol=1e-5, atol=1e-6)


def test_reference_with_scale_is_softmax_of_scaled_logits():
    x = torch.randn(6, 50, 300, dtype=torch.float64).float()
    scale = torch.rand(6, 50) * 4 - 2  # both signs, one per row
    y = x * scale[..., None]
    p = torch.softmax(y, dim=-1)
    for k in (1, 7):
        prob, index = topk_prob_reference(x, k, scale=scale)
        want = torch.topk(p, k)
        torch.testing.assert_close(prob, want.values, rtol=1e-6, atol=0)
        assert torch.equal(index, want.indices)
        log_prob, _ = topk_prob_reference(x, k, log=True, scale=scale)
        torch.testing.assert_close(log_prob, torch.topk(torch.log_softmax(y, -1), k).values, rtol=1e-5, atol=1e-6)
    index, prob = argmax_prob_reference(x, scale=scale)
    assert torch.equal(index, p.argmax(-1))
    torch.testing.assert_close(prob, p.max(-1).values, rtol=1e-6, atol=0)
    # a 0-d scale applies to every row; scale 1 is no scale
    index, prob = argmax_prob_reference(x, scale=torch.tensor(0.5))
    torch.testing.assert_close(prob, torch.softmax(x * 0.5, -1).max(-1).values, rtol=1e-6, atol=0)
    for got, want in zip(topk_prob_reference(x.bfloat16(), 4, scale=torch.tensor(1.0)), topk_prob_reference(x.bfloat16(), 4)):
        assert torch.equal(got, want)


def test_reference_scale_order_rules():
    x = torch.tensor([[1.0, 3.0, NAN, 3.0, -INF], [2.0, -1.0, 5.0, -1.0, 0.0], [1.0, INF, 2.0, 0.0, -0.0]])
    # s < 0: the order of -x (NaN still first; ties to the lower index); s = 0: all tie (inf * 0 is NaN)
    _, index = topk_prob_reference(x, 5, scale=torch.tensor([-1.0, -2.0, 0.0]))
    assert index.tolist() == [[2, 4, 0, 1, 3], [1, 3, 4, 0, 2], [1, 0, 2, 3, 4]]
    index, prob = argmax_prob_reference(x[1:2], scale=torch.tensor([0.0]))
    assert index.tolist() == [0] and prob.item() == pytest.approx(1 / 5)
    # a NaN scale: every product is NaN, so all tie (torch.sign(nan) is 0, which would not be)
    prob, index = topk_prob_reference(x[1:2], 4, scale=torch.tensor([NAN]))
    assert index.tolist() == [[0, 1, 2, 3]] and prob.isnan().all()
    # float32 products that round to ties keep the order of x
    ties = rounding_ties()
    y = ties * 0.75
    assert (y[0, 1:] == y[0, :-1]).any()  # the premise: some neighbours' products tie
    index, _ = argmax_prob_reference(ties, scale=torch.tensor([0.75, 0.75, -0.75]))
    assert index.tolist() == [4095, int(ties[1].argmax()), 4095]
    _, index = topk_prob_reference(ties, 3, scale=torch.tensor([0.75, -0.75, 0.75]))
    assert index[0].tolist() == [4095, 4094, 4093] and index[1].tolist() == [int(i) for i in ties[1].argsort()[:3]]


def test_scale_checks():
    x = torch.randn(2, 3, 10)
    for bad in (torch.ones(2), torch.ones(2, 3, 1), torch.ones(6), torch.ones(2, 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="scale"):
            topk_prob_reference(x, 2, scale=bad)
        with pytest.raises(ValueError, match="scale"):
            torch.ops.draftfuse.argmax_prob(x, False, bad)
    torch.ops.draftfuse.topk_prob(x, 2, False, torch.ones(2, 3, dtype=torch.float64))  # any float dtype


def test_the_launcher_refuses_a_strided_last_dim():
    """The ops fall back to torch for such logits; a direct call (tests, the benchmark, probes) read the
    rows as runs of memory and returned other tokens without an error."""
    kernels = _selection._triton_selection()
    x = torch.randn(40, 6).t()  # [6, 40], strides (1, 6)
    prob, index = torch.empty(6, 4), torch.empty(6, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        kernels.launch_selection(x, 4, False, prob, index)


def test_wide_logits_are_ranked_in_their_own_precision():
    """float64 (and integer) logits that float32 would round to a tie keep their order: the index is
    torch.argmax's, the k largest are the k largest."""
    x = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64)
    assert torch.ops.draftfuse.argmax_prob(x)[0].tolist() == [1] == torch.argmax(x, -1).tolist()
    assert torch.ops.draftfuse.topk_prob(x, 2)[1].tolist() == [[1, 0]]
    assert torch.ops.draftfuse.argmax_prob(torch.tensor([[2**25, 2**25 + 1, 0]]))[0].tolist() == [1]
    # int64 past float64's 2**53 (the order was taken in float64: a tie, the lower index)
    assert torch.ops.draftfuse.argmax_prob(torch.tensor([[2**60, 2**60 + 1, 0]]))[0].tolist() == [1]
    assert torch.ops.draftfuse.topk_prob(torch.tensor([[2**60, 2**60 + 1, 0]]), 2)[1].tolist() == [[1, 0]]


def test_scaled_integer_logits_keep_their_exact_order_and_unsupported_logits_are_refused():
    """With a scale, integer logits were ordered as float64 x * sign: int64 past 2**53 tied, and the lower
    index won. uint64 of 2**63 wrapped negative in the unscaled order, and complex logits were ordered by
    their truncated real part: torch.topk takes neither, and now neither do the ops (helper-74)."""
    x = torch.tensor([[2**53, 2**53 + 1, 5, 2**62, 2**62 + 1]])
    for scale in (torch.tensor([1.0]), torch.tensor(0.5)):
        assert torch.ops.draftfuse.topk_prob(x, 2, False, scale)[1].tolist() == [[4, 3]]
        assert torch.ops.draftfuse.argmax_prob(x, False, scale)[0].tolist() == [4]
    assert torch.ops.draftfuse.topk_prob(x, 2, False, torch.tensor([-1.0]))[1].tolist() == [[2, 0]]  # ~x: no wrap
    low = torch.tensor([[-(2**63), 0, 2**63 - 1]])
    assert torch.ops.draftfuse.topk_prob(low, 3, False, torch.tensor([-1.0]))[1].tolist() == [[0, 1, 2]]
    prob, index = torch.ops.draftfuse.topk_prob(x, 3, False, torch.tensor([float("nan")]))
    assert index.tolist() == [[0, 1, 2]] and prob.isnan().all()  # a NaN scale ties all, as for floats
    for bad in (torch.tensor([[2**63, 1, 5]], dtype=torch.uint64), torch.tensor([[0.3 + 0j, 0.7 + 0j]]),
                torch.eye(3).to_sparse()):
        with pytest.raises(ValueError, match="pass a dense tensor of a floating-point, bool or int8-int64 dtype"):
            torch.ops.draftfuse.topk_prob(bad, 1)
        with pytest.raises(ValueError, match="argmax_prob: logits of dtype"):
            torch.ops.draftfuse.argmax_prob(bad)


def test_fake_implementations_raise_what_the_ops_raise():
    """Under tracing (FakeTensorMode, the meta kernels) the ops check k and the scale as they do when run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 10)
        with pytest.raises(ValueError, match="k=11 out of range"):
            torch.ops.draftfuse.topk_prob(x, 11)
        with pytest.raises(ValueError, match="scale must be 0-d or of shape"):
            torch.ops.draftfuse.argmax_prob(x, False, torch.empty(3))
    with pytest.raises(ValueError, match="scale is on meta"):
        torch.ops.draftfuse.argmax_prob(torch.randn(2, 10), False, torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="out of range for logits of shape"):
        torch.ops.draftfuse.argmax_prob(torch.tensor(1.0))


def test_reference_order_and_special_values():
    x = torch.tensor([[1.0, NAN, 3.0, NAN], [1.0, INF, 2.0, INF], [2.0, 5.0, 5.0, 5.0], [-INF, -INF, -INF, -INF]])
    index, prob = argmax_prob_reference(x)
    assert index.tolist() == [1, 1, 1, 0]  # torch.argmax: first NaN, first max
    assert prob[:2].isnan().all() and prob[3].isnan() and prob[2].item() == pytest.approx(1 / (3 + torch.e**-3))
    prob, index = topk_prob_reference(x, 3)
    assert index.tolist() == [[1, 3, 2], [1, 3, 2], [1, 2, 3], [0, 1, 2]]  # ties: lower index first
    assert prob[2].tolist() == pytest.approx([1 / (3 + torch.e**-3)] * 3)
    with pytest.raises(ValueError, match="out of range"):
        topk_prob_reference(x, 5)


def test_ops_schema_and_fake_implementations():
    x = torch.randn(3, 4, 100)
    scale = torch.rand(3, 4) - 0.5
    for log in (False, True):
        torch.library.opcheck(torch.ops.draftfuse.argmax_prob.default, (x, log))
        torch.library.opcheck(torch.ops.draftfuse.topk_prob.default, (x.bfloat16(), 4, log))
        torch.library.opcheck(torch.ops.draftfuse.argmax_prob.default, (x, log, scale))
        torch.library.opcheck(torch.ops.draftfuse.topk_prob.default, (x.bfloat16(), 16, log, torch.tensor(2.0)))
    torch.library.opcheck(torch.ops.draftfuse.topk_prob.default, (x[..., ::2], 3))
    schema = str(torch.ops.draftfuse.argmax_prob.default._schema)
    assert schema.endswith("(Tensor logits, bool log=False, Tensor? scale=None) -> (Tensor, Tensor)"), schema
    schema = str(torch.ops.draftfuse.topk_prob.default._schema)
    assert schema.endswith("(Tensor logits, SymInt k, bool log=False, Tensor? scale=None) -> (Tensor, Tensor)"), schema


def test_ops_captured_by_dynamo_as_one_graph():
    def draft_pick(logits, inv_temperature):
        index, prob = torch.ops.draftfuse.argmax_prob(logits)
        top_prob, top_index = torch.ops.draftfuse.topk_prob(logits, 4, True, inv_temperature)
        return index, prob, top_prob, top_index

    x, s = torch.randn(2, 1000), torch.tensor([0.7, -1.3])
    got = torch.compile(draft_pick, backend="aot_eager", fullgraph=True)(x, s)
    for a, b in zip(got, draft_pick(x, s)):
        assert torch.equal(a, b)


def test_kernels_predicate():
    assert not selection_kernels_available("cpu", torch.bfloat16, 1)
    assert not selection_kernels_available("cuda", torch.float64, 1)
    assert not selection_kernels_available("cuda", torch.bfloat16, 17)
    assert not selection_kernels_available("cuda", torch.bfloat16, 4, last_dim_contiguous=False)
    triton = importlib.util.find_spec("triton") is not None
    assert selection_kernels_available(torch.device("cuda", 0), torch.bfloat16, 16) == triton


def test_plan_chunks_per_row(monkeypatch):
    """The planner on an H200's 132 SMs: k = 1 rows take up to 256 chunks, k > 1 rows aim at 128 (asked for,
    more), and a row never takes more chunks than tiles."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from draftfuse.kernels import _triton_launch

    monkeypatch.setattr(_triton_launch, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert _triton_launch.plan(1, 262144, 1, cuda, programs_per_sm=24)[0] == 256
    assert _triton_launch.plan(8, 262144, 1, cuda, programs_per_sm=24)[0] == 256
    assert _triton_launch.plan(32, 262144, 1, cuda, programs_per_sm=24)[0] == 86  # 99 asked: 512 tiles in chunks of 6
    assert _triton_launch.plan(1, 262144, 4, cuda, programs_per_sm=16)[0] == 128
    assert _triton_launch.plan(1, 262144, 4, cuda, splits=200)[0] == 171  # chunks of 3 tiles
    assert _triton_launch.plan(1, 32000, 1, cuda, programs_per_sm=24)[0] == 63  # one tile each


def test_captured_launches_use_the_given_workspace_while_it_fits(monkeypatch):
    """During a capture, `capturing_with`'s workspace (on the logits' device, with room for the rows) is the
    one a launch gets; otherwise, and outside the block (nested blocks restore the outer one), the capture
    stream's or a per-launch copy, as without it. On the CPU: stand-ins for the capture state and tensors."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    import types

    from draftfuse.kernels import _triton_launch

    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(_triton_launch, "_current_stream", lambda index: 12345)
    monkeypatch.setattr(_triton_launch, "_fresh_workspace", lambda rows, device: ("per-launch copy", rows))
    monkeypatch.setattr(_triton_launch, "_workspaces", {})
    outer = types.SimpleNamespace(device=cuda0, shape=(1024, 64))
    inner = types.SimpleNamespace(device=cuda0, shape=(16, 64))
    assert _triton_launch._workspace(cuda0, 8) == ("per-launch copy", 8)
    with _triton_launch.capturing_with(outer):
        assert _triton_launch._workspace(cuda0, 8) is outer
        assert _triton_launch._workspace(cuda0, 2000) == ("per-launch copy", 2000)  # no room
        assert _triton_launch._workspace(cuda1, 8) == ("per-launch copy", 8)  # another device
        with _triton_launch.capturing_with(inner):
            assert _triton_launch._workspace(cuda0, 8) is inner
            assert _triton_launch._workspace(cuda0, 100) == ("per-launch copy", 100)
        assert _triton_launch._workspace(cuda0, 100) is outer
    assert _triton_launch._workspace(cuda0, 8) == ("per-launch copy", 8)


def test_ready_key_holds_what_the_launch_specialises_on():
    """A repeated call launches the kernel and grid its key's first calls picked: the key must change with
    every input of the plan and of Triton's specialisation (dtype, shape, row stride, k, log, the scale's
    kind, each pointer's 16-byte alignment), and only with those."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from draftfuse.kernels import _triton_launch

    def key(x, k=4, log=False, scale=None, prob=None, index=None):
        prob = torch.empty(x.shape[0], k) if prob is None else prob
        index = torch.empty(x.shape[0], k, dtype=torch.int64) if index is None else index
        return _triton_launch._ready_key(x, k, log, prob, index, scale)

    x = torch.randn(8, 32000)
    base = key(x)
    assert key(torch.randn(8, 32000)) == base  # other values, other memory: the same launch
    others = [
        key(x.half()), key(torch.randn(16, 32000)), key(torch.randn(8, 32001)), key(torch.randn(8, 32016)[:, :32000]),
        key(torch.randn(8 * 32000 + 1)[1:].view(8, 32000)),  # 4 bytes off 16-byte alignment
        key(x, k=8), key(x, log=True), key(x, scale=torch.ones(8)), key(x, scale=torch.ones(())),
        key(x, scale=torch.ones(9)[1:]),  # a misaligned scale
        key(x, scale=torch.ones(8, dtype=torch.float64)),
        key(x, prob=torch.empty(8, 4, dtype=torch.float64)), key(x, index=torch.empty(8, 4, dtype=torch.int32)),
        key(x, prob=torch.empty(33)[1:].view(8, 4)), key(x, index=torch.empty(33, dtype=torch.int64)[1:].view(8, 4)),
    ]
    assert len({base, *others}) == len(others) + 1, others


def test_a_ready_launch_passes_what_the_full_path_passed(monkeypatch):
    """A ready launch (the compiled kernel called directly) gets the full path's grid, arguments and
    constexprs: the same logits, outputs and scale, scratch of the same shapes. On the CPU: the JIT
    functions and the compiled kernel stood in by recorders."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from draftfuse.kernels import _triton_launch

    seen = []

    class Recorder:
        def __init__(self, arg_names=()):
            self.arg_names = arg_names

        def __getitem__(self, grid):
            return lambda *args, stream=None, **constexprs: seen.append((tuple(grid)[:2], args, constexprs))

    for name in ("_argmax_kernel", "_selection_kernel"):
        monkeypatch.setattr(_triton_launch, name, Recorder(getattr(_triton_launch, name).arg_names))
    monkeypatch.setattr(_triton_launch, "_current_stream", lambda index: 0)
    same = lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype) if isinstance(a, torch.Tensor) else a == b  # noqa: E731
    for k in (1, 4):
        for scale in (None, torch.rand(8), torch.rand(())):
            x, prob, index = torch.randn(8, 32000), torch.empty(8, k), torch.empty(8, k, dtype=torch.int64)
            seen.clear()
            _triton_launch.launch_selection(x, k, True, prob, index, scale)
            grid, args, constexprs = seen[0]
            names = getattr(_triton_launch, "_argmax_kernel" if k == 1 else "_selection_kernel").arg_names
            consts = tuple(constexprs[name] for name in names[len(args):])
            cand = _triton_launch._CANDIDATES if k > 1 else 0
            ready = (Recorder(), (8, args[4], 1), consts, args[4], args[3], cand)
            _triton_launch._launch_ready(ready, x, k, True, prob, index, scale)
            ready_grid, ready_args, _ = seen[1]
            assert ready_grid == grid and len(ready_args) == len(args) + len(consts)
            assert all(same(a, b) for a, b in zip((*args, *consts), ready_args)), (k, scale)
            assert all(ready_args[i] is args[i] for i in (0, 10, 11)) and (scale is None or ready_args[5].data_ptr() == scale.data_ptr())


def test_slots_read_again_only_where_measured_faster(monkeypatch):
    """k > 1 programs read the slots a second time only at k >= 16, 8 rows or more and one tile a program
    (vocab 32000 at batch 8-32 on an H200, where it measured 0.77-0.96x; 1.04-1.12x at batch 1)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from draftfuse.kernels import _triton_launch

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: seen.append(constexprs.get("RESNAP"))

    monkeypatch.setattr(_triton_launch, "_selection_kernel", Recorder())
    monkeypatch.setattr(_triton_launch, "_sm_count", lambda device: 132)
    for rows, vocab, k, want in [(8, 32000, 16, True), (32, 32000, 16, True), (1, 32000, 16, False), (8, 32000, 8, False),
                                 (64, 32000, 16, False), (8, 128256, 16, False)]:
        seen.clear()
        _triton_launch.launch_selection(torch.randn(rows, vocab), k, False, torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64))
        assert seen == [want], (rows, vocab, k)


def test_kernels_launch_on_the_logits_device(monkeypatch):
    """Triton launches on the current CUDA device: logits on another one are launched with it made current
    (the op's callers need not set it). On the CPU: fake CUDA tensors, the launch and the device stood in."""
    import contextlib
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode

    current, seen = [0], []

    @contextlib.contextmanager
    def device(d):
        saved, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = saved

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    launcher = types.SimpleNamespace(launch_selection=lambda logits, *args: seen.append((logits.device.index, current[0])))
    monkeypatch.setattr(_selection, "_triton_selection", lambda: launcher)
    with FakeTensorMode():
        for index in (0, 1):
            x = torch.empty(2, 100, device=f"cuda:{index}")
            _selection._run_kernels(x, 4, False, torch.empty(2, 4, device=x.device), torch.empty(2, 4, device=x.device))
    assert seen == [(0, 0), (1, 1)] and current == [0]


BENCH_SIZES = [(b, v) for v in (32000, 128256, 151936, 262144) for b in (1, 8, 64, 256)] + [(3, 7), (5, 1000003)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 4, 8, 16])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_cuda_kernels_match_reference(dtype_name, k, scaled):
    dtype = DTYPES[dtype_name]
    assert selection_kernels_available("cuda", dtype, k)
    g = torch.Generator(device="cuda").manual_seed(k)
    for batch, vocab in BENCH_SIZES:
        if vocab < k:
            continue
        x = (torch.randn(batch, vocab, device="cuda", generator=g) * 4).to(dtype)
        scale = (torch.rand(batch, device="cuda", generator=g) * 4 - 2) if scaled else None
        for log in (False, True):
            for _ in range(3):  # the third call of a shape launches the kernel its first calls readied
                if k == 1:
                    index, prob = torch.ops.draftfuse.argmax_prob(x, log, scale)
                    prob, index = prob[:, None], index[:, None]
                else:
                    prob, index = torch.ops.draftfuse.topk_prob(x, k, log, scale)
            assert not (problem := check_selection(x, k, log, prob, index, scale)), (batch, vocab, log, problem)
    for vocab in (1, 7, 1000, 4099, 32000, 151936):
        if k <= vocab:
            x = special_rows(vocab, dtype, "cuda")
            scale = special_scales(10, "cuda") if scaled else None
            prob, index = torch.ops.draftfuse.topk_prob(x, k, False, scale)
            assert not (problem := check_selection(x, k, False, prob, index, scale)), (vocab, problem)
    if scaled:  # a temperature of 0 as 1 / T over a zero tail: y = x * s is NaN there, the order u's
        x = torch.randn(2, 5000, device="cuda", generator=g).to(dtype).index_fill_(1, torch.arange(4000, 5000, device="cuda"), 0.0)
        scale = torch.tensor([INF, -INF], device="cuda")
        prob, index = torch.ops.draftfuse.topk_prob(x, k, True, scale)
        assert not (problem := check_selection(x, k, True, prob, index, scale)), problem
    if dtype == torch.float32 and scaled:
        x = rounding_ties("cuda")
        scale = torch.tensor([0.75, -0.75, 0.75], device="cuda")
        prob, index = torch.ops.draftfuse.topk_prob(x, k, False, scale)
        assert not (problem := check_selection(x, k, False, prob, index, scale)), problem
    for ws in _selection._triton_selection()._workspaces.values():
        assert bool((ws == INT32_MIN).all()), "a launch left the workspace dirty"


@pytest.mark.cuda
@pytest.mark.parametrize(
    "tile", [(512, 24, False, 32), (2048, 8, True, None), (1024, 4, True, 64), (1024, 32, False, 256)], ids=str
)
def test_cuda_other_tilings(tile):
    """The tiling is a tuning choice (benchmarks/selection.py --tile): results must not depend on it; nor
    on a row's room for k > 1's candidates (32: programs keep their own often)."""
    kernels = _selection._triton_selection()
    block, programs_per_sm, pdl, candidates = tile
    for dtype in DTYPES.values():
        for x in (special_rows(4099, dtype, "cuda"), torch.randn(64, 151936, device="cuda").mul_(4).to(dtype)):
            for k in (1, 4, 16):
                for scale in (None, torch.rand(x.shape[0], device="cuda") - 0.5):
                    prob = torch.empty(x.shape[0], k, device="cuda")
                    index = torch.empty(x.shape[0], k, device="cuda", dtype=torch.int64)
                    kernels.launch_selection(
                        x, k, False, prob, index, scale, block=block, programs_per_sm=programs_per_sm, pdl=pdl,
                        candidates=candidates,
                    )
                    problem = check_selection(x, k, False, prob, index, scale)
                    assert not problem, (dtype, x.shape, k, scale is not None, problem)


def fill_kernels_in(graph: torch.cuda.CUDAGraph) -> int:
    """How many fill kernels one replay of `graph` runs (a torch.profiler trace)."""
    return fill_kernels_of(graph.replay)


def fill_kernels_of(work) -> int:
    """How many fill kernels `work()` runs on the device (a torch.profiler trace)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    return sum("FillFunctor" in e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.slow
def test_l2_prefetch_compiled_for_16_bit_logits_only():
    """The k > 1 kernel's pass 1 prefetches into L2 (_prefetch_l2) where it measured faster: in the PTX that
    Triton makes for an H200 (sm_90) from bf16 logits, and not from float32 ones, where it measured slower.
    Compiled on this CPU; nothing runs."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the kernels are defined for the interpreter, not compiled")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from draftfuse.kernels._triton_selection import _selection_kernel

    pointers = {"scale_ptr": "*fp32", "part_ptr": "*fp32", "key_ptr": "*i64", "ws_ptr": "*i32", "prob_ptr": "*fp32", "index_ptr": "*i64"}
    constants = dict(K=4, BLOCK=512, CAND=256, HAS_SCALE=False, GPU=True, PDL=True, SORT=True, MERGE=128, RECORD=32, RESNAP=False)
    names, found = _selection_kernel.arg_names, {}
    for dtype, v in (("bf16", 8), ("fp32", 4)):
        values = {**constants, "V": v}
        signature = {n: "constexpr" if n in values else pointers.get(n, f"*{dtype}" if n == "logits_ptr" else "i32") for n in names}
        source = ASTSource(_selection_kernel, signature, constexprs={(names.index(n),): x for n, x in values.items()},
                           attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("ptr")})
        kernel = triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "launch_pdl": True, "enable_fp_fusion": False})
        found[dtype] = kernel.asm["ptx"].count("prefetch.global.L2")
    assert found["bf16"] >= 1 and found["fp32"] == 0, found


def test_graph_workspace_off_the_kernels():
    """The public pair for captures of one's own: where the kernels don't run there is no workspace, and
    capturing with None changes nothing."""
    import draftfuse.kernels

    assert draftfuse.kernels.graph_workspace(torch.device("cpu")) is None
    x = torch.randn(3, 50)
    with draftfuse.kernels.capturing_with(None):
        prob, index = torch.ops.draftfuse.topk_prob(x, 4)
    assert torch.equal(index, torch.topk(x, 4).indices)


def test_a_capture_without_a_workspace_warns_once(monkeypatch):
    """A launch captured on a stream with no workspace for it fills one per call in the graph: a UserWarning
    (once per process) names the cost and the fix. The CUDA calls are stood in for: the logic only."""
    import types

    kernels = _selection._triton_selection()
    if kernels is None:
        pytest.skip("no Triton")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(kernels, "_current_stream", lambda index: 12345)
    monkeypatch.setattr(kernels, "_fresh_workspace", lambda rows, device: torch.full((rows, 64), -(2**31), dtype=torch.int32))
    monkeypatch.setattr(kernels, "_warned_fill", False)
    with pytest.warns(UserWarning, match=r"for 8 rows .* has no workspace: .* fill kernel .*graph_workspace\(device, rows\)") as seen:
        assert kernels._workspace(cuda, 8).shape[0] == 8
    assert seen[0].filename == __file__  # the caller's line, not draftfuse's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels._workspace(cuda, 8).shape[0] == 8  # once is enough
    monkeypatch.setattr(kernels, "_warned_fill", False)
    small = types.SimpleNamespace(device=cuda, shape=(4, 64))  # given, but too small for 8 rows
    with kernels.capturing_with(small), pytest.warns(UserWarning, match=r"given to capturing_with has room for 4 rows"):
        assert kernels._workspace(cuda, 8).shape[0] == 8


@pytest.mark.cuda
def test_cuda_time_in_graph_captures_as_the_recorder():
    """The benchmark's and the probes' timing (_measure.time_in_graph) captures the selection kernels with
    a workspace made before the capture, as draftfuse's recorder does: the graph fills nothing. Captured
    bare (selection_workspace=False), every call in it fills a workspace of its own on every replay."""
    from draftfuse import _measure

    inputs = [torch.randn(8, 32000, device="cuda") for _ in range(4)]
    call = lambda x: torch.ops.draftfuse.topk_prob(x, 4)  # noqa: E731
    call(inputs[0])  # compiled, and the current stream's workspace made
    # 4 calls a graph, replayed once after the capture and 3 times timed: 16 fills captured bare; the
    # recorder's way, one, the workspace's own when made. (Both traces hold the same two fills more on the
    # H200, outside the graphs: [3, 18].)
    fills = [fill_kernels_of(lambda: _measure.time_in_graph(call, inputs, 3, selection_workspace=ws)) for ws in (True, False)]
    assert fills[1] - fills[0] == 16 - 1, fills


@pytest.mark.cuda
@pytest.mark.parametrize("workspace", ["stream's", "none", "given"], ids=["stream-workspace", "captured-without-one", "graph-workspace"])
def test_cuda_graph_replay_recomputes(workspace):
    kernels = _selection._triton_selection()
    static = torch.randn(8, 128256, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(8, device="cuda") + 0.5
    torch.ops.draftfuse.topk_prob(static, 4)  # compile the kernels outside the capture
    torch.ops.draftfuse.argmax_prob(static, False, scale)
    saved = dict(kernels._workspaces)
    if workspace == "none":
        kernels._workspaces.clear()  # the capture must then fill a workspace of each launch's own
    given = _selection.graph_workspace(torch.device("cuda")) if workspace == "given" else None
    try:
        graph = torch.cuda.CUDAGraph()
        with _selection.capturing_with(given), torch.cuda.graph(graph):
            prob, index = torch.ops.draftfuse.topk_prob(static, 4)
            top1, top1_prob = torch.ops.draftfuse.argmax_prob(static, False, scale)
        for _ in range(3):
            static.copy_(torch.randn_like(static))
            scale.copy_(torch.rand_like(scale) * 4 - 2)
            graph.replay()
            assert not check_selection(static, 4, False, prob, index)
            assert not check_selection(static, 1, False, top1_prob[:, None], top1[:, None], scale)
        fills = fill_kernels_in(graph)
        assert fills == 0 if workspace == "given" else fills == 2 if workspace == "none" else fills <= 2
        if given is not None:
            assert torch.all(given == INT32_MIN)  # left as found, so no replay fills it
    finally:
        kernels._workspaces.clear()
        kernels._workspaces.update(saved)


@pytest.mark.cuda
def test_cuda_register_budget_for_16_bit_argmax_of_3_tiles_or_more():
    """k = 1 with 16-bit logits compiles with a register budget where a program's chunk holds 3 tiles or
    more (measured faster on an H200; slower on some grids of 2-tile programs); float32, k > 1 and fewer
    tiles keep ptxas's own count; maxnreg=0 turns it off. Each launch exact, through the ready launches too."""
    kernels = _selection._triton_selection()
    device = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    budget, seen = kernels._MAXNREG_16BIT, set()
    for rows, dtype, k, options in [(256, torch.bfloat16, 1, {}), (256, torch.float16, 1, {}), (8, torch.bfloat16, 1, {}),
                                    (256, torch.float32, 1, {}), (256, torch.bfloat16, 4, {}), (256, torch.bfloat16, 1, {"maxnreg": 0})]:
        _, chunk, block = kernels.plan(rows, 32000, k, device, programs_per_sm=kernels.default_programs_per_sm(2, k, False))
        many_tiles = chunk >= kernels._MAXNREG_MIN_TILES * block
        want = budget if dtype != torch.float32 and k == 1 and not options and many_tiles else None
        seen.add(want)
        for _ in range(3):  # the third call is a ready launch
            x = (torch.randn(rows, 32000, device="cuda", generator=g) * 4).to(dtype)
            prob, index = torch.empty(rows, k, device="cuda"), torch.empty(rows, k, device="cuda", dtype=torch.int64)
            kernel = kernels.launch_selection(x, k, False, prob, index, **options)
            assert not (problem := check_selection(x, k, False, prob, index)), (rows, dtype, k, problem)
        assert (kernel.metadata.maxnreg or None) == want, (rows, dtype, k, options, kernel.metadata.maxnreg)
        assert want is None or kernel.n_regs <= want
    assert seen == {budget, None}  # both kinds of launch were made on this GPU


@pytest.mark.cuda
def test_cuda_repeated_calls_skip_the_jit(monkeypatch):
    """From a key's third call on (the second one learns the kernel's occupancy), a call launches the compiled
    kernel directly: no Triton JIT lookup. Exact on every call, new data each time; a misaligned view, a
    scale and a CUDA-graph capture take keys of their own or the same path."""
    kernels = _selection._triton_selection()
    jit_runs = []
    for jit in (kernels._argmax_kernel, kernels._selection_kernel):
        monkeypatch.setattr(jit, "run", lambda *a, _run=jit.run, **kw: jit_runs.append(1) or _run(*a, **kw))
    monkeypatch.setattr(kernels, "_ready", {})
    monkeypatch.setattr(kernels, "_fits", {})  # as in a fresh process: the first call learns the occupancy
    g = torch.Generator(device="cuda").manual_seed(0)
    storage = torch.empty(8 * 32000 + 1, device="cuda", dtype=torch.bfloat16)
    aligned, misaligned = storage[: 8 * 32000].view(8, 32000), storage[1:].view(8, 32000)  # 2 bytes off
    for k in (1, 4):
        for x, scale in ((aligned, None), (misaligned, None), (aligned, torch.rand(8, device="cuda") - 0.5)):
            del jit_runs[:]
            for _ in range(4):
                x.copy_(torch.randn(x.shape, device="cuda", generator=g) * 4)
                prob, index = torch.ops.draftfuse.topk_prob(x, k, False, scale)
                assert not (problem := check_selection(x, k, False, prob, index, scale)), (k, problem)
            assert len(jit_runs) == 2, (k, scale is None, len(jit_runs))
    assert len(kernels._ready) == 6
    x = aligned
    graph = torch.cuda.CUDAGraph()
    with _selection.capturing_with(_selection.graph_workspace(torch.device("cuda"))), torch.cuda.graph(graph):
        prob, index = torch.ops.draftfuse.topk_prob(x, 4)
    assert len(jit_runs) == 2  # captured through the ready launch too
    for _ in range(2):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        graph.replay()
        assert not (problem := check_selection(x, 4, False, prob, index)), problem


@pytest.mark.cuda
def test_cuda_compiled_reduce_overhead():
    """CUDA-graph trees warm up (outside capture, allocating into their pool) and then record: with no
    workspace yet, the warm-up makes it, on a side stream, so that it never lands in their pool (whose
    leak check would fail the recording)."""
    torch._dynamo.reset()
    kernels = _selection._triton_selection()
    saved = dict(kernels._workspaces)
    kernels._workspaces.clear()

    def pick(logits, inv_temperature):
        index, prob = torch.ops.draftfuse.argmax_prob(logits)
        top_prob, top_index = torch.ops.draftfuse.topk_prob(logits, 8, False, inv_temperature)
        return index, prob.to(logits.dtype), top_prob, top_index

    fn = torch.compile(pick, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        x = torch.randn(4, 151936, device="cuda", dtype=torch.bfloat16)
        s = torch.rand(4, device="cuda") + 0.5
        index, prob, top_prob, top_index = fn(x, s)
        assert torch.equal(index, x.argmax(-1))
        # float32 inside, then one rounding to bf16: at most one bf16 ulp from softmax's own rounding
        torch.testing.assert_close(prob, torch.softmax(x.float(), -1).amax(-1).to(x.dtype), rtol=2**-7, atol=0)
        assert not check_selection(x, 8, False, top_prob, top_index, s)
    assert kernels._workspaces, "the warm-up made no workspace"
    kernels._workspaces.update(saved)


if __name__ == "__main__":
    import triton  # noqa: F401  (fail loudly here: the test skips before starting this without Triton)

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (Triton's interpreter, on CPU)"
    failed = [failure for name in sys.argv[1:] for failure in run_interpreter_cases(DTYPES[name])]
    print("\n".join(failed) or f"all interpreter cases passed ({', '.join(sys.argv[1:])})")
    sys.exit(1 if failed else 0)
