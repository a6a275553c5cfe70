"""Differential fuzzers for draftfuse (the tests: tests/test_fuzz_selection.py, tests/test_fuzz_seed_fold.py).

    selection.py        softmax/log_softmax -> selection programs with hazards, a float64 value model that
                        rules out the documented difference cases, and the oracles (Dynamo graph, Inductor's
                        pre-post-grad ATen graph, hand-written decomposed forms, draft_graphs, the backend)
    seed_fold.py        seed + loop programs over integer index arithmetic, and the oracles (fold_seed on
                        the Dynamo graph, draft_graphs, draftfuse.fold)
    common.py           the choice interface (hypothesis, a seeded random.Random, a replayed tape),
                        comparisons, controls that tell PyTorch's own differences from draftfuse's
    hyp.py              hypothesis settings (CI samples, slow runs) and reproducer printing
    run.py              command-line runner over many seeds, failures grouped by kind (background runs)
    shrink_failures.py  shrinks what run.py recorded
    known_failures.py   the failure classes found, one minimal reproducer each: `python -m tests.fuzz.known_failures`

DRAFTFUSE_FUZZ_DISABLE=a,b switches hazard families off, to look past a known failure class.
"""
