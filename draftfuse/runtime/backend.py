"""The `draftfuse` torch.compile backend: draftfuse's graph passes, then Inductor.

    torch.compile(fn, backend="draftfuse", mode="reduce-overhead")
    torch.compile(fn, backend="draftfuse", options={"probs": "ones", "triton.cudagraphs": True})

Pipeline for each Dynamo graph: the seed fold (when `draftfuse.passes.seed_fold` is installed), the
softmax -> topk rewrite on the Dynamo graph, then `compile_fx` with the same rewrite installed as
Inductor's `post_grad_custom_pre_pass` (it catches selections that only appear after decomposition).

`mode` becomes Inductor settings through `torch._inductor.list_mode_options` (torch passes `mode` to a
non-inductor backend and leaves that to it). `options` mixes draftfuse's own keys with Inductor config
keys; torch.compile refuses `mode` and `options` together, so put the mode's settings in `options`
(`"triton.cudagraphs": True` is what "reduce-overhead" sets). draftfuse's keys:

    "probs":        "exact" (default) or "ones": values of k = 1 selections; "ones" is the constant 1.0
                    that greedy chains use when nothing reads the probabilities (see DESIGN.md).
    "lowering":     "auto" (default), "torch" or "kernels": how the rewritten selection is computed.
                    "auto" takes draftfuse's one-pass selection kernels where they run (CUDA, Triton,
                    fp32/fp16/bf16, k <= 16, last dim) and torch's argmax/topk elsewhere.
    "softmax_topk": True (default); False leaves softmax -> topk alone at both levels.
    "seed_fold":    True (default); False skips the seed fold.

Every other key must name an Inductor config entry (`torch._inductor.list_options()`); anything else
raises ValueError: a misspelt option silently ignored would make a benchmark measure the wrong thing.

A user's own `post_grad_custom_pre_pass` is kept: it runs first, then draftfuse's, in one
CustomGraphPass whose uuid covers both (None, i.e. no FX graph caching, if the user's has none).

Each compile leaves a `CompileRecord` in `compile_records` (the last few, newest last): the graph
Dynamo handed over, each pass report, the post-grad pass and the config given to Inductor.
Logging (`TORCH_LOGS=draftfuse`): the Dynamo graph and the graph handed to Inductor, and each pass
report, at INFO; the passes log their own before/after graphs.

Registered as "draftfuse" twice over, harmlessly: the `torch_dynamo_backends` entry point (the name
works without importing draftfuse) and on import of this module (for a source checkout that is not
installed). torch asserts on a duplicate name, so the import-time registration steps aside when the
name is already taken or the entry point is known to torch's registry.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from draftfuse.passes._report import PassReport
from draftfuse.passes.seed_fold import fold_seed
from draftfuse.passes.softmax_topk import SoftmaxTopkPostGradPass, rewrite_softmax_topk

log = logging.getLogger(__name__)

BACKEND_NAME = "draftfuse"

# draftfuse's own options and their defaults; every other options key goes to Inductor.
DEFAULT_OPTIONS: dict[str, Any] = {"probs": "exact", "lowering": "auto", "softmax_topk": True, "seed_fold": True}
_CHOICES = {"probs": ("exact", "ones"), "lowering": ("torch", "kernels", "auto")}

_POST_GRAD_KEY = "post_grad_custom_pre_pass"


@dataclasses.dataclass
class CompileRecord:
    """What the backend did with one Dynamo graph."""

    dynamo_graph: str  # the graph Dynamo handed over, as readable code
    inductor_graph: str  # the graph handed to Inductor, after the Dynamo-level passes
    reports: list[PassReport]  # Dynamo-level pass reports, in pipeline order
    post_grad_pass: SoftmaxTopkPostGradPass | None  # None when softmax_topk is off
    config_patches: dict[str, Any]  # what compile_fx was given
    draft_options: dict[str, Any]  # draftfuse's options, defaults filled in

    @property
    def post_grad_report(self) -> PassReport | None:
        """The post-grad pass's report; None when the FX graph cache hit (Inductor skips the pass)."""
        return self.post_grad_pass.last_report if self.post_grad_pass else None


# The last few compiles of this process, newest last: for tests, `explain`-style tooling and bug
# reports. Bounded so that a long-running server does not keep every graph's text alive.
compile_records: collections.deque[CompileRecord] = collections.deque(maxlen=32)


@functools.cache
def _inductor_config_names() -> frozenset[str]:
    return frozenset(torch._inductor.config.get_config_copy())  # a full copy costs ~10 ms: once


def split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `options` into draftfuse's options (defaults filled in) and Inductor config patches.

    Raises ValueError on a key that is neither, or on a bad value for a draftfuse key.
    """
    draft_options = dict(DEFAULT_OPTIONS)
    inductor_options: dict[str, Any] = {}
    known_inductor = _inductor_config_names()
    for key, value in (options or {}).items():
        if key in DEFAULT_OPTIONS:
            draft_options[key] = value
        elif key.replace("-", "_") in known_inductor:
            inductor_options[key.replace("-", "_")] = value
        else:
            raise ValueError(
                f"draftfuse: unknown option {key!r}. draftfuse's options are {sorted(DEFAULT_OPTIONS)}; "
                "any other key must be an Inductor config name (see torch._inductor.list_options())"
            )
    for key, choices in _CHOICES.items():
        if draft_options[key] not in choices:
            raise ValueError(f"draftfuse: option {key!r} must be one of {choices}, not {draft_options[key]!r}")
    for key in ("softmax_topk", "seed_fold"):
        if not isinstance(draft_options[key], bool):
            raise ValueError(f"draftfuse: option {key!r} must be True or False, not {draft_options[key]!r}")
    return draft_options, inductor_options


def inductor_config_patches(mode: str | None, inductor_options: dict[str, Any]) -> dict[str, Any]:
    """The Inductor settings of `mode` (as torch.compile's inductor backend applies them), then `options`."""
    patches = dict(torch._inductor.list_mode_options(mode)) if mode and mode != "default" else {}
    patches.update(inductor_options)
    return patches


class _PostGradPasses(CustomGraphPass):
    """The user's post-grad pre pass followed by draftfuse's, as one pass with one cache key."""

    def __init__(self, user_pass: Callable[[torch.fx.Graph], None], draft_pass: CustomGraphPass) -> None:
        self.user_pass = user_pass
        self.draft_pass = draft_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.user_pass(graph)
        self.draft_pass(graph)

    def uuid(self) -> Any:
        # A pass without a uuid cannot be keyed; None makes Inductor bypass the FX graph cache.
        user_uuid = self.user_pass.uuid() if hasattr(self.user_pass, "uuid") else None
        if user_uuid is None:
            return None
        return (user_uuid, self.draft_pass.uuid())


def _carry_dynamo_metadata(source: torch.fx.GraphModule, target: torch.fx.GraphModule) -> None:
    """Give a pass's new GraphModule the Dynamo metadata AOT autograd reads from the original.

    AOT treats a graph as Dynamo's only if it carries `_param_name_to_source` and each placeholder its
    `_dynamo_source`; without them it takes the graph for an export graph and forgets which inputs
    are static (parameters, KV caches marked static), so CUDA graphs would copy the weights on every
    replay and skip on the KV cache write. torch's DDP optimizer carries the same fields for the same
    reason. Passes keep the placeholders and their order, so they are matched by position.
    """
    for attr in ("_param_name_to_source", "_source_to_user_stacks"):
        if hasattr(source, attr):
            setattr(target, attr, getattr(source, attr))
    old = source.graph.find_nodes(op="placeholder")
    new = target.graph.find_nodes(op="placeholder")
    assert len(old) == len(new), "a draftfuse pass changed the graph's inputs"
    for old_node, new_node in zip(old, new):
        if hasattr(old_node, "_dynamo_source"):
            new_node._dynamo_source = old_node._dynamo_source


def _readable(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False)


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    inspect_graph: Callable[[torch.fx.GraphModule], None] | None = None,
) -> tuple[Callable[..., Any], CompileRecord]:
    """Run draftfuse's passes on a Dynamo graph and compile it with Inductor; return it and its record.

    `inspect_graph`, when given, sees the graph after the Dynamo-level passes, just before Inductor:
    draft_loop's capture checks run there, because the seed fold removes host round trips that only
    existed at the old seam. It may raise, or mark placeholders (static inputs).
    """
    draft_options, inductor_options = split_options(options)
    config_patches = inductor_config_patches(mode, inductor_options)
    dynamo_graph = _readable(gm)
    log.info("draftfuse: Dynamo graph:\n%s", dynamo_graph)

    reports: list[PassReport] = []
    passes: list[Callable[[torch.fx.GraphModule], Any]] = []
    if draft_options["seed_fold"]:
        passes.append(fold_seed)
    if draft_options["softmax_topk"]:
        passes.append(
            lambda g: rewrite_softmax_topk(g, probs=draft_options["probs"], lowering=draft_options["lowering"])
        )
    for run_pass in passes:
        result = run_pass(gm)
        _carry_dynamo_metadata(gm, result.graph_module)
        gm = result.graph_module
        reports.append(result.report)  # each pass logs its own report

    post_grad_pass = None
    if draft_options["softmax_topk"]:
        post_grad_pass = SoftmaxTopkPostGradPass(probs=draft_options["probs"], lowering=draft_options["lowering"])
        user_pass = config_patches.get(_POST_GRAD_KEY, torch._inductor.config.post_grad_custom_pre_pass)
        config_patches[_POST_GRAD_KEY] = _PostGradPasses(user_pass, post_grad_pass) if user_pass else post_grad_pass

    if inspect_graph is not None:
        inspect_graph(gm)
    inductor_graph = _readable(gm)
    log.info("draftfuse: graph handed to Inductor (config %s):\n%s", config_patches, inductor_graph)
    compiled = compile_fx(gm, example_inputs, config_patches=config_patches)
    record = CompileRecord(dynamo_graph, inductor_graph, reports, post_grad_pass, config_patches, draft_options)
    if post_grad_pass is not None and post_grad_pass.last_report is None:  # it logs its report when it runs
        log.info("softmax_topk (post-grad): not run, FX graph cache hit")
    compile_records.append(record)
    return compiled, record


def draftfuse_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """torch.compile backend: draftfuse's passes, then Inductor with `mode` and `options` applied."""
    compiled, _ = compile_graph(gm, example_inputs, mode=mode, options=options)
    return compiled


def _register() -> None:
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return  # registered already: a second import, or torch loaded the entry point
    if isinstance(registry._BACKENDS.get(BACKEND_NAME), EntryPoint):
        # torch knows the entry point and registers whatever it loads, possibly this very import:
        # registering here too would trip its duplicate-name assert.
        return
    registry.register_backend(draftfuse_backend, name=BACKEND_NAME)


_register()
