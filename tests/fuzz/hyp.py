"""Hypothesis glue for the fuzz tests: settings for CI samples and slow runs, and running an oracle
so that a failure prints a reproducer (the generated source and its inputs as literals)."""

from __future__ import annotations

import os
import zlib
from typing import Any, Callable, NamedTuple

import pytest
from hypothesis import HealthCheck, Phase, given, note, reject, seed, settings

from tests.fuzz.common import Failure

_QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large, HealthCheck.large_base_example]


def ci(examples: int, shrink: bool = True) -> settings:
    """A CI sample: the same examples on every run, no example database. shrink=False
    for oracles that compile (a shrink runs the oracle hundreds of times): the failing example is
    printed as generated, still a runnable reproducer."""
    phases = tuple(p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain))
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET, print_blob=True, phases=phases)


def slow_settings(examples: int) -> settings:
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



class Run(NamedTuple):
    """One oracle's fuzz runs: `ci` examples in CI (the same ones on every run), `slow` in a long
    run (None: no long run). Oracles that compile don't shrink in CI (a shrink runs the oracle
    hundreds of times): their failures print as generated, still runnable reproducers."""

    programs: Any  # a hypothesis strategy
    oracle: Callable
    ci: int
    slow: int | None = None
    shrink: bool = True
    options: dict = {}
    marks: tuple = ()


def params(runs: dict[str, Run], slow: bool) -> list:
    """pytest params: the names of `runs` (those with a long run, for slow)."""
    return [pytest.param(name, marks=run.marks, id=name) for name, run in runs.items() if not slow or run.slow]


def sample(run: Run, name: str, unsupported: type[Exception], slow: bool = False) -> None:
    """Checks run.ci (slow: run.slow) programs with the oracle, as `check` does. A CI sample is
    seeded by `name`; a long run draws new programs each time."""

    @given(run.programs)
    def test(program):
        check(run.oracle, program, name, unsupported, **run.options)

    if slow:
        slow_settings(run.slow)(test)()
    else:
        seed(zlib.crc32(name.encode()))(ci(run.ci, run.shrink)(test))()


def tests(runs: dict[str, Run], unsupported: type[Exception], path: str) -> tuple[Callable, Callable]:
    """The two tests of a fuzz test file over `runs`: its CI samples, and its long runs under -m slow."""

    @pytest.mark.parametrize("name", params(runs, slow=False))
    def test_ci_sample(name):
        """About 60 s together on a 2-core CPU."""
        sample(runs[name], name, unsupported)

    @pytest.mark.slow
    @pytest.mark.parametrize("name", params(runs, slow=True))
    def test_slow_run(request, name):
        require_slow(request)
        sample(runs[name], name, unsupported, slow=True)

    test_slow_run.__doc__ = f"`python -m pytest -m slow {path}`"
    return test_ci_sample, test_slow_run
