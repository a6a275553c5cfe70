"""`draftfuse.explain(fn, *args, **kwargs)`: what draftfuse would do to a draft, and what would stop it.

    print(draftfuse.explain(draft, head, token, hidden, pos, steps=3))
    python -m draftfuse explain examples/eagle_head.py

It traces `fn(*args, **kwargs)` with Dynamo (through torch._dynamo.explain, so graph breaks are
recorded instead of raised), runs the backend's Dynamo-level passes on every graph with its default
options (the seed fold, then softmax -> topk) without compiling anything further, and
collects:
  * each graph before the passes, each pass's rewrites and refusals (with reasons and file:line), and
    what each pass changed in the graph;
  * everything that keeps the draft from being one captured region: graph breaks, host syncs, CPU
    inputs, dynamic shapes (draftfuse.runtime.capture's checks), each with file:line and the usual fix;
  * the inputs the draft writes in place, and whether they are static (a KV cache must be).

Limits: `fn` runs once (its in-place writes happen, as in any call); like torch._dynamo.explain it
resets Dynamo's caches, so explain a draft before compiling it, not in the middle of serving. The
Inductor-level (post-grad) run of the selection rewrite is not shown: it only acts on selections that
appear after decomposition, and needs a real compile.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._dynamo.testing import normalize_gm

from draftfuse.passes._report import PassReport, PassResult
from draftfuse.passes.seed_fold import fold_seed
from draftfuse.passes.softmax_topk import rewrite_softmax_topk
from draftfuse.runtime import capture
from draftfuse.runtime.backend import DEFAULT_OPTIONS
from draftfuse.runtime.errors import DraftCaptureError, GraphBreakError, HostSyncError

_NOT_STATIC = (
    "not static: @draft_loop marks it static for you; with torch.compile alone, CUDA graphs skip the draft "
    "unless you mark it (torch._dynamo.mark_static_address) or make it a module buffer"
)


@dataclasses.dataclass
class PassStep:
    """One pass on one graph: its report and the graph (as normalised code) before and after."""

    report: PassReport
    graph_before: str
    graph_after: str


@dataclasses.dataclass
class GraphExplanation:
    """One Dynamo graph of the draft: the passes run on it and what would stop it being captured."""

    steps: list[PassStep]
    obstacles: list[DraftCaptureError]
    written_inputs: list[capture.MutatedInput]


@dataclasses.dataclass
class Explanation:
    """What `explain` found; str() is the report for a person."""

    draft: str  # the function's name and file:line
    graphs: list[GraphExplanation]
    graph_breaks: list[DraftCaptureError]

    @property
    def obstacles(self) -> list[DraftCaptureError]:
        """Everything that keeps the draft from being one captured region, graph breaks first."""
        return self.graph_breaks + [o for g in self.graphs for o in g.obstacles]

    @property
    def one_region(self) -> bool:
        return len(self.graphs) == 1 and not self.obstacles

    def __str__(self) -> str:
        verdict = "one captured region" if self.one_region else "NOT one captured region"
        lines = [
            f"draftfuse.explain: {self.draft}",
            f"{len(self.graphs)} Dynamo graph(s), {len(self.graph_breaks)} graph break(s): {verdict}",
        ]
        for number, graph in enumerate(self.graphs, 1):
            lines += ["", f"== graph {number} of {len(self.graphs)}, as Dynamo traced it", graph.steps[0].graph_before]
            for step in graph.steps:
                lines += ["", f"== pass {step.report.pass_name}", str(step.report)]
                lines += _diff(step.graph_before, step.graph_after) or ["(graph unchanged)"]
            for written in graph.written_inputs:
                lines.append(f"writes input {written.name!r} in place at {written.where or 'an unknown line'}")
                lines.append(f"  {'static: fine' if written.static else _NOT_STATIC}")
        lines += ["", "== what keeps the draft from being one captured region"]
        lines += [f"{type(o).__name__}: {o}" for o in self.obstacles] or ["nothing found"]
        return _relative_paths("\n".join(lines))


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
    """Trace `fn(*args, **kwargs)`, run draftfuse's passes on its graphs and report (see the module doc)."""
    traced = torch._dynamo.explain(fn)(*args, **kwargs)
    graphs = [_explain_graph(gm) for gm in traced.graphs]
    breaks = [_break_error(reason) for reason in traced.break_reasons if reason.graph_break]
    return Explanation(_describe_function(fn), graphs, breaks)


# The backend's Dynamo-level pipeline (draftfuse.runtime.backend.compile_graph) with its default options.
_PASSES: list[Callable[[torch.fx.GraphModule], PassResult]] = [
    fold_seed,
    functools.partial(rewrite_softmax_topk, probs=DEFAULT_OPTIONS["probs"], lowering=DEFAULT_OPTIONS["lowering"]),
]


def _explain_graph(gm: torch.fx.GraphModule) -> GraphExplanation:
    # The capture checks read Dynamo's own metadata on the placeholders: run them on the traced graph.
    obstacles = []
    try:
        capture.check_graph(gm, allow_dynamic=False)
    except DraftCaptureError as error:
        obstacles.append(error)
    written = capture.mutated_inputs(gm)
    steps = []
    for run_pass in _PASSES:
        result = run_pass(gm)
        steps.append(PassStep(result.report, _code(gm), _code(result.graph_module)))
        gm = result.graph_module
    return GraphExplanation(steps, obstacles, written)


def _break_error(reason: Any) -> DraftCaptureError:
    """A graph break that Dynamo recorded (a GraphCompileReason), as the error draft_loop would raise."""
    lines = [line.strip() for line in reason.reason.splitlines() if line.strip()]
    frame = reason.user_stack[-1] if reason.user_stack else None
    where = f"{frame.filename}:{frame.lineno}" if frame else ""
    if any(read in lines[0] for read in ("item()", "tolist()", "numpy()", "nonzero")):
        # Not Dynamo's hint (capture_scalar_outputs): a read traced into the graph still syncs with the host.
        fix = "keep the value on the device (tensor ops, not Python numbers), or read it after the draft returns"
        return HostSyncError(f"graph break: {lines[0]}", where=where, fix=fix)
    hint = next((line.removeprefix("Hint:").strip() for line in lines if line.startswith("Hint:")), "")
    fix = hint or "keep the draft traceable here: tensor ops instead of Python control flow on tensor values"
    return GraphBreakError(f"graph break: {lines[0]}", where=where, fix=fix)


def _describe_function(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return f"{name} ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError):
        return name


def _code(gm: torch.fx.GraphModule) -> str:
    return normalize_gm(gm.print_readable(print_output=False)).strip("\n")


def _diff(before: str, after: str) -> list[str]:
    return list(difflib.unified_diff(before.splitlines(), after.splitlines(), "before", "after", n=1, lineterm=""))


def _relative_paths(text: str) -> str:
    # Paths under the working directory read better (and compare across machines) without its prefix.
    return text.replace(os.getcwd() + os.sep, "")
