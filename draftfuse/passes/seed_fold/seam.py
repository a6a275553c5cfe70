"""What `draftfuse.fold(seed, loop)` puts into the traced graph for the seed fold to read.

  * `draftfuse::seam(tensors, facts)`: the seed's outputs pass through it, so the graph shows where
    the seed ends. It returns copies (a custom op may not return its inputs), of the seed's layout;
    the fold removes it (with the fold off, `strip_seams` does), so the loop reads the seed's values
    themselves, as `loop(*seed(...))` does. Nothing of it shows to the loop's Python either: a tensor
    the seed returns twice is marked once, lists and dicts keep their identity, and run eagerly (a
    force_eager stance) the marker does nothing. `facts` is JSON: what the caller of fold() states
    about the draft (value ranges of its arguments, drop_buffer_writes).
  * `draftfuse::assume_range(x, low, high, name)`: the fold puts it on a graph input whose elements the
    caller declared to lie in [low, high] (None: unbounded) and that the draft never writes; every
    reader of the input reads it. It survives AOT autograd (a functional op returning a copy), and the
    post-grad setup merging reads the range off it, then removes it. A declared range is trusted, not
    checked: it describes the argument's values as the draft receives them.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from draftfuse.graph.values import Node

ValueRangeSpec = Mapping[str, tuple[int | None, int | None]]


@torch.library.custom_op("draftfuse::seam", mutates_args=())
def _seam(tensors: list[torch.Tensor], facts: str) -> list[torch.Tensor]:
    # Copies: the fold removes the op, so they only run when the graph is compiled without the fold.
    return [_copy_keeping_layout(t) for t in tensors]


@_seam.register_fake
def _seam_fake(tensors: list[torch.Tensor], facts: str) -> list[torch.Tensor]:
    # the seed's layout (strides, stride 0 included), not a dense copy: the loop's Python may read it
    # (x.is_contiguous(), x.stride(-1)) while Dynamo traces it, before the fold removes the marker
    return [torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device) for t in tensors]


def _copy_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with its sizes and strides: the memory its view spans, copied, then viewed alike."""
    if t.numel() == 0:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    span = 1 + sum((n - 1) * stride for n, stride in zip(t.size(), t.stride()))
    return t.as_strided((span,), (1,)).clone().as_strided(t.size(), t.stride())


@torch.library.custom_op("draftfuse::assume_range", mutates_args=())
def _assume_range(x: torch.Tensor, low: int | None, high: int | None, name: str) -> torch.Tensor:
    return x.clone()


@_assume_range.register_fake
def _assume_range_fake(x: torch.Tensor, low: int | None, high: int | None, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def seam_facts(*, value_ranges: ValueRangeSpec | None = None, drop_buffer_writes: bool = False) -> str:
    """What the caller of fold() states about a draft, as the marker's constant argument (computed
    outside the traced code: json is not traceable). Raises ValueError for a range that is not (low, high)
    of ints or None with low <= high."""
    for name, bounds in (value_ranges or {}).items():
        ints = isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(
            b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in bounds
        )
        if not isinstance(name, str) or not ints or (None not in bounds and bounds[0] > bounds[1]):
            raise ValueError(f"value_ranges[{name!r}] = {bounds!r}: give (low, high), ints or None (unbounded), low <= high")
    facts = {"value_ranges": {name: list(bounds) for name, bounds in (value_ranges or {}).items()}}
    facts["drop_buffer_writes"] = drop_buffer_writes
    return json.dumps(facts, sort_keys=True)


def mark_seam(values: Any, facts: str = "{}") -> Any:
    """`values` with every tensor passed through the seam marker (mark_seam_undoable's first value)."""
    return mark_seam_undoable(values, facts)[0]


def mark_seam_undoable(values: Any, facts: str = "{}") -> tuple[Any, list]:
    """`values` (a tensor, or a tuple/list/dict holding tensors and other values) with every tensor
    passed through the seam marker, so that the traced graph shows where the seed ends; and what
    `unmark_seam` needs to undo the marking of the lists and dicts among them.

    Only where Dynamo traces it: run eagerly (under a force_eager stance, say) it returns `values` as
    they are. Lists and dicts (and subclasses storing entries as they do) keep their identity (the loop
    may append to the caller's list): their entries are replaced in place, and unmark_seam puts the
    seed's objects back after the loop, where the loop left them. Tuples are rebuilt; a tensor met
    twice is marked once, so `a is b` holds in the trace as in eager.

    Dynamo traces this inside the folded draft, and every call of the draft checks the guards the trace
    left: plain tensors, tuples (namedtuples too), lists and dicts are walked here, which leaves none
    beyond the values' own; other containers go through torch's pytree, whose trace is guarded by a
    few dozen checks of pytree's module state (each draft call pays them)."""
    undo: list = []
    if not torch.compiler.is_dynamo_compiling():
        return values, undo
    tensors: list[torch.Tensor] = []
    if not _walk(values, tensors):
        return mark_seam_by_pytree(values, facts), undo
    if not tensors:
        return values, undo
    marked = torch.ops.draftfuse.seam.default(tensors, facts)
    return _rebuild(values, tensors, marked, undo), undo


def unmark_seam(undo: list) -> None:
    """Put back the seed's own objects into the lists and dicts mark_seam marked, where the loop left
    the marked ones (what the loop wrote there stays)."""
    for container, key, original, marked in reversed(undo):
        # where the loop left it: the loop may have removed the entry, or moved it (insert(0, x), pop())
        keys = range(len(container)) if isinstance(container, list) else list(container)
        for where in [key, *keys] if key in keys else keys:
            if container[where] is marked:
                container[where] = original
                break


def mark_seam_by_pytree(values: Any, facts: str = "{}") -> Any:
    """mark_seam for any container torch's pytree knows (the marker's only path before the walk above)."""
    leaves, spec = tree_flatten(values)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not where:
        return values
    marked = torch.ops.draftfuse.seam.default([leaves[i] for i in where], facts)
    for i, tensor in zip(where, marked):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


_STORES_AS_BUILTINS = (list.__setitem__, dict.__setitem__, collections.OrderedDict.__setitem__)


def _walk(value: Any, tensors: list[torch.Tensor]) -> bool:
    """Appends the tensors in `value` to `tensors` (each object once), walking tuples, namedtuples, lists
    and dicts (and their subclasses that store entries as they do); False where it meets another tuple, list
    or dict subclass (pytree's, which rebuilds them). Other objects (a deque, a dataclass) are values."""
    kind = type(value)
    # the namedtuple test is written out here and in _rebuild, not shared: Dynamo traces both, and a helper
    # function is one more global, so one more guard on every replayed call of a folded draft. A list or dict
    # subclass that stores entries as they do (OrderedDict, defaultdict) is marked in place too: pytree would
    # hand the loop a copy, and the loop's writes to it would not reach the caller's object.
    if (kind is tuple or kind is list or kind is dict or (isinstance(value, tuple) and hasattr(kind, "_fields"))
            or (isinstance(value, (list, dict)) and kind.__setitem__ in _STORES_AS_BUILTINS)):
        for seed_output in value.values() if isinstance(value, dict) else value:  # (the draft's graph names nodes after it)
            if not _walk(seed_output, tensors):
                return False
        return True
    if isinstance(value, torch.Tensor):
        for seen in tensors:
            if seen is value:
                return True
        tensors.append(value)
    return not isinstance(value, (tuple, list, dict))


def _rebuild(value: Any, tensors: list[torch.Tensor], marked: list[torch.Tensor], undo: list) -> Any:
    """`value` (one that _walk took apart) with each tensor replaced by its marked one; the entries of
    lists and dicts replaced in place, each replacement recorded in `undo`."""
    if isinstance(value, torch.Tensor):
        for tensor, mark in zip(tensors, marked):
            if tensor is value:
                return mark
        return value
    if isinstance(value, (list, dict)):
        for container, _, _, _ in undo:
            if container is value:
                return value  # the same container met again: marked already
        for key in range(len(value)) if isinstance(value, list) else list(value):
            entry = value[key]
            new = _rebuild(entry, tensors, marked, undo)
            if new is not entry:
                value[key] = new
                undo.append((value, key, entry, new))
        return value
    if isinstance(value, tuple):
        items = [_rebuild(v, tensors, marked, undo) for v in value]
        return type(value)(*items) if hasattr(type(value), "_fields") else tuple(items)
    return value


def _is_op(node: Node, name: str) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name == f"draftfuse::{name}"
    return isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name == f"draftfuse::{name}"


def is_seam(node: Node) -> bool:
    return _is_op(node, "seam")


def is_assume_range(node: Node) -> bool:
    return _is_op(node, "assume_range")


def read_facts(graph: torch.fx.Graph) -> tuple[dict[str, tuple[Any, Any]], bool]:
    """The value ranges and drop_buffer_writes that fold() put in the graph's seam markers."""
    value_ranges: dict[str, tuple[Any, Any]] = {}
    drop_buffer_writes = False
    for seam in [n for n in graph.nodes if is_seam(n)]:
        facts = json.loads(seam.args[1] if len(seam.args) > 1 else seam.kwargs.get("facts", "{}"))
        value_ranges.update({name: tuple(bounds) for name, bounds in facts.get("value_ranges", {}).items()})
        drop_buffer_writes |= bool(facts.get("drop_buffer_writes"))
    return value_ranges, drop_buffer_writes
