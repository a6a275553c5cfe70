"""Fuzzer B: random seed + loop programs over integer index arithmetic, and the seed-fold oracles.

What is generated (`generate(chooser)` -> `SeedFoldProgram`: source text of `seed` and `loop`, inputs):

  inputs     seq_lens (int64, every element >= 1), pos (int64, >= 0), scale (int32, large: products
             wrap in int32), offset (0-d int64), count/prob (float, for torch.binomial), and sometimes a
             pool tensor together with a view of it (`view = pool[a:b]`, passed as a second argument:
             the two alias)
  seed       writes before anything reads (pos.add_(1), pos += 1, torch.add(pos, 1, out=pos),
             torch._foreach_add_([pos, seq_lens], 1), a write through pool or its view, through
             torch.einsum("i->i", pos)); integer expressions over the inputs: + - * with constants and
             tensors (torch.add, Tensor.sub, ...), neg, // and torch.div(rounding_mode="floor") and
             torch.floor_divide, %, torch.remainder (divisors that do not fit a narrow dtype too),
             clamp/clamp_min/clamp_max/clip, torch.maximum/minimum (with a 0-d int64 limit too),
             casts .long()/.int()/.short()/.char()/.to(dtype) between int64/int32/int16/int8 (narrow
             products wrap), torch.full; random draws (torch.randint, torch.rand, torch.binomial,
             torch.randint_like, torch.randperm); a fresh buffer filled from a value (buf.copy_(a),
             buf[:] = a), sometimes written again afterwards; returns some of the inputs (the same
             tensors), expressions and buffers
  loop       for step in range(S): writes to what the seed carried (the caller's tensors: pos.add_(1),
             seq_lens.sub_(c) which breaks the declared range for the written value, out=, _foreach,
             einsum views, the pool through its view); VARIANTS of the seed's expressions over the
             carried values: the same expression (CSE), ones equal under the true facts (a clamp that
             never clamps given seq_lens >= 1, (e + c) - c, e * 1, e // 1, e % big, min(e, 2**32 - 1) and
             e % (2**32 + 5) (equal only if e is int64: torch converts the limit to e's dtype), a cast round trip
             that fits, operands swapped, a product distributed), ones equal only without wrap-around
             (a cast through int8, a product in int32 against the same in int64) or only without a write
             in between; the same random draw again (two draws, never one); fresh expressions
  value_ranges   only true facts about the inputs as generated ({"seq_lens": (1, None)}, upper bounds
             that hold, {"pos": (0, None)}); a write after the seam may break them for the written value

The oracles compare with eager `loop(*seed(**kwargs))` on identical cloned inputs (aliases rebuilt as
views of the cloned pool) with the same torch.manual_seed before both runs: outputs exactly equal,
inputs' final contents equal.

  * check_pass: the composition captured as one Dynamo graph (seed, seam marker with the facts, loop,
    as fold() composes them), `fold_seed` on it, the folded graph run by Dynamo's guarded code.
    Random draws are compared: the graph runs the same draws in the same order on the same generator
    unless the pass merges or drops one, which is exactly the bug to catch.
  * check_fold: `draftfuse.fold(seed, loop, value_ranges=..., mode=None)` (Inductor, no CUDA graphs),
    with `fallback_random=True` so Inductor draws through the same ATen random ops as eager; the
    compiled code may still order independent draws differently, so a mismatch on a program with
    random draws is confirmed against plain Inductor on `loop(*seed(...))` ("control") before it
    counts as a draftfuse failure.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from tests.fuzz.common import Chooser, Failure, Reject, aot_control, describe_exception, flat, literal, quiet, raised_in_draftfuse, same_tensor, where_raised

# uint8: torch converts a negative Python bound to it (clamp(min=-1) is clamp(min=255)) where signed dtypes raise
INT_DTYPES = {torch.int64: "torch.int64", torch.int32: "torch.int32", torch.int16: "torch.int16", torch.int8: "torch.int8", torch.uint8: "torch.uint8"}
CASTS = {
    torch.int64: [".long()", ".to(torch.int64)"],
    torch.int32: [".int()", ".to(torch.int32)", ".to(dtype=torch.int32)"],
    torch.int16: [".short()", ".to(torch.int16)"],
    torch.int8: [".char()", ".to(torch.int8)"],
    torch.uint8: [".byte()", ".to(torch.uint8)"],
}
SMALL = [-3, -2, -1, 1, 2, 3, 4, 5, 7, 9, 16, 100, 127]


# --------------------------------------------------------------------------------------------------
# Expressions: trees rendered to source; variants are trees too.

Expr = tuple  # ("leaf", name) | ("const", int) | (op, ...)


def render(e: Expr) -> str:
    kind = e[0]
    if kind == "leaf":
        return e[1]
    if kind == "const":
        return repr(e[1])
    if kind == "bin":  # ("bin", op, a, b, spelling)
        _, op, a, b, spelling = e
        ra, rb = render(a), render(b)
        sym = {"add": "+", "sub": "-", "mul": "*"}[op]
        if spelling == "op":
            return f"({ra} {sym} {rb})"
        if spelling == "fn":
            return f"torch.{op}({ra}, {rb})"
        return f"{_atom(ra)}.{op}({rb})"
    if kind == "neg":
        return f"(-{_atom(render(e[1]))})" if e[2] == "op" else f"torch.neg({render(e[1])})"
    if kind == "floordiv":  # ("floordiv", a, d, spelling)
        _, a, d, spelling = e
        ra = render(a)
        return {"op": f"({ra} // {d})", "div": f"torch.div({ra}, {d}, rounding_mode='floor')",
                "mdiv": f"{_atom(ra)}.div({d}, rounding_mode='floor')", "fdiv": f"torch.floor_divide({ra}, {d})"}[spelling]  # fmt: skip
    if kind == "mod":
        _, a, d, spelling = e
        return f"({render(a)} % {d})" if spelling == "op" else f"torch.remainder({render(a)}, {d})"
    if kind == "clamp":  # ("clamp", a, lo, hi, spelling): lo/hi ints, exprs or None
        _, a, lo, hi, spelling = e
        ra = render(a)
        lo_s = None if lo is None else render(lo) if isinstance(lo, tuple) else repr(lo)
        hi_s = None if hi is None else render(hi) if isinstance(hi, tuple) else repr(hi)
        if spelling == "min_only":
            return f"{_atom(ra)}.clamp_min({lo_s})"
        if spelling == "max_only":
            return f"{_atom(ra)}.clamp_max({hi_s})"
        parts = ([f"min={lo_s}"] if lo_s is not None else []) + ([f"max={hi_s}"] if hi_s is not None else [])
        if spelling == "fn":
            return f"torch.clamp({ra}, {', '.join(parts)})"
        if spelling == "clip":
            return f"torch.clip({ra}, {', '.join(parts)})"
        return f"{_atom(ra)}.clamp({', '.join(parts)})"
    if kind == "maxmin":  # ("maxmin", which, a, b)
        _, which, a, b = e
        return f"torch.{which}({render(a)}, {render(b)})"
    if kind == "cast":  # ("cast", a, dtype, spelling)
        return f"{_atom(render(e[1]))}{e[3]}"
    if kind == "full":  # ("full", value, dtype)
        return f"torch.full((B,), {e[1]}, dtype={INT_DTYPES[e[2]]})"
    if kind == "scalar":  # ("scalar", value, dtype): 0-d, so it does not promote; converted to the other operand's dtype
        return f"torch.full((), {e[1]}, dtype={INT_DTYPES[e[2]]})"
    if kind == "raw":  # source as is (random draws, arange)
        return e[1]
    raise ValueError(kind)


def _atom(text: str) -> str:
    return text if text.isidentifier() or text.startswith("(") or text.endswith(")") and "(" in text.split(".")[0] else f"({text})"


def leaves(e: Expr) -> set[str]:
    if e[0] == "leaf":
        return {e[1]}
    out: set[str] = set()
    for part in e[1:]:
        if isinstance(part, tuple):
            out |= leaves(part)
    return out


def rename(e: Expr, names: dict[str, str]) -> Expr:
    if e[0] == "leaf":
        return ("leaf", names.get(e[1], e[1]))
    return tuple(rename(p, names) if isinstance(p, tuple) else p for p in e)


@dataclasses.dataclass
class _Scope:
    """Names visible in a function body, with their dtypes (int tensors of shape (B,) unless noted)."""

    dtypes: dict[str, torch.dtype]
    scalars: set[str] = dataclasses.field(default_factory=set)  # 0-d tensors
    write_only: set[str] = dataclasses.field(default_factory=set)  # another shape (the pool): written, not read

    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> the tensor it is (a = pos)

    def root(self, name: str) -> str:
        while name in self.aliases:
            name = self.aliases[name]
        return "pool" if name in ("view", "c_view", "c_pool") else name

    def ints(self) -> list[str]:
        return [n for n, d in self.dtypes.items() if not d.is_floating_point and n not in self.write_only]


def _dtype_of(e: Expr, scope: _Scope) -> torch.dtype:
    """The result dtype, computed by running the expression on small tensors of ones."""
    return _value_of(e, scope).dtype


def _value_of(e: Expr, scope: _Scope) -> torch.Tensor:
    """The expression run on small tensors of ones (its dtype and rank are what matter)."""
    env = {n: torch.ones(() if n in scope.scalars else (2,), dtype=d) for n, d in scope.dtypes.items()}
    text = render(e).replace("(B,)", "(2,)")
    env.update(torch=torch, B=2)
    try:
        value = eval(text, env)
    except Exception as error:  # an invalid combination (clamp(min=tensor, max=int)...): draw again
        raise Reject(f"cannot type {text}: {error}") from error
    return value


def _random_expr(c: Chooser, scope: _Scope, depth: int) -> Expr:
    names = scope.ints()
    if depth <= 0 or c.flag(0.25) or not names:
        if c.flag(0.15) or not names:
            return ("full", c.pick([0, 1, 3, -1]), c.pick(list(INT_DTYPES)))
        return ("leaf", c.pick(names))
    kind = c.pick(["bin", "bin", "bin", "neg", "floordiv", "mod", "clamp", "clamp", "maxmin", "cast", "cast"])
    a = _random_expr(c, scope, depth - 1)
    if kind == "bin":
        op = c.pick(["add", "sub", "mul"])
        b = ("const", c.pick(SMALL)) if c.flag(0.5) else _random_expr(c, scope, depth - 1)
        spelling = c.pick(["op", "op", "fn", "method"])
        if spelling == "fn" and b[0] == "const" and a[0] == "const":
            spelling = "op"
        return ("bin", op, a, b, spelling)
    if kind == "neg":
        return ("neg", a, c.pick(["op", "fn"]))
    if kind == "floordiv":
        # 300 and 2**32 + 3 do not fit narrow dtypes: torch divides an int8 tensor by 44, an int32 one by 3
        return ("floordiv", a, c.pick([1, 2, 3, 4, 8, 16, 300, 2**32 + 3]), c.pick(["op", "div", "mdiv", "fdiv"]))
    if kind == "mod":
        return ("mod", a, c.pick([2, 3, 4, 7, 16, 64, 1000, 300, 2**32 + 3]), c.pick(["op", "fn"]))
    if kind == "clamp":
        lo = c.pick([None, 0, 1, -1, 2])
        hi = c.pick([None, 5, 10, 100]) if lo is None or c.flag(0.4) else None
        if lo is None and hi is None:
            lo = 0
        if lo is not None and c.flag(0.15):
            lo = _random_expr(c, scope, 0)
        spelling = c.pick(["method", "fn", "clip"] + (["min_only"] if hi is None and not isinstance(lo, tuple) else []) + (["max_only"] if lo is None else []))
        return ("clamp", a, lo, hi, spelling)
    if kind == "maxmin":
        # a 0-d limit of a wider dtype (or out of the other's range): converted down, 2**32 - 1 is -1 to int32
        b = ("scalar", c.pick([5, 300, 2**31, 2**32 - 1]), torch.int64) if c.flag(0.2) else _random_expr(c, scope, depth - 1)
        return ("maxmin", c.pick(["maximum", "minimum"]), a, b)
    dtype = c.pick(list(INT_DTYPES))
    return ("cast", a, dtype, c.pick(CASTS[dtype]))


def _variant(c: Chooser, e: Expr, scope: _Scope, tags: list[str]) -> Expr:
    """A variant of e (same leaves): equal, equal under the true facts, or equal only without
    wrap-around or without a write in between. Applied at the root or at a subtree."""
    if e[0] not in ("leaf", "const", "full", "scalar", "raw") and c.flag(0.3):
        # recurse into a child
        parts = list(e)
        children = [i for i, p in enumerate(parts) if isinstance(p, tuple) and p[0] not in ("const",)]
        if children:
            i = c.pick(children)
            parts[i] = _variant(c, parts[i], scope, tags)
            return tuple(parts)
    kind = c.pick(["same", "same", "clamp_never", "clamp_never", "max_never", "addsub", "mul1", "div1", "mod_big", "roundtrip", "roundtrip_narrow", "swap", "distribute", "widen", "min_wide", "mod_wide"])
    tags.append(f"variant:{kind}")
    if kind == "same":
        return e
    if kind == "clamp_never":
        return ("clamp", e, c.pick([0, 1, -5, -1]), None, c.pick(["method", "fn", "clip", "min_only"]))
    if kind == "max_never":
        return ("maxmin", "maximum", e, ("full", c.pick([0, 1]), _dtype_of(e, scope)))
    if kind == "addsub":
        k = c.pick([1, 2, 5])
        return ("bin", "sub", ("bin", "add", e, ("const", k), "op"), ("const", k), "op")
    if kind == "mul1":
        return ("bin", "mul", e, ("const", 1), c.pick(["op", "method"]))
    if kind == "div1":
        return ("floordiv", e, 1, c.pick(["op", "div", "fdiv"]))
    if kind == "min_wide":  # never clamps an int64 below 2**32 - 1; converted to int32 or narrower the limit is -1
        return ("maxmin", "minimum", e, ("scalar", 2**32 - 1, torch.int64))
    if kind == "mod_wide":  # e itself for an int64 e in [0, 2**32 + 4]; an int32 e is divided by 5
        return ("mod", e, (1 << 32) + 5, c.pick(["op", "fn"]))
    if kind == "mod_big":
        return ("mod", e, c.pick([64, 1000, 1 << 20, (1 << 40) + 5]), c.pick(["op", "fn"]))
    if kind in ("roundtrip", "roundtrip_narrow"):
        original = _dtype_of(e, scope)
        through = c.pick([torch.int32, torch.int64]) if kind == "roundtrip" else c.pick([torch.int8, torch.int16])
        return ("cast", ("cast", e, through, c.pick(CASTS[through])), original, c.pick(CASTS[original]))
    if kind == "swap" and e[0] == "bin" and e[1] in ("add", "mul"):
        return ("bin", e[1], e[3], e[2], e[4] if e[3][0] != "const" or e[4] == "op" else "op")
    if kind == "distribute" and e[0] == "bin" and e[1] == "mul" and e[2][0] == "bin" and e[2][1] in ("add", "sub"):
        _, _, (_, inner, a, b, _), k, _ = e
        return ("bin", inner, ("bin", "mul", a, k, "op"), ("bin", "mul", b, k, "op"), "op")
    if kind == "widen" and e[0] == "bin":
        return ("bin", e[1], ("cast", e[2], torch.int64, ".long()"), ("cast", e[3], torch.int64, ".long()") if e[3][0] != "const" else e[3], "op")
    return e


# --------------------------------------------------------------------------------------------------
# Programs.


@dataclasses.dataclass
class SeedFoldProgram:
    source: str  # defines seed(...) and loop(...)
    tensors: list[tuple[str, torch.Tensor]]  # the seed's arguments that are not views of another
    views: list[tuple[str, str, str]]  # (argument, base argument, index source): argument = base[index]
    params: list[str]  # the seed's parameters, in order
    value_ranges: dict[str, tuple[int | None, int | None]]
    random: bool  # the program draws random numbers
    tags: tuple[str, ...]
    rng_seed: int = 1234

    def functions(self) -> tuple[Callable, Callable]:
        namespace: dict[str, Any] = {"torch": torch}
        exec(compile(self.source, "<fuzz:seed_fold>", "exec"), namespace)
        return namespace["seed"], namespace["loop"]

    def kwargs(self) -> dict[str, torch.Tensor]:
        """Fresh clones of the inputs, views rebuilt on the cloned bases."""
        out = {name: t.clone() for name, t in self.tensors}
        for name, base, index in self.views:
            out[name] = eval(f"base[{index}]", {"base": out[base]})
        return {p: out[p] for p in self.params}

    def reproducer(self, oracle: str = "pass") -> str:
        lines = ["# run from the repository root: PYTHONPATH=. python this_file.py", "import torch", "from tests.fuzz import seed_fold", "", f'SOURCE = """\\\n{self.source.rstrip()}\n"""', ""]
        lines.append("program = seed_fold.SeedFoldProgram(")
        lines.append("    source=SOURCE,")
        lines.append("    tensors=[" + ", ".join(f"({n!r}, {literal(t)})" for n, t in self.tensors) + "],")
        lines.append(f"    views={self.views!r}, params={self.params!r}, value_ranges={self.value_ranges!r},")
        lines.append(f"    random={self.random!r}, tags={self.tags!r})")
        lines.append(f"seed_fold.check_{oracle}(program)")
        return "\n".join(lines)


def source_of(*fns: Callable) -> str:
    import textwrap

    return "\n".join(textwrap.dedent(inspect.getsource(f)) for f in fns)


# Hazard families that can be switched off (DRAFTFUSE_FUZZ_DISABLE=binomial,einsum,... or the argument),
# to look for failures beyond the classes already known. Default: everything on.
FEATURES = ("binomial", "einsum", "foreach", "alias", "write_inputs", "int32", "uint8", "buffer", "random", "view", "ranges")


def _disabled_from_env() -> frozenset[str]:
    import os

    names = {n.strip() for n in os.environ.get("DRAFTFUSE_FUZZ_DISABLE", "").split(",") if n.strip()}
    unknown = names - set(FEATURES) - {"probs_write", "logits_write"}
    if unknown:
        raise ValueError(f"DRAFTFUSE_FUZZ_DISABLE: unknown {sorted(unknown)}; known: {FEATURES}")
    return frozenset(names)


def generate(c: Chooser, disabled: frozenset[str] | None = None) -> SeedFoldProgram:
    disabled = _disabled_from_env() if disabled is None else disabled
    tags: list[str] = []
    batch = c.integer(1, 4)
    length = c.integer(2, 12)
    seq_lens = torch.tensor([c.integer(1, length) for _ in range(batch)])
    pos = torch.tensor([c.integer(0, length - 1) for _ in range(batch)])
    tensors: list[tuple[str, torch.Tensor]] = [("seq_lens", seq_lens), ("pos", pos)]
    views: list[tuple[str, str, str]] = []
    dtypes = {"seq_lens": torch.int64, "pos": torch.int64}
    scalars: set[str] = set()
    if c.flag(0.3) and "int32" not in disabled:
        tensors.append(("scale", torch.tensor([c.integer(30000, 70000) for _ in range(batch)], dtype=torch.int32)))
        dtypes["scale"] = torch.int32
        tags.append("int32 input (large)")
    if c.flag(0.25) and "uint8" not in disabled:  # counters a server keeps narrow; a negative clamp bound converts
        tensors.append(("counts", torch.tensor([c.integer(0, 255) for _ in range(batch)], dtype=torch.uint8)))
        dtypes["counts"] = torch.uint8
        tags.append("uint8 input")
    if c.flag(0.2):
        tensors.append(("offset", torch.tensor(c.integer(-3, 3))))
        dtypes["offset"] = torch.int64
        scalars.add("offset")
    if c.flag(0.3) and "alias" not in disabled:
        start = c.integer(0, 2)
        pool = torch.tensor([c.integer(0, 20) for _ in range(batch + start + c.integer(0, 2))])
        tensors.append(("pool", pool))
        views.append(("view", "pool", f"{start}:{start + batch}"))
        dtypes["pool"] = torch.int64
        dtypes["view"] = torch.int64
        tags.append("aliased inputs (pool and a view of it)")
    random_ops = c.flag(0.3) and "random" not in disabled
    if random_ops:
        tensors.append(("count", torch.tensor([float(c.integer(1, 20)) for _ in range(batch)])))
        tensors.append(("prob", torch.tensor([c.pick([0.25, 0.5, 0.75]) for _ in range(batch)])))
    params = [n for n, _ in tensors] + [n for n, _, _ in views]
    c_order = c.permutation(len(params))
    params = [params[i] for i in c_order]
    # true facts only
    value_ranges: dict[str, tuple[int | None, int | None]] = {}
    if c.flag(0.6):
        value_ranges["seq_lens"] = (1, c.pick([None, length, length + c.integer(0, 5)]))
    if c.flag(0.3):
        value_ranges["pos"] = (0, c.pick([None, length - 1 + c.integer(0, 3)]))
    if c.flag(0.1) and "scale" in dtypes:
        value_ranges["scale"] = (30000, 70000)
    if "ranges" in disabled:
        value_ranges = {}

    scope = _Scope(dict(dtypes), scalars, {"pool"} & set(dtypes))
    seed_lines: list[str] = []
    loop_lines: list[str] = []

    # seed: writes before reading
    if c.flag(0.25):
        seed_lines.append(_write(c, scope, tags, "seed", list(dtypes), disabled))
    # seed expressions
    exprs: list[tuple[str, Expr]] = []
    for i in range(c.integer(1, 3)):
        e = _random_expr(c, scope, c.integer(1, 3))
        _dtype_of(e, scope)
        name = f"a{i}"
        seed_lines.append(f"{name} = {render(e)}")
        exprs.append((name, e))
        value = _value_of(e, scope)
        scope.dtypes[name] = value.dtype
        if e[0] == "leaf":  # `a0 = pos`: the same tensor
            scope.aliases[name] = e[1]
        if value.dim() == 0:
            scope.scalars.add(name)
    draws: list[tuple[str, str]] = []
    if random_ops:
        for i in range(c.integer(1, 2)):
            draw = _random_draw(c, scope, disabled)
            name = f"r{i}"
            seed_lines.append(f"{name} = {draw}")
            draws.append((name, draw))
            scope.dtypes[name] = torch.int64  # every draw below is an int64 tensor of shape (B,)
            tags.append("random draw")
    buffers: list[str] = []
    vectors = [n for n, _ in exprs if n not in scope.scalars]
    if vectors and c.flag(0.3) and "buffer" not in disabled:
        source_name = c.pick(vectors)
        dtype = scope.dtypes[source_name]
        alloc = c.pick([f"torch.zeros(B, dtype={INT_DTYPES[dtype]})", f"torch.empty_like({source_name})", f"torch.full((B,), -1, dtype={INT_DTYPES[dtype]})"])
        seed_lines.append(f"buf = {alloc}")
        seed_lines.append(c.pick([f"buf.copy_({source_name})", f"buf[:] = {source_name}", f"buf[...] = {source_name}"]))
        tags.append("buffer filled")
        if c.flag(0.4):
            seed_lines.append(c.pick([f"{source_name}.add_(1)", f"{source_name} += 2", f"{source_name}.mul_(-1)"]))
            tags.append("buffer source written after the fill")
        scope.dtypes["buf"] = dtype
        buffers.append("buf")
    # what the seed carries: some inputs (the caller's tensors) and values
    carry_inputs = [n for n in params if n not in ("count", "prob") and c.flag(0.7)]
    if not carry_inputs:
        carry_inputs = ["seq_lens"]
    carry = carry_inputs + [n for n, _ in exprs if c.flag(0.7)] + [n for n, _ in draws] + buffers
    if random_ops:
        carry += ["count", "prob"] + (["seq_lens"] if "seq_lens" not in carry else [])
    seed_lines.append(f"return ({', '.join(carry)},)")
    loop_names = {n: f"c_{n}" for n in carry}
    loop_aliases = {loop_names[n]: loop_names.get(a, a) for n, a in scope.aliases.items() if n in loop_names}
    loop_scope = _Scope({loop_names[n]: scope.dtypes.get(n, torch.float32) for n in carry}, {loop_names[n] for n in carry if n in scope.scalars}, {loop_names[n] for n in carry if n == "pool"}, loop_aliases)

    # loop: S steps of writes and variants
    steps = c.integer(1, 3)
    body: list[str] = []
    results: list[str] = []
    for k in range(c.integer(1, 3)):
        # a variant of a seed expression whose leaves the loop can see
        visible = [(n, e) for n, e in exprs if leaves(e) <= set(carry)]
        if visible and c.flag(0.8):
            _, e = c.pick(visible)
            variant = _variant(c, rename(e, loop_names), loop_scope, tags)
        else:
            variant = _random_expr(c, loop_scope, c.integer(1, 3))
        _dtype_of(variant, loop_scope)
        body.append(f"b{k} = {render(variant)}")
        if _value_of(variant, loop_scope).dim() == 0:
            loop_scope.scalars.add(f"b{k}")
        results.append(f"b{k}")
    if draws and c.flag(0.8):
        name, draw = c.pick(draws)
        again = draw
        for n in carry:
            again = _replace_name(again, n, loop_names[n])
        body.append(f"d0 = {again}")
        results.append("d0")
        tags.append("same draw repeated in the loop")
    write_where = c.pick(["none", "before", "after", "both"])
    if write_where != "none":
        tags.append(f"loop writes {write_where} its computations")
    writable = [loop_names[n] for n in carry if n in carry_inputs or n in buffers or n.startswith("a")]
    writable = [w for w in writable if not loop_scope.dtypes[w].is_floating_point]
    if "write_inputs" in disabled:  # no writes after the seam to the caller's tensors
        writable = [w for w in writable if w.removeprefix("c_") not in carry_inputs]
    if writable and write_where in ("before", "both"):
        body.insert(0, _write(c, loop_scope, tags, "loop", writable, disabled))
    if writable and write_where in ("after", "both"):
        body.append(_write(c, loop_scope, tags, "loop", writable, disabled))
    loop_lines.append("outs = []")
    loop_lines.append(f"for step in range({steps}):")
    loop_lines += [f"    {line}" for line in body]
    loop_lines.append(f"    outs += [{', '.join(results)}]")
    returned = [loop_names[n] for n in carry if n in carry_inputs and c.flag(0.3)]
    # the seed's draws reach the outputs: an unused draw is dead code that torch.compile drops (its
    # place in the random stream with it), with or without draftfuse
    returned += [loop_names[n] for n, _ in draws]
    loop_lines.append(f"return (*outs, {''.join(r + ', ' for r in returned)})")
    source = f"B = {batch}\n\n\ndef seed({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in seed_lines)
    source += f"\n\ndef loop({', '.join(loop_names[n] for n in carry)}):\n" + "".join(f"    {line}\n" for line in loop_lines)
    if value_ranges:
        tags.append("value_ranges declared")
    return SeedFoldProgram(source, tensors, views, params, value_ranges, random_ops, tuple(dict.fromkeys(tags)))


def _replace_name(text: str, old: str, new: str) -> str:
    import re

    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def _random_draw(c: Chooser, scope: _Scope, disabled: frozenset[str] = frozenset()) -> str:
    kind = c.pick(["randint", "rand", "binomial", "randint_like", "randperm"])
    if kind == "binomial" and "binomial" in disabled:
        kind = "randint"
    if kind == "randint":
        return f"torch.randint(0, {c.pick([10, 50, 1000])}, (B,))"
    if kind == "rand":
        return f"(torch.rand(B) * {c.pick([10, 100])}).long()"
    if kind == "binomial":
        return "torch.binomial(count, prob).long()"
    if kind == "randint_like":
        return f"torch.randint_like(seq_lens, 0, {c.pick([10, 50])})"
    return "torch.randperm(B)"


def _write(c: Chooser, scope: _Scope, tags: list[str], side: str, targets: list[str], disabled: frozenset[str] = frozenset()) -> str:
    """An in-place write to one of `targets` (or to pool through its view, or several at once)."""
    targets = [t for t in targets if t in scope.dtypes and not scope.dtypes[t].is_floating_point]
    if not targets:
        return "pass"
    t = c.pick(targets)
    kind = c.pick(["add_", "iadd", "out", "sub_", "mul_", "foreach", "einsum", "setitem", "copy_", "view", "view"])
    if kind in disabled:
        kind = "add_"
    k = c.pick([1, 2, 3, -1, 5])
    tags.append(f"{side} write ({kind})")
    if kind == "add_":
        return f"{t}.add_({k})"
    if kind == "iadd":
        return f"{t} += {k}"
    if kind == "out":
        return f"torch.add({t}, {k}, out={t})"
    if kind == "sub_":
        return f"{t}.sub_({c.pick([1, 3, 20])})"
    if kind == "mul_":
        return f"{t}.mul_({c.pick([-1, 2, 3])})"
    if kind == "foreach":  # two different tensors (AOT autograd itself mishandles a list holding one twice)
        others = [o for o in targets if scope.root(o) != scope.root(t) and o not in scope.scalars and o not in scope.write_only]
        group = [t] + ([c.pick(others)] if others and c.flag(0.5) else [])
        return f"torch._foreach_add_([{', '.join(group)}], {k})"
    if kind == "view":  # a write through an alias: views, detach, and casts/contiguous that return self
        if t in scope.scalars:
            view = c.pick([".view(())", ".detach()", "[...]", ".reshape(())", ".long()", ".contiguous()"])
        else:
            view = c.pick([".view(-1)", ".detach()", "[...]", f".view_as({t})", ".unsqueeze(0)[0]", ".flatten()", ".long()", ".to(torch.int64)", ".contiguous()", "[:]"])
        return f"{t}{view}.add_({k})"
    if kind == "einsum":
        if t in scope.scalars:
            return f"{t}.add_({k})"
        return f"torch.einsum('i->i', {t}).add_({k})"
    if kind == "setitem":
        if t in scope.scalars:
            return f"{t}.fill_({k})"
        return f"{t}[{c.pick(['0', ':', '-1:'])}] = {c.pick([0, 7, -2])}"
    return f"{t}.copy_({t} * {c.pick([2, -1])} + 1)"


# --------------------------------------------------------------------------------------------------
# Oracles.


class CaptureUnsupported(Exception):
    """Dynamo cannot capture the composition in one graph: not a draftfuse matter."""


def composed(seed: Callable, loop: Callable, value_ranges: dict):
    """seed and loop composed as fold() composes them (seam marker with the facts), by keyword."""
    from draftfuse.passes.seed_fold import mark_seam, seam_facts

    facts = seam_facts(value_ranges=value_ranges)

    def draft(**kwargs):
        return loop(*mark_seam(seed(**kwargs), facts))

    return draft


def _eager(program: SeedFoldProgram):
    seed, loop = program.functions()
    kwargs = program.kwargs()
    torch.manual_seed(program.rng_seed)
    with quiet():
        out = loop(*seed(**kwargs))
    return out, kwargs


def compare(program: SeedFoldProgram, want: Any, got: Any, want_inputs: dict, got_inputs: dict, oracle: str) -> None:
    want_leaves, got_leaves = flat(want), flat(got)
    if len(want_leaves) != len(got_leaves):
        raise Failure("output count differs", f"{len(got_leaves)} vs eager {len(want_leaves)}", oracle)
    for position, (w, g) in enumerate(zip(want_leaves, got_leaves)):
        if not same_tensor(w, g):
            describe = (lambda t: f"{t.dtype} {t.tolist()}") if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) else repr
            raise Failure("outputs differ", f"output {position}: {describe(g)} vs eager {describe(w)}", oracle)
    for name in program.params:
        if not same_tensor(want_inputs[name], got_inputs[name]):
            raise Failure("input contents differ", f"{name}: {got_inputs[name].tolist()} vs eager {want_inputs[name].tolist()}", oracle)


def check_pass(program: SeedFoldProgram, *, direct_ranges: bool = False) -> Any:
    """Oracle 1: fold_seed on the Dynamo graph of the composition, run against eager. With
    direct_ranges the value ranges go to fold_seed's argument instead of the marker."""
    from draftfuse.passes import fold_seed

    box: dict[str, Any] = {}

    def backend(gm, example_inputs):
        try:
            result = fold_seed(gm, value_ranges=program.value_ranges) if direct_ranges else fold_seed(gm)
        except Exception as error:
            box["error"] = error
            return gm.forward
        box["report"] = result.report
        return result.graph_module.forward

    want, want_inputs = _eager(program)
    seed, loop = program.functions()
    draft = composed(seed, loop, {} if direct_ranges else program.value_ranges)
    torch._dynamo.reset()
    compiled = torch.compile(draft, backend=backend, fullgraph=True)
    got_inputs = program.kwargs()
    torch.manual_seed(program.rng_seed)
    try:
        with quiet():
            got = compiled(**got_inputs)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
        raise CaptureUnsupported(describe_exception(error)) from error
    except Exception as error:
        if "report" not in box and "error" not in box:  # Dynamo failed before handing over a graph
            raise CaptureUnsupported(describe_exception(error)) from error
        raise Failure(f"folded graph raises ({where_raised(error)})", describe_exception(error), "pass", str(box.get("report", ""))) from error
    if "error" in box:
        raise Failure(f"pass raises ({where_raised(box['error'])})", describe_exception(box["error"]), "pass")
    report = box["report"]
    internal = [n for n in report.notes if "internal error" in n]
    try:
        compare(program, want, got, want_inputs, got_inputs, "pass")
    except Failure as failure:
        failure.report = str(report)
        raise
    if internal:
        raise Failure("pass internal error (graph left unchanged)", internal[0][:300], "pass", str(report))
    return report


def check_pipeline(program: SeedFoldProgram) -> Any:
    """Oracle 2 (when draftfuse has draftfuse.testing): the composition through the backend's whole
    pipeline without code generation, `draftfuse.testing.draft_graphs`: the Dynamo-level passes (the
    seam cleanup, the declared ranges put into the graph), AOT autograd with Inductor's decompositions
    and joint-graph passes, draftfuse's post-grad passes (setup merging, with the proofs), the
    post-grad graph run eagerly; against eager, exactly."""
    from draftfuse.testing import draft_graphs

    want, want_inputs = _eager(program)
    seed, loop = program.functions()
    draft = composed(seed, loop, program.value_ranges)
    got_inputs = program.kwargs()
    torch._dynamo.reset()
    torch.manual_seed(program.rng_seed)
    try:
        # fallback_random: the graph draws through ATen's random ops, as eager does (and without it
        # draft_graphs' joint-graph passes fail on random ops: replace_random needs Inductor's context)
        with quiet(), torch._inductor.config.patch(fallback_random=True):
            graphs = draft_graphs(draft, **got_inputs)
    except Exception as error:
        if not raised_in_draftfuse(error):
            raise CaptureUnsupported(describe_exception(error)) from error
        raise Failure(f"pipeline raises ({where_raised(error)})", describe_exception(error), "pipeline") from error
    try:
        compare(program, want, graphs.outputs, want_inputs, got_inputs, "pipeline")
    except Failure as failure:
        _require_torch_agrees(program, want, want_inputs, failure)
        _require_harness_agrees(program, want, want_inputs, failure)
        failure.report = graphs.report
        raise
    internal = [n for r in graphs.reports for n in r.notes if "internal error" in n]
    if internal:
        raise Failure("pass internal error (graph left unchanged)", internal[0][:300], "pipeline", graphs.report)
    return graphs.report


def _require_torch_agrees(program: SeedFoldProgram, want: Any, want_inputs: dict, failure: Failure) -> None:
    """A mismatch is draftfuse's only if PyTorch alone (aot_eager on loop(*seed(...))) matches eager."""
    seed, loop = program.functions()

    def check(out, args, kwargs):
        compare(program, want, out, want_inputs, kwargs, "control")

    if not aot_control(lambda **kw: loop(*seed(**kw)), lambda: ((), program.kwargs()), check, program.rng_seed):
        raise CaptureUnsupported(f"PyTorch's AOT autograd alone differs from eager here: {failure.detail}") from failure


def _require_harness_agrees(program: SeedFoldProgram, want: Any, want_inputs: dict, failure: Failure) -> None:
    """A pipeline mismatch is draftfuse's only if draft_graphs itself, on loop(*seed(...)) with
    draftfuse's passes off, matches eager. It does not always: Inductor's joint-graph passes turn
    `0 + x` into `x`, and the post-grad graph run eagerly then returns the input that the draft later
    writes (real Inductor and the draftfuse backend return the value before the write)."""
    from draftfuse.testing import draft_graphs

    seed, loop = program.functions()
    kwargs = program.kwargs()
    torch._dynamo.reset()
    torch.manual_seed(program.rng_seed)
    try:
        with quiet(), torch._inductor.config.patch(fallback_random=True):
            control = draft_graphs(lambda **kw: loop(*seed(**kw)), options={"seed_fold": False, "softmax_topk": False}, **kwargs)
        compare(program, want, control.outputs, want_inputs, kwargs, "control")
    except Exception as error:  # noqa: BLE001
        raise CaptureUnsupported(f"draft_graphs without draftfuse's passes differs from eager here: {failure.detail}") from error


def check_fold(program: SeedFoldProgram, **settings) -> Any:
    """Oracle 2: draftfuse.fold(seed, loop, value_ranges=..., mode=None) against eager."""
    import draftfuse

    def run(options: dict):
        seed, loop = program.functions()
        torch._dynamo.reset()
        with quiet():
            draft = draftfuse.fold(seed, loop, value_ranges=program.value_ranges, mode=None, options=options, **settings)
            kwargs = program.kwargs()
            torch.manual_seed(program.rng_seed)
            return draft(**kwargs), kwargs

    def control():
        """Inductor alone, on the plain composition (no marker, no draftfuse pass)."""
        seed, loop = program.functions()
        torch._dynamo.reset()
        compiled = torch.compile(lambda **kw: loop(*seed(**kw)), backend="inductor", options={"fallback_random": True})
        kwargs = program.kwargs()
        torch.manual_seed(program.rng_seed)
        with quiet():
            return compiled(**kwargs), kwargs

    want, want_inputs = _eager(program)
    try:
        got, got_inputs = run({"fallback_random": True})
    except Exception as error:
        if "Unsupported" in type(error).__name__ or "GraphBreak" in type(error).__name__:
            raise CaptureUnsupported(describe_exception(error)) from error
        raise Failure(f"fold raises ({where_raised(error)})", describe_exception(error), "fold") from error
    try:
        compare(program, want, got, want_inputs, got_inputs, "fold")
    except Failure as failure:
        _require_torch_agrees(program, want, want_inputs, failure)
        # Inductor's own? (its draw order, or a lowering torch gets wrong: minimum(int8, a 0-d int64 of
        # 4294967295) wraps the operand in eager, not in Inductor's code)
        control_out, control_inputs = control()
        try:
            compare(program, want, control_out, want_inputs, control_inputs, "fold control")
        except Failure:
            if program.random:
                raise CaptureUnsupported(f"Inductor alone differs from eager here: {failure.detail}") from failure
            try:  # the same wrong values as Inductor alone: torch's; other values: still draftfuse's
                compare(program, control_out, got, control_inputs, got_inputs, "fold against Inductor alone")
            except Failure:
                raise failure from None
            raise CaptureUnsupported(f"Inductor alone gives the same values, which differ from eager: {failure.detail}") from failure
        raise
