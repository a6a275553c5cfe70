"""What a pass did to one graph: the rewrites made and the near-matches refused, with reasons."""

from __future__ import annotations

import dataclasses

import torch.fx


@dataclasses.dataclass(frozen=True)
class Rewrite:
    rule: str  # which rewrite fired, e.g. "softmax+topk(k=1) -> argmax"
    nodes: tuple[str, ...]  # the matched nodes, by name, in graph order
    detail: str = ""  # anything a reader needs: dim, k, value formula, kernel chosen


@dataclasses.dataclass(frozen=True)
class Refusal:
    node: str  # the selection (or softmax) node that almost matched
    reason: str  # why the graph was left unchanged there
    where: str = ""  # the user's file:line, when the node carries a stack trace


@dataclasses.dataclass
class PassReport:
    pass_name: str
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    refusals: list[Refusal] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"[{self.pass_name}] {len(self.rewrites)} rewrite(s), {len(self.refusals)} refusal(s)"]
        lines += [f"  rewrote {', '.join(r.nodes)}: {r.rule}" + (f" ({r.detail})" if r.detail else "") for r in self.rewrites]
        lines += [f"  refused {r.node}: {r.reason}" + (f" at {r.where}" if r.where else "") for r in self.refusals]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclasses.dataclass
class PassResult:
    """A pass's output: a new GraphModule (the input is left untouched) and its report."""

    graph_module: torch.fx.GraphModule
    report: PassReport


def user_location(node: torch.fx.Node) -> str:
    """The innermost user frame of a node's stack trace, as "file:line" (empty when unknown)."""
    trace = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    if not frames:
        return ""
    # 'File "/path/x.py", line 12, in f' -> /path/x.py:12
    parts = frames[-1].split('"')
    if len(parts) < 3:
        return frames[-1]
    line = parts[2].split(",")[1].strip().removeprefix("line ").strip()
    return f"{parts[1]}:{line}"


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with a fresh copy of `gm`'s graph, sharing its parameters and buffers."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(getattr(gm, "meta", {}))
    return new
