"""The failure classes the differential fuzzers found on earlier versions (softmax -> topk: S*, the seed
fold: F* and G*), each as its minimal reproducer (tests/fuzz/known_failures.py), against today's
draftfuse: outputs and the inputs' final contents must equal eager's (or the unrewritten graph's)."""

import pytest

from tests.fuzz import known_failures


@pytest.mark.parametrize("name", sorted(known_failures.CASES), ids=lambda n: n.split(" ")[0])
def test_known_failure_class_is_fixed(name):
    failure = known_failures.run(name)
    assert failure is None, f"{name}: {failure}"
