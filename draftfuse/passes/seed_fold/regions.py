"""The seed region and the draft's iterations.

Iterations are counted by chains of dependent selections (topk, argmax/argmin, max/min over a dim,
draftfuse's selection ops): each link is one iteration, so a tree step that selects twice (expand, then
rerank) counts twice. Values also flow through memory: a read of a buffer depends on what was written
there. The seed region is everything before the first seam marker; a graph without a marker has a seed
only if its selections form a chain of two or more (a draft loop with its seed inside, as
`@draft_loop` sees it): everything up to the first selection and its values. Parallel selections
(Medusa heads) or a single one have no seed.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from draftfuse.graph.effects import Effects
from draftfuse.graph.selection import as_selection
from draftfuse.graph.values import Node
from draftfuse.passes.seed_fold.seam import is_seam


@dataclasses.dataclass
class Regions:
    seed: set[Node]  # the seed's nodes; everything else (and every node a rewrite adds) is the loop
    seed_selections: list[Node]
    loop_selections: list[Node]
    seed_iterations: int
    loop_iterations: int


def selection_depths(graph: torch.fx.Graph, effects: Effects) -> dict[Node, int]:
    """For each selection, the number of selections on its longest chain of dependencies, itself included."""
    depth: dict[Node, int] = {}
    written_depth: dict[object, int] = {}
    selections: dict[Node, int] = {}
    for node in graph.nodes:
        reads = [depth.get(a, 0) for a in node.all_input_nodes]
        reads += [written_depth.get(key, 0) for a in node.all_input_nodes for key in effects.memory(a)]
        selects = as_selection(node) is not None
        depth[node] = max(reads, default=0) + selects
        if selects:
            selections[node] = depth[node]
        for key in effects.writes(node):
            written_depth[key] = max(written_depth.get(key, 0), depth[node])
    return selections


def find_regions(graph: torch.fx.Graph, effects: Effects) -> Regions | None:
    depths = selection_depths(graph, effects)
    seam = next((n for n in graph.nodes if is_seam(n)), None)
    if seam is not None:
        boundary = effects.order[seam]
    else:
        chain = sorted(set(depths.values()))
        if len(chain) < 2:
            return None
        first = min((n for n, d in depths.items() if d == chain[0]), key=effects.order.get)
        parts = [u for u in first.users if u.op == "call_function" and u.target is operator.getitem]
        boundary = max(effects.order[n] for n in [first, *parts]) + 1  # the first selection and its values
    seed = {n for n in graph.nodes if effects.order[n] < boundary and n.op not in ("placeholder", "get_attr")}
    seed_selections = [n for n in depths if n in seed]
    loop_selections = [n for n in depths if n not in seed]
    return Regions(
        seed,
        seed_selections,
        loop_selections,
        len({depths[n] for n in seed_selections}),
        len({depths[n] for n in loop_selections}),
    )
