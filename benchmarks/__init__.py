"""draftfuse's GPU benchmarks: `python benchmarks/run.py` (issue 6) and `python -m benchmarks.selection`.

A regular package, so that `benchmarks` resolves to this directory even where an installed
distribution ships a top-level package of the same name.
"""
