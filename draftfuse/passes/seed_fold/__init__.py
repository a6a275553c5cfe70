"""Seed fold: make a draft's seed forward iteration 0 of the captured region, and drop what the seam cost.

Servers run a draft's seed forward eagerly and replay a captured graph of the recurrent steps. Once
both are traced as one Dynamo graph (`draftfuse.fold(seed, loop)` marks the old seam with
`draftfuse::seam`, see seam.py), this pass removes what only existed to carry values across the seam:

  * the seam marker itself: the loop reads the seed's values directly, as in `loop(*seed(...))`;
  * placeholder allocations that get filled: `buf = zeros(...); buf.copy_(src)` (also `buf[:] = src`
    and `buf.index_copy_(d, arange(buf.size(d)), src)`) becomes `src`;
  * host round trips whose value comes back: `x.cpu()` ... `.to(x.device)` becomes `x`, and
    `full(shape, x.item())` / `tensor(x.item())` / `scalar_tensor(x.item())` a broadcast of `x` on its device;
  * the seed's writes into caller buffers that only feed the loop, with `drop_buffer_writes=True` (opt
    in: only when nothing reads those buffers after the draft).
It also puts the caller's declared `value_ranges` into the graph (`draftfuse::assume_range` on each
declared input that the draft never writes) for the proofs below.

Where each part lives, and why. The seam cleanup needs the Dynamo graph: the marker, the placeholder
buffers and the host round trips are gone or unrecognisable after AOT autograd (`.item()` becomes an
unbacked symbol, a fill a functional copy). Dynamo graphs are not functional, so each rewrite's
legality is read off draftfuse.graph.effects (cleanup.py says what each checks). Merging setup that
both sides compute (positions, masks, clamps) is common-subexpression elimination: that runs on the
post-grad graph (draftfuse.passes.merge_setup), which is functional, so a value never changes after it
is computed and no write can separate two reads; each node carries its dtype there, and the proofs
of equal index arithmetic (draftfuse.passes.prove) are made on exact integers only where no value can
wrap around in its dtype.

Regions (regions.py): the report names the seed region and the iterations found. A graph with no seam
marker is cleaned up only if its selections form a chain of two or more (a draft loop with its seed
inside, as `@draft_loop` sees it); parallel selections (Medusa heads) or a single one are left alone.
Setup merging runs on every graph the backend compiles: it is sound on any functional graph.

Limits: a host round trip with computation on the host in between, and `.tolist()`, are left alone
(the capture checks then report the sync).
"""

from __future__ import annotations

import torch

from draftfuse.graph.effects import Effects
from draftfuse.passes.report import PassReport, PassResult, run_on_copy
from draftfuse.passes.seed_fold.cleanup import PASS_NAME, declare_ranges, forward_buffers, remove_round_trips, remove_seams
from draftfuse.passes.seed_fold.regions import Regions, find_regions
from draftfuse.passes.seed_fold.seam import ValueRangeSpec, is_seam, mark_seam, read_facts, seam_facts

# Each rewrite can expose work for another (a removed round trip makes a fill's source plain): repeat
# until nothing changes, at most this many times.
_MAX_ROUNDS = 8


def fold_seed(gm: torch.fx.GraphModule, *, value_ranges: ValueRangeSpec | None = None, drop_buffer_writes: bool = False) -> PassResult:
    """Fold the seed into the draft loop of a Dynamo graph (see the module docstring).

    value_ranges: {argument name: (low, high)} (None for unbounded): every element of that argument of
        the draft lies in [low, high]; `a.b` names attribute `b` of argument `a`. Added to what fold()
        declared in the graph's seam marker (the marker's wins for the same name).
    drop_buffer_writes: also drop the seed's full overwrites of caller buffers that the loop reads.

    Returns a new GraphModule (`gm` is untouched) and a report: the seed region, the iterations found,
    what was removed, and what was refused and why. A graph the pass does not understand comes back
    unchanged, with the reason in the report; the pass never raises on a graph.
    """

    def fold(graph: torch.fx.Graph) -> PassReport:
        report = PassReport(PASS_NAME)
        _fold(graph, report, dict(value_ranges or {}), drop_buffer_writes)
        return report

    return run_on_copy(gm, PASS_NAME, fold)


def strip_seams(gm: torch.fx.GraphModule) -> PassResult | None:
    """With the seed fold off: only the seam markers removed (the loop reads the seed's values, as in
    `loop(*seed(...))`; a marker left in would hand it copies); None where the graph has none."""
    if not any(is_seam(n) for n in gm.graph.nodes):
        return None

    def strip(graph: torch.fx.Graph) -> PassReport:
        report = PassReport(PASS_NAME)
        report.notes.append("seed_fold off: the seam markers removed, nothing else")
        remove_seams(graph, Effects(graph), report)
        return report

    return run_on_copy(gm, PASS_NAME, strip)


def _describe(regions: Regions, graph: torch.fx.Graph) -> list[str]:
    seed_nodes = [n for n in graph.nodes if n in regions.seed]
    span = f"{seed_nodes[0].name} .. {seed_nodes[-1].name}" if seed_nodes else "empty"
    seed_selections = ", ".join(n.name for n in regions.seed_selections) or "none"
    loop_selections = ", ".join(n.name for n in regions.loop_selections) or "none"
    return [
        f"seed region: {len(seed_nodes)} nodes ({span}), selections: {seed_selections}",
        f"iterations found: {regions.seed_iterations + regions.loop_iterations} ({regions.seed_iterations} in the "
        f"seed, {regions.loop_iterations} in the loop; loop selections: {loop_selections})",
    ]


def _fold(graph: torch.fx.Graph, report: PassReport, value_ranges: dict, drop_buffer_writes: bool) -> None:
    marked_ranges, marked_drop = read_facts(graph)
    value_ranges |= marked_ranges
    drop_buffer_writes |= marked_drop
    effects = Effects(graph)
    regions = find_regions(graph, effects)
    if regions is None:
        report.notes.append("no seam: no draftfuse::seam marker and no chain of two or more dependent selections; no cleanup")
        if value_ranges:
            declare_ranges(graph, effects, report, value_ranges)
        return
    report.notes += _describe(regions, graph)
    remove_seams(graph, effects, report)
    effects = Effects(graph)  # the markers' readers read the carried values now
    for _ in range(_MAX_ROUNDS):
        round_trips = remove_round_trips(graph, effects, report)
        if round_trips:
            effects = Effects(graph)
        buffers = forward_buffers(graph, effects, regions, report, drop_buffer_writes)
        if buffers:
            effects = Effects(graph)
        if not (round_trips or buffers):
            break
    if value_ranges:  # last: the loop's reads of carried values now read the seed's (and their writes)
        declare_ranges(graph, effects, report, value_ranges)
    report.prune(graph)

__all__ = ["PASS_NAME", "fold_seed", "mark_seam", "seam_facts", "strip_seams"]
