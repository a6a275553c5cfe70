"""`draftfuse.explain(fn, *args, **kwargs)`: what draftfuse would do to a draft, and what would stop it.

    print(draftfuse.explain(draft, head, token, hidden, pos, steps=3))
    print(draftfuse.explain(draft, head, token, hidden, pos).format(graphs=True))   # graphs and diffs too
    python -m draftfuse explain [--graphs] examples/eagle_head.py

It traces `fn(*args, **kwargs)` as `draft_loop` does (a copy of its code, fullgraph, without grad, static
shapes), runs the pipeline's prepare step on the graph with the draft's options (a draft_loop's or
fold's own; the defaults for a plain function: the seed fold, then softmax -> topk) and the capture
checks `draft_loop` runs, and stops there: nothing of the draft runs and nothing is compiled further.
The summary leads with the verdict (one captured region or not), then each rewrite and refusal by the
user's source line with its reason, the inputs written in place, and everything that would keep the
draft from being one captured region (host syncs, CPU inputs, dynamic shapes, or the graph break, host
read or error that ends the trace: the first one, as `draft_loop` raises it, with the same class, line
and fix; the passes then report on the graph before it), each with file:line and the fix;
`format(graphs=True)` adds the graph as traced and each pass's diff.

Limits: it reports the first thing that ends the trace (fix it and explain again); where the draft's
first traced op comes after a graph break, what precedes it runs (to trace the graph after the break).
Dynamo's caches of other functions are left as they are. The post-grad passes (softmax -> topk after
decomposition, setup merging) need a real compile: their reports are in a draft_loop's
`compiles[i].reports` after its first call.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from draftfuse.runtime import checks
from draftfuse.runtime.fold import as_compiled
from draftfuse.runtime.tracing import _Captured, trace_as_draft_loop, trace_before_break
from draftfuse.runtime.errors import DraftCaptureError
from draftfuse.runtime.pipeline import Prepared, prepare
from draftfuse.testing import graph_text

_NOT_STATIC = (
    "not static: @draft_loop marks it static for you; with torch.compile alone, CUDA graphs skip the draft "
    "unless you mark it (torch._dynamo.mark_static_address) or make it a module buffer"
)


@dataclasses.dataclass
class GraphExplanation:
    """One Dynamo graph of the draft: the passes run on it and what would stop it being captured."""

    prepared: Prepared
    obstacles: list[DraftCaptureError]
    written_inputs: list[checks.WrittenInput]


@dataclasses.dataclass
class Explanation:
    """What `explain` found; str() is the summary for a person, `format(graphs=True)` adds the graphs."""

    draft: str  # the function's name and file:line
    graphs: list[GraphExplanation]
    graph_breaks: list[DraftCaptureError]  # what ended the trace (a graph break, a host read, an error), if anything

    @property
    def obstacles(self) -> list[DraftCaptureError]:
        """Everything that keeps the draft from being one captured region, graph breaks first."""
        return self.graph_breaks + [o for g in self.graphs for o in g.obstacles]

    @property
    def one_region(self) -> bool:
        return len(self.graphs) == 1 and not self.obstacles

    def format(self, *, graphs: bool = False) -> str:
        verdict = "one captured region" if self.one_region else "NOT one captured region"
        if not self.graphs and not self.obstacles:
            verdict = "nothing to capture (Dynamo traced no tensor op)"
        lines = [f"draftfuse.explain: {self.draft}", f"verdict: {verdict} ({len(self.graphs)} Dynamo graph(s), {len(self.graph_breaks)} graph break(s))"]
        if self.obstacles:
            lines += ["", "what keeps it from being one captured region:"]
            lines += [f"  {type(o).__name__}: {_indent(str(o))}" for o in self.obstacles]
        for number, graph in enumerate(self.graphs, 1):
            header = f"graph {number} of {len(self.graphs)}" if len(self.graphs) > 1 else "the graph"
            lines += ["", f"what draftfuse does to {header}:"]
            for report in graph.prepared.reports:
                lines += ["  " + line for line in report.format().splitlines()]
            for written in graph.written_inputs:
                where = written.where or "an unknown line"
                lines.append(f"  writes input {written.name!r} in place at {where}: {'static, fine' if written.static else _NOT_STATIC}")
        if graphs:
            for number, graph in enumerate(self.graphs, 1):
                before = _code(graph.prepared.traced)
                lines += ["", f"== graph {number}, as Dynamo traced it", before]
                lines += ["", f"== graph {number} after draftfuse's passes (diff)"]
                lines += _diff(before, _code(graph.prepared.graph_module)) or ["(unchanged)"]
        return short_path_all("\n".join(lines))

    def __str__(self) -> str:
        return self.format()


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
    """Trace `fn(*args, **kwargs)`, run draftfuse's passes and capture checks on its graphs, and report
    (see the module docstring)."""
    name = _describe_function(fn)
    fn, options, dynamic, args = as_compiled(fn, args)
    graphs: list[GraphExplanation] = []

    def probe(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        prepared = prepare(gm, options)
        found = checks.obstacles(prepared.graph_module, allow_dynamic=dynamic is True)
        graphs.append(GraphExplanation(prepared, found, checks.written_inputs(prepared.graph_module)))
        raise _Captured  # the draft does not run

    try:
        trace_as_draft_loop(fn, probe, args, kwargs, dynamic)
    except DraftCaptureError as error:
        if not graphs:  # the graph before the obstacle, for its rewrites and written inputs
            trace_before_break(fn, dynamic, args, kwargs, probe)
        return Explanation(name, graphs, [error])
    return Explanation(name, graphs, [])


def _describe_function(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return f"{name} ({inspect.getsourcefile(fn) or ''}:{inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError):
        return name


def _indent(text: str) -> str:
    return text.replace("\n", "\n    ")


def _code(gm: torch.fx.GraphModule) -> str:
    return graph_text(gm).strip("\n")


def _diff(before: str, after: str) -> list[str]:
    return list(difflib.unified_diff(before.splitlines(), after.splitlines(), "before", "after", n=1, lineterm=""))


def short_path_all(text: str) -> str:
    """Paths under the working directory, relative to it, wherever they appear in `text`."""
    return text.replace(os.getcwd() + os.sep, "")
