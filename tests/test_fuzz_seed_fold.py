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

from tests.fuzz import hyp, seed_fold
from tests.fuzz.common import hypothesis_strategy, pipeline_available

PROGRAMS = hypothesis_strategy(seed_fold.generate)
needs_pipeline = pytest.mark.skipif(not pipeline_available(), reason="this draftfuse has no draftfuse.testing.draft_graphs")

RUNS = {
    "pass": hyp.Run(PROGRAMS, seed_fold.check_pass, ci=100, slow=2000),
    "pass-ranges-as-argument": hyp.Run(PROGRAMS, seed_fold.check_pass, ci=25, options={"direct_ranges": True}),
    "pipeline": hyp.Run(PROGRAMS, seed_fold.check_pipeline, ci=40, slow=2000, shrink=False, marks=(needs_pipeline,)),
    "fold": hyp.Run(PROGRAMS, seed_fold.check_fold, ci=3, slow=40, shrink=False),
}


test_ci_sample, test_slow_run = hyp.tests(RUNS, seed_fold.CaptureUnsupported, "tests/test_fuzz_seed_fold.py")
