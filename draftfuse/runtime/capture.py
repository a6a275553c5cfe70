"""Checks that a draft is one captured region, and the errors that say why it is not.

A draft pays off only as one Dynamo graph replayed as one CUDA graph. Everything that silently
prevents that becomes a `DraftCaptureError` naming the user's file and line, the cause and the fix:

  * graph breaks: torch.compile(fullgraph=True) raises Dynamo's Unsupported/UserError; translated by
    `capture_error`, with the location from the exception's user stack. Breaks caused by reading a
    tensor on the host (`.item()`, `.tolist()`, `.numpy()`, `nonzero`, in torch versions that break
    on them) are HostSyncErrors.
  * host syncs traced INTO the graph (torch 2.13 traces `.item()` and `nonzero` under fullgraph):
    `check_graph` scans the Dynamo graph for `item`, `tolist`, `cpu`, `numpy`, `nonzero`,
    `aten._local_scalar_dense`, and any copy from an accelerator to the CPU.
  * CUDA-graph skips, checked on the Dynamo graph before Inductor sees it: a CPU tensor input on an
    accelerator draft, a dynamic shape (unless the caller asked for dynamic=True), and inputs written
    in place (`mutated_inputs`; the runtime makes them static or raises). Skips Inductor finds itself
    surface as "skipping cudagraphs due to ..." (with triton.cudagraph_or_error) and are translated.
  * recompile storms: the runtime counts compiles; `describe_change` says which argument changed.

Limits: the in-place check trusts the fake tensors' version counters, which count every in-place op
(writes through views included) but nothing a custom op does without declaring its mutation. The
host-sync scan knows the spellings above, not every op with a data-dependent output shape.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.multiprocessing.reductions import StorageWeakRef

from draftfuse.passes._report import user_location
from draftfuse.runtime.errors import (
    CudagraphSkipError,
    DraftCaptureError,
    GraphBreakError,
    HostSyncError,
    RecompileError,
)

_HOST_READ_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero"}
_HOST_READ_FUNCTIONS = {torch.ops.aten._local_scalar_dense.default, torch.nonzero, torch.ops.aten.nonzero.default}

_HOST_SYNC_FIX = (
    "keep the value on the device: use it in tensor ops (torch.where instead of a Python branch, "
    "a tensor index instead of a Python int), or read it after the draft returns"
)
_SKIP_MESSAGE = "skipping cudagraphs due to"


@dataclasses.dataclass(frozen=True)
class MutatedInput:
    """A graph input that the draft writes in place (a KV cache, usually)."""

    index: int  # position among the graph's inputs (what the compiled graph is called with)
    name: str  # the user's name for it: "kv_cache", "self.kv_cache"
    where: str  # file:line of its first in-place write, when known
    static: bool  # already static: a parameter, a buffer, or marked with mark_static_address


def input_name(placeholder: torch.fx.Node) -> str:
    """The user's spelling of a graph input ("kv_cache", "self.cache[0]"), from Dynamo's source."""
    source = getattr(placeholder, "_dynamo_source", None)
    if source is None:
        return placeholder.name
    name = source.name() if callable(source.name) else source.name  # a method in older torch versions
    return re.sub(r"L\['([^']+)'\]", r"\1", name)


def _example(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value")


def _first_use(node: torch.fx.Node) -> str:
    for user in node.users:
        if where := user_location(user):
            return where
    return ""


def draft_device(gm: torch.fx.GraphModule) -> torch.device:
    """The device the draft computes on: its first non-CPU tensor input, else the CPU."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = _example(node)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device
    return torch.device("cpu")


def _host_read(node: torch.fx.Node) -> str | None:
    """What host read `node` is ("`.item()`", ...), or None."""
    if node.op == "call_method" and node.target in _HOST_READ_METHODS:
        return f"`.{node.target}()`"
    if node.op == "call_function" and node.target in _HOST_READ_FUNCTIONS:
        return f"`{getattr(node.target, '__name__', node.target)}`"
    if node.op in ("call_method", "call_function"):
        value = _example(node)
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            sources = [_example(a) for a in node.all_input_nodes]
            if any(isinstance(s, torch.Tensor) and s.device.type != "cpu" for s in sources):
                return f"a copy to the CPU (`{node.target}`)"
    return None


def check_graph(gm: torch.fx.GraphModule, *, allow_dynamic: bool) -> None:
    """Raise if the Dynamo graph cannot be one CUDA-graph replay: host syncs, CPU inputs, dynamic shapes."""
    for node in gm.graph.nodes:
        if read := _host_read(node):
            raise HostSyncError(
                f"{read} reads a device value on the host inside the draft: the CPU waits for the GPU "
                "there and CUDA graphs cannot capture it",
                where=user_location(node),
                fix=_HOST_SYNC_FIX,
            )
    device = draft_device(gm)
    for node in gm.graph.find_nodes(op="placeholder"):
        value = _example(node)
        if device.type != "cpu" and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            raise CudagraphSkipError(
                f"input {input_name(node)!r} is a CPU tensor in a draft on {device}: CUDA graphs skip graphs with CPU inputs",
                where=_first_use(node),
                fix=f"create it on {device} (or pass a Python number for a scalar)",
            )
    dynamic = [node for node in gm.graph.find_nodes(op="placeholder") if free_symbols(_example(node))]
    if dynamic and not allow_dynamic:
        # Dynamo adds the sizes as inputs of their own ("x.size()[0]"); the tensor's own line is
        # the one to show, so take the first input whose use has a location.
        located = next((node for node in dynamic if _first_use(node)), dynamic[0])
        raise CudagraphSkipError(
            f"dynamic shape: input(s) {', '.join(repr(input_name(n)) for n in dynamic)} are symbolic: every "
            "new size re-records the CUDA graph, and Inductor skips CUDA graphs for data-dependent sizes",
            where=_first_use(located),
            fix="keep shapes fixed across calls (pad to a few fixed batch sizes), or pass dynamic=True to "
            "draft_loop if one CUDA graph per size is what you want",
        )


def _storage(node: Any) -> StorageWeakRef | None:
    value = _example(node) if isinstance(node, torch.fx.Node) else None
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def _writes_in_place(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return name.endswith("_") and not name.endswith("__")


def _first_write(gm: torch.fx.GraphModule, placeholder: torch.fx.Node) -> str:
    storage = _storage(placeholder)
    for node in gm.graph.nodes:
        if _writes_in_place(node) and node.args and _storage(node.args[0]) == storage:
            return user_location(node)
    return ""


def mutated_inputs(gm: torch.fx.GraphModule) -> list[MutatedInput]:
    """Graph inputs the draft writes in place, read off the fake tensors' version counters.

    Dynamo traces on fake tensors, and every in-place op (through a view too) bumps the version of
    the fake it writes, so a placeholder's fake with version > 0 is an input the draft mutates.
    """
    found = []
    for index, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        value = _example(node)
        if isinstance(value, torch.Tensor) and value._version > 0:
            static = bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))
            found.append(MutatedInput(index, input_name(node), _first_write(gm, node), static))
    return found


def make_static(gm: torch.fx.GraphModule, example_inputs: list[Any], mutated: MutatedInput) -> None:
    """Mark a mutated input static, for this compile and the next ones.

    mark_static_address on the real tensor covers later traces; this graph was traced before, so its
    placeholder gets the same mark Dynamo would have recorded (`tensor_dict`), which AOT autograd reads
    to tell CUDA graphs which inputs keep their address. torch's own mark_static_input does the same.
    Unguarded: the runtime checks the address on every call and raises instead of re-recording.
    """
    torch._dynamo.mark_static_address(example_inputs[mutated.index], guard=False)
    placeholder = gm.graph.find_nodes(op="placeholder")[mutated.index]
    placeholder.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"


def moved_input_error(mutated: MutatedInput) -> CudagraphSkipError:
    """The error for a mutated input whose address changed since the draft was compiled."""
    return CudagraphSkipError(
        f"input {mutated.name!r} is written in place by the draft but is a different tensor than on the "
        "first call: a CUDA graph writes to the address it recorded, so it would re-record (or write "
        "into the old tensor)",
        where=mutated.where,
        fix=f"allocate {mutated.name!r} once and pass the same tensor on every call (copy_ new contents into it)",
    )


def _frame_location(exc: BaseException) -> str:
    stack = getattr(exc, "real_stack", None)
    if stack:
        frame = stack[-1]
        return f"{frame.filename}:{frame.lineno}"
    matches = re.findall(r'File "([^"]+)", line (\d+)', str(exc))
    return f"{matches[-1][0]}:{matches[-1][1]}" if matches else ""


def _graph_break_error(exc: BaseException) -> DraftCaptureError:
    text = str(getattr(exc, "msg", "") or exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    title = getattr(exc, "gb_type", "") or (lines[0] if lines else type(exc).__name__)
    where = _frame_location(exc)
    explanation = next((ln.removeprefix("Explanation:").strip() for ln in lines if ln.startswith("Explanation:")), "")
    # Older torch versions break on .item() and nonzero instead of tracing them: still host syncs.
    if re.search(r"\b(item|tolist|numpy|nonzero)\b", f"{title} {explanation}"):
        return HostSyncError(f"graph break: {title}: reads a device value on the host", where=where, fix=_HOST_SYNC_FIX)
    if "branch" in title.lower():
        fix = "compute both sides and pick with torch.where (or use torch.cond): a draft must not decide on the host"
    else:
        fix = (
            "move this call out of the draft (before or after it), or make it traceable: "
            "torch.compiler.allow_in_graph, or a torch.library custom op"
        )
    return GraphBreakError(f"graph break: {title}" + (f" ({explanation})" if explanation else ""), where=where, fix=fix)


def _skip_error(text: str) -> CudagraphSkipError:
    reason = text[text.index(_SKIP_MESSAGE) + len(_SKIP_MESSAGE) :].strip().splitlines()[0].rstrip(".:")
    matches = re.findall(r'File "([^"]+)", line (\d+)', text)
    return CudagraphSkipError(
        f"Inductor skips CUDA graphs for this draft: {reason}",
        where=f"{matches[-1][0]}:{matches[-1][1]}" if matches else "",
        fix="make the draft's inputs device tensors of fixed shape, and mark tensors it writes in place "
        "static (torch._dynamo.mark_static_address)",
    )


def capture_error(exc: BaseException) -> DraftCaptureError | None:
    """The DraftCaptureError that `exc` (raised by a compiled draft's call) stands for, or None."""
    if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
        exc = exc.inner_exception  # the backend's own error, raised while compiling
    if isinstance(exc, DraftCaptureError):
        return exc
    if isinstance(exc, torch._dynamo.exc.FailOnRecompileLimitHit):
        return RecompileError(
            "torch's recompile limit was reached for the draft's code (torch._dynamo.config.recompile_limit)",
            fix="pass the values that change as tensors, keep shapes fixed, or use fewer draft instances",
        )
    if isinstance(exc, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        return _graph_break_error(exc)
    if _SKIP_MESSAGE in str(exc):
        return _skip_error(str(exc))
    return None


def describe_change(before: dict[str, str], after: dict[str, str]) -> str:
    """Which call arguments differ between two calls, as "name: before -> after; ..." (empty if none)."""
    changes = [f"{name}: {before.get(name, '<absent>')} -> {value}" for name, value in after.items() if before.get(name) != value]
    changes += [f"{name}: {value} -> <absent>" for name, value in before.items() if name not in after]
    return "; ".join(changes)


def describe_value(value: Any) -> str:
    """A short description of an argument that changes when a guard on it would fail."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} on {value.device}"
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} object"


def last_guard_failure(code: Any) -> str:
    """Dynamo's last recorded guard failure for a code object (why it recompiled), or ""."""
    failures = torch._dynamo.utils.guard_failures.get(code) or []
    if not failures:
        return ""
    # "0/3: steps == 1      # for _ in range(steps):  # file:line" -> "steps == 1"
    reason = failures[-1].splitlines()[0].split("#")[0]
    return re.sub(r"^\d+/\d+: ", "", reason).strip()
