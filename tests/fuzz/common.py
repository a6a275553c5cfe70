"""What both fuzzers share: a choice interface, rejection, tensor literals, comparisons, failures."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import traceback
from collections.abc import Sequence
from typing import Any

import torch


class Reject(Exception):
    """The generator's construction cannot guarantee its invariants for this draw: draw again.

    Raised before anything of draftfuse runs; never used to hide a failure."""


class Chooser:
    """The choices a generator makes. `flag(p)` is a hazard switch: True with probability ~p, and
    False is the simpler value (hypothesis shrinks towards it)."""

    def integer(self, low: int, high: int) -> int:
        raise NotImplementedError

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def flag(self, p: float = 0.5) -> bool:
        return self.integer(0, 999) >= 1000 - int(p * 1000)

    def permutation(self, n: int) -> list[int]:
        items = list(range(n))
        for i in range(n - 1, 0, -1):  # Fisher-Yates; all-zero draws give the identity
            j = i - self.integer(0, i)
            items[i], items[j] = items[j], items[i]
        return items


class RandomChooser(Chooser):
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)


class DrawChooser(Chooser):
    """Choices from a hypothesis `draw` (inside @st.composite)."""

    def __init__(self, draw):
        from hypothesis import strategies as st

        self.draw, self.st = draw, st

    def integer(self, low: int, high: int) -> int:
        return self.draw(self.st.integers(low, high))


def hypothesis_strategy(generate):
    """A hypothesis strategy of generate(chooser); Reject becomes hypothesis.reject()."""
    from hypothesis import reject
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        try:
            return generate(DrawChooser(draw))
        except Reject:
            reject()

    return strategy()


def literal(t: torch.Tensor) -> str:
    """Python source that rebuilds `t` exactly (values, dtype, shape; contiguous)."""
    dtype = str(t.dtype)
    if t.dtype.is_floating_point:
        values = t.double().tolist()
        text = repr(values).replace("inf", "float('inf')").replace("nan", "float('nan')")
    else:
        text = repr(t.tolist())
    return f"torch.tensor({text}, dtype={dtype})"


@dataclasses.dataclass
class Failure(Exception):
    """A differential mismatch or a crash: `kind` names the class, `detail` the evidence."""

    kind: str
    detail: str
    oracle: str = ""
    report: str = ""

    def __str__(self) -> str:
        out = f"[{self.oracle}] {self.kind}: {self.detail}"
        if self.report:
            out += f"\npass report:\n{self.report}"
        return out


def describe_exception(error: BaseException) -> str:
    lines = traceback.format_exception_only(type(error), error)
    return "".join(lines).strip().splitlines()[-1][:300] if lines else repr(error)


def where_raised(error: BaseException) -> str:
    """file:function of the innermost draftfuse frame of a traceback (for grouping crashes)."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if "/draftfuse/" in f.filename]
    frame = (mine or frames or [None])[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}" if frame else "?"


@contextlib.contextmanager
def quiet():
    """Silence torch's warnings and prints while a compile runs (a failure re-raises as usual)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stderr(io.StringIO()):
            yield


def same_tensor(a: Any, b: Any) -> bool:
    """Bit-exact equality of two tensors (NaN equal to NaN), dtype and shape included."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return type(a) is type(b) and a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a, 0.0), torch.nan_to_num(b, 0.0))
    return torch.equal(a, b)


def flat(out: Any) -> list:
    return torch.utils._pytree.tree_leaves(out)


# --------------------------------------------------------------------------------------------------
# Replaying and shrinking a run's choices (for the command-line runner; hypothesis shrinks its own).


class TapeChooser(Chooser):
    """Random choices that are recorded as offsets from each call's low bound (`tape`), or replayed
    from a given tape (an exhausted tape replays the low bound: the simplest choice)."""

    def __init__(self, seed: int | None = None, tape: list[int] | None = None):
        self.rng = random.Random(seed) if tape is None else None
        self.replay = list(tape) if tape is not None else None
        self.tape: list[int] = []

    def integer(self, low: int, high: int) -> int:
        if self.replay is None:
            offset = self.rng.randint(0, high - low)
        else:
            position = len(self.tape)
            offset = min(self.replay[position], high - low) if position < len(self.replay) else 0
        self.tape.append(offset)
        return low + offset


def shrink(generate, fails, tape: list[int], budget: int = 400) -> tuple[Any, list[int]]:
    """A smaller program for which fails(program) still holds: shortens the tape, then lowers its
    entries (0 is each choice's simplest value). Returns (program, tape)."""
    best_tape = list(tape)
    best = generate(TapeChooser(tape=best_tape))
    tries = 0

    def attempt(candidate: list[int]) -> bool:
        nonlocal best, best_tape, tries
        tries += 1
        chooser = TapeChooser(tape=candidate)
        try:
            program = generate(chooser)
        except Reject:
            return False
        if chooser.tape == best_tape:
            return False
        try:
            if not fails(program):
                return False
        except Exception:
            return False
        best, best_tape = program, chooser.tape
        return True

    improved = True
    while improved and tries < budget:
        improved = False
        for size in (len(best_tape) // 2, len(best_tape) // 4, 8, 4, 2, 1):  # cut chunks
            i = 0
            while size > 0 and i < len(best_tape) and tries < budget:
                if attempt(best_tape[:i] + best_tape[i + size:]):
                    improved = True
                else:
                    i += size
        i = 0
        while i < len(best_tape) and tries < budget:  # lower each entry (the tape may get shorter)
            if best_tape[i] != 0:
                for value in (0, best_tape[i] // 2, best_tape[i] - 1):
                    if i < len(best_tape) and value < best_tape[i] and attempt(best_tape[:i] + [value] + best_tape[i + 1:]):
                        improved = True
                        break
            i += 1
    return best, best_tape


def pipeline_available() -> bool:
    """Whether this draftfuse has `draftfuse.testing.draft_graphs` (the whole pipeline, no codegen)."""
    try:
        from draftfuse.testing import draft_graphs  # noqa: F401
    except ImportError:
        return False
    return True


def raised_in_draftfuse(error: BaseException) -> bool:
    """Whether a draftfuse frame (other than the testing harness) is on the traceback of `error` or of
    an exception it was raised from: a failure of Dynamo's own tracing has none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame in traceback.extract_tb(error.__traceback__):
            if "/draftfuse/" in frame.filename and not frame.filename.endswith("/draftfuse/testing.py"):
                return True
        error = error.__cause__ or error.__context__
    return False


def aot_control(fn, make_args, compare, rng_seed: int | None = None) -> bool:
    """Whether PyTorch alone (Dynamo + AOT autograd's functionalization, backend "aot_eager") computes
    what eager does on this program. A draftfuse oracle's mismatch counts only where it does: e.g.
    torch._foreach_add_([x, x], 1) adds 1 once under AOT (a PyTorch limitation, not draftfuse's)."""
    torch._dynamo.reset()
    args, kwargs = make_args()
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    try:
        with quiet():
            out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return False
    try:
        compare(out, args, kwargs)
    except Failure:
        return False
    return True
