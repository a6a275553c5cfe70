"""The pass: for each selection, in graph order (passes/driver.py), match (match.py), emit (emit.py)
right after the collective (where the original read the shards), point the selection's readers at
the new nodes, erase the pattern one node at a time (Dynamo graphs are not functional), report.

Every rank must make the same decision, or the ranks would run different collectives: each decision
depends on the graph and the group's size only, which SPMD code shares; this rank's number enters
only a padded vocabulary's mask (a constant of the emitted graph, not a decision).
"""

from __future__ import annotations

import logging

import torch
from torch._dynamo.utils import counters

from draftfuse.graph.selection import Selection, readers, rewire_readers
from draftfuse.graph.values import Node, erase_emitted, erase_unused, level as graph_level, user_location
from draftfuse.passes.driver import rewrite_selections
from draftfuse.passes.report import PassReport, Rewrite
from draftfuse.passes.vocab_parallel.emit import PASS_NAME, AtenVocabEmitter, TorchVocabEmitter, emit_selection
from draftfuse.passes.vocab_parallel.match import VocabMatch, is_gather_node, match

log = logging.getLogger("draftfuse.passes.vocab_parallel")


def has_gather(graph: torch.fx.Graph) -> bool:
    """Whether anything in the graph may gather (the pass has nothing to do otherwise)."""
    return any(is_gather_node(node) for node in graph.nodes)


def _apply(vm: VocabMatch, emit, probs: str, lowering: str, erased: set[Node]) -> Rewrite:
    sel = vm.m.selection
    found = readers(sel)  # match checked: getitem 0 (values) or 1 (ids)
    index, value, rule, detail = emit_selection(vm, emit, bool(found[0]), probs, lowering)
    rewire_readers(sel, found, index, value)
    erase_unused([*found[0], *found[1], *reversed(vm.pattern)], erased)
    counters["draftfuse"][f"{PASS_NAME}.{'k1' if vm.m.k == 1 else 'topk'}"] += 1
    names = tuple(n.name for n in vm.pattern if n.op != "placeholder")
    return Rewrite(rule, names, detail, user_location(sel.node))


def _apply_or_undo(vm: VocabMatch, emit, probs: str, lowering: str, erased: set[Node]) -> Rewrite:
    """_apply; on failure the new nodes (all after the anchor, in order) are erased and it raises."""
    anchor = emit.cursor
    try:
        return _apply(vm, emit, probs, lowering, erased)
    except Exception:
        erase_emitted(anchor, emit.cursor)
        raise


def rewrite_graph(graph: torch.fx.Graph, *, probs: str = "exact", lowering: str = "torch", half_probs: str = "rewrite") -> PassReport:
    """Localise every all_gather -> softmax -> selection of `graph` in place and report; never raises
    on a graph (options: checked by the caller)."""
    report = PassReport(PASS_NAME)
    if not has_gather(graph):
        return report
    level = graph_level(graph)
    emitter_cls = AtenVocabEmitter if level == "aten" else TorchVocabEmitter

    def apply(sel: Selection, vm: VocabMatch, erased: set[Node]) -> Rewrite:
        return _apply_or_undo(vm, emitter_cls(origin=sel.node, cursor=vm.gather.anchor), probs, lowering, erased)

    rewrite_selections(graph, report, log, lambda sel, effects: match(sel, level, effects, half_probs), apply)
    if level == "aten" and report.rewrites:
        graph.eliminate_dead_code()
    if report.rewrites:
        report.notes.append("each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)")
    return report
