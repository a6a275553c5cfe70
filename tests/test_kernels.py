"""The selection ops (torch.ops.draftfuse.argmax_prob / topk_prob) against their torch references.

- CPU: the references against softmax + topk/argmax, the ops' schemas and fake implementations
  (torch.library.opcheck), a Dynamo + AOT capture.
- Triton's interpreter (TRITON_INTERPRET=1, on CPU): the kernels against the references on every
  dtype, ragged and large vocabularies, forced and automatic splits, ties, NaN, +-inf, all-equal rows.
  Triton reads that variable when a kernel is defined, so these cases run in a subprocess started
  with it (`python -m tests.test_kernels DTYPE` runs them by hand). Skipped, saying why, where Triton
  is not installed.
- `cuda`: the same on the GPU, at the benchmark's sizes, plus CUDA-graph capture and torch.compile.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from draftfuse.kernels import argmax_prob_reference, selection_kernels_available, topk_prob_reference
from draftfuse.kernels import selection as _selection

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAN, INF = float("nan"), float("inf")


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


def check_selection(logits: torch.Tensor, k: int, log: bool, prob: torch.Tensor, index: torch.Tensor) -> str:
    """'' if (prob, index) from the kernels equal the reference, else what differs."""
    want_prob, want_index = topk_prob_reference(logits.cpu(), k, log)
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


def _interpreter_cases(dtype: torch.dtype) -> list[tuple[str, torch.Tensor, int, bool, int | None]]:
    """(name, logits, k, log, splits) for the interpreter, sized for a 2-core CPU."""
    cases = []
    for vocab in (1, 7, 1000, 4099):  # 4099: two whole tiles and a ragged tail, so 3 splits by default
        rows = special_rows(vocab, dtype)
        for k in (1, 4, 16):
            if k <= vocab:
                cases.append((f"special-v{vocab}-k{k}", rows, k, k == 4, None))
                if vocab == 4099:
                    cases.append((f"special-v{vocab}-k{k}-one-split", rows, k, k == 1, 1))
    g = torch.Generator().manual_seed(0)
    batch = 256 if dtype == torch.bfloat16 else 64  # the interpreter runs programs one by one
    ties = torch.randint(-2, 3, (batch, 64), generator=g).to(dtype)
    cases.append((f"ties-b{batch}-v64-k4", ties, 4, True, None))
    for vocab, k in ((32000, 16), (128256, 1), (151936, 4), (262144, 1)):
        logits = (torch.randn(1, vocab, generator=g) * 4).to(dtype)
        cases.append((f"random-b1-v{vocab}-k{k}", logits, k, False, None))
    return cases


def run_interpreter_cases(dtype: torch.dtype) -> list[str]:
    """Runs the kernels under Triton's interpreter; returns the failures."""
    kernels = _selection._triton_selection()
    failures = []
    for name, logits, k, log, splits in _interpreter_cases(dtype):
        prob = torch.empty(logits.shape[0], k)
        index = torch.empty(logits.shape[0], k, dtype=torch.int64)
        kernels.launch_selection(logits, k, log, prob, index, splits=splits)
        if problem := check_selection(logits, k, log, prob, index):
            failures.append(f"{name}: {problem}")
    # the ops' CUDA-path wrapper: leading dims that don't flatten to one stride, and a strided last dim
    logits = special_rows(1000, dtype).reshape(2, 5, 1000).transpose(0, 1)
    for k in (1, 3):
        prob = torch.empty(*logits.shape[:-1], k)
        index = torch.empty(*logits.shape[:-1], k, dtype=torch.int64)
        _selection._run_kernels(logits, k, False, prob, index)
        if problem := check_selection(logits, k, False, prob, index):
            failures.append(f"3-d logits, k={k}: {problem}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_kernels_in_triton_interpreter(dtype_name):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed, so the selection kernels can't run in its interpreter (pip install triton)")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_kernels", dtype_name],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


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
    for log in (False, True):
        torch.library.opcheck(torch.ops.draftfuse.argmax_prob.default, (x, log))
        torch.library.opcheck(torch.ops.draftfuse.topk_prob.default, (x.bfloat16(), 4, log))
    torch.library.opcheck(torch.ops.draftfuse.topk_prob.default, (x[..., ::2], 3))
    assert str(torch.ops.draftfuse.argmax_prob.default._schema).endswith("(Tensor logits, bool log=False) -> (Tensor, Tensor)")


def test_ops_captured_by_dynamo_as_one_graph():
    def draft_pick(logits):
        index, prob = torch.ops.draftfuse.argmax_prob(logits)
        top_prob, top_index = torch.ops.draftfuse.topk_prob(logits, 4, True)
        return index, prob, top_prob, top_index

    x = torch.randn(2, 1000)
    got = torch.compile(draft_pick, backend="aot_eager", fullgraph=True)(x)
    for a, b in zip(got, draft_pick(x)):
        assert torch.equal(a, b)


def test_kernels_predicate():
    assert not selection_kernels_available("cpu", torch.bfloat16, 1)
    assert not selection_kernels_available("cuda", torch.float64, 1)
    assert not selection_kernels_available("cuda", torch.bfloat16, 17)
    assert not selection_kernels_available("cuda", torch.bfloat16, 4, last_dim_contiguous=False)
    triton = importlib.util.find_spec("triton") is not None
    assert selection_kernels_available(torch.device("cuda", 0), torch.bfloat16, 16) == triton


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 16])
def test_cuda_kernels_match_reference(dtype_name, k):
    dtype = DTYPES[dtype_name]
    assert selection_kernels_available("cuda", dtype, k)
    g = torch.Generator(device="cuda").manual_seed(k)
    sizes = [(b, v) for v in (32000, 128256, 151936, 262144) for b in (1, 8, 64, 256)] + [(3, 7), (5, 1000003)]
    for batch, vocab in sizes:
        if vocab < k:
            continue
        x = (torch.randn(batch, vocab, device="cuda", generator=g) * 4).to(dtype)
        for log in (False, True):
            if k == 1:
                index, prob = torch.ops.draftfuse.argmax_prob(x, log)
                assert torch.equal(index, x.argmax(-1)), (batch, vocab)
                prob, index = prob[:, None], index[:, None]
            else:
                prob, index = torch.ops.draftfuse.topk_prob(x, k, log)
            assert not (problem := check_selection(x, k, log, prob, index)), (batch, vocab, log, problem)
    for vocab in (1, 7, 1000, 4099, 32000, 151936):
        if k <= vocab:
            x = special_rows(vocab, dtype, "cuda")
            prob, index = torch.ops.draftfuse.topk_prob(x, k)
            assert not (problem := check_selection(x, k, False, prob, index)), (vocab, problem)


@pytest.mark.cuda
@pytest.mark.parametrize("tile", [(512, 1, 24), (2048, 4, 8)], ids=str)
def test_cuda_other_tilings(tile):
    """The tiling is a tuning choice (benchmarks/selection.py --tile): results must not depend on it."""
    kernels = _selection._triton_selection()
    block, num_warps, programs_per_sm = tile
    for dtype in DTYPES.values():
        for x in (special_rows(4099, dtype, "cuda"), torch.randn(64, 151936, device="cuda").mul_(4).to(dtype)):
            for k in (1, 4, 16):
                prob = torch.empty(x.shape[0], k, device="cuda")
                index = torch.empty(x.shape[0], k, device="cuda", dtype=torch.int64)
                kernels.launch_selection(
                    x, k, False, prob, index, block=block, num_warps=num_warps, programs_per_sm=programs_per_sm
                )
                assert not (problem := check_selection(x, k, False, prob, index)), (dtype, x.shape, k, problem)


@pytest.mark.cuda
def test_cuda_graph_replay_recomputes():
    static = torch.randn(8, 128256, device="cuda", dtype=torch.bfloat16)
    torch.ops.draftfuse.topk_prob(static, 4)  # compile the kernels outside the capture
    torch.ops.draftfuse.argmax_prob(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prob, index = torch.ops.draftfuse.topk_prob(static, 4)
        top1, top1_prob = torch.ops.draftfuse.argmax_prob(static)
    for _ in range(3):
        static.copy_(torch.randn_like(static))
        graph.replay()
        assert not check_selection(static, 4, False, prob, index)
        assert not check_selection(static, 1, False, top1_prob[:, None], top1[:, None])


@pytest.mark.cuda
def test_cuda_compiled_reduce_overhead():
    torch._dynamo.reset()

    def pick(logits):
        index, prob = torch.ops.draftfuse.argmax_prob(logits)
        return index, prob.to(logits.dtype)

    fn = torch.compile(pick, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        x = torch.randn(4, 151936, device="cuda", dtype=torch.bfloat16)
        index, prob = fn(x)
        assert torch.equal(index, x.argmax(-1))
        # float32 inside, then one rounding to bf16: at most one bf16 ulp from softmax's own rounding
        torch.testing.assert_close(prob, torch.softmax(x.float(), -1).amax(-1).to(x.dtype), rtol=2**-7, atol=0)


if __name__ == "__main__":
    import triton  # noqa: F401  (fail loudly here: the test skips before starting this without Triton)

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (Triton's interpreter, on CPU)"
    failed = run_interpreter_cases(DTYPES[sys.argv[1]])
    print("\n".join(failed) or f"all interpreter cases passed ({sys.argv[1]})")
    sys.exit(1 if failed else 0)
