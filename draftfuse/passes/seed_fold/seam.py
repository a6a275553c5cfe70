"""What `draftfuse.fold(seed, loop)` puts into the traced graph for the seed fold to read.

  * `draftfuse::seam(tensors, facts)`: the seed's outputs pass through it, so the graph shows where
    the seed ends. It returns copies (a custom op may not return its inputs); the fold removes it, so
    the loop reads the seed's values themselves, as `loop(*seed(...))` does. `facts` is JSON: what the
    caller of fold() states about the draft (value ranges of its arguments, drop_buffer_writes).
  * `draftfuse::assume_range(x, low, high, name)`: the fold puts it on a graph input whose elements the
    caller declared to lie in [low, high] (None: unbounded) and that the draft never writes; every
    reader of the input reads it. It survives AOT autograd (a functional op returning a copy), and the
    post-grad setup merging reads the range off it, then removes it. A declared range is trusted, not
    checked: it describes the argument's values as the draft receives them.
"""

from __future__ import annotations

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
    return [t.clone() for t in tensors]


@_seam.register_fake
def _seam_fake(tensors: list[torch.Tensor], facts: str) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


@torch.library.custom_op("draftfuse::assume_range", mutates_args=())
def _assume_range(x: torch.Tensor, low: int | None, high: int | None, name: str) -> torch.Tensor:
    return x.clone()


@_assume_range.register_fake
def _assume_range_fake(x: torch.Tensor, low: int | None, high: int | None, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def seam_facts(*, value_ranges: ValueRangeSpec | None = None, drop_buffer_writes: bool = False) -> str:
    """What the caller of fold() states about a draft, as the marker's constant argument (computed
    outside the traced code: json is not traceable)."""
    facts = {"value_ranges": {name: list(bounds) for name, bounds in (value_ranges or {}).items()}}
    facts["drop_buffer_writes"] = drop_buffer_writes
    return json.dumps(facts, sort_keys=True)


def mark_seam(values: Any, facts: str = "{}") -> Any:
    """`values` (a tensor, or a tuple/list/dict holding tensors and other values) with every tensor
    passed through the seam marker, so that the traced graph shows where the seed ends.

    Dynamo traces this inside the folded draft, and every call of the draft checks the guards the trace
    left: plain tensors, tuples (namedtuples too), lists and dicts are walked here, which leaves none
    beyond the values' own; other containers go through torch's pytree, whose trace is guarded by a
    few dozen checks of pytree's module state (each draft call pays them)."""
    tensors: list[torch.Tensor] = []
    if not _walk(values, tensors):
        return mark_seam_by_pytree(values, facts)
    if not tensors:
        return values
    return _rebuild(values, iter(torch.ops.draftfuse.seam.default(tensors, facts)))


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


def _walk(value: Any, tensors: list[torch.Tensor]) -> bool:
    """Appends the tensors in `value` to `tensors`, walking tuples, namedtuples, lists and dicts; False
    where it meets another container (a tuple, list or dict subclass, say: pytree's to take apart)."""
    kind = type(value)
    # the namedtuple test is written out here and in _rebuild, not shared: Dynamo traces both, and a helper
    # function is one more global, so one more guard on every replayed call of a folded draft
    if kind is tuple or kind is list or kind is dict or (isinstance(value, tuple) and hasattr(kind, "_fields")):
        for seed_output in value.values() if kind is dict else value:  # (the draft's graph names nodes after it)
            if not _walk(seed_output, tensors):
                return False
        return True
    if isinstance(value, torch.Tensor):
        tensors.append(value)
    return not isinstance(value, (tuple, list, dict))


def _rebuild(value: Any, marked: Any) -> Any:
    """`value` (one that _walk took apart) with each tensor replaced by the next of `marked`, in _walk's order."""
    if isinstance(value, torch.Tensor):
        return next(marked)
    if isinstance(value, list):
        return [_rebuild(v, marked) for v in value]
    if isinstance(value, tuple):
        items = [_rebuild(v, marked) for v in value]
        return type(value)(*items) if hasattr(type(value), "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: _rebuild(v, marked) for k, v in value.items()}
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
