"""The loop both selection passes run over a graph (softmax_topk, vocab_parallel): each selection in
graph order is matched, then rewritten in place, or refused with a reason; the pass says what a match
is and how to apply it.

A refusal (`Refuse`, raised by a match or an apply) is reported with its reason. Any other exception is
a bug of ours: logged, reported as an internal error, never raised, and the graph stays as it was at
that selection (an apply that fails undoes what it emitted before it raises). The graph's effects
(graph/effects.py) are read again after each rewrite, since the next match must see the rewritten
graph. draftfuse's own selections (argmax_prob, topk_prob) are selected already and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from draftfuse.graph.effects import Effects
from draftfuse.graph.selection import Selection, as_selection
from draftfuse.graph.values import Node
from draftfuse.passes.report import PassReport, Rewrite

OWN_KINDS = ("argmax_prob", "topk_prob")


class Refuse(Exception):
    """A near-match that must not be rewritten; the message is the reason."""


def rewrite_selections(
    graph: torch.fx.Graph,
    report: PassReport,
    logger: logging.Logger,
    match: Callable[[Selection, Effects], Any],
    apply: Callable[[Selection, Any, set[Node]], Rewrite],
) -> None:
    """For each selection of `graph` not erased by an earlier rewrite: `match(sel, effects)` is its match
    or None; `apply(sel, m, erased)` rewrites it, adds the nodes it erases to `erased` and returns the
    Rewrite (see the module docstring for refusals and errors)."""
    erased: set[Node] = set()
    effects = Effects(graph)
    for node in list(graph.nodes):
        sel = as_selection(node) if node not in erased else None
        if sel is None or sel.kind in OWN_KINDS:
            continue
        try:
            m = match(sel, effects)
            if m is None:
                continue
            rewrite = apply(sel, m, erased)
        except Refuse as refusal:
            report.refuse(node, str(refusal))
            continue
        except Exception as error:  # a bug of ours: refuse, never break the compile
            logger.warning("%s: internal error on %s", report.pass_name, node.name, exc_info=True)
            report.refuse(node, f"internal error: {error!r}")
            continue
        report.rewrites.append(rewrite)
        effects = Effects(graph)
