"""Setup merging: what a draft computes twice is computed once, on the post-grad (functional) graph.

A folded draft computes its setup on both sides of the old seam (positions, masks, attention metadata)
and in every iteration. This pass, run by draftfuse's post-grad pass on every graph:

  * merges identical computations: the same op on the same values with the same constants, when it
    neither writes nor draws random numbers (common-subexpression elimination);
  * merges integer index arithmetic that draftfuse.passes.prove proves equal for every value the
    ranges allow: `clamp(seq_lens - 1, min=0)` and `seq_lens - 1` once `seq_lens >= 1` is declared
    (fold(value_ranges=...)), `topk(...).indices.clamp(max=vocab - 1)` and the indices, a clamp of a
    symbolic size the ShapeEnv bounds. What cannot be proven stays, and the report says why when the
    two sides look related (one is the other clamped or offset).

Why here: the graph is functional after AOT autograd, so a value never changes after it is computed,
and merging two nodes needs little reasoning about writes (the only writes are the copies into
mutated inputs at the end, which the effects model sees: an input they overwrite is not kept for a
computation read after them). Each node carries its dtype, which the
proofs need. Two merged nodes must not both reach the outputs (or one an output and the other an
input): the caller would get one tensor where it had two.
"""

from __future__ import annotations

import collections
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._sympy.functions import FloorDiv, Max, Min, PythonMod
from torch.utils._sympy.value_ranges import ValueRanges

from draftfuse.graph.effects import Effects
from draftfuse.graph.values import Node, fake, user_code, user_location
from draftfuse.passes.prove import Expressions, ProofError, prove_equal
from draftfuse.passes.report import PassReport, Rewrite
from draftfuse.passes.seed_fold.seam import is_assume_range

PASS_NAME = "merge_setup"
_MAX_ROUNDS = 4


class _Unkeyable(Exception):
    pass


_CONSTANTS = (bool, int, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _freeze(a: Any) -> Any:
    if isinstance(a, Node):
        return ("node", a)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_freeze(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in a.items())))
    if isinstance(a, float):
        return ("float", a.hex())  # 0.0 == -0.0, yet they are different constants
    if isinstance(a, slice):
        return ("slice", _freeze(a.start), _freeze(a.stop), _freeze(a.step))
    if a is None or a is Ellipsis or isinstance(a, _CONSTANTS):
        return (type(a).__name__, a)
    raise _Unkeyable(type(a).__name__)


def _signature(value: Any) -> tuple:
    return tuple(
        (v.dtype, v.device, tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.requires_grad)
        if isinstance(v, torch.Tensor) else repr(type(v))
        for v in tree_leaves(value)
    )  # fmt: skip


def _key(node: Node) -> tuple:
    """What a node computes: its call, its arguments, and its result's metadata (dtype, layout)."""
    return (node.op, node.target, _freeze(node.args), _freeze(dict(node.kwargs)), _signature(fake(node)))


def _mergeable(node: Node, effects: Effects) -> bool:
    return effects.is_pure(node) and bool(node.users)


def _merge(kept: Node, twin: Node, effects: Effects) -> bool:
    """Point twin's readers at kept; False (nothing done) when the caller would get one tensor where it
    had two, when something writes what either reads in between, or when something writes kept's memory
    before one of twin's readers reads it (an input the graph's last copies overwrite: a reader after
    them would read the new value where twin held the old)."""
    if effects.would_alias(twin, kept):
        return False
    if effects.writers([*kept.all_input_nodes, *twin.all_input_nodes, kept], kept, twin):
        return False
    if effects.writers([kept], twin, max(effects.order[user] for user in twin.users)):
        return False
    twin.replace_all_uses_with(kept)
    twin.graph.erase_node(twin)
    return True


def _merge_identical(graph: torch.fx.Graph, report: PassReport) -> bool:
    effects, changed = Effects(graph), False
    seen: dict[tuple, Node] = {}
    merged: dict[str, list[str]] = collections.defaultdict(list)
    for node in list(graph.nodes):
        if not _mergeable(node, effects):
            continue
        try:
            key = _key(node)
        except _Unkeyable:
            continue
        kept = seen.setdefault(key, node)
        if kept is not node and _merge(kept, node, effects):
            merged[user_location(node) or user_location(kept)].append(node.name)
            changed = True
    for where, names in merged.items():
        report.rewrites.append(Rewrite("setup merged (identical)", tuple(names), f"{len(names)} computed again", where))
    return changed


def take_assumed_ranges(graph: torch.fx.Graph, report: PassReport) -> tuple[dict[Node, ValueRanges], dict[Node, str]]:
    """The ranges `draftfuse::assume_range` nodes declare, and the argument names, by the node they
    wrap; the markers are removed."""
    assumed: dict[Node, ValueRanges] = {}
    names: dict[Node, str] = {}
    for node in [n for n in graph.nodes if is_assume_range(n)]:
        source, low, high, name = node.args[:4]
        assumed[source] = ValueRanges(-sympy.oo if low is None else low, sympy.oo if high is None else high)
        names[source] = name
        node.replace_all_uses_with(source)
        graph.erase_node(node)
    if assumed:
        declared = ", ".join(f"{names[n]} in [{r.lower}, {r.upper}]" for n, r in assumed.items())
        report.notes.append(f"declared ranges: {declared}")
    return assumed, names


def _related(expr: sympy.Expr, other: sympy.Expr, equal: bool | None, diff: sympy.Expr) -> bool:
    """Whether one side is the other offset by a constant, or the other clamped (max/min/mod/div of it):
    the mismatches worth a line in the report, unlike any two expressions that share a symbol (or an
    input compared with itself offset)."""
    if equal is False:
        return diff.is_number and not (expr.is_Symbol or other.is_Symbol)

    def decided_from(outer: sympy.Expr, inner: sympy.Expr) -> bool:
        return isinstance(outer, (Max, Min, PythonMod, FloorDiv, sympy.Max, sympy.Min)) and inner in outer.args

    return decided_from(expr, other) or decided_from(other, expr)


def _given(expr: sympy.Expr, exprs: Expressions, only: set | None = None) -> str:
    symbols = [s for s in sorted(expr.free_symbols, key=str) if s in exprs.ranges and (only is None or s in only)]
    known = [f"{_name(s, exprs)} in [{exprs.ranges[s].lower}, {exprs.ranges[s].upper}]" for s in symbols]
    return f" given {', '.join(known)}" if known else ""


def _name(symbol: sympy.Symbol, exprs: Expressions) -> str:
    node = exprs.leaf_nodes.get(symbol)
    return exprs.names.get(node, str(symbol))


def _show(expr: sympy.Expr, exprs: Expressions) -> str:
    names = {s: sympy.Symbol(_name(s, exprs), integer=True) for s in expr.free_symbols if s in exprs.leaf_nodes}
    return str(expr.subs(names, simultaneous=True))


def _hint(expr: sympy.Expr, exprs: Expressions) -> str:
    inputs = [exprs.leaf_nodes[s] for s in sorted(expr.free_symbols, key=str) if s in exprs.leaf_nodes]
    names = ", ".join(f"{exprs.names.get(n, n.name)!r}: (low, high)" for n in inputs if n.op == "placeholder")
    return f"; value_ranges={{{names}}} lets the proof use what the caller knows" if names else ""


def _merge_proven(graph: torch.fx.Graph, assumed: dict[Node, ValueRanges], names: dict[Node, str], report: PassReport) -> bool:
    effects, exprs = Effects(graph), Expressions(graph, assumed)
    exprs.names = names
    groups: dict[tuple, list[tuple[Node, sympy.Expr]]] = collections.defaultdict(list)
    candidates = []
    for node in graph.nodes:
        if node.op not in ("call_function", "placeholder"):
            continue
        expr = exprs.of(node)
        if expr is None:
            continue
        signature = _signature(fake(node))
        groups[signature].append((node, expr))
        if node.op != "placeholder" and exprs.leaf_nodes.get(expr) is not node and _mergeable(node, effects):
            candidates.append((node, expr, signature))
    changed = False
    for node, expr, signature in candidates:
        if node.graph is None or getattr(node, "_erased", False):
            continue
        earlier = [
            (other, other_expr) for other, other_expr in groups[signature]
            if not getattr(other, "_erased", False) and effects.order[other] < effects.order[node]
            and (other.op == "placeholder" or _mergeable(other, effects))
        ]  # fmt: skip
        try:
            outcomes = [(other, other_expr, *prove_equal(expr, other_expr, exprs.ranges)) for other, other_expr in earlier]
        except ProofError as error:
            report.refuse(node, f"kept {_show(expr, exprs)}: sympy could not decide ({error})")
            continue
        proven = next((o for o in outcomes if o[2]), None)
        if proven is not None and _merge(proven[0], node, effects):
            used = [x for x in (expr, proven[1]) if x.free_symbols & exprs.narrowed]
            given = _given(used[0], exprs, exprs.narrowed) if used else ""
            detail = f"{_show(expr, exprs)} == {_show(proven[1], exprs)}{given}"
            report.rewrites.append(Rewrite("setup merged (proven equal)", (proven[0].name, node.name), detail, user_location(node)))
            changed = True
            continue
        _explain_kept(node, expr, outcomes, exprs, report)
    for node, intended in exprs.undecided.items():
        _explain_undecided(node, intended, groups.get(_signature(fake(node)), []), effects, exprs, report)
    return changed


def _explain_undecided(node: Node, intended: sympy.Expr, group: list, effects: Effects, exprs: Expressions, report: PassReport) -> None:
    """A clamp (max, min, division) left undecided because its operand may wrap around: say so when an
    earlier computation is what it would clamp, with what would prove it."""
    for other, other_expr in group:
        if effects.order.get(other, 1 << 62) < effects.order.get(node, 0) and _related(intended, other_expr, None, intended - other_expr):
            code = user_code(other) or other.name
            why = f"its operand may wrap around{_given(intended, exprs)}{_hint(intended, exprs)}"
            reason = f"kept {_show(intended, exprs)} beside {_show(other_expr, exprs)} (from `{code}`): not proven, {why}"
            report.refuse(node, reason)
            return


def _explain_kept(node: Node, expr: sympy.Expr, outcomes: list, exprs: Expressions, report: PassReport) -> None:
    """Say why a computation the seed's side makes too (clamped or offset) was not merged."""
    related = [o for o in outcomes if _related(expr, *o[1:])]
    if related:
        other, other_expr, equal, diff = related[-1]
        why = f"they differ by {_show(diff, exprs)}" if equal is False else f"not proven{_given(expr, exprs)}{_hint(expr, exprs)}"
        code = user_code(other) or other.name
        reason = f"kept {_show(expr, exprs)} beside {_show(other_expr, exprs)} (from `{code}`): {why}"
        report.refuse(node, reason)


def merge_setup(graph: torch.fx.Graph, input_names: list[str] | None = None) -> PassReport:
    """Merge identical and proven-equal setup of a functional (post-grad) graph in place; see the module
    doc. `input_names`: the user's names of the graph's inputs, in order, for the report."""
    report = PassReport(PASS_NAME)
    assumed, names = take_assumed_ranges(graph, report)
    placeholders = graph.find_nodes(op="placeholder")
    if input_names is not None and len(input_names) == len(placeholders):
        names = {**dict(zip(placeholders, input_names)), **names}
    for _ in range(_MAX_ROUNDS):
        changed = _merge_identical(graph, report)
        changed |= _merge_proven(graph, assumed, names, report)
        if not changed:
            break
    report.prune(graph)
    return report
