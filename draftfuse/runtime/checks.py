"""Capture checks on a prepared Dynamo graph: what keeps it from being one CUDA-graph replay.

  * host reads traced into the graph (torch 2.13 traces `.item()` under fullgraph): `item`, `tolist`,
    `cpu`, `numpy`, `nonzero`, `aten._local_scalar_dense`, any copy from an accelerator to the CPU.
    A `.item()` of an input Dynamo made from a Python number (a module's float attribute such as
    RMSNorm's eps under dynamic=True) reads no device memory and is not one;
  * a CPU tensor input on an accelerator draft (CUDA graphs skip such graphs);
  * a dynamic shape, unless the caller asked for dynamic=True;
  * inputs the draft writes in place (`written_inputs`, from draftfuse.graph.effects): a KV cache must
    keep its address, so the runtime marks it static and checks its address on every call
    (`guard_written_inputs`, with the check that no other argument shares its memory).
They run after the Dynamo-level passes: the seed fold removes host round trips that only existed at
the old seam.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_symbols

from draftfuse.graph.effects import Effects, defines_unbacked_symbols, written_values
from draftfuse.graph.values import Node, fake, fake_tensor, input_name, is_python_number, source_name, user_location
from draftfuse.runtime.errors import CudagraphSkipError, DraftCaptureError, HostSyncError, first_line

_HOST_READ_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero"}
_HOST_READ_FUNCTIONS = {torch.ops.aten._local_scalar_dense.default, torch.nonzero, torch.ops.aten.nonzero.default}

DATA_DEPENDENT_FIX = (
    "keep data-dependent sizes out of the draft: pad to a static size (fixed-size topk, masks instead of "
    "boolean indexing, torch.where instead of nonzero), or build what needs the host's view (a tree from "
    "unique ids, a list) after the draft returns"
)
HOST_SYNC_FIX = (
    "keep the value on the device: use it in tensor ops (torch.where instead of a Python branch, a tensor "
    "index instead of a Python int, a fixed-size padded tensor instead of a list), or read it after the draft returns"
)


@dataclasses.dataclass(frozen=True)
class WrittenInput:
    """A graph input that the draft writes in place (a KV cache, usually)."""

    index: int  # position among the graph's inputs (what the compiled graph is called with)
    name: str  # the user's name for it: "kv_cache", "self.kv_cache"
    where: str  # file:line of its first in-place write, when known
    static: bool  # already static: a parameter, a buffer, or marked with mark_static_address
    shares: tuple[str, ...] = ()  # the other inputs whose memory it shared when traced (prev = cache[1])


def _first_use(node: Node) -> str:
    for user in node.users:
        if where := user_location(user):
            return where
    return ""


def draft_device(gm: torch.fx.GraphModule) -> torch.device:
    """The device the draft computes on: its first non-CPU tensor input, else the CPU."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = fake_tensor(node)
        if value is not None and value.device.type != "cpu":
            return value.device
    return torch.device("cpu")


def host_read(node: Node) -> str | None:
    """What host read `node` is ("`.item()`", ...), or None."""
    if node.op == "call_method" and node.target in _HOST_READ_METHODS or node.op == "call_function" and node.target in _HOST_READ_FUNCTIONS:
        source = node.args[0] if node.args else None
        if isinstance(source, Node) and source.op == "placeholder" and is_python_number(source):
            return None  # a Python number Dynamo passes as a CPU tensor: no device value is read
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
        if name == "item":  # Dynamo traces .tolist(), int(t), float(t) and bool(t) as .item() calls
            return "`.item()` (or `.tolist()`, `int()`, `float()` of a tensor, traced as `.item()`)"
        return f"`.{name}()`" if node.op == "call_method" else f"`{name}`"
    if node.op in ("call_method", "call_function"):
        value = fake_tensor(node)
        if value is not None and value.device.type == "cpu":
            sources = [fake_tensor(a) for a in node.all_input_nodes]
            if any(s is not None and s.device.type != "cpu" for s in sources):
                return f"a copy to the CPU (`{node.target}`)"
    return None


def defines_data_dependent_value(node: Node) -> bool:
    """Whether `node` makes a value whose size or value depends on the data (nonzero, unique...)."""
    return node.op != "placeholder" and defines_unbacked_symbols(node)


def obstacles(gm: torch.fx.GraphModule, *, allow_dynamic: bool) -> list[DraftCaptureError]:
    """Everything in the Dynamo graph that keeps it from being one CUDA-graph replay, in graph order."""
    found: list[DraftCaptureError] = []
    for node in gm.graph.nodes:
        if read := host_read(node):
            sized = isinstance(fake(node), torch.Tensor) and defines_data_dependent_value(node)  # nonzero, unique
            found.append(HostSyncError(
                f"{read} reads a device value on the host inside the draft: the CPU waits for the GPU there "
                "and CUDA graphs cannot capture it",
                where=user_location(node), fix=DATA_DEPENDENT_FIX if sized else HOST_SYNC_FIX,
            ))  # fmt: skip
        elif defines_data_dependent_value(node) and not any(map(defines_data_dependent_value, node.all_input_nodes)):
            # where data-dependence starts: what is computed from it (a slice to a length read, its size
            # asserts) is not another obstacle
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
            found.append(HostSyncError(
                f"`{name}` makes a tensor whose size depends on the data: the host must read that size "
                "to allocate it, so the CPU waits for the GPU there and CUDA graphs cannot capture it",
                where=user_location(node), fix=DATA_DEPENDENT_FIX,
            ))  # fmt: skip
    device = draft_device(gm)
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node in placeholders:
        value = fake_tensor(node)
        if device.type != "cpu" and value is not None and value.device.type == "cpu" and not is_python_number(node):
            found.append(CudagraphSkipError(
                f"input {input_name(node)!r} is a CPU tensor in a draft on {device}: CUDA graphs skip graphs with CPU inputs",
                where=_first_use(node), fix=f"create it on {device} (or pass a Python number for a scalar)",
            ))  # fmt: skip
    dynamic = [node for node in placeholders if free_symbols(fake(node)) and not is_python_number(node)]
    if dynamic and not allow_dynamic:
        # Dynamo adds the sizes as inputs of their own ("x.size()[0]"): show the first input used on a line.
        located = next((node for node in dynamic if _first_use(node)), dynamic[0])
        found.append(CudagraphSkipError(
            f"dynamic shape: input(s) {', '.join(repr(input_name(n)) for n in dynamic)} are symbolic (an argument marked "
            "with torch._dynamo.mark_dynamic, say): every new size re-records the CUDA graph, and Inductor skips CUDA "
            "graphs for data-dependent sizes",
            where=_first_use(located),
            fix="keep shapes fixed across calls (pad to a few fixed batch sizes), or pass dynamic=True to "
            "draft_loop if one compile for every size is what you want (its CUDA graph is recorded again at each change of size)",
        ))  # fmt: skip
    unique: dict[tuple, DraftCaptureError] = {}
    for error in found:  # a loop's repeats once, where first found
        unique.setdefault((type(error), str(error)), error)
    return list(unique.values())


def written_inputs(gm: torch.fx.GraphModule) -> list[WrittenInput]:
    """Graph inputs the draft writes in place (through any view of them), with their first write."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    effects = Effects(gm.graph)
    written = effects.written_inputs()

    def shares(node: Node) -> tuple[str, ...]:
        """The inputs it shared memory with, when the draft writes it only through one of those."""
        written_args = written_values(written[node]) or []
        if any(node in _ancestors(arg) for arg in written_args):
            return ()  # written through itself (or a view of it)
        return tuple(input_name(other) for other in placeholders if other is not node and effects.may_share(node, other))

    return [
        WrittenInput(index, input_name(node), user_location(written[node]), is_static(node), shares(node))
        for index, node in enumerate(placeholders)
        if node in written
    ]


def _ancestors(node: Node) -> set[Node]:
    """`node` and the nodes it is computed from (at compile time, for an error's wording)."""
    seen, frontier = {node}, [node]
    while frontier:
        for source in frontier.pop().all_input_nodes:
            if source not in seen:
                seen.add(source)
                frontier.append(source)
    return seen


def is_static(placeholder: Node) -> bool:
    """A parameter, a buffer, or a tensor marked static: CUDA graphs read it where it is."""
    return bool(placeholder.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))


def is_parameter_or_buffer(placeholder: Node) -> bool:
    """A module's parameter or registered buffer, by its Dynamo source. Dynamo also marks a module's plain
    tensor attributes static, which callers replace (Medusa's mask each step): those are read per call."""
    return re.search(r"\._(parameters|buffers)\[", source_name(placeholder._dynamo_source)) is not None


def make_static(gm: torch.fx.GraphModule, example_inputs: list[Any], written: WrittenInput) -> None:
    """Mark a written input static, for this compile and the next ones.

    mark_static_address on the real tensor covers later traces; this graph was traced before, so its
    placeholder gets the same mark Dynamo would have recorded (`tensor_dict`), which AOT autograd reads
    to tell CUDA graphs which inputs keep their address. torch's own mark_static_input does the same.
    Unguarded: the runtime checks the address on every call and raises instead of re-recording.
    """
    torch._dynamo.mark_static_address(example_inputs[written.index], guard=False)
    placeholder = gm.graph.find_nodes(op="placeholder")[written.index]
    placeholder.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"


def moved_input_error(written: WrittenInput) -> CudagraphSkipError:
    """The error for a written input whose address changed since the draft was compiled."""
    if written.shares:  # written through the memory it shared with another input (prev = cache[1]) when traced
        others = ", ".join(repr(name) for name in written.shares)
        return CudagraphSkipError(
            f"input {written.name!r} shared memory with {others} when the draft was compiled, and the draft writes "
            "that memory in place; it is a different tensor now: a CUDA graph reads and writes the addresses it "
            "recorded, so it would re-record (or use the old tensor)",
            where=written.where,
            fix=f"pass {written.name!r} the same way on every call (the same view of {others}, or a tensor of its own "
            "from the first call on)",
        )
    return CudagraphSkipError(
        f"input {written.name!r} is written in place by the draft but is a different tensor than on the "
        "first call: a CUDA graph writes to the address it recorded, so it would re-record (or write "
        "into the old tensor)",
        where=written.where,
        fix=f"allocate {written.name!r} once and pass the same tensor on every call (copy_ new contents into it)",
    )


def guard_written_inputs(compiled: Callable[..., Any], written: list[WrittenInput], example_inputs: list[Any], names: list[str]) -> Callable[..., Any]:
    """Check, on every call, that each written input is the tensor the draft was compiled with, and
    that no other tensor argument shares its memory unless one did when traced. `names`: the user's name
    of each graph input."""
    addresses = [(item, example_inputs[item.index].data_ptr()) for item in written]
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    written_storages = {storage(example_inputs[item.index]): item.name for item in written}
    traced_sharing = {id(v) for v in example_inputs if isinstance(v, torch.Tensor) and storage(v) in written_storages}
    written_positions = {item.index for item in written}

    def check_graph_inputs(*args: Any) -> None:
        for item, address in addresses:
            if args[item.index].data_ptr() != address:
                raise moved_input_error(item)

    def check_arguments(arguments: Sequence[Any], positions: Iterable[int]) -> None:
        """The same promise for the tensors a replay reads from the call, at their graph input positions
        (the fast path has no graph inputs; a held input read in place at its recorded address was checked
        when recorded). A written input itself is its own memory: its address is what counts."""
        for position, value in zip(positions, arguments):
            if position in written_positions:
                continue
            if isinstance(value, torch.Tensor) and id(value) not in traced_sharing and storage(value) in written_storages:
                raise DraftCaptureError(
                    f"input {names[position]!r} shares memory with an input the draft writes in place "
                    f"({written_storages[storage(value)]!r}), which it did not when the draft was compiled: the compiled "
                    "draft reads the memory as traced",
                    fix=f"pass a tensor for {names[position]!r} that does not overlap the ones the draft writes (or the same view on every call)",
                )

    def run(*args: Any) -> Any:
        check_graph_inputs(*args)
        check_arguments(args, range(len(args)))
        return compiled(*args)

    run.check = check_arguments
    return run


def capture_failed_error(exc: BaseException) -> CudagraphSkipError:
    """The error for a draft whose compiled region could not be captured in a CUDA graph."""
    return CudagraphSkipError(
        f"the draft's compiled region could not be captured in a CUDA graph: {first_line(str(exc), type(exc).__name__)}",
        fix="the region must not synchronise with the host or allocate host memory while it runs: look for "
        "host reads, CPU tensors and data-dependent sizes (draftfuse.explain lists them)",
    )


def describe_value(value: Any) -> str:
    """A short description of an argument, as a guard on it sees it."""
    if isinstance(value, torch.Tensor):
        layout = "" if value.is_contiguous() else f", strides {tuple(value.stride())}"
        # made under torch.inference_mode: no autograd dispatch keys, which Dynamo's guards hold
        kind = " (an inference tensor)" if value.is_inference() else ""
        return f"{str(value.dtype).removeprefix('torch.')} of shape {tuple(value.shape)}{layout} on {value.device}{kind}"
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} object"


def describe_arguments(arguments: dict[str, Any]) -> dict[str, str]:
    """Each argument described (describe_value), the entries of its lists, tuples and dicts one by one
    (kv[1], meta['seq_lens']: a tensor in a list whose shape changed is named)."""
    described: dict[str, str] = {}

    def add(name: str, value: Any, depth: int) -> None:
        entries = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else None
        if entries is None or depth == 3 or len(value) > 64:
            described[name] = describe_value(value)
            return
        described[name] = f"{type(value).__name__} of {len(value)}"
        for key, entry in entries:
            add(f"{name}[{key!r}]", entry, depth + 1)

    for name, value in arguments.items():
        add(name, value, 0)
    return described


def last_guard_failure(code: Any) -> str:
    """The guard of the code's latest compiled entry that failed (why it recompiled), or ""."""
    # one record per entry that failed, newest entry first on each call: "0/3: steps == 4    # for ...  # file:line"
    found = [(re.match(r"(\d+)/(\d+): ([^#\n]*)", str(f)), i) for i, f in enumerate(torch._dynamo.utils.guard_failures.get(code) or [])]
    # the latest entry's, and of its records the newest (a refused compile leaves its record too)
    latest = max(((m, i) for m, i in found if m), key=lambda mi: (int(mi[0].group(1)), int(mi[0].group(2)), mi[1]), default=None)
    return latest[0].group(3).strip() if latest else ""


def describe_change(before: dict[str, str], after: dict[str, str]) -> str:
    """Which call arguments differ between two calls: "hidden: float32 of shape (9, 128) ..., was ..."."""
    changes = [f"{name}: {value}, was {before.get(name, '<absent>')}" for name, value in after.items() if before.get(name) != value]
    changes += [f"{name}: <absent>, was {value}" for name, value in before.items() if name not in after]
    return "; ".join(changes)
