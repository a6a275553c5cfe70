"""The `draftfuse` backend: mode and options reach Inductor, passes run, registration, logging.

Most tests replace `compile_fx` with a spy that records what it was given and runs the graph as is,
so they cost a Dynamo trace, not an Inductor compile.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import draftfuse.testing
from draftfuse.options import Options
from draftfuse.passes.post_grad import PostGradPass
from draftfuse.runtime import backend, pipeline

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _pick(x):
    return torch.softmax(x, dim=-1).topk(1, dim=-1)[1]


@pytest.fixture
def inductor_calls(monkeypatch):
    """The (graph, config_patches) of each compile_fx call; compile_fx itself is not run."""
    calls = []

    def spy(gm, example_inputs, config_patches=None):
        calls.append((gm, config_patches))
        return gm.forward

    monkeypatch.setattr(pipeline, "compile_fx", spy)
    return calls


def test_mode_reaches_inductor(inductor_calls):
    x = torch.randn(4, 16)
    recording = backend.Backend()
    out = torch.compile(_pick, backend=recording, mode="reduce-overhead", fullgraph=True)(x)
    assert torch.equal(out, _pick(x))
    (gm, patches), = inductor_calls
    assert patches["triton.cudagraphs"] is True  # what list_mode_options("reduce-overhead") sets
    post_grad = patches["post_grad_custom_pre_pass"]
    assert isinstance(post_grad, PostGradPass) and post_grad.options.probs == "exact"
    # the Dynamo-level rewrite ran before Inductor: no softmax, no topk left
    assert "topk" not in gm.code and "softmax" not in gm.code and "argmax" in gm.code
    (record,) = recording.compiles
    assert record.config_patches is patches
    assert [r.pass_name for r in record.reports][-1] == "softmax_topk" and record.reports[-1].rewrites


def test_options_split_between_draftfuse_and_inductor(inductor_calls):
    options = {"probs": "ones", "triton.cudagraphs": True, "coordinate-descent-tuning": True}
    recording = backend.Backend()
    torch.compile(_pick, backend=recording, options=options, fullgraph=True)(torch.randn(4, 16))
    (_, patches), = inductor_calls
    assert patches["triton.cudagraphs"] is True and patches["coordinate_descent_tuning"] is True
    assert "probs" not in patches and patches["post_grad_custom_pre_pass"].options.probs == "ones"
    assert recording.compiles[-1].options.probs == "ones"


def test_passes_off_leave_the_graph(inductor_calls):
    options = {"softmax_topk": False, "seed_fold": False, "vocab_parallel": False}
    torch.compile(_pick, backend="draftfuse", options=options, fullgraph=True)(torch.randn(4, 16))
    (gm, patches), = inductor_calls
    assert "topk" in gm.code and "post_grad_custom_pre_pass" not in patches


def test_vocab_parallel_alone_installs_the_post_grad_pass(inductor_calls):
    """Its post-grad form (a gather seen only after decomposition) is rewritten as draft_graphs shows."""
    options = {"softmax_topk": False, "seed_fold": False}
    torch.compile(_pick, backend="draftfuse", options=options, fullgraph=True)(torch.randn(4, 16))
    (gm, patches), = inductor_calls
    assert "topk" in gm.code and isinstance(patches["post_grad_custom_pre_pass"], PostGradPass)


def test_seed_fold_runs_first_unless_turned_off(inductor_calls):
    recording = backend.Backend()
    torch.compile(_pick, backend=recording, fullgraph=True)(torch.randn(4, 16))
    assert [r.pass_name for r in recording.compiles[-1].reports] == ["seed_fold", "softmax_topk"]
    torch._dynamo.reset()
    torch.compile(_pick, backend=recording, options={"seed_fold": False}, fullgraph=True)(torch.randn(4, 16))
    assert [r.pass_name for r in recording.compiles[-1].reports] == ["softmax_topk"]


def test_bad_options_raise():
    with pytest.raises(ValueError, match="unknown option 'prob'.*Inductor config name"):
        Options.parse(options={"prob": "ones"})
    with pytest.raises(ValueError, match="'probs' must be one of"):
        Options.parse(options={"probs": "one"})
    with pytest.raises(ValueError, match="'seed_fold' must be one of"):
        Options.parse(options={"seed_fold": "no"})
    with pytest.raises(ValueError, match="'half_probs' must be one of"):
        Options.parse(options={"half_probs": "drop"})
    with pytest.raises(ValueError, match="'spare_recordings' must be one of"):
        Options.parse(options={"spare_recordings": 3})
    with pytest.raises(ValueError, match="'spare_recordings' must be one of"):
        Options.parse(options={"spare_recordings": False})
    with pytest.raises(ValueError, match="'spare_recordings' must be one of"):
        Options.parse(options={"spare_recordings": 2.0})  # range(2.0) would fail at the capture
    assert Options.parse(options={"spare_recordings": 0}).spare_recordings == 0
    with pytest.raises(ValueError, match="'spare_recordings' is draft_loop's"):
        backend.Backend(Options.parse(options={"spare_recordings": 0}))
    with pytest.raises(Exception, match="'spare_recordings' is draft_loop's"):
        torch.compile(_pick, backend="draftfuse", options={"spare_recordings": 0}, fullgraph=True)(torch.randn(4, 16))
    parsed = Options.parse("reduce-overhead", {"lowering": "kernels", "max-autotune": True})
    assert parsed.lowering == "kernels" and parsed.inductor == {"triton.cudagraphs": True, "max_autotune": True}


def test_rewritten_graph_keeps_dynamo_metadata(inductor_calls):
    # AOT autograd reads which inputs are static (parameters, marked KV caches) from Dynamo's
    # metadata; a pass's new GraphModule must still carry it.
    linear = torch.nn.Linear(16, 16)

    def pick_after_linear(x):
        return _pick(linear(x))

    torch.compile(pick_after_linear, backend="draftfuse", fullgraph=True)(torch.randn(4, 16))
    (gm, _), = inductor_calls
    assert "topk" not in gm.code  # a pass did replace the graph module
    assert len(gm._param_name_to_source) == 2  # linear.weight and linear.bias
    sources = [node._dynamo_source.name for node in gm.graph.find_nodes(op="placeholder")]
    assert len(sources) == 3 and all(sources)


class _CountingPass(CustomGraphPass):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1

    def uuid(self):
        return "counting-pass"


def test_user_post_grad_pass_is_chained_with_ours():
    user_pass = _CountingPass()
    x = torch.randn(4, 16)
    options = {"post_grad_custom_pre_pass": user_pass, "fx_graph_cache": False}  # no cache: passes must run
    recording = backend.Backend()
    out = torch.compile(_pick, backend=recording, options=options, fullgraph=True)(x)
    assert torch.equal(out, _pick(x))
    (record,) = recording.compiles
    chained = record.config_patches["post_grad_custom_pre_pass"]
    assert user_pass.calls == 1 and record.post_grad is chained and chained.reports
    assert "counting-pass" in chained.uuid()
    assert PostGradPass(Options(), user_pass=lambda graph: None).uuid() is None  # no uuid: no cache


def test_golden_graphs_run_the_user_post_grad_pass_as_the_backend_does():
    """draftfuse.testing.draft_graphs built its post-grad pass without the user's (given in the options or in
    Inductor's config): its post-grad graph was not the one the backend compiles."""
    from draftfuse.testing import draft_graphs

    in_options, in_config = _CountingPass(), _CountingPass()
    draft_graphs(_pick, torch.randn(4, 16), options={"post_grad_custom_pre_pass": in_options})
    with torch._inductor.config.patch(post_grad_custom_pre_pass=in_config):
        draft_graphs(_pick, torch.randn(4, 16))
    assert in_options.calls == 1 and in_config.calls == 1


def test_golden_graphs_of_a_draft_whose_trace_restarts():
    """A float64 0-d temperature makes Dynamo restart the trace from inside the backend (it turns the tensor
    into a Python float), which then runs again: draft_graphs said "the draft breaks into several" graphs
    of a draft that compiles as one."""
    from draftfuse.testing import draft_graphs

    def draft(x, t):
        return torch.softmax(x / t, -1).topk(3, -1)

    x, t = torch.randn(3, 53), torch.tensor(0.7, dtype=torch.float64)
    graphs = draft_graphs(draft, x, t)
    assert "softmax+topk(k=3) -> topk(logits)" in graphs.report and "softmax" not in graphs.post_grad
    assert torch.equal(graphs.outputs[1], draft(x, t)[1])


@pytest.mark.parametrize("lowering", ["torch", "kernels"])
def test_probs_ones_holds_at_every_batch_size(lowering):
    """probs="ones" gave 1.0 at batch 1 and 2 but the exact probabilities from batch 3 on, where torch's
    automatic dynamic shapes recompile with a symbolic batch: the constant needed a static shape at both
    levels, where only ATen's full does. A decomposed softmax (post-grad level) keeps the exact values
    there, as the report says; before, the kernels' path filled it from the shape as first traced."""

    def greedy(x):
        return torch.softmax(x, -1).topk(1, -1)

    def decomposed(x):
        e = (x - x.amax(-1, keepdim=True)).exp()
        return (e / e.sum(-1, keepdim=True)).max(-1)

    compiled = torch.compile(greedy, backend="draftfuse", options={"probs": "ones", "lowering": lowering})
    for batch in (1, 3, 8, 2):
        x = torch.randn(batch, 16)
        values, index = compiled(x)
        assert torch.equal(values, torch.ones(batch, 1)) and torch.equal(index, greedy(x)[1])
    compiled = torch.compile(decomposed, backend="draftfuse", options={"probs": "ones", "lowering": lowering})
    for batch in (1, 3, 8):
        x = torch.randn(batch, 16)
        values, index = compiled(x)
        want = torch.ones(1) if batch == 1 else decomposed(x)[0]  # static at first: the constant
        torch.testing.assert_close(values, want)
        assert torch.equal(index, decomposed(x)[1])


def test_generated_code_has_no_topk():
    x = torch.randn(8, 128)
    out, code = run_and_get_code(torch.compile(_pick, backend="draftfuse", fullgraph=True), x)
    assert torch.equal(out, _pick(x))
    assert "topk" not in "\n".join(code)


def test_registration_is_idempotent():
    from torch._dynamo.backends.registry import lookup_backend

    backend._register()  # a second registration attempt must not trip torch's duplicate-name assert
    assert lookup_backend("draftfuse") is backend.draftfuse_backend
    assert "draftfuse" in torch._dynamo.list_backends()


_PICK_SCRIPT = """
import sys, torch
def pick(x):
    return torch.softmax(x, dim=-1).topk(1, dim=-1)[1]
x = torch.randn(4, 16)
imported_before = "draftfuse" in sys.modules
out = torch.compile(pick, backend="draftfuse")(x)
print("imported before:", imported_before, "after:", "draftfuse" in sys.modules, "equal:", torch.equal(out, pick(x)))
"""


def _run_pick_script(env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", _PICK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow  # a fresh interpreter imports torch and compiles: about 12 s of CPU
def test_backend_by_name_in_a_fresh_interpreter():
    # The torch_dynamo_backends entry point makes the name work without `import draftfuse`.
    done = _run_pick_script({key: value for key, value in os.environ.items() if key != "TORCH_LOGS"})
    assert "imported before: False after: True equal: True" in done.stdout


@pytest.mark.slow
def test_torch_logs_draftfuse_shows_graphs_and_reports():
    # torch accepts importable module names as log names (and imports the package to find them).
    done = _run_pick_script({**os.environ, "TORCH_LOGS": "draftfuse"})
    assert "equal: True" in done.stdout
    assert "draftfuse: Dynamo graph" in done.stderr  # the backend's logger
    assert "[softmax_topk] 1 rewrite," in done.stderr  # a pass report
    assert "draftfuse: graph handed to Inductor" in done.stderr


def test_a_backend_with_fixed_options_refuses_torch_compiles_own():
    fixed = backend.Backend(Options.parse(None, {"probs": "ones"}))
    with pytest.raises(Exception, match="would be ignored"):
        torch.compile(_pick, backend=fixed, options={"probs": "exact"}, fullgraph=True)(torch.randn(4, 16))


def _top_k_of_tempered(logits, temperature, k: int = 4):
    return torch.topk(torch.softmax(logits.float() / temperature[:, None], -1), k)


def test_draft_graphs_do_not_depend_on_an_earlier_trace():
    """draft_graphs traces static shapes and ints: after a trace with k = 1, Dynamo's automatic dynamic
    shapes would make k a symbol in the next trace of the same function, and the rewrite (which needs a
    known k) would be refused there: a golden graph would depend on the tests run before it."""
    logits, temperature = torch.randn(8, 100) * 4, torch.rand(8) + 0.5
    for k in (1, 4, 8):
        graphs = draftfuse.testing.draft_graphs(_top_k_of_tempered, logits, temperature, k=k)
        assert "softmax+topk(k=" in graphs.report and "refused" not in graphs.report, (k, graphs.report)


class _Bf16Head(torch.nn.Module):
    """A head whose parameters require grad, as any module's do: a draft run without no_grad."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 100)

    def forward(self, hidden):
        return self.lm_head(hidden)


@pytest.mark.parametrize("case", ["bf16 values (round_to)", "kernels", "probs ones"])
def test_a_draft_run_with_grad_enabled_compiles_and_keeps_its_gradients(case):
    """With grad enabled the rewritten graph goes through AOTAutograd's backward: draftfuse's ops there
    need a backward (round_to has one; the selection kernels have none, so torch's ops are used), and
    probs="ones" would cut the gradient (so the exact values are emitted). Each crashed or detached."""
    torch.manual_seed(0)
    head, hidden = _Bf16Head(), torch.randn(2, 8)
    if case == "bf16 values (round_to)":
        head, hidden, options, k = head.bfloat16(), hidden.bfloat16(), {}, 4
    else:
        options, k = {"lowering": "kernels"} if case == "kernels" else {"probs": "ones"}, 1

    def draft(hidden):
        return torch.softmax(head(hidden).float() if case != "bf16 values (round_to)" else head(hidden), -1).topk(k)

    values, index = torch.compile(draft, backend="draftfuse", options=options, fullgraph=True)(hidden)
    want_values, want_index = draft(hidden)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(values, want_values)
    assert values.requires_grad
    values.float().sum().backward()
    got = head.lm_head.weight.grad.clone()
    head.zero_grad()
    want_values.float().sum().backward()
    bf16 = dict(atol=1e-4, rtol=2e-2) if case == "bf16 values (round_to)" else {}  # bf16 backward kernels round apart
    torch.testing.assert_close(got.float(), head.lm_head.weight.grad.float(), **bf16)


@pytest.mark.parametrize("options", [{}, {"probs": "ones"}, {"lowering": "kernels"}])
def test_a_temperature_that_requires_grad_keeps_its_gradient(options):
    """Only the temperature requires grad (a learned one): the rewrite looked at the logits alone, so
    probs="ones" cut the gradient and the kernels (no backward) crashed the compile."""

    def draft(logits, t):
        return torch.softmax(logits / t[:, None], -1).max(-1)

    logits = torch.randn(3, 50)
    t = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    want_values, want_index = draft(logits, t)
    want_values.sum().backward()
    want_grad, t.grad = t.grad.clone(), None
    values, index = torch.compile(draft, backend="draftfuse", options=options, fullgraph=True)(logits, t)
    assert torch.equal(index, want_index)
    values.sum().backward()
    torch.testing.assert_close(t.grad, want_grad)


def test_the_gradient_of_a_tied_maximum_goes_to_the_index_picked():
    """p_max's gradient is eager's: softmax(x)[index] is smooth, so at a tie of the maximum the gradient
    goes through the index picked; 1 / sum(exp(x - max(x))) split it over the tied positions (max's backward)."""

    def draft(x):
        return torch.softmax(x, -1).max(-1)[0]

    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, -1.0]], requires_grad=True)
    draft(x).sum().backward()
    want, x.grad = x.grad.clone(), None
    torch.compile(draft, backend="draftfuse", fullgraph=True)(x).sum().backward()
    torch.testing.assert_close(x.grad, want)


def _under_no_grad_topk(x):
    p = torch.softmax(x, -1)
    with torch.no_grad():
        values, index = p.topk(2, -1)
    return (p * p).sum() + (values * values).sum(), values, index


def _under_no_grad_temperature(x):
    with torch.no_grad():
        scaled = x / 0.5
    values, index = torch.softmax(scaled, -1).topk(2, -1)
    return (x * x).sum() + (values * values).sum(), values, index


@pytest.mark.parametrize("draft", [_under_no_grad_topk, _under_no_grad_temperature], ids=["topk", "temperature"])
def test_a_grad_mode_switch_inside_the_pattern_keeps_eagers_gradients(draft):
    """`with torch.no_grad()` around the topk (or the temperature) puts a grad-mode switch between the
    softmax's chain and the selection: the rewrite computed the values beside the softmax, under the
    other grad mode, and they carried gradients where eager's carry none (the program's gradient then
    changed). Refused now, with the reason in the report."""
    x = torch.tensor([[0.1, 2.0, 1.0, -1.0], [3.0, 0.5, 1.2, 0.0]], requires_grad=True)
    loss, values, index = draft(x)
    loss.backward()
    want, x.grad = x.grad.clone(), None
    recording = backend.Backend()
    got_loss, got_values, got_index = torch.compile(draft, backend=recording, fullgraph=True)(x)
    assert torch.equal(got_index, index) and got_values.requires_grad is values.requires_grad is False
    got_loss.backward()
    torch.testing.assert_close(x.grad, want)
    report = "\n".join(map(str, recording.compiles[-1].reports))
    assert "changes torch's global state" in report, report


@pytest.mark.parametrize("lowering", ["torch", "kernels"])
@pytest.mark.parametrize("k", [1, 4])
def test_values_of_probabilities_read_elsewhere_are_their_elements(k, lowering):
    """Code that reads the probabilities besides the selection (a min-p or top-k mask, a one-hot of the
    max) compares them with the selected values: eager's are elements of the probabilities. Recomputed
    from the exp-sum they differed in the last bit (bf16 logits, float32 softmax), and the mask kept no
    entry of most rows. Gathered from the probabilities now."""

    def draft(logits):
        probs = torch.softmax(logits.float(), -1)
        values, index = probs.topk(k, -1) if k > 1 else probs.max(-1, keepdim=True)
        return (probs >= values[..., -1:]).sum(-1), index, values

    torch.manual_seed(0)
    logits = (torch.randn(8, 4096) * 3).to(torch.bfloat16)
    recording = backend.Backend(Options(lowering=lowering))
    kept, index, values = torch.compile(draft, backend=recording, fullgraph=True)(logits)
    want_kept, want_index, want_values = draft(logits)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(values, want_values)  # the compiled softmax's own rounding
    assert kept.tolist() == want_kept.tolist() == [k] * 8
    assert "read elsewhere too" in "\n".join(map(str, recording.compiles[-1].reports))


@pytest.mark.parametrize("lowering", ["torch", "kernels"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("twin", ["same call", "another spelling"])
def test_values_compared_with_a_twin_softmax_are_its_elements(twin, k, lowering):
    """The same softmax spelled twice (a logits processor recomputing the probabilities to mask them by the
    k-th selected one, as a min-p or top-k warper does): eager's two are bit for bit alike, so the mask
    keeps k entries. The values were recomputed from the exp-sum, as if nothing else read the
    probabilities, and the mask dropped the k-th entry where their last bit differed (helper-62's repro:
    one row of four, and the sampled token changed). Gathered from the probabilities now."""

    def draft(logits):
        values, index = torch.softmax(logits.float(), -1).topk(k, -1)
        probs = torch.softmax(logits.float(), -1) if twin == "same call" else logits.float().softmax(dim=-1)
        return (probs >= values[..., -1:]).sum(-1), index, values

    torch.manual_seed(0)
    logits = torch.randn(64, 4096) * 3  # float32: no ties among the top k
    recording = backend.Backend(Options(lowering=lowering))
    kept, index, values = torch.compile(draft, backend=recording, fullgraph=True)(logits)
    want_kept, want_index, want_values = draft(logits)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(values, want_values)
    assert kept.tolist() == want_kept.tolist() == [k] * 64
    assert "read elsewhere too" in "\n".join(map(str, recording.compiles[-1].reports))


def test_values_are_gathered_when_a_refused_selection_reads_the_probabilities():
    """A selection the pass refuses (topk(sorted=False), k > 1) reads the probabilities too: it counted as
    a selection, so the rewritten max's value was recomputed and equalled no value of the refused topk in
    half of the rows."""

    def draft(logits):
        probs = torch.softmax(logits.float(), -1)
        vmax, imax = probs.max(-1)
        vu, _ = probs.topk(4, -1, sorted=False)
        return (vu == vmax[:, None]).sum(-1), imax

    torch.manual_seed(0)
    logits = (torch.randn(64, 4096) * 3).to(torch.bfloat16)
    got, index = torch.compile(draft, backend=backend.Backend(Options(lowering="torch")), fullgraph=True)(logits)
    want, want_index = draft(logits)
    assert torch.equal(index, want_index) and int((got == 1).sum()) == int((want == 1).sum())


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32])
def test_integer_logits_under_a_negative_temperature_tensor_select_eagers_token(dtype):
    """The order under a temperature tensor is that of x * sign(t), computed in float64 for integer
    logits: in uint8 -x wraps (5 -> 251) and int8's -128 stays -128, and the wrong token was picked."""

    def draft(x, t):
        return torch.softmax(x / t, -1).argmax(-1)

    low = 0 if dtype == torch.uint8 else -128
    x = torch.tensor([[0, 5, 3], [7, 0, 2], [low, 5, 3]], dtype=dtype)
    for t in (torch.tensor(-1), torch.tensor([[-1], [2], [-3]])):
        torch._dynamo.reset()
        got = torch.compile(draft, backend="draftfuse", fullgraph=True)(x, t)
        assert torch.equal(got, draft(x, t)), (t, got)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("temperature", ["row", "constant", "row, then a cast"])
def test_integer_logits_under_a_negative_temperature_give_eager_s_values(k, temperature):
    """The values' s - amax(s) over x / t is what Inductor's joint-graph pass rewrites into (x * sign -
    max(x * sign)) / (sign * t), in x's dtype: for int8 -128 * -1 wraps, and the top probability came out
    0.018 where eager's is 0.982 (helper-69's fuzzing). The values now read s from x made float."""

    def draft(x, t):
        scaled = x / -0.5 if temperature == "constant" else x / t.unsqueeze(1)
        if temperature == "row, then a cast":
            scaled = scaled.to(torch.float32)  # a no-op cast AOT drops: the fuzzer's seed 500566
        return torch.softmax(scaled, 1).topk(k, 1)

    x = torch.tensor([[-128, -126, 3], [-126, -128, 3]], dtype=torch.int8)
    t = torch.tensor([-0.5, -0.5])
    got = torch.compile(draft, backend="draftfuse", fullgraph=True)(x, t)
    want = draft(x, t)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values)


@pytest.mark.parametrize(
    "dtype, scaled",
    [
        (torch.int8, lambda x, t: (x * 2) / t),  # 100 * 2 is -56 in int8
        (torch.int32, lambda x, t: (x * 2) * 0.5),  # a constant factor after the wrap
        (torch.uint8, lambda x, t: (x * 2) * 0.5),
        (torch.int32, lambda x, t: (x * torch.full_like(x[:, :1], 2)) * 0.5),  # an integer per-row scale
    ],
)
def test_an_integer_product_that_wraps_is_selected_as_computed(dtype, scaled):
    """The walk back from the softmax went through an integer multiplication as through an order-keeping
    scale, so the selection read the logits from before it wrapped around and picked another token (with
    probability 1.0 for it; helper-66). An integer product now stops the walk: the selection reads it."""
    from draftfuse.passes.softmax_topk import rewrite_softmax_topk
    from tests._graphs import dynamo_graph

    def draft(x, t):
        return torch.softmax(scaled(x, t), -1).topk(1, -1)

    big = {torch.int8: 100, torch.uint8: 200, torch.int32: 2**30 + 5}[dtype]
    x = torch.tensor([[big, 100, 5, 3], [1, 2, big, 9]], dtype=dtype)
    t = torch.tensor([[0.8], [1.5]])
    gm = dynamo_graph(draft, x, t)
    result = rewrite_softmax_topk(gm)
    assert len(result.report.rewrites) == 1, result.report.format()
    used = (x, t)[: len(gm.graph.find_nodes(op="placeholder"))]  # Dynamo drops a t the draft does not read
    got, want = result.graph_module(*used), draft(x, t)
    assert torch.equal(got[1], want.indices), (got[1].tolist(), want.indices.tolist())
    assert torch.allclose(got[0], want.values)


def test_a_one_value_temperature_that_adds_dims_is_not_a_kernel_scale():
    """t of shape [1, 1, 1] broadcasts [5, 7] logits to [1, 5, 7]: the softmax's dim 1 is then the rows of
    the logits, which the kernels (reducing the logits' last dim) would not select over; the torch form
    selects as eager does (the kernels picked the wrong tokens, in a [5, 2] result for eager's [1, 2, 7])."""

    def topk(x, t):
        return torch.softmax(x / t, dim=1).topk(2, dim=1)

    def argmax(x, t):
        return torch.softmax(x / t, dim=1).argmax(1).flatten()

    t = torch.full((1, 1, 1), 0.7)
    for draft, x in ((topk, torch.randn(5, 7)), (argmax, torch.randn(7, 7))):
        torch._dynamo.reset()
        backend_ = backend.Backend(Options.parse(None, {"lowering": "kernels"}))
        got = torch.compile(draft, backend=backend_, fullgraph=True)(x, t)
        want = draft(x, t)
        assert torch.equal(got[1] if draft is topk else got, want[1] if draft is topk else want)
        reports = [str(r) for c in backend_.compiles for r in c.reports]
        assert any("not one value per row of the logits" in r for r in reports), reports


def test_probs_ones_under_dynamic_shapes_is_reported_as_emitted():
    """The report says what is emitted (it said 'probabilities 1' and computed them): under dynamic shapes
    the constant at the Dynamo level (ones_like takes any shape), the exact values at the ATen level (full
    needs a static shape)."""

    def draft(logits):
        return torch.softmax(logits, -1).max(-1)

    def decomposed(logits):
        e = (logits - logits.amax(-1, keepdim=True)).exp()
        return (e / e.sum(-1, keepdim=True)).max(-1)

    for fn, constant in ((draft, True), (decomposed, False)):
        torch._dynamo.reset()
        backend_ = backend.Backend(Options.parse(None, {"probs": "ones"}))
        values, _ = torch.compile(fn, backend=backend_, dynamic=True, fullgraph=True)(torch.randn(3, 7))
        reports = [str(r) for c in backend_.compiles for r in c.reports]
        assert torch.equal(values, torch.ones(3)) == constant
        assert any("(probs='ones')" in r for r in reports) == constant, reports
        assert any("probabilities from the exp-sum" in r for r in reports) != constant, reports


@pytest.mark.parametrize("options", [{"fallback_random": "False"}, {"triton.cudagraphs": "False"}, {"spare_recordings": 2}])
def test_options_of_the_wrong_type_or_owner_are_refused(options):
    """An Inductor option of the wrong type ('False' is truthy) and draft_loop's spare_recordings, even
    at its default, are errors, as torch.compile's own options check is."""
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="ValueError: draftfuse: "):  # raised when it compiles
        torch.compile(lambda x: x + 1, backend="draftfuse", options=options)(torch.zeros(2))


@pytest.mark.parametrize(
    "options, message",
    [([("probs", "ones")], "must be a dict"), ({1: "ones"}, "names are strings"), ({"max-autotune": True, "max_autotune": False}, "given twice")],
)
def test_malformed_options_are_value_errors(options, message):
    """A list of pairs or a non-string key raised AttributeError; one Inductor option spelled both ways kept the last."""
    from draftfuse.options import Options

    with pytest.raises(ValueError, match=message):
        Options.parse(None, options)


def test_probs_ones_says_when_the_probabilities_are_read_elsewhere():
    """probs="ones" is the caller's promise that no result depends on the k = 1 values; where the pass sees
    the probabilities read elsewhere (a mask p >= v), the report says the constant was used anyway (helper-75)."""

    def draft(x):
        probs = torch.softmax(x, -1)
        values, index = probs.topk(1, -1)
        return (probs >= values).sum(-1), index

    rec = backend.Backend(Options.parse(None, {"probs": "ones"}))
    torch.compile(draft, backend=rec, fullgraph=True)(torch.randn(3, 9))
    text = "\n".join(r.format() for c in rec.compiles for r in c.reports)
    assert "probs='ones', though the probabilities are read elsewhere" in text, text
