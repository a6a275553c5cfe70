"""Fuzzer A: random softmax -> selection programs with hazards, and the oracles that run them.

What is generated (`generate(chooser)` -> `SelectionProgram`, a function as source text plus inputs):

  logits x (fp32, fp16 or bf16, or int64 / int32 / int16 / int8 / uint8 made float by a temperature or a
            cast; rank 2 or 3)
    [integer product]                  integer logits times an integer factor in their own dtype, before
                                       the casts and temperatures: x * 2, 2 * x, x.mul(3), torch.mul(x, -1),
                                       x.clone().mul_(2), or a per-row tensor s of 2, 3 (or -1) in x's
                                       dtype (x * s, s * x, x.mul(s), torch.mul(x, s), or x * torch.full_like(
                                       x[..., :1], 2)): the product wraps around (int8 100 * 2 == -56,
                                       -128 * -1 == -128) and the selection must read it as computed;
                                       often with the temperature right on it and a plain tail (a largest
                                       selection along the softmax dim, no writes), where the rewrite's walk
                                       back from the softmax reaches the product
    [writes to x]                      x.mul_(-1), x *= 2, x += p, x.add_(p), torch.add(x, p, out=x),
                                       x[:, j] = v, x.masked_fill_(m, -inf), x.add_(c), an in-place flag
                                       passed by position (F.leaky_relu(x, 0.5, True)), ...
    s = views / casts / temperature    .t(), .transpose, .view, [:, :]; .float(), .to(dtype), .half(),
                                       .bfloat16(), .double(); s / c, c * s, s.div(c), torch.mul(s, c)
                                       with c a positive or negative Python constant, s / t[:, None]
                                       (per-row tensor, signs mixed; t * s too), s / t (t one value of
                                       rank 0 to rank(s) + 1: broadcasting s up a dim); t may require
                                       grad (then the gradients of the outputs are compared too)
    [writes to x]                      (the logits change after s was read: s may alias x, or not)
    probs = softmax spelled any way    torch.softmax / F.softmax(dtype=) / Tensor.softmax /
                                       torch.special.softmax / the log_softmax forms, any dim
    [steps]                            writes to x after the softmax read; writes to probs or an alias
                                       of it (probs.div_(q), probs[:, ids] = 0, probs.masked_fill_(m, 0),
                                       probs.mul_(w), probs *= w, probs.t().mul_(w), out=, neg_,
                                       F.leaky_relu(probs, 0.25, True));
                                       casts (.float(), .half(), ...), views; a clone of probs written
    selections                         topk (function/method, k and dim positional or keyword,
                                       largest, sorted), max/min(dim, keepdim), argmax/argmin; one or two;
                                       under torch.no_grad() where the temperature requires grad; their
                                       values compared with their source ((probs >= v.amin(d)).sum(d))
    return                             the selections' values and indices, and other consumers (probs,
                                       probs * 2, the clone, a view)

How the documented difference cases are excluded by construction, not by filtering failures:

  * No NaN or +inf rows, no exact ties: logits are a Latin arrangement of a lattice,
    x[b, i, j] = g * (((pi(j) + i + R*b) mod M) - M // 2) with rows and positions shuffled, so the values
    are distinct along EVERY dim (any softmax or selection dim), and g is a power of two: every value,
    every lattice shift and every power-of-two scaling of it is exact in fp32, fp16 and bf16.
  * No rounding ties: the temperature's magnitudes fix g so that two neighbouring scaled logits are
    >= 0.25 apart (probability ratio >= e^0.25 = 1.28, i.e. > 30 bf16 ulps), and the spread of a row
    is bounded (<= 5 in the scaled domain when a half type is involved: the smallest probability
    is >= e^-5 / 24 ~ 2.8e-4, a normal fp16; log-probabilities stay within [-8, 0] where bf16's
    spacing is <= 1/16 < 0.25).
  * Every program is mirrored by a float64 value model with an error bound per element (`Model`): the
    ideal value and |actual - ideal| <= e, e growing by half an ulp of the dtype at each rounding
    (including subnormal spacing), by the softmax's sensitivity to its input error and its own
    float32 accumulation error, and exact (e = 0) for exact lattice operations. The writes mirror
    aliasing (the model's tensors are views of each other exactly where the program's are). Before a
    program is emitted, each selection is checked on the model: along its dim, the k + 1 leading
    values (k for topk, 1 for max/argmax, the smallest for min/argmin/largest=False) must have
    disjoint intervals [v - 2e, v + 2e]. Writes that create ties (zeros, -inf) are limited per row so
    that ties never fall inside the selected part. This check uses only the model, never draftfuse or
    eager results; a draw that fails it is redrawn (`Reject`), which is rare (see `rejection_rate`).
  * An integer product wraps by design, exactly mirrored: the Latin lattice above is drawn for the
    product's values w (what the softmax side sees: small, distinct along every dim, exact in every
    float type), and x is a preimage of it in two's complement, x * f == w mod 2**bits: for an odd f the
    only one, w * f^-1 mod 2**bits (f = 3: w / 3 where 3 divides w, else near +-2**bits / 3, i.e. int32
    logits near +-2**30.4 and int64 near +-2**62.4; f = -1: -w, which wraps only at the dtype's minimum),
    for f = 2 per entry w / 2 or w / 2 + 2**(bits - 1) (int32 near +-2**31, int64 near +-2**63); so some
    products wrap and others not, and the order of x is not that of x * f. The model of the product is
    those wrapped integers, computed again from x's exact integers with Python ints (e = 0; a mismatch is
    a generator error), and checked as any other value;
    f = 2 makes the lattice step g at least 2 (w even). The tag "integer product wraps" marks programs
    where some entry of the product wrapped. x is not written before its product is taken (the float64
    model cannot hold int64 values beyond 2**53; the model of x is not read after the product).

The oracles (`check_dynamo`, `check_aten`, `check_backend`) compare with eager on cloned inputs:
indices exactly, values within `value_tolerance`, every other output and every input bit-exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tests.fuzz.common import Chooser, Failure, Reject, describe_exception, flat, literal, quiet, raised_in_draftfuse, same_tensor, where_raised

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# no writes to these (their lattice spans the dtype: a write would wrap); the integer product step wraps
# on purpose, mirrored exactly in the model (see `_integer_product`)
NARROW_INTS = {torch.int8: (-128, 127), torch.uint8: (0, 255)}
PRODUCT_FACTORS = [2, 3, -1, 2, 3]  # a constant integer factor (-1: int8 -128 * -1 stays -128)
PRODUCT_ROW_FACTORS = [[2], [3], [2, 3], [2, 3], [2, 3, -1]]  # the values of a per-row integer factor
HALF = (F16, BF16)
DTYPE_SRC = {F16: "torch.float16", BF16: "torch.bfloat16", F32: "torch.float32", F64: "torch.float64"}
LEAKY_SLOPES = [0.5, 0.25, 2.0]  # powers of two: exact on the lattice, and monotone (no new ties)
CAST_SPELLINGS = {  # dtype -> spellings of a cast to it
    F32: [".float()", ".to(torch.float32)", ".to(dtype=torch.float32)", ".type(torch.float32)"],
    F64: [".double()", ".to(torch.float64)"],
    F16: [".half()", ".to(torch.float16)"],
    BF16: [".bfloat16()", ".to(torch.bfloat16)"],
}
GAP = 0.25  # minimal distance of two scaled logits of a row


# --------------------------------------------------------------------------------------------------
# The value model: ideal float64 values and an error bound, with the program's aliasing.


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |values| (float64), subnormal spacing included."""
    info = torch.finfo(dtype)
    magnitude = values.abs().clamp_min(info.tiny)
    spacing = torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps
    return torch.where(values.isinf(), torch.zeros_like(spacing), spacing.clamp_min(info.tiny * info.eps))


@dataclasses.dataclass
class Model:
    """A program value: ideal values v, error bound e (|actual - v| <= e), and the program's dtype.
    Views of a Model share v and e storage, as the program's views share memory."""

    v: torch.Tensor
    e: torch.Tensor
    dtype: torch.dtype
    floor: torch.dtype | None = None  # the least precise dtype the values were rounded to

    def view(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Model:
        return Model(fn(self.v), fn(self.e), self.dtype, self.floor)

    def copy(self) -> Model:
        return Model(self.v.clone(), self.e.clone(), self.dtype, self.floor)

    def round_(self, dtype: torch.dtype | None = None) -> Model:
        """Round in place to `dtype` (default: own dtype); exact values stay exact."""
        dtype = dtype or self.dtype
        if not dtype.is_floating_point:  # integer logits: the generator keeps them integers, exactly
            return self
        rounded = self.v.to(dtype).double()
        exact = (self.e == 0) & ((rounded == self.v) | self.v.isinf())
        step = ulp(self.v.abs() + self.e, dtype) / 2
        overflow = (self.v.abs() + self.e) > torch.finfo(dtype).max
        if bool((overflow & ~self.v.isinf()).any()):
            raise Reject("overflow in the model")
        self.e.copy_(torch.where(exact, torch.zeros_like(self.e), self.e + step))
        return self

    def cast(self, dtype: torch.dtype) -> Model:
        """`.to(dtype)`: the same tensor if the dtype is unchanged (torch returns self), else a copy."""
        if dtype == self.dtype:
            return self
        floor = max([self.floor or self.dtype, dtype], key=_eps)
        out = Model(self.v.clone(), self.e.clone(), dtype, floor)
        return out.round_()


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0  # integers: exact


def model_softmax(s: Model, dim: int, log: bool, dtype: torch.dtype | None) -> Model:
    """torch.softmax / log_softmax(s, dim, dtype=dtype) on the model."""
    if dtype is not None and dtype != s.dtype:
        s = s.cast(dtype)
    v, e = s.v, torch.where(s.v.isinf(), torch.zeros_like(s.e), s.e)
    if bool(v.isnan().any()) or bool((v == math.inf).any()) or bool((v == -math.inf).all(dim).any()):
        raise Reject("NaN row in the model")
    n = v.shape[dim] if v.dim() else 1
    acc_eps = torch.finfo(F64 if s.dtype == F64 else F32).eps
    e_in = e.amax(dim, keepdim=True) if v.dim() else e
    if log:
        out = torch.log_softmax(v, dim)
        scale = v.where(v.isfinite(), torch.zeros_like(v)).abs().amax(dim, keepdim=True) if v.dim() else v.abs()
        err = 2 * e_in + (n + 10) * acc_eps * (out.where(out.isfinite(), torch.zeros_like(out)).abs() + scale + math.log(n + 1))
        err = torch.where(out.isinf(), torch.zeros_like(err), err)
    else:
        out = torch.softmax(v, dim)
        err = out * (torch.expm1(2 * e_in) + (n + 10) * acc_eps)
    return Model(out, err.expand_as(out).clone(), s.dtype, s.dtype).round_()


def unambiguous(m: Model, dim: int, k: int, largest: bool) -> bool:
    """Whether selecting the k largest (smallest) along dim is decided whatever the rounding: the
    leading k + 1 values of each row have disjoint intervals [v - 2e, v + 2e]."""
    if m.v.dim() == 0:
        return True
    v = m.v.movedim(dim, -1).reshape(-1, m.v.shape[dim])
    e = m.e.movedim(dim, -1).reshape(-1, m.v.shape[dim])
    if bool(v.isnan().any()):
        return False
    n = v.shape[1]
    order = torch.argsort(v, dim=1, descending=largest, stable=True)
    v, e = v.gather(1, order)[:, : min(k + 1, n)], e.gather(1, order)[:, : min(k + 1, n)]
    for i in range(v.shape[1] - 1):
        a, b, ea, eb = v[:, i], v[:, i + 1], e[:, i], e[:, i + 1]
        if bool((a == b).any()):
            return False
        hi, lo = (a, b) if largest else (b, a)
        ehi, elo = (ea, eb) if largest else (eb, ea)
        if not bool(((hi - 2 * ehi) > (lo + 2 * elo)).all()):
            return False
    return True


# --------------------------------------------------------------------------------------------------
# Programs.


@dataclasses.dataclass
class Out:
    """One returned tensor: kind "index", "value" or "other"; for values, the tolerance data."""

    kind: str
    group: int = -1  # the selection it belongs to
    unsorted: bool = False  # topk(sorted=False) with k > 1: the order is unspecified
    dim: int = -1  # the selection dim in the output (for comparing unsorted results)
    log_scale: float = 0.0  # log-probabilities: magnitude of the log-sum-exp they were computed from
    floor: torch.dtype | None = None  # values: the least precise dtype they were rounded to


@dataclasses.dataclass
class SelectionProgram:
    source: str  # "def draft(...): ..." (imports: torch, F)
    args: list[tuple[str, torch.Tensor]]
    outs: list[Out]
    expected_rewrites: int  # selections that the README says are rewritten (0: no expectation)
    tags: tuple[str, ...]  # the hazards present, for grouping failures
    name: str = "draft"

    def function(self) -> Callable:
        namespace = {"torch": torch, "F": F}
        exec(compile(self.source, f"<fuzz:{self.name}>", "exec"), namespace)
        return namespace[self.name]

    def inputs(self) -> list[torch.Tensor]:
        return [t.detach().clone().requires_grad_(t.requires_grad) for _, t in self.args]

    def reproducer(self, oracle: str = "dynamo") -> str:
        lines = ["# run from the repository root: PYTHONPATH=. python this_file.py", "import torch", "import torch.nn.functional as F", "from tests.fuzz import selection", "", f'SOURCE = """\\\n{self.source.rstrip()}\n"""', ""]
        lines += [f"{name} = {literal(t.detach())}" + (".requires_grad_()" if t.requires_grad else "") for name, t in self.args]
        names = ", ".join(name for name, _ in self.args)
        lines += ["", f"program = selection.SelectionProgram(source=SOURCE, args=list(zip({names!r}.split(', '), [{names}])),"]
        lines += [f"    outs={self.outs!r}, expected_rewrites={self.expected_rewrites}, tags={self.tags!r})"]
        lines += [f"selection.check_{oracle}(program)"]
        return "\n".join(lines).replace("Out(", "selection.Out(")


def source_of(fn: Callable) -> str:
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(fn))


class _Builder:
    """Emits source lines and mirrors each in the model."""

    def __init__(self, c: Chooser):
        self.c = c
        self.lines: list[str] = []
        self.args: list[tuple[str, torch.Tensor]] = []
        self.models: dict[str, Model] = {}
        self.tags: list[str] = []
        self.counter = itertools.count()
        self.grad = False  # an input requires grad
        self.softmax_calls: dict[str, str] = {}  # probabilities' name -> the call computing them (for a twin)

    def fresh(self, stem: str) -> str:
        return f"{stem}{next(self.counter)}"

    def arg(self, stem: str, tensor: torch.Tensor) -> str:
        name = self.fresh(stem)
        self.args.append((name, tensor))
        return name

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def tag(self, tag: str) -> None:
        if tag not in self.tags:
            self.tags.append(tag)


def _dim_spelling(c: Chooser, dim: int, rank: int) -> int:
    """dim as written: positive or negative."""
    dim %= max(rank, 1)
    return dim - rank if rank and c.flag(0.5) else dim


def _latin(c: Chooser, shape: tuple[int, ...]) -> torch.Tensor:
    """Integers distinct along every dim: ((pi(j) + i + R*b) mod M) with shuffled rows and positions."""
    v = shape[-1]
    r = shape[-2] if len(shape) >= 2 else 1
    b = shape[-3] if len(shape) >= 3 else 1
    m = max(v, r * b)
    pi = torch.tensor(c.permutation(m)[:v])
    bi = torch.arange(b)[:, None, None] * r
    ri = torch.arange(r)[None, :, None]
    n = (pi[None, None, :] + ri + bi) % m
    n = n[torch.tensor(c.permutation(b))][:, torch.tensor(c.permutation(r))]
    return n.reshape(shape) - m // 2


def _temperature_plan(c: Chooser, narrow_int: bool = False) -> dict:
    # 8-bit logits: mostly a tensor temperature, whose sign the order of x * t must take in a wider type
    kind = c.pick(["row", "row", "scalar", "none", "const"] if narrow_int else ["none", "none", "const", "const", "const2", "row", "scalar"])
    plan = {"kind": kind, "steps": [], "min": 1.0, "max": 1.0, "negative": False, "any_negative": False}
    mags = [0.5, 2.0, 1.5, 0.25, 4.0, 0.75, 3.0, 0.7]
    if kind in ("const", "const2"):
        for _ in range(1 if kind == "const" else 2):
            value = c.pick(mags)
            if c.flag(0.2):
                value = -value
            op = c.pick(["div", "mul", "rmul", "div_m", "mul_m", "tdiv", "tmul"])
            factor = abs(1 / value if op in ("div", "div_m", "tdiv") else value)
            plan["steps"].append((op, value))
            plan["min"] *= factor
            plan["max"] *= factor
            plan["negative"] ^= value < 0
            plan["any_negative"] |= value < 0  # the README: a negative temperature is refused, even twice
    elif kind in ("row", "scalar"):
        value = c.pick([0.5, 1.0, 2.0])
        op = c.pick(["div", "mul"])
        factor = 1 / value if op == "div" else value
        plan["steps"].append((op, value))
        plan["min"] = plan["max"] = factor
    return plan


def generate(c: Chooser, disabled: frozenset[str] | None = None) -> SelectionProgram:
    """One program. `disabled` (default: DRAFTFUSE_FUZZ_DISABLE, comma-separated) switches hazard
    families off, to look past known failure classes: "probs_write" (writes to the probabilities or
    an alias of them before the selection), "logits_write" (writes to x between reading it and the
    softmax)."""
    if disabled is None:
        import os

        disabled = frozenset(n.strip() for n in os.environ.get("DRAFTFUSE_FUZZ_DISABLE", "").split(",") if n.strip())
    b = _Builder(c)
    dx = c.pick([F32, F32, F16, BF16]) if c.flag(0.85) else c.pick(INTS)
    rank = 3 if c.flag(0.25) else 2
    product = _product_plan(c) if dx in INTS and c.flag(0.6) else None  # x times an integer (it may wrap)
    # often the rest of such a program is a form the rewrite takes (a largest selection along the softmax's
    # dim, no writes): its walk back from the softmax then reaches the product, whose wrap is the hazard
    plain_tail = product is not None and c.flag(0.4)
    log = c.flag(0.3)
    temp = _temperature_plan(c, narrow_int=dx in NARROW_INTS)
    # dtypes through which the scaled logits and probabilities pass: decide casts now
    pre_cast = c.pick([None, None, F32, F64, F16, BF16]) if c.flag(0.5) else None
    sm_dtype = c.pick([None, F32, F64, F16, BF16]) if c.flag(0.3) else None
    if dx in INTS and temp["kind"] == "none" and pre_cast is None and sm_dtype is None:
        if product is not None and c.flag(0.5):  # softmax(x * 2, dtype=...): the softmax reads the product itself
            sm_dtype = c.pick([F32, F64])
        else:
            pre_cast = c.pick([F32, F64, F16, BF16])  # a softmax needs floats: integer logits are made float first
    post_cast = c.pick([F32, F64, F16, BF16]) if c.flag(0.3) else None
    involved = {dx, pre_cast, sm_dtype, post_cast} - {None}
    half = bool(involved & set(HALF))
    spread_max = 5.0 if half else 20.0
    g = 2.0 ** math.ceil(math.log2(GAP / temp["min"]))
    if dx in INTS:
        g = max(g, 1.0)  # integer logits: the lattice's points are integers
    if product is not None and product["even"]:
        g = max(g, 2.0)  # x * 2 is even: so is the lattice of the product's values
    m_max = int(spread_max / (temp["max"] * g)) + 1
    if m_max < 2:
        raise Reject("temperature range too wide for a half type")
    vocab = c.integer(2, max(2, min(m_max, 24 if half else 40)))
    rows = c.integer(1, max(1, min(4, m_max)))
    batch = c.integer(1, max(1, min(3, m_max // rows))) if rank == 3 else 1
    shape = (batch, rows, vocab) if rank == 3 else (rows, vocab)
    n = _latin(c, shape)
    x_values = n.double() * g
    if c.flag(0.2):  # an offset keeps distinctness (and softmax)
        x_values = x_values + g * 4 * c.integer(-3, 3)
    if c.flag(0.2):  # an offset per last-dim row: different row maxima (the model rejects column ties)
        offsets = torch.tensor([float(c.integer(-3, 3)) for _ in range(math.prod(shape[:-1]))], dtype=F64)
        x_values = x_values + g * offsets.reshape(*shape[:-1], 1)
    if dx in NARROW_INTS:  # in range; int8 often at its -128 (whose negation is itself), uint8 from 0
        low, high = NARROW_INTS[dx]
        if dx == torch.uint8 or c.flag(0.5):
            x_values = x_values + (low - x_values.min())
        if x_values.min() < low or x_values.max() > high:
            raise Reject("integer logits out of their dtype's range")
    if product is not None:  # x_values are the product's (wrapped) values: x is drawn as their preimage
        product["w"] = x_values
        x_tensor = _product_preimage(c, product, x_values, dx)
    else:
        x_tensor = x_values.to(dx)
    x = b.arg("x", x_tensor)
    b.models[x] = Model(x_tensor.double(), torch.zeros(shape, dtype=F64), dx)
    b.tag(f"dtype={str(dx).removeprefix('torch.')}")
    if dx in INTS:
        b.tag("integer logits")

    # the selections to make, decided first: they bound how many ties writes may create
    sel_count = 2 if c.flag(0.25) else 1
    sels = [_selection_plan(c, plain_tail) for _ in range(sel_count)]

    # (1) writes to x before anything reads it (not before an integer product: see the module docstring)
    if c.flag(0.2) and product is None:
        _write_logits(b, x, sels, log, phase="before")

    # (2) s: an integer product first, then views, casts and temperature, in a random order
    s = x
    if product is not None:
        s = _integer_product(b, x, x_tensor, product)
    steps = []
    if c.flag(0.25):
        steps.append("view")
    if pre_cast is not None:
        steps.append("cast")
    steps += ["temp"] * len(temp["steps"])
    order = c.permutation(len(steps))
    if product is not None and (plain_tail or c.flag(0.5)):  # the temperature right on the product (a cast of an integer stops the walk back)
        order.sort(key=lambda position: steps[position] != "temp")
    temp_steps = iter(temp["steps"])
    for position in order:
        step = steps[position]
        if step == "view":
            s = _view(b, s, "s")
        elif step == "cast":
            s = _cast(b, s, pre_cast, "s")
        else:
            s = _temperature(b, s, next(temp_steps), temp["kind"])
    if temp["kind"] in ("row", "scalar"):
        b.tag(f"temperature={temp['kind']}-tensor")
    elif temp["any_negative"]:
        b.tag("temperature=negative" if temp["negative"] else "temperature=two negatives")
    elif temp["steps"]:
        b.tag("temperature=positive")

    # (3) writes to x between reading it into s and the softmax
    if c.flag(0.25) and "logits_write" not in disabled and not plain_tail:
        _write_logits(b, x, sels, log, phase="between")

    # (4) the softmax
    sm_rank = b.models[s].v.dim()
    sm_dim = c.integer(0, sm_rank - 1)
    probs = _softmax(b, s, sm_dim, log, sm_dtype)

    # (5) steps between the softmax and the selection
    tip, tip_dim, hazards_between = probs, sm_dim, []
    aliases = [probs]
    clone_name = None
    for _ in range(0 if plain_tail else c.pick([0, 0, 1, 1, 2, 3])):
        what = c.pick(["write_probs", "write_probs", "write_x", "cast", "view", "clone"])
        if what == "write_probs" and "probs_write" in disabled:
            what = "clone"
        if what == "write_probs":
            target = c.pick(aliases)
            _write_probs(b, target, sels, log)
            hazards_between.append("probs write")
        elif what == "write_x":
            _write_logits(b, x, sels, log, phase="after")
            hazards_between.append("logits write after softmax")
        elif what == "cast":
            dtype = post_cast or c.pick([F32, F64])
            tip = _cast(b, tip, dtype, "q")
            aliases.append(tip)
            hazards_between.append("cast")
        elif what == "view":
            tip, tip_dim = _view(b, tip, "q", tip_dim, report=True)
            aliases.append(tip)
            hazards_between.append("view")
        elif what == "clone" and clone_name is None:
            clone_name = b.fresh("pc")
            b.emit(f"{clone_name} = {tip}.clone()")
            b.models[clone_name] = b.models[tip].copy()
            _write_probs(b, clone_name, sels, log, tag="clone write")
    if post_cast is not None and "cast" not in hazards_between and c.flag(0.7):
        tip = _cast(b, tip, post_cast, "q")
        hazards_between.append("cast")

    # (6) the selections
    outs: list[Out] = []
    returned: list[str] = []
    expected, after_no_grad = 0, False
    plain = (
        dx not in INTS
        and (sm_dtype is None or _is_upcast(b.models[s].dtype, sm_dtype))
        and set(hazards_between) <= {"cast"}
    )
    for group, plan in enumerate(sels):
        source, source_dim = (tip, tip_dim) if group == 0 or c.flag(0.5) else (probs, sm_dim)
        model = b.models[source]
        same_dim = plain_tail or c.flag(0.85)
        sel_dim = source_dim if same_dim else c.integer(0, model.v.dim() - 1)
        if sel_dim != source_dim:
            b.tag("selection dim differs")
        size = model.v.shape[sel_dim]
        k = min(plan["k"], size)
        largest = plan["largest"]
        if not unambiguous(model, sel_dim, k, largest):
            raise Reject("the model cannot guarantee this selection")
        if not largest:
            b.tag("selects smallest")
        if plan["kind"] == "topk" and k > 1 and not plan["sorted"]:
            b.tag("topk sorted=False")
        no_grad = _select(b, source, model, sel_dim, k, plan, group, outs, returned, log)
        # expected rewrites: the README's forms; smallest-probability selections are left out (the README
        # lists min/argmin/largest=False, ea7481a refuses them: the smallest probabilities can underflow)
        # (and a selection after a `with torch.no_grad():` block: the grad mode changes on its way)
        if plain and not no_grad and not after_no_grad and source == tip and sel_dim == source_dim and largest and not (plan["kind"] == "topk" and k > 1 and not plan["sorted"]):
            expected += 1
        after_no_grad |= no_grad
    # (7) other consumers
    for name in [probs, tip, clone_name]:
        if name is not None and name not in returned and c.flag(0.25):
            if c.flag(0.5):
                b.emit(f"r{len(returned)} = {name} * 2")
                returned.append(f"r{len(returned)}")
            else:
                returned.append(name)
            outs.append(Out("other", floor=b.models[name].floor or b.models[name].dtype))
            b.tag("softmax has other users")
    if c.flag(0.15):
        returned.append(x)
        outs.append(Out("other", floor=dx))
    arg_names = ", ".join(name for name, _ in b.args)
    body = "\n".join("    " + line for line in b.lines)
    source = f"def draft({arg_names}):\n{body}\n    return ({', '.join(returned)},)\n"
    if log:
        b.tag("log_softmax")
    if rank == 3:
        b.tag("rank 3")
    return SelectionProgram(source, b.args, outs, expected, tuple(b.tags))


def _is_upcast(src: torch.dtype, dst: torch.dtype) -> bool:
    if not src.is_floating_point:
        return True  # the generator's integer logits are small (an integer product's too): exact in every float type
    return src == dst or (torch.finfo(dst).bits > torch.finfo(src).bits and torch.finfo(dst).max >= torch.finfo(src).max)


def _selection_plan(c: Chooser, plain: bool = False) -> dict:
    """One selection to make; `plain`: a largest, sorted one (a form the rewrite takes)."""
    kind = c.pick(["topk", "topk", "max", "argmax"] if plain else ["topk", "topk", "topk", "max", "argmax", "min", "argmin"])
    k = 1
    if kind == "topk":
        k = c.pick([1, 1, 2, 3, 4, 8])
    largest = kind in ("max", "argmax") or (kind == "topk" and (plain or not c.flag(0.2)))
    return {"kind": kind, "k": k, "largest": largest, "sorted": plain or not c.flag(0.2), "keepdim": c.flag(0.4)}


def _max_ties(sels: list[dict], size: int, extreme_low: bool) -> int:
    """How many entries per row may become equal at the low (or high) end without a tie inside any
    selection's leading k + 1 values."""
    allowed = size - 1
    for plan in sels:
        k = min(plan["k"], size)
        at_selected_end = plan["largest"] != extreme_low  # ties at the end the selection reads first
        allowed = min(allowed, 1 if at_selected_end else size - k)
    return max(allowed, 0)


def _mask(c: Chooser, shape: tuple[int, ...], dim: int, count: int) -> torch.Tensor:
    """A bool mask with exactly `count` True entries in each row along dim."""
    moved = list(shape)
    moved.append(moved.pop(dim))
    rows = math.prod(moved[:-1])
    mask = torch.zeros(rows, moved[-1], dtype=torch.bool)
    for r in range(rows):
        for j in c.permutation(moved[-1])[:count]:
            mask[r, j] = True
    return mask.reshape(moved).movedim(-1, dim).contiguous()


def _write_logits(b: _Builder, x: str, sels: list[dict], log: bool, phase: str) -> None:
    c = b.c
    m = b.models[x]
    shape = tuple(m.v.shape)
    rank = len(shape)
    kind = c.pick(["neg", "neg", "double", "shift", "shift_out", "perm_add", "perm_add", "setitem", "mask_inf", "mask_fill", "leaky"])
    if m.dtype in NARROW_INTS:
        return
    if not m.dtype.is_floating_point:  # what torch allows on integer logits, exactly (wrapping as torch does)
        kind = c.pick(["neg", "double", "perm_add"])
        reach = float(m.v.abs().max()) + math.prod(shape) * _lattice_unit(m.v)  # bounds |p| of perm_add below
        if kind == "perm_add" and reach > min(torch.iinfo(m.dtype).max, 2**53):  # x near its range's ends (a product's)
            kind = "neg"
    b.tag(f"logits write {phase}")
    if kind == "leaky":
        _leaky_relu_(b, x, "logits write (in-place flag)")
        return
    finite = m.v[m.v.isfinite()]
    lattice = _lattice_unit(m.v)
    if kind == "neg":
        if bool((m.v == -math.inf).any()):
            kind = "shift"
        else:
            shape_text = ", ".join(map(str, shape))
            b.emit(c.pick([f"{x}.mul_(-1)", f"{x}.neg_()", f"{x} *= -1", f"{x}.view({shape_text}).neg_()", f"{x}.detach().mul_(-1)",
                           f"{x}[...].neg_()", f"{x}.reshape({shape_text}).mul_(-1)", f"{x}.unsqueeze(0)[0].neg_()"]))
            m.v.mul_(-1)
            _wrap_(m)
            return
    if kind == "double":
        b.emit(c.pick([f"{x}.mul_(2)", f"{x} *= 2", f"torch.mul({x}, 2, out={x})"]))
        m.v.mul_(2)
        m.e.mul_(2)
        _wrap_(m)
        m.round_()
        return
    if kind == "shift":
        value = lattice * c.integer(-4, 4)
        b.emit(c.pick([f"{x}.add_({value!r})", f"{x} += {value!r}", f"torch.add({x}, {value!r}, out={x})", f"{x}.sub_({-value!r})"]))
        m.v.add_(value)
        m.round_()
        return
    if kind == "shift_out":  # a tensor shift per row: softmax-invariant, a write all the same
        row_shape = list(shape)
        row_shape[-1] = 1
        p = torch.tensor([lattice * c.integer(-3, 3) for _ in range(math.prod(row_shape))], dtype=F64).reshape(row_shape)
        name = b.arg("p", p.to(m.dtype))
        b.emit(c.pick([f"{x} += {name}", f"{x}.add_({name})", f"torch.add({x}, {name}, out={x})"]))
        m.v.add_(p)
        m.round_()
        return
    if kind == "perm_add":  # x + p is a new arrangement of the lattice: the order changes
        target = _latin(c, shape).double() * lattice
        current = torch.where(m.v.isfinite(), m.v, torch.zeros_like(m.v))
        p = torch.where(m.v.isfinite(), target - current, torch.zeros_like(m.v))
        name = b.arg("p", p.to(m.dtype))
        b.emit(c.pick([f"{x} += {name}", f"{x}.add_({name})", f"torch.add({x}, {name}, out={x})", f"{x}.copy_({x} + {name})"]))
        m.v.add_(p)
        m.round_()
        return
    if kind == "setitem":  # one position along the last dim becomes a new row maximum (or minimum)
        j = c.integer(0, shape[-1] - 1)
        top = float(finite.max()) if finite.numel() else 0.0
        bottom = float(finite.min()) if finite.numel() else 0.0
        others = math.prod(shape[:-1])
        order = torch.tensor(c.permutation(others), dtype=F64).reshape(shape[:-1])
        up = c.flag(0.7)
        values = (top + lattice * (1 + order)) if up else (bottom - lattice * (1 + order))
        index = ", ".join([":"] * (rank - 1) + [str(j)]) if c.flag(0.5) else f"..., {j}"
        if others == 1 and c.flag(0.5):
            b.emit(f"{x}[{index}] = {float(values.reshape(-1)[0])!r}")
        else:
            name = b.arg("v", values.to(m.dtype))
            b.emit(f"{x}[{index}] = {name}")
        m.v[..., j] = values
        m.e[..., j] = 0
        m.round_()
        return
    # masks along the softmax-selection dim: the last dim here (a masked write elsewhere is the same hazard)
    dim = rank - 1
    if kind == "mask_inf":
        if bool((m.v == -math.inf).any()):
            return
        count = c.integer(1, max(1, _max_ties(sels, shape[dim], extreme_low=True)))
        if _max_ties(sels, shape[dim], extreme_low=True) < 1 or shape[dim] < 2:
            return
        mask = _mask(c, shape, dim, count)
        name = b.arg("m", mask)
        b.emit(c.pick([f"{x}.masked_fill_({name}, float('-inf'))", f"{x}.masked_fill_({name}, -float('inf'))", f"{x}[{name}] = float('-inf')"]))
        m.v.masked_fill_(mask, -math.inf)
        m.e.masked_fill_(mask, 0)
        return
    # mask_fill: one entry per row set to a fresh value above the row
    mask = _mask(c, shape, dim, 1)
    top = float(finite.max()) if finite.numel() else 0.0
    value = top + lattice * c.integer(1, 3)
    name = b.arg("m", mask)
    b.emit(f"{x}.masked_fill_({name}, {value!r})")
    m.v.masked_fill_(mask, value)
    m.e.masked_fill_(mask, 0)
    m.round_()


def _leaky_relu_(b: _Builder, name: str, tag: str) -> None:
    """An in-place leaky_relu, its inplace flag often passed by position: a write the graph shows only
    through the op's schema (the call's value is not used)."""
    c = b.c
    m = b.models[name]
    slope = c.pick(LEAKY_SLOPES)
    b.emit(c.pick([f"F.leaky_relu({name}, {slope!r}, True)", f"F.leaky_relu({name}, {slope!r}, inplace=True)",
                   f"torch.nn.functional.leaky_relu({name}, negative_slope={slope!r}, inplace=True)", f"F.leaky_relu_({name}, {slope!r})"]))
    # the actual value may sit on the other side of 0 than v where |v| <= e: the bound grows by max(1, slope) there
    e = torch.where(m.v.abs() <= m.e, m.e * max(1.0, slope), torch.where(m.v < 0, m.e * slope, m.e))
    m.v.copy_(torch.where(m.v < 0, m.v * slope, m.v))
    m.e.copy_(e)
    m.round_()
    b.tag(tag)


def _lattice_unit(v: torch.Tensor) -> float:
    """The largest power of two dividing every finite value (the lattice spacing g, or a multiple)."""
    finite = v[v.isfinite()]
    nonzero = finite[finite != 0].abs()
    if nonzero.numel() == 0:
        return 1.0
    unit = 2.0 ** math.floor(math.log2(float(nonzero.min())))
    while unit > 2**-10 and not bool(((finite / unit) == torch.round(finite / unit)).all()):
        unit /= 2
    return unit


def _view(b: _Builder, name: str, stem: str, dim: int | None = None, report: bool = False):
    """A view of `name`: .t(), .transpose(a, b), [:, :], .view(shape), .permute; returns (view, dim)."""
    c = b.c
    m = b.models[name]
    rank = m.v.dim()
    new = b.fresh(stem)
    options = ["slice", "view"]
    if rank == 2:
        options += ["t", "transpose"]
    elif rank == 3:
        options += ["transpose", "permute"]
    kind = c.pick(options)
    if kind == "view" and not m.v.is_contiguous():
        kind = "slice"
    perm = list(range(rank))
    if kind == "t":
        b.emit(f"{new} = {name}.t()")
        perm = [1, 0]
    elif kind == "transpose":
        a, bb = c.pick(list(itertools.combinations(range(rank), 2)))
        b.emit(f"{new} = {name}.transpose({_dim_spelling(c, a, rank)}, {_dim_spelling(c, bb, rank)})")
        perm[a], perm[bb] = perm[bb], perm[a]
    elif kind == "permute":
        perm = c.permutation(rank)
        b.emit(f"{new} = {name}.permute({', '.join(map(str, perm))})")
    elif kind == "slice":
        b.emit(f"{new} = {name}[{', '.join([':'] * rank)}]")
    else:
        b.emit(f"{new} = {name}.view({', '.join(map(str, m.v.shape))})")
    b.models[new] = m.view(lambda t: t.permute(perm))
    if report:
        b.tag(f"view between softmax and selection ({kind})")
    if dim is None:
        return new
    return new, perm.index(dim)


def _cast(b: _Builder, name: str, dtype: torch.dtype, stem: str) -> str:
    new = b.fresh(stem)
    m = b.models[name]
    b.emit(f"{new} = {name}{b.c.pick(CAST_SPELLINGS[dtype])}")
    b.models[new] = m.cast(dtype)
    if not _is_upcast(m.dtype, dtype):
        b.tag("downcast")
    return new


def _product_plan(c: Chooser) -> dict:
    """An integer product of the logits: a Python constant, or a tensor of factors (in x's dtype)."""
    if c.flag(0.55):
        f = c.pick(PRODUCT_FACTORS)
        return {"kind": "const", "factors": [f], "even": f % 2 == 0}
    factors = c.pick(PRODUCT_ROW_FACTORS)
    return {"kind": "tensor", "factors": factors, "even": 2 in factors}


def _wrap_int(value: int, dtype: torch.dtype) -> int:
    """`value` wrapped around into the range of integer `dtype` (two's complement, as torch computes)."""
    info = torch.iinfo(dtype)
    return (value - info.min) % (1 << info.bits) + info.min


def _wrap_(m: Model) -> None:
    """Wrap an integer model's values around into its dtype's range, in place (exact below 2**53)."""
    if not m.dtype.is_floating_point:
        info = torch.iinfo(m.dtype)
        m.v.copy_(torch.remainder(m.v - info.min, 2.0**info.bits) + info.min)


def _product_preimage(c: Chooser, plan: dict, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integer logits x whose product with the plan's factors wraps around to `w` (float64 integers):
    x * f == w mod 2**bits. An odd f has one preimage, w * f^-1 (spread over the whole range); f = 2 has
    two, w / 2 and w / 2 + 2**(bits - 1) (in the signed range: near +-2**(bits - 1)), chosen per entry.
    Decides the factors too (plan["tensor"], constant along plan["dim"], or one value of rank 0)."""
    shape = tuple(w.shape)
    if plan["kind"] == "tensor":
        if c.flag(0.15):  # one factor, a rank-0 tensor
            plan["dim"], f_shape = None, []
        else:  # constant along one dim (a per-row factor when that is the softmax's dim)
            plan["dim"] = c.integer(0, len(shape) - 1)
            f_shape = list(shape)
            f_shape[plan["dim"]] = 1
        values = [c.pick(plan["factors"]) for _ in range(math.prod(f_shape))]
        if c.flag(0.3):
            values = [values[0]] * len(values)
        plan["tensor"] = torch.tensor(values, dtype=torch.int64).reshape(f_shape)
        factor = plan["tensor"].expand(shape)
    else:
        factor = torch.full(shape, plan["factors"][0], dtype=torch.int64)
    mod = 1 << torch.iinfo(dtype).bits
    xs = []
    for wi, fi in zip(w.reshape(-1).tolist(), factor.reshape(-1).tolist()):
        wi, fi = int(wi), _wrap_int(fi, dtype) % mod  # (uint8: -1 is stored as 255)
        if fi % 2:
            xi = wi * pow(fi, -1, mod)
        else:
            assert fi == 2 and wi % 2 == 0, (fi, wi)
            xi = (wi % mod) // 2 + (mod // 2 if c.flag(0.5) else 0)
        xs.append(_wrap_int(xi, dtype))
    return torch.tensor(xs, dtype=torch.int64).reshape(shape).to(dtype)


def _integer_product(b: _Builder, x: str, x_tensor: torch.Tensor, plan: dict) -> str:
    """s = x * f in x's integer dtype (it may wrap around); the model is the wrapped integers, computed
    from x's exact integers (Python ints), and must equal the lattice the generator drew (plan["w"])."""
    c = b.c
    dtype, shape = x_tensor.dtype, tuple(x_tensor.shape)
    new = b.fresh("s")
    if plan["kind"] == "const":
        f = plan["factors"][0]
        b.emit(f"{new} = " + c.pick([f"{x} * {f}", f"{f} * {x}", f"{x}.mul({f})", f"torch.mul({x}, {f})", f"{x}.clone().mul_({f})"]))
        factor = torch.full(shape, f, dtype=torch.int64)
        b.tag("integer product (constant)")
    else:
        t = plan["tensor"]
        first = int(t.reshape(-1)[0])
        if plan["dim"] == len(shape) - 1 and bool((t == first).all()) and first > 0 and c.flag(0.3):
            b.emit(f"{new} = {x} * torch.full_like({x}[..., :1], {first})")
        else:
            name = b.arg("f", t.to(dtype))
            b.emit(f"{new} = " + c.pick([f"{x} * {name}", f"{name} * {x}", f"{x}.mul({name})", f"torch.mul({x}, {name})", f"torch.mul({name}, {x})"]))
        factor = t.expand(shape)
        b.tag("integer product (tensor)")
    products = [int(xi) * _wrap_int(int(fi), dtype) for xi, fi in zip(x_tensor.reshape(-1).tolist(), factor.reshape(-1).tolist())]
    wrapped = [_wrap_int(p, dtype) for p in products]
    v = torch.tensor(wrapped, dtype=F64).reshape(shape)
    if not torch.equal(v, plan["w"]):
        raise AssertionError(f"generator error: {x} * f does not wrap to the drawn lattice")
    b.models[new] = Model(v, torch.zeros(shape, dtype=F64), dtype)
    if products != wrapped:
        b.tag("integer product wraps")
    return new


def _temperature(b: _Builder, s: str, step: tuple[str, float], kind: str) -> str:
    c = b.c
    op, value = step
    m = b.models[s]
    new = b.fresh("s")
    if kind == "row":
        rank = m.v.dim()
        dim = c.integer(0, rank - 1) if rank > 1 else 0
        negative = 0.5 if m.dtype in NARROW_INTS else 0.3
        signs = [(-1.0 if c.flag(negative) else 1.0) for _ in range(math.prod(m.v.shape) // m.v.shape[dim])]
        t_shape = list(m.v.shape)
        del t_shape[dim]
        t = (torch.tensor(signs, dtype=F64) * value).reshape(t_shape)
        name = b.arg("t", _maybe_requiring_grad(b, t.to(F32)))
        broadcast = f"{name}[:, None]" if rank == 2 and dim == 1 and c.flag(0.5) else f"{name}.unsqueeze({dim})"
        expr = f"{s} / {broadcast}" if op == "div" else c.pick([f"{s} * {broadcast}", f"{broadcast} * {s}", f"torch.mul({broadcast}, {s})"])
        operand = broadcast
        factor = t.unsqueeze(dim)
        other = torch.empty(t_shape, dtype=F32).unsqueeze(dim)
        if any(sg < 0 for sg in signs):
            b.tag("temperature=negative-row")
    elif kind == "scalar":
        sign = -1.0 if c.flag(0.3) else 1.0
        # one value, of any rank: [1] * rank + 1 broadcasts the logits up a dim (the softmax's dim then
        # counts in the broadcast shape)
        shape = [1] * c.pick([0, 0, 1, m.v.dim(), m.v.dim() + 1])
        if len(shape) > m.v.dim():
            b.tag("temperature adds a dim")
        name = b.arg("t", _maybe_requiring_grad(b, torch.tensor(sign * value, dtype=F32).reshape(shape)))
        expr = f"{s} / {name}" if op == "div" else c.pick([f"{name} * {s}", f"{s} * {name}"])
        operand = name
        factor = torch.tensor(sign * value, dtype=F64).reshape(shape)
        other = torch.empty(shape, dtype=F32)
    else:
        spell = {
            "div": f"{s} / {value!r}", "mul": f"{s} * {value!r}", "rmul": f"{value!r} * {s}",
            "div_m": f"{s}.div({value!r})", "mul_m": f"{s}.mul({value!r})",
            "tdiv": f"torch.div({s}, {value!r})", "tmul": f"torch.mul({s}, {value!r})",
        }  # fmt: skip
        expr = spell[op]
        operand = repr(value)
        factor = torch.tensor(value, dtype=F64)
        op = "div" if op in ("div", "div_m", "tdiv") else "mul"
        other = value
    dtype = (torch.empty(m.v.shape, dtype=m.dtype, device="meta") * (other.to("meta") if isinstance(other, torch.Tensor) else other)).dtype
    if m.dtype.is_floating_point and factor.dim() <= m.v.dim() and c.flag(0.3):
        # in place on a copy, as vLLM's sampler (`x = logits.to(float32); x.div_(t)`): the copy is a cast or
        # a scale the rewrite could look through, written before the softmax reads it; its dtype stays
        m = _in_place_copy(b, s, new)
        dtype = m.dtype
        b.emit(c.pick([f"{new}.{op}_({operand})", f"{new} {'/=' if op == 'div' else '*='} {operand}"]))
        b.tag("temperature in place")
    else:
        b.emit(f"{new} = {expr}")
    v = m.v / factor if op == "div" else m.v * factor
    e = m.e / factor.abs() if op == "div" else m.e * factor.abs()
    e = e + v.abs() * 1e-15  # float64 division by 1.5 or 0.7 is not exact
    b.models[new] = Model(v, e, dtype).round_()
    return new


def _in_place_copy(b: _Builder, s: str, new: str) -> Model:
    """`new` = a fresh copy of float `s` that the rewrite could look through: an upcast (a new tensor:
    float32 -> float64, fp16/bf16 -> float32) or, for float64, a product by 1."""
    m = b.models[s]
    if m.dtype == F64:
        b.emit(f"{new} = {s} * 1.0")
        b.models[new] = m.copy()
    else:
        dtype = F64 if m.dtype == F32 else F32
        b.emit(f"{new} = {s}{b.c.pick(CAST_SPELLINGS[dtype])}")
        b.models[new] = m.cast(dtype)
    return b.models[new]


def _maybe_requiring_grad(b: _Builder, t: torch.Tensor) -> torch.Tensor:
    if b.c.flag(0.25):
        b.tag("temperature requires grad")
        b.grad = True
        t.requires_grad_()
    return t


SOFTMAX_FNS = {False: ["torch.softmax", "F.softmax", "torch.special.softmax", "method"], True: ["torch.log_softmax", "F.log_softmax", "torch.special.log_softmax", "method"]}


def _softmax(b: _Builder, s: str, dim: int, log: bool, dtype: torch.dtype | None) -> str:
    c = b.c
    m = b.models[s]
    rank = m.v.dim()
    fn = c.pick(SOFTMAX_FNS[log])
    d = _dim_spelling(c, dim, rank)
    dim_text = f"dim={d}" if c.flag(0.5) or fn.startswith("F.") and c.flag(0.8) else f"{d}"
    dtype_text = f", dtype={DTYPE_SRC[dtype]}" if dtype is not None else ""
    name = b.fresh("probs")
    if fn == "method":
        call = f"{s}.{'log_softmax' if log else 'softmax'}({dim_text}{dtype_text})"
    else:
        if fn == "torch.special.softmax" or fn == "torch.special.log_softmax":
            dim_text = f"{d}"  # torch.special spells dim positionally
        call = f"{fn}({s}, {dim_text}{dtype_text})"
    b.emit(f"{name} = {call}")
    b.softmax_calls[name] = call
    if dtype is not None:
        b.tag("softmax dtype=" + str(dtype).removeprefix("torch.") + ("" if _is_upcast(m.dtype, dtype) else " (narrower)"))
    b.models[name] = model_softmax(m, dim, log, dtype)
    return name


def _write_probs(b: _Builder, target: str, sels: list[dict], log: bool, tag: str = "probs write") -> None:
    c = b.c
    m = b.models[target]
    shape = tuple(m.v.shape)
    rank = len(shape)
    kind = c.pick(["neg", "scale", "pow2", "pow2", "zero_ids", "mask_zero", "transposed", "slice_view", "out", "add", "alias_view", "leaky"])
    if kind == "transposed" and rank != 2 or kind == "out" and (not m.v.is_contiguous() or b.grad):
        kind = "pow2"  # (Dynamo does not capture out= into a non-contiguous tensor; out= refuses autograd)
    zero_low = not log  # a zero is the smallest probability, but the largest log-probability
    if kind == "leaky":  # changes log-probabilities (and negated probabilities); others stay, written all the same
        _leaky_relu_(b, target, f"{tag} (in-place flag)")
        return
    if kind == "neg":
        b.emit(c.pick([f"{target}.mul_(-1)", f"{target}.neg_()", f"{target} *= -1"]))
        m.v.mul_(-1)
        b.tag(f"{tag} (negate)")
        return
    if kind == "scale":
        q = c.pick([2.0, 3.0, 0.5, 1.5])
        b.emit(c.pick([f"{target}.div_({q!r})", f"{target} /= {q!r}", f"{target}.mul_({1 / q!r})"]))
        m.v.div_(q)
        m.e.div_(q)
        m.e.add_(m.v.abs() * 1e-15)
        m.round_()
        b.tag(f"{tag} (scale)")
        return
    if kind == "add":
        value = c.pick([0.5, 1.0, -0.25])
        b.emit(c.pick([f"{target}.add_({value!r})", f"{target} += {value!r}"]))
        m.v.add_(value)
        m.round_()
        b.tag(f"{tag} (add constant)")
        return
    if kind in ("pow2", "transposed", "slice_view", "out", "alias_view"):
        big = c.integer(1, 6)
        exps = torch.tensor([big * c.integer(0, 1) for _ in range(math.prod(shape))], dtype=F64).reshape(shape)
        w = torch.exp2(exps)
        divide = c.flag(0.4)
        if kind == "transposed":
            name = b.arg("w", w.t().contiguous().to(F32 if m.dtype == F64 else m.dtype))
            view = c.pick([f"{target}.t()", f"{target}.transpose(0, 1)", f"{target}.transpose(-1, -2)"])
            b.emit(f"{view}.{'div_' if divide else 'mul_'}({name})")
        else:
            name = b.arg("w", w.to(F32 if m.dtype == F64 else m.dtype))
            if kind == "slice_view":
                b.emit(f"{target}[{', '.join([':'] * rank)}].{'div_' if divide else 'mul_'}({name})")
            elif kind == "alias_view":  # the same elements through another alias
                shape_text = ", ".join(map(str, shape))
                views = [".detach()", "[...]", ".unsqueeze(0)[0]", f".view_as({target})"] + ([f".view({shape_text})", ".flatten().view(" + shape_text + ")"] if m.v.is_contiguous() else [])
                b.emit(f"{target}{c.pick(views)}.{'div_' if divide else 'mul_'}({name})")
            elif kind == "out":
                b.emit(f"torch.{'div' if divide else 'mul'}({target}, {name}, out={target})")
            else:
                b.emit(c.pick([f"{target}.{'div_' if divide else 'mul_'}({name})", f"{target} {'/=' if divide else '*='} {name}"]))
        if divide:
            m.v.div_(w)
            m.e.div_(w)
        else:
            m.v.mul_(w)
            m.e.mul_(w)
        m.round_()
        b.tag(f"{tag} (tensor factor{', through a transpose' if kind == 'transposed' else ''})")
        return
    # zeros: along the last dim, no more per row than the selections tolerate as ties
    dim = rank - 1
    limit = _max_ties(sels, shape[dim], extreme_low=zero_low)
    if limit < 1:
        return
    count = c.integer(1, limit)
    if kind == "zero_ids":
        ids = sorted(c.permutation(shape[dim])[:count])
        spelled = c.pick(["list", "tensor", "index_fill"])
        if spelled == "list":
            b.emit(f"{target}[..., {ids!r}] = 0")
        elif spelled == "tensor":
            name = b.arg("ids", torch.tensor(ids))
            b.emit(f"{target}[..., {name}] = 0")
        else:
            name = b.arg("ids", torch.tensor(ids))
            b.emit(f"{target}.index_fill_({_dim_spelling(c, dim, rank)}, {name}, 0)")
        m.v[..., ids] = 0
        m.e[..., ids] = 0
    else:
        mask = _mask(c, shape, dim, count)
        name = b.arg("m", mask)
        b.emit(f"{target}.masked_fill_({name}, 0)")
        m.v.masked_fill_(mask, 0)
        m.e.masked_fill_(mask, 0)
    b.tag(f"{tag} (zeros)")


def _select(b: _Builder, source: str, model: Model, dim: int, k: int, plan: dict, group: int, outs: list, returned: list, log: bool) -> bool:
    """Emit one selection (and maybe a consumer comparing its values with its source); whether it runs
    under torch.no_grad() (where an input requires grad: then its values do not)."""
    c = b.c
    no_grad = b.grad and c.flag(0.3)
    if no_grad:
        b.tag("selection under no_grad")
        b.emit("with torch.no_grad():")
    emit = (lambda line: b.emit("    " + line)) if no_grad else b.emit  # noqa: E731
    rank = model.v.dim()
    d = _dim_spelling(c, dim, rank)
    kind = plan["kind"]
    v, i = b.fresh("v"), b.fresh("i")
    log_scale = 0.0
    if log:
        finite = model.v[model.v.isfinite()]
        log_scale = float(finite.abs().max()) + 8 if finite.numel() else 8.0
    returns_values = kind in ("topk", "max", "min") and c.flag(0.7)
    returns_index = not returns_values or c.flag(0.7)
    keepdim = plan["keepdim"]
    if kind == "topk":
        largest, sorted_ = plan["largest"], plan["sorted"]
        extra = []
        if not largest:
            extra.append(("largest", "False"))
        if not sorted_:
            extra.append(("sorted", "False"))
        dim_default = dim == rank - 1 and not extra and c.flag(0.3)
        style = c.pick(["fn_pos", "fn_kw", "method_pos", "method_kw", "fn_allpos"])
        if style == "fn_allpos":
            call = f"torch.topk({source}, {k}, {d}, {largest}, {sorted_})"
        else:
            kw = style.endswith("kw")
            args = [f"k={k}" if kw and c.flag(0.5) else f"{k}"]
            if not dim_default:
                args.append(f"dim={d}" if kw or args[0].startswith("k=") else f"{d}")
            args += [f"{name}={value}" for name, value in extra]
            if args[0].startswith("k=") and style.startswith("fn"):
                call = f"torch.topk({source}, {', '.join(args)})"
            elif style.startswith("fn"):
                call = f"torch.topk({source}, {', '.join(args)})"
            else:
                call = f"{source}.topk({', '.join(args)})"
        unpack = c.pick(["tuple", "index", "attr"])
        keep = True
    elif kind in ("max", "min"):
        style = c.pick(["fn_pos", "fn_kw", "method_pos", "method_kw"])
        kd = f", keepdim={keepdim}" if keepdim or c.flag(0.3) else ""
        dim_text = f"dim={d}" if style.endswith("kw") else f"{d}"
        call = f"torch.{kind}({source}, {dim_text}{kd})" if style.startswith("fn") else f"{source}.{kind}({dim_text}{kd})"
        unpack = c.pick(["tuple", "index", "attr"])
        keep = keepdim
    else:
        style = c.pick(["fn_pos", "fn_kw", "method_pos", "method_kw"])
        kd = f", keepdim={keepdim}" if keepdim or c.flag(0.3) else ""
        dim_text = f"dim={d}" if style.endswith("kw") else f"{d}"
        call = f"torch.{kind}({source}, {dim_text}{kd})" if style.startswith("fn") else f"{source}.{kind}({dim_text}{kd})"
        emit(f"{i} = {call}")
        returned.append(i)
        outs.append(Out("index", group, False, dim if keepdim else -1))
        return no_grad
    if unpack == "tuple":
        emit(f"{v}, {i} = {call}")
    else:
        r = b.fresh("r")
        emit(f"{r} = {call}")
        if unpack == "index":
            emit(f"{v}, {i} = {r}[0], {r}[1]")
        else:
            emit(f"{v}, {i} = {r}.values, {r}.indices")
    unsorted = kind == "topk" and k > 1 and not plan["sorted"]
    out_dim = dim if keep else -1
    if returns_values:
        returned.append(v)
        outs.append(Out("value", group, unsorted, out_dim, log_scale, model.floor))
    if returns_index:
        returned.append(i)
        outs.append(Out("index", group, unsorted, out_dim))
    if c.flag(0.2):  # code that compares the values with their source (a top-k or min-p mask): k entries
        largest = plan["largest"] if kind == "topk" else kind == "max"
        cut = f"{v}.{'amin' if largest else 'amax'}({d}, keepdim=True)" if keep else f"{v}.unsqueeze({d})"
        n = b.fresh("n")
        compared = source
        if source in b.softmax_calls and c.flag(0.5):  # the same softmax spelled again (a logits processor's)
            compared = b.fresh("twin")
            b.emit(f"{compared} = {b.softmax_calls[source]}")
            b.tag("values compared with a twin softmax")
        b.emit(f"{n} = ({compared} {'>=' if largest else '<='} {cut}).sum({d})")
        returned.append(n)
        outs.append(Out("other"))
        b.tag("values compared with their source")
    return no_grad


# --------------------------------------------------------------------------------------------------
# Comparing a run with eager.


def value_tolerance(want: torch.Tensor, log_scale: float, floor: torch.dtype | None = None) -> torch.Tensor:
    """|got - want| allowed for selection values: two ulps of the least precise dtype the values were
    rounded to (`floor`; the result dtype if unknown), plus the float32 (float64) rounding of the
    computation: 8 eps relative to the value (probabilities) or to the log-sum-exp scale
    (log-probabilities, where the subtraction cancels). For fp32 that is ~1e-6 relative.
    Eager's CPU log_softmax of fp16/bf16 rounds the exp-sum to the input dtype before its log:
    log(s * (1 + d)) = log(s) + d with |d| <= eps/2, up to eps/2 absolute on each log-probability,
    many ulps of one near 0 (measured: fp16 4.5e-4, bf16 3.8e-3 beyond one ulp)."""
    floor = floor or want.dtype
    acc = torch.finfo(F64 if floor == F64 else F32).eps
    w = want.double()
    own = 2 * ulp(w, floor) if floor != F64 else w.abs() * 4 * acc
    if log_scale and floor in (torch.float16, torch.bfloat16):
        own = own + torch.finfo(floor).eps
    return own + 8 * acc * (w.abs() + log_scale)


def _canonical(values: torch.Tensor | None, index: torch.Tensor, dim: int):
    """topk(sorted=False) results in index order along dim (the order is unspecified)."""
    order = torch.argsort(index, dim=dim)
    return (None if values is None else values.gather(dim, order)), index.gather(dim, order)


def compare(program: SelectionProgram, want: Any, got: Any, want_inputs: list, got_inputs: list, oracle: str, loose_other: bool = False) -> None:
    want_leaves, got_leaves = flat(want), flat(got)
    if len(want_leaves) != len(got_leaves):
        raise Failure("output count differs", f"{len(got_leaves)} outputs, eager has {len(want_leaves)}", oracle)
    # put unsorted topk groups in index order
    by_group: dict[int, dict[str, int]] = {}
    for position, out in enumerate(program.outs):
        if out.unsorted:
            by_group.setdefault(out.group, {})[out.kind] = position
    want_leaves, got_leaves = list(want_leaves), list(got_leaves)
    for group, where in by_group.items():
        dim = program.outs[where["index"]].dim if "index" in where else None
        if dim is None:  # values only: sort them
            p = where["value"]
            want_leaves[p] = want_leaves[p].sort(dim=-1).values
            got_leaves[p] = got_leaves[p].sort(dim=-1).values
            continue
        for leaves in (want_leaves, got_leaves):
            values = leaves[where["value"]] if "value" in where else None
            values, index = _canonical(values, leaves[where["index"]], dim)
            leaves[where["index"]] = index
            if "value" in where:
                leaves[where["value"]] = values
    for position, (out, w, g) in enumerate(zip(program.outs, want_leaves, got_leaves)):
        if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
            if w != g:
                raise Failure("output differs", f"output {position}: {g!r} vs eager {w!r}", oracle)
            continue
        if w.dtype != g.dtype or w.shape != g.shape:
            raise Failure(f"{out.kind} dtype/shape differs", f"output {position}: {g.dtype}{list(g.shape)} vs eager {w.dtype}{list(w.shape)}", oracle)
        if out.kind == "index":
            if not torch.equal(w, g):
                raise Failure("indices differ", f"output {position}: {g.tolist()} vs eager {w.tolist()}", oracle)
        elif out.kind == "value":
            error = (g.double() - w.double()).abs()
            both_inf = (g == w) & w.isinf()
            both_nan = g.isnan() & w.isnan()  # (generated logits give none; Inductor's uint8 softmax can, in both graphs)
            bad = ~((error <= value_tolerance(w, out.log_scale, out.floor)) | both_inf | both_nan)
            if bool(bad.any()):
                worst = float(torch.where(bad, error, torch.zeros_like(error)).max())
                raise Failure("values differ", f"output {position}: {g.tolist()} vs eager {w.tolist()} (worst error {worst:.3g})", oracle)
        elif loose_other and w.dtype.is_floating_point:
            tol = ulp(w.double(), out.floor or w.dtype) * 4 + 1e-6 * ((out.floor or w.dtype) == F32)
            if not bool((((g.double() - w.double()).abs() <= tol) | (g == w)).all()):
                raise Failure("other output differs", f"output {position}: {g.tolist()} vs eager {w.tolist()}", oracle)
        elif not same_tensor(w, g):
            raise Failure("other output differs", f"output {position}: {g.tolist()} vs eager {w.tolist()}", oracle)
    for (name, _), w, g in zip(program.args, want_inputs, got_inputs):
        if loose_other and w.dtype.is_floating_point:
            close = ((g.double() - w.double()).abs() <= ulp(w.double(), w.dtype) * 4) | (g == w)
            if bool(close.all()):
                continue
        if not same_tensor(w, g):
            raise Failure("input contents differ", f"input {name} after the call: {g.tolist()} vs eager {w.tolist()}", oracle)


def compare_grads(program: SelectionProgram, want: Any, got: Any, want_inputs: list, got_inputs: list, oracle: str) -> None:
    """Where an input requires grad (a temperature tensor): every float output requires grad as eager's
    does, and the gradients of sum(out ** 2) over them (an order-free loss: unsorted topk values may be in
    another order) agree with eager's within 5 % of their largest. Skipped where eager's own backward
    raises (a write to a tensor its backward needs)."""
    wanted = [i for i, (_, t) in enumerate(program.args) if t.requires_grad]
    if not wanted:
        return
    pairs = [(w, g) for w, g in zip(flat(want), flat(got)) if isinstance(w, torch.Tensor) and w.dtype.is_floating_point]
    for position, (w, g) in enumerate(pairs):
        if w.requires_grad != g.requires_grad:
            raise Failure("requires_grad differs", f"float output {position}: requires_grad={g.requires_grad}, eager {w.requires_grad}", oracle)
    pairs = [(w, g) for w, g in pairs if w.requires_grad]
    if not pairs:
        return

    def grads(outs: list, inputs: list) -> tuple:
        loss = sum((o.double() ** 2).sum() for o in outs)
        return torch.autograd.grad(loss, [inputs[i] for i in wanted], allow_unused=True)

    try:
        want_grads = grads([w for w, _ in pairs], want_inputs)
    except RuntimeError:
        return
    try:
        got_grads = grads([g for _, g in pairs], got_inputs)
    except RuntimeError as error:
        raise Failure("backward raises", describe_exception(error), oracle) from error
    for i, w, g in zip(wanted, want_grads, got_grads):
        if (w is None) != (g is None) and not (w is None and not bool(g.any())) and not (g is None and not bool(w.any())):
            raise Failure("gradient missing", f"input {program.args[i][0]}: {g} vs eager {w}", oracle)
        if w is None or g is None:
            continue
        w, g = w.double(), g.double()
        tolerance = 0.05 * float(w.abs().nan_to_num(0.0).max()) + 1e-6
        if not bool(((g - w).abs() <= tolerance).logical_or(g.isnan() & w.isnan()).logical_or(g == w).all()):  # NaN where eager's is
            raise Failure("gradients differ", f"input {program.args[i][0]}: {g.tolist()} vs eager {w.tolist()}", oracle)


# --------------------------------------------------------------------------------------------------
# The oracles.


class CaptureUnsupported(Exception):
    """Dynamo cannot capture the generated program in one graph: not a draftfuse matter."""


def _eager(program: SelectionProgram):
    fn = program.function()
    inputs = program.inputs()
    with quiet():
        out = fn(*inputs)
    return out, inputs


def _compiled(program: SelectionProgram, backend, **kwargs):
    torch._dynamo.reset()
    fn = program.function()
    inputs = program.inputs()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, **kwargs)
    try:
        with quiet():
            out = compiled(*inputs)
    except torch._dynamo.exc.BackendCompilerFailed:
        raise
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
        raise CaptureUnsupported(describe_exception(error)) from error
    return out, inputs


def rewrite_softmax_topk(gm, **kwargs):
    from draftfuse.passes import rewrite_softmax_topk as rewrite

    return rewrite(gm, **kwargs)


def check_dynamo(program: SelectionProgram, *, expect_rewrites: bool = False, **pass_options) -> Any:
    """Oracle 1: the pass on the program's Dynamo graph, the rewritten GraphModule run by Dynamo's own
    guarded code on cloned inputs, against eager on cloned inputs. Returns the pass report."""
    box: dict[str, Any] = {}

    def backend(gm, example_inputs):
        try:
            result = rewrite_softmax_topk(gm, **pass_options)
        except Exception as error:  # the pass must never raise
            box["error"] = error
            return gm.forward
        box["report"] = result.report
        return result.graph_module.forward

    want, want_inputs = _eager(program)
    try:
        got, got_inputs = _compiled(program, backend)
    except CaptureUnsupported:
        raise
    except Exception as error:
        if "report" not in box and "error" not in box:  # Dynamo failed before handing over a graph
            raise CaptureUnsupported(describe_exception(error)) from error
        raise Failure(f"rewritten graph raises ({where_raised(error)})", describe_exception(error), "dynamo", str(box.get("report", ""))) from error
    if "error" in box:
        error = box["error"]
        raise Failure(f"pass raises ({where_raised(error)})", describe_exception(error), "dynamo") from error
    report = box["report"]
    try:
        compare(program, want, got, want_inputs, got_inputs, "dynamo")
        compare_grads(program, want, got, want_inputs, got_inputs, "dynamo")
    except Failure as failure:
        failure.report = str(report)
        raise
    if expect_rewrites and len(report.rewrites) < program.expected_rewrites:
        raise Failure("supported form not rewritten", f"{len(report.rewrites)} rewrite(s), expected {program.expected_rewrites}", "dynamo", str(report))
    return report


def aten_graph_backend(box: dict, **pass_options):
    """A Dynamo backend that runs Inductor's own front end (AOTAutograd with Inductor's decompositions,
    functionalization and joint-graph passes, i.e. `compile_fx` up to its inner compile) and, in place of
    the inner compile, returns the post-grad-level ATen graph run eagerly: box["which"] picks the
    original graph ("base") or the pass's result ("new")."""
    from torch._inductor.compile_fx import compile_fx

    def inner(gm, example_inputs, **kwargs):
        graph = torch.fx.GraphModule(gm, gm.graph)
        graph.graph.eliminate_dead_code()  # what post_grad_passes does before the custom pre pass
        graph.recompile()
        box["graph"] = graph
        try:
            box["result"] = rewrite_softmax_topk(graph, **pass_options)
        except Exception as error:
            box["error"] = error
        modules = {"base": graph, "new": box["result"].graph_module if "result" in box else graph}

        def call(args):
            return modules[box["which"]](*args)

        call._boxed_call = True
        return call

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend


def check_aten(program: SelectionProgram, **pass_options) -> Any:
    """Oracle 2: the pass on Inductor's pre-post-grad ATen graph (see `aten_graph_backend`); the
    rewritten graph against the same graph unrewritten (exactly, but values within tolerance); where they
    differ, a rewritten graph that agrees with eager while the unrewritten one does not passes."""
    box: dict[str, Any] = {"which": "base"}
    torch._dynamo.reset()
    fn = program.function()
    compiled = torch.compile(fn, backend=aten_graph_backend(box, **pass_options), fullgraph=True)
    runs = {}
    for which in ("base", "new"):
        box["which"] = which
        inputs = program.inputs()
        try:  # no compile cache: a hit (another run's program of the same graph) skips the inner compile
            with quiet(), torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
                runs[which] = (compiled(*inputs), inputs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
            raise CaptureUnsupported(describe_exception(error)) from error
        except Exception as error:
            if which == "base":
                raise CaptureUnsupported(f"AOT/Inductor front end: {describe_exception(error)}") from error
            raise Failure(f"rewritten graph raises ({where_raised(error)})", describe_exception(error), "aten", str(box.get("result").report if "result" in box else "")) from error
        if "error" in box:
            error = box["error"]
            raise Failure(f"pass raises ({where_raised(error)})", describe_exception(error), "aten") from error
    report = box["result"].report
    try:
        compare(program, *runs["base"][:1], *runs["new"][:1], runs["base"][1], runs["new"][1], "aten")
    except Failure as failure:
        eager = _eager(program)
        if not _agrees_with_eager(program, eager, *runs["base"]) and _selects_like_eager(program, eager[0], runs["new"][0]):
            return report  # Inductor's own graph is what differs from eager (see _agrees_with_eager)
        failure.report = str(report)
        raise
    return report


def _agrees_with_eager(program: SelectionProgram, eager: tuple, outputs: Any, inputs: list) -> bool:
    """Whether a compiled run computes what eager does. Inductor's graph can be the one that is wrong:
    torch 2.13 decomposes softmax(x_uint8 / 4.0) (plain torch.compile too) with x - max(x) in uint8, which
    wraps. The rewrite then still selects eager's tokens (it selects on x), while the probabilities, from
    that decomposition's exp-sum, are as wrong as the unrewritten graph's."""
    want, want_inputs = eager
    try:
        compare(program, want, outputs, want_inputs, inputs, "aten")
    except Failure:
        return False
    return True


def _selects_like_eager(program: SelectionProgram, want: Any, outputs: Any) -> bool:
    pairs = zip(program.outs, flat(want), flat(outputs))
    return all(torch.equal(w, g) for out, w, g in pairs if out.kind == "index" and not out.unsorted)


def check_backend(program: SelectionProgram, **options) -> Any:
    """Oracle 3: torch.compile(fn, backend="draftfuse") against eager (Inductor computes the softmax
    its own way: other float outputs are compared within 4 ulps). A program that plain Inductor cannot
    compile either is not draftfuse's failure: CaptureUnsupported."""
    import draftfuse  # noqa: F401  (registers the backend for a source checkout)

    want, want_inputs = _eager(program)
    try:
        got, got_inputs = _compiled(program, "draftfuse", options=options or None)
    except CaptureUnsupported:
        raise
    except Exception as error:
        try:  # Inductor's own failures (an internal error, a joint graph autograd refuses) are not draftfuse's
            _compiled(program, "inductor")
        except Exception as inductor_error:
            raise CaptureUnsupported(f"Inductor alone raises too: {describe_exception(inductor_error)}") from error
        raise Failure(f"compile raises ({where_raised(error)})", describe_exception(error), "backend") from error
    try:
        compare(program, want, got, want_inputs, got_inputs, "backend", loose_other=True)
    except Failure as failure:
        # Inductor's own results (a narrower softmax dtype computed in float32; on the CPU, 8-bit integer
        # logits' order) are not draftfuse's: the pipeline oracle checks the passes apart from code generation
        try:
            inductor_out = _compiled(program, "inductor")[0]
            compare(program, want, inductor_out, want_inputs, want_inputs, "backend", loose_other=True)  # outputs only
        except Failure as inductor_failure:
            if inductor_failure.kind == failure.kind or failure.kind == "other output differs":
                raise CaptureUnsupported(f"Inductor alone differs from eager too: {inductor_failure.detail}") from failure
        raise
    try:
        compare_grads(program, want, got, want_inputs, got_inputs, "backend")
    except Failure as failure:
        # Inductor's own gradients (a temperature that requires grad, written in place) are not draftfuse's;
        # eager runs again: its graph was freed by the backward above
        (want, want_inputs), (inductor_out, inductor_inputs) = _eager(program), _compiled(program, "inductor")
        try:
            compare_grads(program, want, inductor_out, want_inputs, inductor_inputs, "backend")
        except Failure as inductor_failure:
            raise CaptureUnsupported(f"Inductor alone differs from eager too: {inductor_failure.detail}") from failure
        raise


def check_pipeline(program: SelectionProgram, **options) -> Any:
    """Oracle 4 (when draftfuse has draftfuse.testing): the backend's whole pipeline without code
    generation, `draftfuse.testing.draft_graphs` (the Dynamo-level passes, AOT autograd with Inductor's
    decompositions and joint-graph passes, draftfuse's post-grad passes, the post-grad graph run
    eagerly), against the same pipeline with draftfuse's passes off: Inductor's decompositions round
    differently from eager (a temperature folded into the max-subtraction, fp16 products done in
    float32), which is not draftfuse's to answer for. Other float outputs within 4 ulps. Where the two
    differ and torch's pipeline alone differs from eager (torch 2.13's CPU decompositions of 8-bit integer
    logits times a float), draftfuse's result must equal eager's; where neither does, CaptureUnsupported."""
    from draftfuse.testing import draft_graphs

    def run(opts):
        torch._dynamo.reset()
        fn = program.function()
        inputs = program.inputs()
        with quiet(), torch._inductor.config.patch(fallback_random=True):
            return draft_graphs(fn, *inputs, options=opts), inputs

    try:
        base, base_inputs = run({**options, "softmax_topk": False, "seed_fold": False})
    except Exception as error:
        raise CaptureUnsupported(f"the pipeline without draftfuse's passes: {describe_exception(error)}") from error
    try:
        graphs, got_inputs = run(options or None)
    except Exception as error:
        if not raised_in_draftfuse(error):
            raise CaptureUnsupported(describe_exception(error)) from error
        raise Failure(f"pipeline raises ({where_raised(error)})", describe_exception(error), "pipeline") from error
    try:
        compare(program, base.outputs, graphs.outputs, base_inputs, got_inputs, "pipeline", loose_other=True)
    except Failure as failure:
        failure.report = graphs.report
        want, want_inputs = _eager(program)
        try:  # the pipeline without draftfuse's passes against eager: torch's own (8-bit logits on the CPU)?
            compare(program, want, base.outputs, want_inputs, base_inputs, "pipeline", loose_other=True)
        except Failure as torch_failure:
            try:  # then draftfuse's result is judged against eager
                compare(program, want, graphs.outputs, want_inputs, got_inputs, "pipeline", loose_other=True)
            except Failure:
                raise CaptureUnsupported(f"torch's pipeline alone differs from eager: {torch_failure.detail}") from failure
            return graphs.report
        raise
    return graphs.report


# --------------------------------------------------------------------------------------------------
# Hand-written softmax forms at the ATen level (make_fx: the forms exactly as written).


@dataclasses.dataclass
class HandProgram:
    """A decomposed softmax written by hand, as ATen would show it, in fp32; `is_softmax` says
    whether it really is one (a rewrite of one that is not must not happen)."""

    source: str
    args: list[tuple[str, torch.Tensor]]
    outs: list[Out]
    tags: tuple[str, ...]
    name: str = "draft"

    function = SelectionProgram.function
    inputs = SelectionProgram.inputs

    def reproducer(self, oracle: str = "handwritten") -> str:
        lines = ["# run from the repository root: PYTHONPATH=. python this_file.py", "import torch", "from tests.fuzz import selection", "", f'SOURCE = """\\\n{self.source.rstrip()}\n"""', ""]
        lines += [f"{name} = {literal(t.detach())}" + (".requires_grad_()" if t.requires_grad else "") for name, t in self.args]
        names = ", ".join(name for name, _ in self.args)
        lines += ["", f"program = selection.HandProgram(source=SOURCE, args=list(zip({names!r}.split(', '), [{names}])),"]
        lines += [f"    outs={self.outs!r}, tags={self.tags!r})", "selection.check_handwritten(program)"]
        return "\n".join(lines).replace("Out(", "selection.Out(")


def generate_handwritten(c: Chooser) -> HandProgram:
    """One hand-written softmax form (fp32), then a selection on it."""
    form = c.pick(["keepdim", "keepdim", "no_keepdim_square", "where_two_temps", "where_two_temps", "zero_dim", "amax_no_dim", "amax_other_dim", "log_form", "sum_no_keepdim",
                   "sub_alpha", "log_sub_alpha", "where_signed", "where_signed", "bare_signed", "bare_signed"])
    tags = [f"form={form}"]
    if form == "zero_dim":
        shape: tuple[int, ...] = ()
    elif form in ("no_keepdim_square", "amax_other_dim", "sum_no_keepdim"):
        side = c.integer(2, 6)
        shape = (side, side)
    else:
        shape = (c.integer(1, 4), c.integer(2, 12))
    g = 0.5
    if shape:
        x = _latin(c, shape).double() * g
        if len(shape) == 2 and c.flag(0.7):  # rows with different maxima (a Latin square has one)
            x = x + g * torch.tensor([float(c.integer(-4, 4)) for _ in range(shape[0])], dtype=F64)[:, None]
    else:
        x = torch.tensor(float(c.integer(-4, 4)) * g, dtype=F64)
    args = [("x", x.to(F32))]
    lines = []
    t1 = c.pick([1.0, 2.0, 0.5])
    t2 = c.pick([1.0, 3.0, 0.25, 2.0])
    last = len(shape) - 1 if shape else 0
    d = -1 if shape and c.flag(0.5) else last
    if form == "keepdim":
        if c.flag(0.5):
            lines.append(f"s = x / {t1!r}")
        else:
            lines.append("s = x")
        lines += [f"e = torch.exp(s - torch.amax(s, {d}, keepdim=True))", f"p = e / torch.sum(e, {d}, keepdim=True)"]
    elif form == "no_keepdim_square":
        lines += [f"e = torch.exp(x - torch.amax(x, {d}))", f"p = e / torch.sum(e, {d}, keepdim=True)"]
    elif form == "sum_no_keepdim":
        lines += [f"e = torch.exp(x - torch.amax(x, {d}, keepdim=True))", f"p = e / torch.sum(e, {d})"]
    elif form == "amax_other_dim":
        other = 0 if last == 1 else 1
        lines += [f"e = torch.exp(x - torch.amax(x, {other}, keepdim=True))", f"p = e / torch.sum(e, {d}, keepdim=True)"]
    elif form == "amax_no_dim":
        lines += ["e = torch.exp(x - torch.amax(x))", f"p = e / torch.sum(e, {d}, keepdim=True)"]
    elif form == "log_form":
        lines += [f"z = x - torch.amax(x, {d}, keepdim=True)", f"p = z - torch.log(torch.sum(torch.exp(z), {d}, keepdim=True))"]
    elif form == "sub_alpha":  # a softmax still (shift-invariant), but not of x minus its max
        lines += [f"e = torch.exp(torch.sub(x, torch.amax(x, {d}, keepdim=True), alpha={t2!r}))", f"p = e / torch.sum(e, {d}, keepdim=True)"]
    elif form == "log_sub_alpha":  # a log-softmax only for alpha = 1
        lines += [f"z = x - torch.amax(x, {d}, keepdim=True)", f"p = torch.sub(z, torch.log(torch.sum(torch.exp(z), {d}, keepdim=True)), alpha={t2!r})"]
    elif form == "zero_dim":
        lines += ["p = torch.softmax(x, 0)" if c.flag(0.5) else "p = torch.exp(x - torch.amax(x, 0, keepdim=True)) / torch.sum(torch.exp(x - torch.amax(x, 0, keepdim=True)), 0, keepdim=True)"]
        tags.append("0-d")
    elif form in ("where_signed", "bare_signed"):  # Inductor's form for a temperature tensor (torch 2.11's: its
        op = c.pick(["/", "*"])                        # first branch alone), maybe with one piece off
        bare = form == "bare_signed"
        off = c.pick(["nothing", "nothing", "nothing", "sign of another", "sign of t - 1", "divisor", "signed branch of another",
                      "per-entry temperature", "other op", *(() if bare else ("scaled branch",))])
        temperatures = [0.5, -0.5, 2.0, -2.0, 0.25, -1.0, 0.0]
        columns = shape[1] if off == "per-entry temperature" else 1
        for name in ("t", "u"):  # u: another tensor, where a piece is off
            args.append((name, torch.tensor([[c.pick(temperatures) for _ in range(columns)] for _ in range(shape[0])], dtype=F32)))
        tags += [f"off={off}", f"op={op}"]
        first_op = {"/": "*", "*": "/"}[op] if off == "other op" else op
        lines += [
            "one = torch.scalar_tensor(1.0)",
            f"w = torch.where({'u' if off == 'sign of another' else 't'} >= {1.0 if off == 'sign of t - 1' else 0.0}, one, -one)",
            f"a = {'x.flip(-1)' if off == 'signed branch of another' else 'x'} * w",
            f"f = (a - torch.amax(a, {d}, keepdim=True)) {first_op} (w * {'u' if off == 'divisor' else 't'})",
            f"s = x {op} {'u' if off == 'scaled branch' else 't'}",
            f"b = s - torch.amax(s, {d}, keepdim=True)",
            f"m = torch.logical_not(torch.any(torch.logical_not((s == s) * (torch.abs(s) != float('inf'))), {d}, keepdim=True))",
            "e = torch.exp(torch.where(m, f, b))",
            f"p = e / torch.sum(e, {d}, keepdim=True)",
        ]
        if bare:
            lines = [line for line in lines if line[0] in "owaf"] + ["e = torch.exp(f)", f"p = e / torch.sum(e, {d}, keepdim=True)"]
    else:  # where: two branches with different temperatures (Inductor's form has one)
        per_element = c.flag(0.5)
        if per_element:
            mask = torch.tensor([c.flag(0.5) for _ in range(math.prod(shape))]).reshape(shape)
        else:
            mask = torch.tensor([c.flag(0.5) for _ in range(shape[0])]).reshape(shape[0], 1)
        args.append(("c", mask))
        tags.append("per-element condition" if per_element else "per-row condition")
        lines += [
            f"a = (x - torch.amax(x, {d}, keepdim=True)) / {t1!r}",
            f"y = x / {t2!r}",
            f"b = y - torch.amax(y, {d}, keepdim=True)",
            "z = torch.where(c, a, b)",
            "e = torch.exp(z)",
            f"p = e / torch.sum(e, {d}, keepdim=True)",
        ]
    # a hazard: an input written in place after the softmax's first read of it and before its last node
    gap = next((i for i, line in enumerate(lines) if line.startswith(("f = ", "z = "))), None)
    if gap is not None and c.flag(0.25):
        written = c.pick([name for name, _ in args if name in ("x", "t")])
        lines.insert(gap + 1, f"{written}.neg_()")
        tags.append(f"{written} written between the softmax's reads")
    # the reference, in float64, decides whether the selection is unambiguous
    plan = _selection_plan(c)
    size = shape[last] if shape else 1
    k = min(plan["k"], size)
    kind = plan["kind"]
    sel = {
        "topk": f"v, i = torch.topk(p, {k}, {d}{'' if plan['largest'] else ', largest=False'})",
        "max": f"v, i = torch.max(p, {d})",
        "min": f"v, i = torch.min(p, {d})",
        "argmax": f"i = torch.argmax(p, {d})",
        "argmin": f"i = torch.argmin(p, {d})",
    }[kind]
    lines.append(sel)
    returns = "v, i" if kind in ("topk", "max", "min") else "i"
    arg_names = ", ".join(name for name, _ in args)
    source = f"def draft({arg_names}):\n" + "".join(f"    {line}\n" for line in lines) + f"    return ({returns},)\n"
    program = HandProgram(source, args, [], tuple(tags))
    # model: the same program in float64 (exact lattice inputs), with a relative bound of 1e-4
    namespace = {"torch": torch}
    exec(compile(source.replace("def draft(", "def reference(").replace(f"    {sel}\n", "    return p\n"), "<ref>", "exec"), namespace)
    reference = namespace["reference"](*[t.double() if t.dtype.is_floating_point else t for _, t in args])
    model = Model(reference, reference.abs() * 1e-4 + 1e-30, F32)
    if reference.dim() and not unambiguous(model, d % reference.dim(), k, plan["largest"] and kind not in ("min", "argmin")):
        raise Reject("the reference cannot guarantee this selection")
    outs = []
    if kind in ("topk", "max", "min"):
        outs.append(Out("value", 0, False, -1, 16.0 if form in ("log_form", "log_sub_alpha") else 0.0))
    outs.append(Out("index", 0))
    program.outs = outs
    return program


def check_handwritten(program: HandProgram, **pass_options) -> Any:
    """The pass on the make_fx ATen graph of a hand-written form (fake values in node meta, as in
    Inductor), run eagerly against the unrewritten graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fn = program.function()
    gm = make_fx(fn, tracing_mode="fake")(*program.inputs())
    try:
        result = rewrite_softmax_topk(gm, **pass_options)
    except Exception as error:
        raise Failure(f"pass raises ({where_raised(error)})", describe_exception(error), "handwritten") from error
    base_inputs, new_inputs = program.inputs(), program.inputs()
    want = gm(*base_inputs)
    try:
        got = result.graph_module(*new_inputs)
    except Exception as error:
        raise Failure(f"rewritten graph raises ({where_raised(error)})", describe_exception(error), "handwritten", str(result.report)) from error
    try:
        compare(program, want, got, base_inputs, new_inputs, "handwritten")  # type: ignore[arg-type]
    except Failure as failure:
        failure.report = str(result.report)
        raise
    return result.report
