"""Differential fuzzing of softmax -> selection rewrites against eager PyTorch (tests/fuzz/selection.py).

Programs are generated with the hazards (in-place writes to the logits and the probabilities, views,
aliasing casts, tensor and negative temperatures, mismatched dims, smallest selections...), and with
logits that avoid the README's documented difference cases by construction (no NaN/inf rows, no
ties, no rounding ties: see the module docstring of tests/fuzz/selection.py). Each oracle is a test:

  * Dynamo level: rewrite_softmax_topk on the Dynamo graph vs eager (and, for the forms the README
    lists as rewritten, that the rewrite happens);
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
from hypothesis import given

from tests.fuzz import hyp, selection
from tests.fuzz.common import hypothesis_strategy, pipeline_available

PROGRAMS = hypothesis_strategy(selection.generate)
HANDWRITTEN = hypothesis_strategy(selection.generate_handwritten)


def _dynamo(program):
    hyp.check(selection.check_dynamo, program, "dynamo", selection.CaptureUnsupported)


def _expect(program):
    hyp.check(selection.check_dynamo, program, "dynamo", selection.CaptureUnsupported, expect_rewrites=True)


def _aten(program):
    hyp.check(selection.check_aten, program, "aten", selection.CaptureUnsupported)


def _handwritten(program):
    hyp.check(selection.check_handwritten, program, "handwritten", selection.CaptureUnsupported)


def _pipeline(program):
    hyp.check(selection.check_pipeline, program, "pipeline", selection.CaptureUnsupported)


needs_pipeline = pytest.mark.skipif(not pipeline_available(), reason="this draftfuse has no draftfuse.testing.draft_graphs")


def _backend(program):
    hyp.check(selection.check_backend, program, "backend", selection.CaptureUnsupported)


# ---- CI samples (about 60 s together on a 2-core CPU) ----


@hyp.ci(200)
@given(PROGRAMS)
def test_dynamo_rewrite_matches_eager(program):
    _dynamo(program)


@hyp.ci(100)
@given(PROGRAMS)
def test_supported_forms_are_rewritten(program):
    _expect(program)


@hyp.ci(60)
@given(PROGRAMS)
def test_aten_rewrite_matches_unrewritten(program):
    _aten(program)


@hyp.ci(250)
@given(HANDWRITTEN)
def test_handwritten_post_grad_forms(program):
    _handwritten(program)


@needs_pipeline
@hyp.ci(40, shrink=False)
@given(PROGRAMS)
def test_pipeline_matches_eager(program):
    _pipeline(program)


@hyp.ci(4, shrink=False)
@given(PROGRAMS)
def test_backend_matches_eager(program):
    _backend(program)


# ---- long runs: `python -m pytest -m slow tests/test_fuzz_selection.py` ----


@pytest.mark.slow
@hyp.slow(2000)
@given(program=PROGRAMS)
def test_slow_dynamo_rewrite_matches_eager(slow_run, program):
    _dynamo(program)


@pytest.mark.slow
@hyp.slow(2000)
@given(program=PROGRAMS)
def test_slow_aten_rewrite_matches_unrewritten(slow_run, program):
    _aten(program)


@pytest.mark.slow
@hyp.slow(2000)
@given(program=HANDWRITTEN)
def test_slow_handwritten_post_grad_forms(slow_run, program):
    _handwritten(program)


@pytest.mark.slow
@needs_pipeline
@hyp.slow(2000)
@given(program=PROGRAMS)
def test_slow_pipeline_matches_eager(slow_run, program):
    _pipeline(program)


@pytest.mark.slow
@hyp.slow(40)
@given(program=PROGRAMS)
def test_slow_backend_matches_eager(slow_run, program):
    _backend(program)
