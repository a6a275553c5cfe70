"""Hypothesis glue for the fuzz tests: settings for CI samples and slow runs, and running an oracle
so that a failure prints a reproducer (the generated source and its inputs as literals)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, note, reject, settings

from tests.fuzz.common import Failure

_QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large, HealthCheck.large_base_example]


def ci(examples: int, shrink: bool = True) -> settings:
    """A CI sample: the same examples on every run (derandomize), no example database. shrink=False
    for oracles that compile (a shrink runs the oracle hundreds of times): the failing example is
    printed as generated, still a runnable reproducer."""
    phases = tuple(p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain))
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET, print_blob=True, phases=phases)


def slow(examples: int) -> settings:
    """A long run: random examples (the failing ones are saved in .hypothesis/ and replayed first)."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=_QUIET, print_blob=True)


def require_slow(request) -> None:
    """The slow fuzz runs take minutes: run them only when asked for (`-m slow` or DRAFTFUSE_FUZZ=1)."""
    asked = "slow" in (request.config.option.markexpr or "") and "not slow" not in request.config.option.markexpr
    if not (asked or os.environ.get("DRAFTFUSE_FUZZ")):
        pytest.skip("long fuzz run: select it with `-m slow` or DRAFTFUSE_FUZZ=1")


def check(oracle, program, name: str, unsupported: type[Exception], **kwargs):
    """Run oracle(program); a Failure becomes an AssertionError carrying a runnable reproducer, a
    program Dynamo cannot capture is rejected (not a draftfuse matter)."""
    note(program.reproducer(name))
    try:
        return oracle(program, **kwargs)
    except unsupported:
        reject()
    except Failure as failure:
        raise AssertionError(f"{failure}\n\n--- reproducer ---\n{program.reproducer(name)}\n--- end ---") from None
