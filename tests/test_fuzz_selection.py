"""Differential fuzzing of softmax -> selection rewrites against eager PyTorch (tests/fuzz/selection.py).

Programs are generated with the hazards (in-place writes to the logits and the probabilities, an
in-place flag passed by position, views, aliasing casts, tensor and negative temperatures, temperatures
that require grad, integer logits, mismatched dims, smallest selections...), and with
logits that avoid the README's documented difference cases by construction (no NaN/inf rows, no
ties, no rounding ties: see the module docstring of tests/fuzz/selection.py). Each oracle is a test:

  * Dynamo level: rewrite_softmax_topk on the Dynamo graph vs eager (and, for the forms the README
    lists as rewritten, that the rewrite happens), with the torch lowering and with the kernels';
  * ATen level: the pass on Inductor's own pre-post-grad graph (compile_fx with a recording inner
    compile: no C++ compile), rewritten vs unrewritten;
  * hand-written decomposed softmax forms (make_fx), including wrong ones that must not match;
  * the whole pipeline without code generation (draftfuse.testing.draft_graphs: Dynamo-level passes,
    AOT autograd with Inductor's decompositions, draftfuse's post-grad passes, run eagerly);
  * the whole backend (a tiny sample: each example is an Inductor compile).

CI runs small deterministic samples; `python -m pytest -m slow tests/test_fuzz_selection.py` runs
>= 2,000 examples per level. A failure prints a runnable reproducer.
"""

import pytest

from tests.fuzz import hyp, selection
from tests.fuzz.common import hypothesis_strategy, pipeline_available

PROGRAMS = hypothesis_strategy(selection.generate)
HANDWRITTEN = hypothesis_strategy(selection.generate_handwritten)
needs_pipeline = pytest.mark.skipif(not pipeline_available(), reason="this draftfuse has no draftfuse.testing.draft_graphs")

RUNS = {
    "dynamo": hyp.Run(PROGRAMS, selection.check_dynamo, ci=200, slow=2000),
    "expect": hyp.Run(PROGRAMS, selection.check_dynamo, ci=100, options={"expect_rewrites": True}),  # the README's forms are rewritten
    # lowering="kernels" (CUDA's default): draftfuse's ops, their torch reference on a CPU
    "kernels": hyp.Run(PROGRAMS, selection.check_dynamo, ci=100, slow=2000, options={"lowering": "kernels"}),
    "aten": hyp.Run(PROGRAMS, selection.check_aten, ci=60, slow=2000),
    "handwritten": hyp.Run(HANDWRITTEN, selection.check_handwritten, ci=250, slow=2000),
    # the kernels compute their own values: a form whose branches scale differently shows there
    "handwritten_kernels": hyp.Run(HANDWRITTEN, selection.check_handwritten, ci=100, slow=2000, options={"lowering": "kernels"}),
    "pipeline": hyp.Run(PROGRAMS, selection.check_pipeline, ci=40, slow=2000, shrink=False, marks=(needs_pipeline,)),
    "backend": hyp.Run(PROGRAMS, selection.check_backend, ci=4, slow=40, shrink=False),
}


test_ci_sample, test_slow_run = hyp.tests(RUNS, selection.CaptureUnsupported, "tests/test_fuzz_selection.py")
