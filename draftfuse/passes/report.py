"""What a pass did to one graph: the rewrites made and the near-matches refused, with reasons.

Reports speak to the user first: each line leads with the user's file:line, then what happened there;
the FX node names behind it are shown on request (`report.format(nodes=True)`), for golden tests and
bug reports.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import torch.fx

from draftfuse.graph.values import user_location


@dataclasses.dataclass(frozen=True)
class Rewrite:
    rule: str  # which rewrite fired, e.g. "softmax+topk(k=1) -> argmax"
    nodes: tuple[str, ...]  # the matched nodes, by name, in graph order
    detail: str = ""  # anything a reader needs: dim, k, value formula, kernel chosen
    where: str = ""  # the user's file:line, when the node carries a stack trace


@dataclasses.dataclass(frozen=True)
class Refusal:
    node: str  # the node that almost matched
    reason: str  # why the graph was left unchanged there
    where: str = ""  # the user's file:line, when the node carries a stack trace


@dataclasses.dataclass
class PassReport:
    pass_name: str
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    refusals: list[Refusal] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def refuse(self, node: torch.fx.Node, reason: str) -> None:
        """Record that `node` was left as it is, and why (with the user's source line)."""
        self.refusals.append(Refusal(node.name, reason, user_location(node)))

    def format(self, *, nodes: bool = False) -> str:
        """The report as text: a count line, then a line per rewrite, refusal and note."""
        lines = [f"[{self.pass_name}] {_count(len(self.rewrites), 'rewrite')}, {_count(len(self.refusals), 'refusal')}"]
        for r in self.rewrites:
            names = f" [{', '.join(r.nodes)}]" if nodes and r.nodes else ""
            lines.append(f"  {_at(r.where)}{r.rule}" + (f" ({r.detail})" if r.detail else "") + names)
        for r in self.refusals:
            names = f" [{r.node}]" if nodes else ""
            lines.append(f"  {_at(r.where)}refused: {r.reason}{names}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format(nodes=True)

    def prune(self, graph: torch.fx.Graph) -> None:
        """Each refusal and note once, and refusals only about nodes still in the graph (a pass that runs
        in rounds revisits what it refused)."""
        alive = {n.name for n in graph.nodes}
        self.refusals[:] = [r for r in dict.fromkeys(self.refusals) if r.node in alive]
        self.notes[:] = list(dict.fromkeys(self.notes))


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _at(where: str) -> str:
    return f"{short_path(where)}: " if where else ""


def short_path(where: str) -> str:
    """A path under the working directory, relative to it (reads better, compares across machines)."""
    cwd = os.getcwd() + os.sep
    return where[len(cwd) :] if where.startswith(cwd) else where


@dataclasses.dataclass
class PassResult:
    """A pass's output: a new GraphModule (the input is left untouched) and its report."""

    graph_module: torch.fx.GraphModule
    report: PassReport


def run_on_copy(gm: torch.fx.GraphModule, pass_name: str, rewrite: Callable[[torch.fx.Graph], PassReport]) -> PassResult:
    """Run `rewrite` (in place, returning its report) on a copy of `gm`'s graph. A pass never breaks a
    compile: if the rewrite or the rewritten graph fails, the graph comes back as it came, and the
    report says so. Logs the graph before and after (INFO on the pass's logger, only when shown)."""
    from draftfuse.graph.values import copy_graph_module, level

    log = logging.getLogger(f"draftfuse.passes.{pass_name}")
    new_gm = copy_graph_module(gm)
    shown = log.isEnabledFor(logging.INFO)  # printing a graph costs more than most passes
    if shown:
        log.info("%s: %s graph before:\n%s", pass_name, level(new_gm.graph), new_gm.print_readable(print_output=False))
    try:
        report = rewrite(new_gm.graph)
        new_gm.graph.lint()
        new_gm.recompile()
    except Exception as error:
        log.warning("%s: internal error, graph left unchanged", pass_name, exc_info=True)
        report = PassReport(pass_name, notes=[f"internal error, graph left unchanged: {error!r}"])
        new_gm = copy_graph_module(gm)
    if shown:
        log.info("%s\ngraph after:\n%s", report, new_gm.print_readable(print_output=False))
    return PassResult(new_gm, report)
