"""Differential fuzzing of the seed fold against eager `loop(*seed(...))` (tests/fuzz/seed_fold.py).

Programs: random seeds and loops over integer index arithmetic in int64/int32/int16/int8 (casts,
clamps, maximum/minimum, floor division, %, products that wrap), in-place writes (add_, +=, out=,
_foreach_add_, writes through einsum identity views and through a view passed alongside its pool),
random draws (the same draw in seed and loop is two draws), fresh buffers filled across the seam,
the seed's outputs carried to the loop, and only TRUE value_ranges (a write after the seam may break
them for the written value). Outputs and the inputs' final contents must equal eager's exactly.

  * pass level: fold_seed on the Dynamo graph of the composition (seam marker with the facts, as
    fold() builds it), also with the ranges given to fold_seed directly;
  * the whole pipeline without code generation (draftfuse.testing.draft_graphs): the Dynamo-level
    fold, AOT autograd with Inductor's decompositions, draftfuse's post-grad setup merging (where the
    proofs now run), the post-grad graph run eagerly;
  * draftfuse.fold(seed, loop, value_ranges=..., mode=None): Inductor on CPU, a tiny sample.

CI runs small deterministic samples; `python -m pytest -m slow tests/test_fuzz_seed_fold.py` runs
>= 2,000 examples at the pass and pipeline levels. A failure prints a runnable reproducer.
"""

import pytest
from hypothesis import given

from tests.fuzz import hyp, seed_fold
from tests.fuzz.common import hypothesis_strategy, pipeline_available

PROGRAMS = hypothesis_strategy(seed_fold.generate)


def _pass(program, **kwargs):
    hyp.check(seed_fold.check_pass, program, "pass", seed_fold.CaptureUnsupported, **kwargs)


def _pipeline(program):
    hyp.check(seed_fold.check_pipeline, program, "pipeline", seed_fold.CaptureUnsupported)


needs_pipeline = pytest.mark.skipif(not pipeline_available(), reason="this draftfuse has no draftfuse.testing.draft_graphs")


def _fold(program):
    hyp.check(seed_fold.check_fold, program, "fold", seed_fold.CaptureUnsupported)


# ---- CI samples (about 60 s together on a 2-core CPU) ----


@hyp.ci(100)
@given(PROGRAMS)
def test_fold_seed_pass_matches_eager(program):
    _pass(program)


@hyp.ci(25)
@given(PROGRAMS)
def test_fold_seed_pass_with_ranges_as_argument(program):
    _pass(program, direct_ranges=True)


@needs_pipeline
@hyp.ci(40, shrink=False)
@given(PROGRAMS)
def test_pipeline_matches_eager(program):
    _pipeline(program)


@hyp.ci(3, shrink=False)
@given(PROGRAMS)
def test_fold_matches_eager(program):
    _fold(program)


# ---- long runs: `python -m pytest -m slow tests/test_fuzz_seed_fold.py` ----


@pytest.mark.slow
@hyp.slow(2000)
@given(program=PROGRAMS)
def test_slow_fold_seed_pass_matches_eager(slow_run, program):
    _pass(program)


@pytest.mark.slow
@needs_pipeline
@hyp.slow(2000)
@given(program=PROGRAMS)
def test_slow_pipeline_matches_eager(slow_run, program):
    _pipeline(program)


@pytest.mark.slow
@hyp.slow(40)
@given(program=PROGRAMS)
def test_slow_fold_matches_eager(slow_run, program):
    _fold(program)
