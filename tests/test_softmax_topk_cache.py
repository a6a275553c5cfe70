"""The post-grad pass and Inductor's FX graph cache: a stable uuid lets the second compile hit the cache,
and the cached code is the rewritten one (no topk, no probability tensor)."""

import re

import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

from draftfuse.options import Options
from draftfuse.passes.post_grad import PostGradPass

ROWS, VOCAB = 4, 320


def softmax_pass(**options) -> PostGradPass:
    return PostGradPass(Options.parse(options={"seed_fold": False, "lowering": "torch", **options}))


def greedy_pick(logits):
    return torch.softmax(logits.float(), dim=-1).topk(1)


def _compile_and_code(pass_):
    torch._dynamo.reset()  # forget Dynamo's compiled frame so Inductor is asked again
    with inductor_config.patch(post_grad_custom_pre_pass=pass_, fx_graph_cache=True):
        return run_and_get_code(torch.compile(greedy_pick, fullgraph=True), torch.randn(ROWS, VOCAB))


def _assert_rewritten(code: str):
    assert "topk" not in code
    # no buffer holding a probability per vocabulary entry: only row reductions are written
    assert not re.search(rf"empty_strided_cpu\(\({ROWS}, {VOCAB}\)", code), code


def test_second_compile_hits_the_cache_and_keeps_the_rewrite(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters.clear()
    _, (first_code,) = _compile_and_code(first := softmax_pass())
    assert len(first.reports) == 1 and len(first.reports[0].rewrites) == 1
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    _assert_rewritten(first_code)

    _, (second_code,) = _compile_and_code(second := softmax_pass())
    assert counters["inductor"]["fxgraph_cache_hit"] == 1
    assert second.reports == []  # a cache hit does not run the pass: the code is the cached one
    _assert_rewritten(second_code)


def test_uuid_covers_every_option():
    assert softmax_pass().uuid() == softmax_pass().uuid()
    for key, value in [("probs", "ones"), ("lowering", "auto"), ("half_probs", "keep"), ("seed_fold", True)]:
        assert softmax_pass(**{key: value}).uuid() != softmax_pass().uuid(), key


def test_uuid_covers_every_file_that_decides_a_rewrite():
    from draftfuse.passes import post_grad

    post_grad.source_hash.cache_clear()
    files = post_grad._source_files()
    names = {f.split("draftfuse/")[-1] for f in files}
    assert {"kernels/selection.py", "options.py", "graph/effects.py", "passes/softmax_topk/match.py", "passes/softmax_topk/recognise.py", "passes/softmax_topk/forms.py", "passes/prove.py"} <= names


def test_without_the_pass_the_code_keeps_topk(tmp_path, monkeypatch):
    """The check above can fail: the unrewritten function's code has topk and the probabilities."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    _, (code,) = _compile_and_code(None)
    assert "topk" in code
    assert re.search(rf"empty_strided_cpu\(\({ROWS}, {VOCAB}\)", code)
