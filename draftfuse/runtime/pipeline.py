"""The compile pipeline, in two steps that `torch.compile`'s backend, `draft_loop` and `explain` share:

    prepare(gm, options) -> Prepared        draftfuse's passes on the Dynamo graph (seed fold, vocab-
                                            parallel selection, softmax -> topk), each with its report
    lower(prepared, example_inputs, options) -> compiled
                                            Inductor (compile_fx) with `options.inductor` and
                                            draftfuse's post-grad pass (softmax -> topk after
                                            decomposition, setup merging)

`draft_loop` runs its capture checks between the two; `explain` runs prepare and the checks only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.compile_fx import compile_fx

from draftfuse.graph.values import argument_name
from draftfuse.options import Options
from draftfuse.passes.post_grad import PostGradPass
from draftfuse.passes.report import PassReport
from draftfuse.passes.seed_fold import fold_seed, strip_seams
from draftfuse.passes.softmax_topk import rewrite_softmax_topk
from draftfuse.passes.vocab_parallel import dynamo_pass as vocab_parallel_pass
from draftfuse.runtime.errors import DraftCaptureError
from draftfuse.runtime.translate import inference_mode_error, is_inductor_error

log = logging.getLogger("draftfuse")
_POST_GRAD_KEY = "post_grad_custom_pre_pass"


@dataclasses.dataclass
class Prepared:
    """A Dynamo graph after draftfuse's Dynamo-level passes."""

    traced: torch.fx.GraphModule  # as Dynamo handed it over
    graph_module: torch.fx.GraphModule  # after the passes
    reports: list[PassReport]  # one per pass, in pipeline order


@dataclasses.dataclass
class CompileRecord:
    """What the pipeline did with one Dynamo graph: its reports, before and after Inductor's decomposition."""

    prepared: Prepared
    post_grad: PostGradPass | None  # None when no post-grad pass was installed
    config_patches: dict[str, Any]  # what compile_fx was given
    options: Options

    @property
    def reports(self) -> list[PassReport]:
        """Dynamo-level reports, then post-grad ones (none on an FX graph cache hit: the pass did not run)."""
        return self.prepared.reports + (self.post_grad.reports if self.post_grad else [])


def _dynamo_passes(options: Options) -> list[Callable[[torch.fx.GraphModule], Any]]:
    passes: list[Callable[[torch.fx.GraphModule], Any]] = []
    passes.append(fold_seed if options.seed_fold else strip_seams)  # fold's marker goes either way
    if options.vocab_parallel:  # before softmax_topk, which would rewrite the gathered selection in place
        passes.append(lambda gm: vocab_parallel_pass(gm, options))
    if options.softmax_topk:
        passes.append(
            lambda gm: rewrite_softmax_topk(gm, probs=options.probs, lowering=options.lowering, half_probs=options.half_probs)
        )
    return passes


def prepare(gm: torch.fx.GraphModule, options: Options) -> Prepared:
    """Run draftfuse's Dynamo-level passes on a Dynamo graph (each returns a new GraphModule)."""
    if log.isEnabledFor(logging.INFO):
        log.info("draftfuse: Dynamo graph:\n%s", gm.print_readable(print_output=False))
    current, reports = gm, []
    for run_pass in _dynamo_passes(options):
        result = run_pass(current)
        if result is None:  # nothing for this pass in the graph (vocab_parallel without a gather): no report
            continue
        current = result.graph_module
        reports.append(result.report)
    return Prepared(gm, current, reports)


def post_grad_pass(options: Options, gm: torch.fx.GraphModule) -> PostGradPass:
    """draftfuse's post-grad passes for the Dynamo graph `gm`, after the user's own (in the options, or
    Inductor's config)."""
    user_pass = options.inductor.get(_POST_GRAD_KEY, torch._inductor.config.post_grad_custom_pre_pass)
    names = [argument_name(p) for p in gm.graph.find_nodes(op="placeholder")]
    return PostGradPass(options, user_pass=user_pass, input_names=names)


def lower(prepared: Prepared, example_inputs: Sequence[Any], options: Options) -> tuple[Callable[..., Any], CompileRecord]:
    """Compile a prepared graph with Inductor, draftfuse's post-grad pass installed."""
    patches = dict(options.inductor)
    post_grad = None
    if options.post_grad:
        post_grad = post_grad_pass(options, prepared.graph_module)
        patches[_POST_GRAD_KEY] = post_grad
    gm = prepared.graph_module
    if log.isEnabledFor(logging.INFO):
        log.info("draftfuse: graph handed to Inductor (config %s):\n%s", patches, gm.print_readable(print_output=False))
    try:
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    except Exception as exc:
        # AOT autograd, not Inductor, failing on a graph that enters inference mode: torch 2.11's raw error
        # there (a storage's weakref as its message) says nothing a draft's author could act on
        if not isinstance(exc, DraftCaptureError) and not is_inductor_error(exc) and _enters_inference_mode(gm.graph):
            raise inference_mode_error(exc) from exc
        raise
    if post_grad is not None and not patches.get("use_post_grad_passes", torch._inductor.config.use_post_grad_passes):
        log.warning("draftfuse post-grad passes: not run, Inductor's use_post_grad_passes is off (mode='lite' turns it off)")
    elif post_grad is not None and not post_grad.reports:
        log.info("draftfuse post-grad passes: not run, FX graph cache hit")
    return compiled, CompileRecord(prepared, post_grad, patches, options)


def _enters_inference_mode(graph: torch.fx.Graph) -> bool:
    return bool(graph.find_nodes(op="call_function", target=torch.autograd.grad_mode._enter_inference_mode))
