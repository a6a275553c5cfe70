"""draftfuse's passes on Inductor's post-grad graph, as one `CustomGraphPass` for
`post_grad_custom_pre_pass`.

The post-grad graph is ATen, decomposed and functional (after AOT autograd): the softmax -> topk rewrite
catches selections that only appear after decomposition there, and setup merging (common
subexpressions and proven-equal index arithmetic) is sound there by construction, since no node writes
what another reads. The passes run in that order, each reporting into `reports`.

The uuid covers the source of every file that decides what the passes do (passes, graph facts, the
selection kernels' limits) and every option, so Inductor's FX graph cache keys on them; on a cache hit
Inductor does not call the pass at all, and `reports` stays empty (the compiled code is the one the
passes produced before).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from draftfuse.options import Options
from draftfuse.passes.merge_setup import merge_setup
from draftfuse.passes.report import PassReport
from draftfuse.passes.softmax_topk.rewrite import PASS_NAME as SOFTMAX_TOPK
from draftfuse.passes.softmax_topk.rewrite import rewrite_graph as rewrite_softmax_topk
from draftfuse.passes.vocab_parallel import cache_key as vocab_parallel_key
from draftfuse.passes.vocab_parallel import post_grad_pass as vocab_parallel_pass

log = logging.getLogger(__name__)
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent


def _source_files() -> list[str]:
    """Every source file that decides what the passes emit: the passes, the graph facts, the selection
    kernels' limits (lowering="auto" asks them) and the options."""
    files = sorted(str(p) for folder in ("passes", "graph") for p in (_PACKAGE / folder).rglob("*.py"))
    return files + [str(_PACKAGE / "kernels" / "selection.py"), str(_PACKAGE / "options.py")]


@functools.cache
def source_hash() -> bytes:
    return get_hash_for_files(tuple(_source_files()))


def _differentiated() -> bool:
    """Whether the graph being compiled is part of one autograd differentiates (an output, or an input it
    writes, requires grad), from AOT autograd's metadata: its fake tensors carry no requires_grad."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is None:
        return False
    written = [i for i in meta.input_info if getattr(i, "mutates_data", False)]
    return any(getattr(info, "requires_grad", False) for info in [*meta.output_info, *written])


_EXACT_NOTE = 'probs="ones" gives the exact values here: autograd differentiates this graph (an output, or an input it writes, requires grad)'


class PostGradPass(CustomGraphPass):
    """The post-grad passes that `options` turns on; see the module docstring."""

    def __init__(
        self, options: Options, user_pass: Callable[[torch.fx.Graph], None] | None = None, input_names: list[str] | None = None
    ) -> None:
        self.options = options
        self.user_pass = user_pass  # a user's own post_grad_custom_pre_pass, run first
        self.input_names = input_names  # the Dynamo graph's input names, for reports (not part of the uuid)
        self.reports: list[PassReport] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        log.info("draftfuse post-grad passes, graph before:\n%s", graph)
        options = self.options
        # AOT's forward graph of a compile autograd differentiates: values it saves for the backward must be exact
        exact_only = options.probs == "ones" and _differentiated()
        if exact_only:
            options = dataclasses.replace(options, probs="exact")
        first = len(self.reports)
        if options.vocab_parallel and (report := vocab_parallel_pass(graph, options)) is not None:
            self.reports.append(report)  # before softmax_topk, which would rewrite the gathered selection in place
        if options.softmax_topk:
            report = rewrite_softmax_topk(graph, probs=options.probs, lowering=options.lowering, half_probs=options.half_probs)
            report.pass_name = f"{SOFTMAX_TOPK} (post-grad)"
            self.reports.append(report)
        if exact_only:
            for report in self.reports[first:]:
                report.notes.append(_EXACT_NOTE)
        if options.seed_fold:
            self.reports.append(merge_setup(graph, self.input_names))
        graph.lint()
        for report in self.reports:
            log.info("%s", report)
        log.info("draftfuse post-grad passes, graph after:\n%s", graph)

    def uuid(self) -> Any:
        # A user pass without a uuid cannot be keyed; None makes Inductor bypass the FX graph cache.
        user_uuid = None
        if self.user_pass is not None:
            user_uuid = self.user_pass.uuid() if hasattr(self.user_pass, "uuid") else None
            if user_uuid is None:
                return None
        ranks = vocab_parallel_key() if self.options.vocab_parallel else None  # a padded vocabulary's mask holds the rank
        return (source_hash(), self.options.pass_key(), user_uuid, ranks)
