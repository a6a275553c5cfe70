"""The gather: which collective brings the vocabulary shards together, from which process group, and
where the gathered value starts its way to the softmax.

    as_gather(node) -> Gather | None        walking back from the logits through data movement only

Recognised, at both levels unless said:
  * `_c10d_functional.all_gather_into_tensor(shard, group_size, group_name)` + `wait_tensor`: what
    `funcol.all_gather_tensor` becomes (Dynamo inlines it; AOT keeps it): the gathered tensor is the
    shards stacked along dim 0, [tp * d0, ...], reassembled by the ops after it (layout.py);
  * `funcol.all_gather_tensor(shard, gather_dim, group)` kept as one call (Dynamo, where allowed in
    the graph): the shards concatenated along `gather_dim`;
  * `dist.all_gather_into_tensor(out, shard)` (Dynamo level: a fresh buffer, the functional
    collective copied into it); after AOT it is the first form;
  * DTensor (Dynamo level): `d.full_tensor()` or `d.redistribute(mesh, [Replicate()]).to_local()` of a
    DTensor sharded along one dim on one mesh dim, every other placement Replicate. After AOT it
    lowers to the first form.

The group must be known to this process (`Refuse` otherwise): the rewrite gathers its candidates over
the same group, and a padded vocabulary needs this process's rank in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from draftfuse.graph.selection import bind
from draftfuse.graph.values import Node, fake, fake_tensor, normalise_dim, target_key
from draftfuse.passes.driver import Refuse

_GATHERS: set[Any] = set()
_WAITS: set[Any] = set()
if dist.is_available():
    for namespace in ("_c10d_functional", "_c10d_functional_autograd"):
        ops = getattr(torch.ops, namespace)
        try:
            packet = ops.all_gather_into_tensor
        except (AttributeError, RuntimeError):
            continue
        _GATHERS |= {packet, packet.default}
    _WAITS = {torch.ops._c10d_functional.wait_tensor, torch.ops._c10d_functional.wait_tensor.default}
    from torch.distributed import _functional_collectives as funcol

    _FUNCOL_CALLS = {funcol.all_gather_tensor}
else:  # pragma: no cover - torch built without distributed
    _FUNCOL_CALLS = set()
_BUFFERS = {torch.empty, torch.zeros, "new_empty", "new_zeros", torch.empty_like, torch.zeros_like}


@dataclasses.dataclass
class Gather:
    start: Node  # the gathered value the reassembly starts from
    shard: Node | None  # what each rank contributes (None: `dtensor.to_local()`, emitted)
    dtensor: Node | None
    anchor: Node  # where the collective reads the shard: new nodes go right after it
    nodes: list[Node]  # the collective's own nodes, erased with the pattern
    tp: int
    group_name: str
    group: Any  # the ProcessGroup
    gather_dim: int | None  # None: shards stacked along dim 0; else concatenated along this dim
    level_target: Any  # the collective op to emit (packet at Dynamo level, overload post-grad)
    wait_target: Any

    def rank(self) -> int:
        return dist.get_rank(self.group)


def is_gather_node(node: Node) -> bool:
    """A node that may start a gather (cheap, for the pass's early exit and refusal reports)."""
    key = target_key(node)
    return key in _GATHERS or key in _FUNCOL_CALLS or (node.op == "call_method" and key in ("full_tensor", "redistribute"))


def _group(name: Any, size: Any) -> Any:
    if not isinstance(name, str):
        raise Refuse(f"the gather's process group {name!r} is not a constant group name")
    if not (dist.is_available() and dist.is_initialized()):
        raise Refuse(f"process group {name!r} cannot be identified: torch.distributed is not initialised in this process")
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(name)
    except Exception as error:
        raise Refuse(f"process group {name!r} cannot be identified in this process ({type(error).__name__})") from None
    if size is not None and group.size() != size:
        raise Refuse(f"process group {name!r} has {group.size()} ranks, the gather says {size}")
    return group


def _functional(wait: Node) -> Gather | None:
    """wait_tensor(all_gather_into_tensor(shard, tp, name))"""
    if target_key(wait) not in _WAITS or not wait.args or target_key(wait.args[0]) not in _GATHERS:
        return None
    collective = wait.args[0]
    bound = bind(collective, ("input", "group_size", "group_name"))
    if bound is None or not isinstance(bound.get("input"), Node) or not isinstance(bound.get("group_size"), int):
        raise Refuse(f"{collective.name}: all_gather arguments not understood")
    if len(collective.users) != 1:
        raise Refuse(f"the gathered logits have other users: {collective.name} is read by {', '.join(u.name for u in collective.users)}")
    group = _group(bound.get("group_name"), bound["group_size"])
    return Gather(wait, bound["input"], None, collective, [wait, collective], bound["group_size"], bound["group_name"], group,
                  None, collective.target, wait.target)  # fmt: skip


def _funcol_call(node: Node) -> Gather | None:
    """funcol.all_gather_tensor(shard, gather_dim, group) as one call."""
    if target_key(node) not in _FUNCOL_CALLS:
        return None
    bound = bind(node, ("self", "gather_dim", "group", "tag"))
    if bound is None or not isinstance(bound.get("self"), Node) or isinstance(bound.get("group"), Node):
        raise Refuse(f"{node.name}: all_gather_tensor arguments not understood")
    try:
        name = funcol._resolve_group_name(bound["group"], bound.get("tag", ""))
    except Exception as error:
        raise Refuse(f"the process group of {node.name} cannot be identified ({type(error).__name__})") from None
    group = _group(name, None)
    dim = normalise_dim(bound.get("gather_dim"), fake_tensor(node).dim() if fake_tensor(node) is not None else None)
    if dim is None:
        raise Refuse(f"{node.name}: gather_dim {bound.get('gather_dim')!r} is not a known dim")
    ops = torch.ops._c10d_functional
    return Gather(node, bound["self"], None, node, [node], group.size(), name, group, dim, ops.all_gather_into_tensor, ops.wait_tensor)


def _into_buffer(buffer: Node) -> Gather | None:
    """out = torch.empty(...); out.copy_(wait_tensor(all_gather_into_tensor(shard, ...))): the buffer
    is the gathered tensor when that copy is its only writer and fills it whole."""
    if target_key(buffer) not in _BUFFERS:
        return None
    copies = [u for u in buffer.users if target_key(u) == "copy_" and u.args[0] is buffer]
    if len(copies) != 1 or len(copies[0].args) != 2 or copies[0].kwargs:
        return None
    copy = copies[0]
    source = copy.args[1]
    found = _functional(source) if isinstance(source, Node) else None
    if found is None:
        return None
    if copy.users or len(source.users) != 1:
        raise Refuse(f"the gathered logits have other users: {copy.name} or {source.name} is read elsewhere")
    value, src = fake_tensor(buffer), fake_tensor(source)
    if value is None or src is None or tuple(value.shape) != tuple(src.shape) or value.dtype != src.dtype:
        raise Refuse(f"{copy.name} does not fill {buffer.name} with the gathered shards exactly")
    found.start = buffer
    found.nodes = [copy, buffer, *found.nodes]
    return found


def _dtensor(node: Node) -> Gather | None:
    """full_tensor() or redistribute(..., [Replicate()]).to_local() (or .full_tensor()) of a vocab-sharded
    DTensor."""
    if node.op != "call_method" or node.target not in ("full_tensor", "to_local"):
        return None
    nodes = [node]
    redistribute = node.args[0] if node.args else None
    if not (isinstance(redistribute, Node) and redistribute.op == "call_method" and redistribute.target == "redistribute"):
        if node.target == "to_local":
            return None
        redistribute = None
    bound = bind(redistribute, ("self", "device_mesh", "placements", "async_op")) if redistribute is not None else None
    placements = bound.get("placements") if bound else None
    replicated = isinstance(placements, (list, tuple)) and all(type(p).__name__ == "Replicate" for p in placements)
    if redistribute is not None and (node.target == "to_local" or replicated):  # full_tensor() of a replica: to_local()
        if not replicated:
            raise Refuse(f"{redistribute.name}: redistribute to {placements!r} is not a full replication")
        if len(redistribute.users) != 1:
            raise Refuse(f"the gathered logits have other users: {redistribute.name}")
        nodes.append(redistribute)
        source = redistribute.args[0]
    else:
        source = node.args[0]
    value = fake(source)
    placements, mesh = getattr(value, "placements", None), getattr(value, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    shards = [(i, p) for i, p in enumerate(placements) if type(p).__name__ != "Replicate"]
    if len(shards) != 1 or type(shards[0][1]).__name__ != "Shard":
        raise Refuse(f"{source.name} is placed {list(placements)}: one Shard of the vocabulary, all else Replicate, is what is rewritten")
    mesh_dim, placement = shards[0]
    dim = normalise_dim(placement.dim, value.dim())
    tp = mesh.size(mesh_dim)
    if dim is None or value.shape[dim] % tp:
        raise Refuse(f"uneven shards: {value.shape[dim]} entries over {tp} ranks (DTensor pads the last shards); not proven even")
    try:
        group = mesh.get_group(mesh_dim)
    except Exception as error:
        raise Refuse(f"the process group of mesh dim {mesh_dim} cannot be identified ({type(error).__name__})") from None
    _group(group.group_name, tp)
    ops = torch.ops._c10d_functional
    return Gather(node, None, source, nodes[-1], nodes, tp, group.group_name, group, dim, ops.all_gather_into_tensor, ops.wait_tensor)


_RECOGNISERS = (_functional, _funcol_call, _into_buffer, _dtensor)


def as_gather(node: Node) -> Gather | None:
    """The gather whose value `node` is (the first node of the reassembly), or None."""
    if not isinstance(node, Node):
        return None
    for recognise in _RECOGNISERS:
        if (found := recognise(node)) is not None:
            return found
    return None
