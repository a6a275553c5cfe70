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
  containers (generated last, so a program without one is the program the same choices gave before;
             tagged "container:<kind>", "container:<operation>", "container:mutated", ...)
             the seed returns some of its carried values inside a container: a tuple, a namedtuple, a
             list, a dict, an OrderedDict, a defaultdict(list), a list inside a dict ("nested"); built by
             the seed, or the CALLER's own (an argument `state` holding tensors of its own, sometimes one
             of the tensor arguments too; the seed puts its values in by setitem/update/append/insert,
             sometimes over the caller's entries), sometimes one tensor under two keys, sometimes the
             container alone (fold then calls loop(container)). The loop reads the carried values out of
             it, then sometimes mutates it before its steps, in each step or after them: append,
             insert(0, x), pop(), pop(0), pop(key), popitem(), del, d[k] = new value (a step's result, a
             carried value, an entry + 1), setdefault (a new key or an existing one), update, extend,
             clear then refill, an entry reassigned to another entry's value, an entry written in place,
             move_to_end, a defaultdict's missing key appended to; reads entries again afterwards and
             sometimes returns the container. Containers that reach the loop as copies (deque, classes
             registered with pytree: documented in README) are not generated

The oracles compare with eager `loop(*seed(**kwargs))` (`loop(seed(...))` for a seed that returns no
tuple, as fold calls it) on identical cloned inputs (aliases rebuilt as views of the cloned pool, the
caller's containers rebuilt around the clones) with the same torch.manual_seed before both runs: outputs
exactly equal, inputs' final contents equal, the caller's containers after the call alike (same type,
same keys in the same order or same length, tensor values equal), the outputs' containers alike, and an
output that is the caller's container in eager is the caller's object. The pass and pipeline levels
compose seed and loop as fold does (mark_seam_undoable, the loop, unmark_seam); a traced draft that
raises in draftfuse's own code (Dynamo's "Observed exception" at a draftfuse line) where eager runs is a
failure ("traced draft raises"), not a capture limit.

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
    # containers the caller passes: (argument, kind, entries); kind "list", "dict", "OrderedDict" or
    # "defaultdict" (of list); entries [(key or None for a list, ref)], ref the name of a tensor in
    # `tensors` (or of another argument: the same tensor) or a list of such names (a list inside a dict).
    # A name met twice is one tensor under two keys.
    containers: list = dataclasses.field(default_factory=list)

    def functions(self) -> tuple[Callable, Callable]:
        namespace: dict[str, Any] = {"torch": torch}
        exec(compile(self.source, "<fuzz:seed_fold>", "exec"), namespace)
        return namespace["seed"], namespace["loop"]

    def kwargs(self) -> dict[str, Any]:
        """Fresh clones of the inputs, views rebuilt on the cloned bases, the caller's containers
        rebuilt around the cloned tensors (a tensor named twice is one clone)."""
        out = {name: t.clone() for name, t in self.tensors}
        for name, base, index in self.views:
            out[name] = eval(f"base[{index}]", {"base": out[base]})
        for name, kind, entries in self.containers:
            out[name] = _build_container(kind, entries, out)
        return {p: out[p] for p in self.params}

    def reproducer(self, oracle: str = "pass") -> str:
        lines = ["# run from the repository root: PYTHONPATH=. python this_file.py", "import torch", "from tests.fuzz import seed_fold", "", f'SOURCE = """\\\n{self.source.rstrip()}\n"""', ""]
        lines.append("program = seed_fold.SeedFoldProgram(")
        lines.append("    source=SOURCE,")
        lines.append("    tensors=[" + ", ".join(f"({n!r}, {literal(t)})" for n, t in self.tensors) + "],")
        lines.append(f"    views={self.views!r}, params={self.params!r}, value_ranges={self.value_ranges!r},")
        lines.append(f"    random={self.random!r}, tags={self.tags!r}, containers={self.containers!r})")
        lines.append(f"seed_fold.check_{oracle}(program)")
        return "\n".join(lines)


def source_of(*fns: Callable) -> str:
    import textwrap

    return "\n".join(textwrap.dedent(inspect.getsource(f)) for f in fns)


# Hazard families that can be switched off (DRAFTFUSE_FUZZ_DISABLE=binomial,einsum,... or the argument),
# to look for failures beyond the classes already known. Default: everything on.
FEATURES = ("binomial", "einsum", "foreach", "alias", "write_inputs", "int32", "uint8", "buffer", "random", "view", "ranges", "containers")


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
    returned = [loop_names[n] for n in carry if n in carry_inputs and c.flag(0.3)]
    # the seed's draws reach the outputs: an unused draw is dead code that torch.compile drops (its
    # place in the random stream with it), with or without draftfuse
    returned += [loop_names[n] for n, _ in draws]
    # containers: drawn after everything above, so a program without one is what it was before
    box = None
    if "containers" not in disabled and c.flag(0.4):
        box = _container_hazard(c, carry, loop_names, params, tensors, steps, results, batch, tags)
    prelude, containers = "", []
    if box is None:
        seed_lines.append(f"return ({', '.join(carry)},)")
        loop_params = [loop_names[n] for n in carry]
    else:
        seed_lines += box.seed_lines
        loop_params, params, containers, prelude = box.loop_params, box.params, box.containers, box.prelude
        loop_lines += box.head
        body += box.inside
        returned += box.returned
    loop_lines.append("outs = []")
    loop_lines.append(f"for step in range({steps}):")
    loop_lines += [f"    {line}" for line in body]
    loop_lines.append(f"    outs += [{', '.join(results)}]")
    if box is not None:
        loop_lines += box.tail
    loop_lines.append(f"return (*outs, {''.join(r + ', ' for r in returned)})")
    source = prelude + f"B = {batch}\n\n\ndef seed({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in seed_lines)
    source += f"\n\ndef loop({', '.join(loop_params)}):\n" + "".join(f"    {line}\n" for line in loop_lines)
    if value_ranges:
        tags.append("value_ranges declared")
    return SeedFoldProgram(source, tensors, views, params, value_ranges, random_ops, tuple(dict.fromkeys(tags)), containers=containers)


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
# Containers: the seed returns (some of) its carried values inside one; the loop reads and mutates it.


def _build_container(kind: str, entries: list, env: dict[str, Any]) -> Any:
    import collections

    def value(ref):
        return [env[r] for r in ref] if isinstance(ref, list) else env[ref]

    if kind == "list":
        return [value(ref) for _, ref in entries]
    pairs = [(key, value(ref)) for key, ref in entries]
    if kind == "dict":
        return dict(pairs)
    if kind == "OrderedDict":
        return collections.OrderedDict(pairs)
    if kind == "defaultdict":
        return collections.defaultdict(list, pairs)
    raise ValueError(kind)


class _Invalid(Exception):
    """A container operation that Python would refuse (eager raises) in the container's state then."""


@dataclasses.dataclass
class _Model:
    """What a container holds while the program is generated: a tensor entry is a name (what it is), a
    list inside a dict a _Model. A list's items are its entries; a dict's are [key, entry] pairs in order."""

    kind: str  # "list" or "dict"
    items: list
    flavor: str = "list"  # list, tuple, namedtuple, dict, OrderedDict, defaultdict

    def keys(self) -> list:
        return list(range(len(self.items))) if self.kind == "list" else [k for k, _ in self.items]

    def tensor_keys(self) -> list:
        return [k for k in self.keys() if isinstance(self.get(k), str)]

    def get(self, key):
        if self.kind == "list":
            if not isinstance(key, int) or not -len(self.items) <= key < len(self.items):
                raise _Invalid(key)
            return self.items[key]
        for k, v in self.items:
            if k == key:
                return v
        raise _Invalid(key)

    def set(self, key, entry) -> None:
        if self.kind == "list":
            self.get(key)
            self.items[key] = entry
            return
        for pair in self.items:
            if pair[0] == key:
                pair[1] = entry
                return
        self.items.append([key, entry])

    def remove(self, key):
        entry = self.get(key)
        if self.kind == "list":
            del self.items[key]
        else:
            self.items = [p for p in self.items if p[0] != key]
        return entry

    def inner(self) -> _Model | None:
        """The list under "lens" (a nested container), if it is still there."""
        found = next((v for k, v in self.items if k == "lens"), None) if self.kind == "dict" else None
        return found if isinstance(found, _Model) else None

    def locate(self, name: str, target: str, fields: list[str] | None = None) -> str | None:
        """An access that reads the entry `name` (the first place it is), or None."""
        for key in self.keys():
            entry = self.get(key)
            if entry == name:
                if fields is not None and key % 2 == 0:  # a namedtuple: by field or by index
                    return f"{target}.{fields[key]}"
                return _access(target, self, key)
            if isinstance(entry, _Model):
                found = entry.locate(name, _access(target, self, key))
                if found:
                    return found
        return None


def _access(target: str, model: _Model, key) -> str:
    return f"{target}[{key}]" if model.kind == "list" else f'{target}["{key}"]'


@dataclasses.dataclass
class _Box:
    seed_lines: list[str]  # the seed's writes into the container and its return
    loop_params: list[str]
    params: list[str]
    containers: list
    prelude: str  # module-level source (import collections, a namedtuple class)
    head: list[str]  # the loop's reads of the carried values (and mutations) before its steps
    inside: list[str]  # in every step, after the step's computations
    tail: list[str]  # after the steps
    returned: list[str]  # the loop's extra outputs (entries read, values popped, the container)


_CONSTRUCTORS = {"dict": "dict", "OrderedDict": "collections.OrderedDict", "defaultdict": "collections.defaultdict"}


def _container_hazard(c: Chooser, carry: list[str], loop_names: dict[str, str], params: list[str], tensors: list,
                      steps: int, results: list[str], batch: int, tags: list[str]) -> _Box:
    """The seed packs some of `carry` into a container (built by the seed as `box`, or the caller's own,
    passed as the argument `state` holding tensors of its own); the loop reads the carried values out of
    it, then may mutate it (before its steps, in each step, after them) and read it again. Containers
    that reach the loop as copies (deque, pytree-registered classes: documented) are not generated."""
    import copy

    caller = c.flag(0.4)
    kind = c.pick(["list", "dict", "OrderedDict", "defaultdict", "nested"] if caller else
                  ["tuple", "namedtuple", "list", "list", "dict", "dict", "OrderedDict", "defaultdict", "nested"])
    tags.append(f"container:{kind}")
    order = [carry[i] for i in c.permutation(len(carry))]
    packed = order[:c.integer(0 if caller else 1, min(4, len(carry)))]
    shared = c.flag(0.25)  # one tensor under two keys
    name = "state" if caller else "box"
    target = f"c_{name}"
    seed_lines: list[str] = []
    containers: list = []
    prelude = ""
    fields: list[str] | None = None
    new_params = list(params)
    added: list[tuple[str, torch.Tensor]] = []

    if caller:
        tags.append("container:caller")
        own = [f"{name}_{i}" for i in range(c.integer(1, 2))]
        added = [(o, torch.tensor([c.integer(0, 9) for _ in range(batch)])) for o in own]
        refs: list[str] = list(own)
        if c.flag(0.2):  # the caller's container holds one of its tensor arguments too (the same tensor)
            refs.append(c.pick([p for p in params if p not in ("count", "prob")]))
            tags.append("container:holds an argument")
        if shared:
            refs.append(refs[0])
        if kind == "nested":
            inner = refs[:c.integer(1, len(refs))]
            entries = [("lens", inner)] + [(f"h{i}", r) for i, r in enumerate(refs[len(inner):])]
            model = _Model("dict", [["lens", _Model("list", list(inner))]] + [[k, r] for k, r in entries[1:]], "dict")
        elif kind == "list":
            entries = [(None, r) for r in refs]
            model = _Model("list", list(refs))
        else:
            entries = [(f"h{i}", r) for i, r in enumerate(refs)]
            model = _Model("dict", [[k, r] for k, r in entries], kind)
        containers.append((name, "dict" if kind == "nested" else kind, entries))
        new_params.insert(c.integer(0, len(new_params)), name)
        # the seed puts the packed values into the caller's container
        for n in packed + ([c.pick(packed)] if shared and packed else []):
            inner_model = model.inner()
            if model.kind == "list":
                how = c.pick(["append", "append", "insert", "set", "iadd"])
                if how == "set":
                    i = c.integer(0, len(model.items) - 1)
                    seed_lines.append(f"{name}[{i}] = {n}")
                    model.items[i] = n
                    tags.append("container:seed replaces the caller's entry")
                elif how == "insert":
                    seed_lines.append(f"{name}.insert(0, {n})")
                    model.items.insert(0, n)
                else:
                    seed_lines.append(f"{name}.append({n})" if how == "append" else f"{name} += [{n}]")
                    model.items.append(n)
            elif inner_model is not None and c.flag(0.5):
                seed_lines.append(f'{name}["lens"].append({n})')
                inner_model.items.append(n)
            else:
                keys = model.tensor_keys()
                key = c.pick(keys) if keys and c.flag(0.2) else n if n not in model.keys() else f"{n}_2"
                if key in model.keys():
                    tags.append("container:seed replaces the caller's entry")
                seed_lines.append(f"{name}.update({key}={n})" if c.flag(0.2) else f'{name}["{key}"] = {n}')
                model.set(key, n)
    else:
        items = packed + ([c.pick(packed)] if shared else [])
        fields = []
        for n in items:
            fields.append(n if n not in fields else f"{n}_again")
        if kind in ("tuple", "list"):
            seed_lines.append(f"{name} = ({', '.join(items)},)" if kind == "tuple" else f"{name} = [{', '.join(items)}]")
            model = _Model("list", list(items), kind)
        elif kind == "namedtuple":
            prelude = f"import collections\n\nCarry = collections.namedtuple('Carry', {fields!r})\n\n"
            seed_lines.append(f"{name} = Carry({', '.join(items)})" if c.flag(0.5) else f"{name} = Carry({', '.join(f'{f}={n}' for f, n in zip(fields, items))})")
            model = _Model("list", list(items), kind)
        elif kind == "nested":
            inner = items[:c.integer(1, len(items))]
            outer = list(zip(fields[len(inner):], items[len(inner):]))
            seed_lines.append(f"{name} = {{'lens': [{', '.join(inner)}]{''.join(f', {f!r}: {n}' for f, n in outer)}}}")
            model = _Model("dict", [["lens", _Model("list", list(inner))]] + [[f, n] for f, n in outer], "dict")
        else:
            pairs = list(zip(fields, items))
            constructor = _CONSTRUCTORS[kind]
            first = "list, " if kind == "defaultdict" else ""
            if c.flag(0.3):  # built entry by entry
                seed_lines.append(f"{name} = {constructor}({first.rstrip(', ')})")
                seed_lines += [f'{name}["{f}"] = {n}' for f, n in pairs]
            elif c.flag(0.5) and kind != "defaultdict":
                seed_lines.append(f"{name} = {constructor}({', '.join(f'{f}={n}' for f, n in pairs)})")
            else:
                literal_ = f"{{{', '.join(f'{f!r}: {n}' for f, n in pairs)}}}"
                seed_lines.append(f"{name} = {literal_}" if kind == "dict" else f"{name} = {constructor}({first}{literal_})")
            if kind != "dict":
                prelude = "import collections\n\n"
            model = _Model("dict", [[f, n] for f, n in pairs], kind)
    if shared:
        tags.append("container:one tensor under two keys")
    where = {n: model.locate(n, target, fields if kind == "namedtuple" else None) for n in packed}
    rest = [n for n in carry if where.get(n) is None]  # (a packed value the seed overwrote: passed as before)

    # the seed's return: the container among the rest, or alone (fold then calls loop(container))
    if not rest and kind not in ("tuple", "namedtuple") and c.flag(0.3):
        seed_lines.append(f"return {name}")
        loop_params = [target]
        tags.append("container:returned alone by the seed")
    else:
        outs = list(rest)
        outs.insert(c.integer(0, len(outs)), name)
        seed_lines.append(f"return ({', '.join(outs)},)")
        loop_params = [target if o == name else loop_names[o] for o in outs]
    head = [f"{loop_names[n]} = {where[n]}" for n in carry if where.get(n) is not None]

    inside: list[str] = []
    tail: list[str] = []
    returned: list[str] = []
    counter = [0]
    carried = [loop_names[n] for n in carry]

    def fresh(prefix: str) -> str:
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    def value(m: _Model, t: str, place: str, reads: bool = True) -> str:
        """A tensor to store: a carried value, a fresh tensor, an expression, a step's result, an entry."""
        options = ["carried", "carried", "fresh", "expr"] + (["result", "result"] if place != "before" else [])
        options += ["entry", "entry_expr"] if reads and m.tensor_keys() else []
        how = c.pick(options)
        if how == "carried":
            return c.pick(carried)
        if how == "fresh":
            return c.pick(["torch.zeros(B, dtype=torch.int64)", f"torch.full((B,), {c.pick([-1, 7])})"])
        if how == "expr":
            return f"{c.pick(carried)} + {'step' if place == 'inside' else c.pick([1, 2])}"
        if how == "result":
            return c.pick(results)
        read = _access(t, m, c.pick(m.tensor_keys()))
        return read if how == "entry" else f"{read} + 1"

    def mutation(place: str) -> list[str] | None:
        m, t = model, target
        if m.inner() is not None and c.flag(0.5):  # the list inside the dict
            m, t = model.inner(), f'{target}["lens"]'
        if m.kind == "list":
            ops = ["append", "insert0", "pop", "pop0", "extend", "clear_refill", "setitem", "copy_entry", "del", "inplace"]
        else:
            ops = ["set_existing", "set_new", "pop", "del", "setdefault_existing", "setdefault_new", "clear_refill", "copy_entry",
                   "inplace", "update", "popitem"]
            ops += (["move_to_end"] if m.flavor == "OrderedDict" else []) + (["default_append"] if m.flavor == "defaultdict" else [])
        op = c.pick(ops)
        keys, tensor_keys = m.keys(), m.tensor_keys()
        lines: list[str] = []
        out: list[str] = []
        effects: list[Callable[[_Model], None]] = []  # what one run of the lines does to the container

        def need(ok) -> None:
            if not ok:
                raise _Invalid(op)

        try:
            if op in ("append", "insert0"):
                v = value(m, t, place)
                lines.append(f"{t}.append({v})" if op == "append" else f"{t}.insert(0, {v})")
                effects.append(lambda m: m.items.append(v) if op == "append" else m.items.insert(0, v))
            elif op in ("pop", "pop0") and m.kind == "list":
                need(keys)
                p = fresh("p")
                lines.append(f"{p} = {t}.pop()" if op == "pop" else f"{p} = {t}.pop(0)")
                effects.append(lambda m: m.remove(-1 if op == "pop" else 0))
                out.append(p)
            elif op == "extend":
                vs = [value(m, t, place) for _ in range(c.integer(1, 2))]
                lines.append(f"{t}.extend([{', '.join(vs)}])" if t != target or c.flag(0.5) else f"{t} += [{', '.join(vs)}]")
                effects.append(lambda m: m.items.extend(vs))
            elif op == "clear_refill":  # the values are read before the clear
                vs = [value(m, t, place, reads=False) for _ in range(c.integer(1, 2))]
                lines.append(f"{t}.clear()")
                if m.kind == "list":
                    lines.append(f"{t}.extend([{', '.join(vs)}])" if c.flag(0.5) else f"{t} += [{', '.join(vs)}]" if t == target else f"{t}.append({vs[0]})")
                    vs = vs if lines[-1].count("append") == 0 else vs[:1]
                    effects.append(lambda m: setattr(m, "items", list(vs)))
                else:
                    ks = [c.pick(keys) if keys and c.flag(0.6) else fresh("k") for _ in vs]
                    lines += [f'{t}["{k}"] = {v}' for k, v in zip(ks, vs)]

                    def refill(m: _Model) -> None:
                        m.items = []
                        for k, v in zip(ks, vs):
                            m.set(k, v)
                    effects.append(refill)
            elif op in ("setitem", "set_existing"):
                need(keys)
                k = c.pick(keys)
                v = value(m, t, place)
                lines.append(f"{_access(t, m, k)} = {v}")
                effects.append(lambda m: m.set(k, v))
            elif op in ("set_new", "update"):
                k = c.pick(keys) if op == "update" and keys and c.flag(0.5) else fresh("k")
                v = value(m, t, place)
                lines.append(f'{t}["{k}"] = {v}' if op == "set_new" else f"{t}.update({k}={v})")
                effects.append(lambda m: m.set(k, v))
            elif op == "copy_entry":  # an entry reassigned to another entry's value
                need(tensor_keys and len(keys) >= 2)
                src = c.pick(tensor_keys)
                dst = c.pick([k for k in keys if k != src])
                lines.append(f"{_access(t, m, dst)} = {_access(t, m, src)}")

                def copy_entry(m: _Model) -> None:
                    entry = m.get(src)
                    need(isinstance(entry, str))
                    m.set(dst, entry)
                effects.append(copy_entry)
            elif op == "del":
                need(keys)
                k = c.pick(keys)
                lines.append(f"del {_access(t, m, k)}")
                effects.append(lambda m: m.remove(k))
            elif op == "pop":  # a dict's
                need(keys)
                k = c.pick(keys)
                p = fresh("p")
                lines.append(f'{p} = {t}.pop("{k}")')
                effects.append(lambda m: m.remove(k))
                out.append(p)
            elif op == "inplace":  # an entry written in place (the tensor, not the container)
                need(tensor_keys)
                k = c.pick(tensor_keys)
                lines.append(f"{_access(t, m, k)}.add_({c.pick([1, 3])})")
                effects.append(lambda m: need(isinstance(m.get(k), str)))
            elif op in ("setdefault_existing", "setdefault_new"):
                k = c.pick(tensor_keys) if op == "setdefault_existing" and tensor_keys else fresh("k")
                v = value(m, t, place)
                p = fresh("p")
                lines.append(f'{p} = {t}.setdefault("{k}", {v})')

                def setdefault(m: _Model) -> None:
                    try:
                        need(isinstance(m.get(k), str))
                    except _Invalid:
                        m.set(k, v)
                effects.append(setdefault)
                out.append(p)
            elif op == "popitem":
                need(keys)
                last = m.flavor != "OrderedDict" or c.flag(0.5)
                p = fresh("p")
                lines.append(f"_, {p} = {t}.popitem()" if last else f"_, {p} = {t}.popitem(last=False)")

                def popitem(m: _Model) -> None:
                    need(m.items)
                    m.items.pop(-1 if last else 0)
                effects.append(popitem)
                out.append(p)
            elif op == "move_to_end":
                need(keys)
                k = c.pick(keys)
                last = c.flag(0.5)
                lines.append(f'{t}.move_to_end("{k}")' if last else f'{t}.move_to_end("{k}", last=False)')

                def move(m: _Model) -> None:
                    entry = m.remove(k)
                    m.items.insert(len(m.items) if last else 0, [k, entry])
                effects.append(move)
            elif op == "default_append":  # a missing key of a defaultdict(list): the list made, appended to
                k = fresh("k")
                v = value(m, t, place)
                lines.append(f'{t}["{k}"].append({v})')

                def default_append(m: _Model) -> None:
                    try:
                        entry = m.get(k)
                    except _Invalid:
                        entry = _Model("list", [])
                        m.set(k, entry)
                    need(isinstance(entry, _Model))
                    entry.items.append(v)
                effects.append(default_append)
        except _Invalid:
            return None
        # the lines run once (before or after the steps) or once per step: every run must be valid
        trial = copy.deepcopy(model)
        trial_m = trial if m is model else trial.inner()
        try:
            for _ in range(steps if place == "inside" else 1):
                for effect in effects:
                    effect(trial_m)
        except _Invalid:
            return None
        model.items = trial.items
        tags.append(f"container:{op}")
        returned.extend(out)
        return lines

    if kind not in ("tuple", "namedtuple") and c.flag(0.7):
        # in the order they run; at most one in the steps (its runs are simulated step by step)
        places = [c.pick(["before", "inside", "after", "after"]) for _ in range(c.integer(1, 3))]
        places = [p if p != "inside" or places.index("inside") == i else "after" for i, p in enumerate(places)]
        places.sort(key=["before", "inside", "after"].index)
        for place in places:
            lines = mutation(place)
            if lines is None:
                continue
            tags.append("container:mutated")
            tags.append(f"container:mutated {place} the steps" if place != "inside" else "container:mutated in each step")
            {"before": head, "inside": inside, "after": tail}[place].extend(lines)
    # reads after the mutations reach the outputs; the container itself sometimes does
    for _ in range(c.integer(0, 2)):
        if model.tensor_keys():
            e = fresh("e")
            key = c.pick(model.tensor_keys())
            tail.append(f"{e} = {target}.{fields[key]}" if kind == "namedtuple" and c.flag(0.5) else f"{e} = {_access(target, model, key)}")
            returned.append(e)
    if c.flag(0.4):
        returned.append(target)
        tags.append("container:returned by the loop")
    tensors.extend(added)
    return _Box(seed_lines, loop_params, new_params, containers, prelude, head, inside, tail, returned)


# --------------------------------------------------------------------------------------------------
# Oracles.


class CaptureUnsupported(Exception):
    """Dynamo cannot capture the composition in one graph: not a draftfuse matter."""


def composed(seed: Callable, loop: Callable, value_ranges: dict):
    """seed and loop composed as fold() composes them (seam marker with the facts; the seed's own objects
    put back into its lists and dicts after the loop; loop(*carried) for a tuple, loop(carried) else), by
    keyword."""
    from draftfuse.passes.seed_fold import seam_facts
    from draftfuse.passes.seed_fold.seam import mark_seam_undoable, unmark_seam

    facts = seam_facts(value_ranges=value_ranges)

    def draft(**kwargs):
        carried, undo = mark_seam_undoable(seed(**kwargs), facts)
        out = loop(*carried) if isinstance(carried, tuple) else loop(carried)
        unmark_seam(undo)
        return out

    return draft


def plain(seed: Callable, loop: Callable) -> Callable:
    """`loop(*seed(...))` (loop(seed(...)) where the seed returns no tuple, as fold() calls it), by keyword."""

    def draft(**kwargs):
        carried = seed(**kwargs)
        return loop(*carried) if isinstance(carried, tuple) else loop(carried)

    return draft


def _eager(program: SeedFoldProgram):
    seed, loop = program.functions()
    kwargs = program.kwargs()
    torch.manual_seed(program.rng_seed)
    with quiet():
        out = plain(seed, loop)(**kwargs)
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
        if isinstance(want_inputs[name], torch.Tensor) and not same_tensor(want_inputs[name], got_inputs[name]):
            raise Failure("input contents differ", f"{name}: {got_inputs[name].tolist()} vs eager {want_inputs[name].tolist()}", oracle)
    # the caller's containers after the call: the same type, keys (in order) or length, tensor values
    for name in program.params:
        if not isinstance(want_inputs[name], torch.Tensor):
            difference = _container_difference(want_inputs[name], got_inputs[name], name)
            if difference:
                raise Failure("caller's container differs", difference, oracle)
    # the outputs' containers (a list or dict the loop returns): the same structure; the caller's own
    # object where eager returns the caller's object
    callers = {id(v): n for n, v in want_inputs.items() if not isinstance(v, torch.Tensor)}
    difference = _container_difference(want, got, "output", callers, got_inputs)
    if difference:
        raise Failure("output containers differ", difference, oracle)


def _container_difference(want: Any, got: Any, path: str, callers: dict | None = None, got_inputs: dict | None = None) -> str | None:
    """Where `got` differs from `want` (containers of tensors): type, keys/length, a tensor's values; and,
    given `callers` (id of a caller's container in eager -> its argument), an output that is the caller's
    object in eager must be the caller's object (got_inputs[argument]) too. None if they agree."""
    if callers and id(want) in callers and got is not got_inputs[callers[id(want)]]:
        return f"{path}: eager returns the caller's `{callers[id(want)]}` itself, this run another {type(got).__name__}"
    if isinstance(want, torch.Tensor):
        if not same_tensor(want, got):
            describe = (lambda t: f"{t.dtype} {t.tolist()}") if isinstance(got, torch.Tensor) else repr
            return f"{path}: {describe(got)} vs eager {describe(want)}"
        return None
    if not isinstance(want, (list, tuple, dict)):
        return None if type(want) is type(got) and want == got else f"{path}: {got!r} vs eager {want!r}"
    # (a namedtuple's class is made again by each run of the program's source: compared by name and fields)
    kind = lambda v: (type(v).__qualname__, getattr(type(v), "_fields", None), getattr(v, "default_factory", None))  # noqa: E731
    if kind(want) != kind(got):
        return f"{path}: a {type(got).__qualname__} vs eager's {type(want).__qualname__}"
    if isinstance(want, dict):
        if list(want) != list(got):
            return f"{path}: keys {list(got)} vs eager {list(want)}"
        pairs = [(f"{path}[{k!r}]", want[k], got[k]) for k in want]
    else:
        if len(want) != len(got):
            return f"{path}: length {len(got)} vs eager {len(want)}"
        pairs = [(f"{path}[{i}]", w, g) for i, (w, g) in enumerate(zip(want, got))]
    for where, w, g in pairs:
        difference = _container_difference(w, g, where, callers, got_inputs)
        if difference:
            return difference
    return None


def _traced_error(error: BaseException) -> str:
    """The exception the traced code raised, as Dynamo's message names it ('raised exception
    IndexError(...)'), or the error's own first line."""
    for line in str(error).splitlines():
        if "raised exception" in line:
            return line.strip()[:300]
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else describe_exception(error)


def _draftfuse_line(error: BaseException) -> str | None:
    """file:function of draftfuse's code where the traced draft raised (Dynamo's 'Observed exception' names
    the user code it traced: the innermost frame of its real_stack; draftfuse's DraftCaptureError names it
    in `where`), following causes; None if the innermost frame is not draftfuse's (the program's own code,
    Dynamo's limits)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        stack = getattr(error, "real_stack", None)
        if stack:
            frame = stack[-1]
            if "/draftfuse/" in frame.filename and not frame.filename.endswith("/draftfuse/testing.py"):
                return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
        where = getattr(error, "where", None)
        if isinstance(where, str) and "/draftfuse/" in where and "/draftfuse/testing.py" not in where:
            return where.rsplit("/", 1)[-1]
        error = error.__cause__ or error.__context__
    return None


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
        if _draftfuse_line(error):  # the traced draft raised in draftfuse's code (the seam), where eager runs
            raise Failure(f"traced draft raises ({_draftfuse_line(error)})", _traced_error(error), "pass") from error
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
        if _draftfuse_line(error):  # the traced draft raised in draftfuse's code (the seam), where eager runs
            raise Failure(f"traced draft raises ({_draftfuse_line(error)})", _traced_error(error), "pipeline") from error
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

    if not aot_control(plain(seed, loop), lambda: ((), program.kwargs()), check, program.rng_seed):
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
            control = draft_graphs(plain(seed, loop), options={"seed_fold": False, "softmax_topk": False}, **kwargs)
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
        compiled = torch.compile(plain(seed, loop), backend="inductor", options={"fallback_random": True})
        kwargs = program.kwargs()
        torch.manual_seed(program.rng_seed)
        with quiet():
            return compiled(**kwargs), kwargs

    want, want_inputs = _eager(program)
    try:
        got, got_inputs = run({"fallback_random": True})
    except Exception as error:
        if _draftfuse_line(error):  # the traced draft raised in draftfuse's code (the seam), where eager runs
            raise Failure(f"traced draft raises ({_draftfuse_line(error)})", _traced_error(error), "fold") from error
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
