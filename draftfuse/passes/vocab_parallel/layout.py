"""The reassembly: proving that the ops between the gather and the logits put rank r's shard at
vocabulary positions [r * S, (r + 1) * S), and saying what each rank's own logits are.

    reassemble(gather, logits, reader) -> Reassembly       (Refuse when it cannot be proven)

Two phases, in graph order along the chain of nodes from the gathered value to the logits:

 1. Data movement (chunk/split/unbind + getitem, cat/stack, view/reshape/flatten/unflatten/squeeze/
    unsqueeze, permute/transpose/movedim, contiguous/clone). Each tensor is described by its dims,
    each dim a row-major list of factors: ("rank", tp) or ("x", i) for dim i of the shard (size-1
    factors dropped). The stacked gather is [[rank, x0], [x1], ...]; a reshape regroups the factor
    sequence (refused if it would split a factor), a permute reorders dims, a chunk into tp pieces of
    a dim led by the rank factor fixes the rank per piece, a cat of the pieces 0..tp-1 in order puts
    the rank factor in front of the cat dim. The phase must end in the form "full": one dim led by
    the rank factor, every other factor the shard's in order. Then full = cat_r(L_r, vd) with
    L_r = shard_r.reshape(local shape): rank r holds positions r * S + j along dim vd.
 2. Indexing of the full logits (getitem with ints/slices/None/..., select, slice, narrow, exact
    upcasts, contiguous/clone), replayed on each rank's L_r with the vocabulary entry left whole. A
    prefix slice of the vocabulary dim ([..., :V] of a vocabulary padded to tp * S) is the known mask
    of a padded vocabulary: positions >= V are left out of the selection. Any other slice of the
    vocabulary dim, or a tensor mask, is a padded vocabulary without a known mask: refused.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from draftfuse.graph.selection import bind
from draftfuse.graph.values import Node, fake, fake_tensor, made_by, normalise_dim, target_key
from draftfuse.passes.driver import Refuse
from draftfuse.passes.softmax_topk.forms import as_cast, is_upcast
from draftfuse.passes.vocab_parallel.gather import Gather

aten = torch.ops.aten
Factor = tuple[str, int]

_VIEWS = {
    "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous", "clone", "detach",
    torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze, torch.clone,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default, aten.alias.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.flatten.using_ints,
    aten.unflatten.int,
}  # fmt: skip
_PERMUTES = {
    "permute", "transpose", "movedim", "moveaxis", "swapaxes", "swapdims", "t",
    torch.permute, torch.transpose, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims, torch.t,
    aten.permute.default, aten.transpose.int, aten.t.default,
}  # fmt: skip
# (parameter names, how many pieces: "chunks" | "size" | "sizes" | "unbind")
_SPLITS = {
    torch.chunk: ("input", "chunks", "dim"), "chunk": ("input", "chunks", "dim"), aten.chunk.default: ("input", "chunks", "dim"),
    torch.split: ("input", "split_size_or_sections", "dim"), "split": ("input", "split_size", "dim"),
    aten.split.Tensor: ("input", "split_size", "dim"), aten.split_with_sizes.default: ("input", "split_sizes", "dim"),
    torch.tensor_split: ("input", "sections", "dim"), "tensor_split": ("input", "sections", "dim"),
    torch.unbind: ("input", "dim"), "unbind": ("input", "dim"), aten.unbind.int: ("input", "dim"),
}  # fmt: skip
_CATS = {torch.cat: False, torch.concat: False, torch.concatenate: False, aten.cat.default: False, torch.stack: True, aten.stack.default: True}
_IDENTITY = {"contiguous", "clone", "detach", torch.clone, aten.clone.default, aten.alias.default}
_MASKS = {"masked_fill", "masked_fill_", torch.masked_fill, torch.where, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self}


@dataclasses.dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[Factor, ...], ...]
    rank: int | None = None  # a piece of the gathered tensor: the rank factor fixed to this value


@dataclasses.dataclass(frozen=True)
class Pieces:
    parts: tuple[Layout, ...]


@dataclasses.dataclass
class LocalOp:
    """One indexing op of phase 2, to replay on each rank's logits."""

    node: Node
    args: tuple  # the node's args with its input at position 0 and the vocabulary entry left whole
    kwargs: dict


@dataclasses.dataclass
class Reassembly:
    chain: list[Node]  # every node from the gathered value to the logits, in graph order
    local_shape: tuple[int, ...]  # L_r = shard.reshape(local_shape) (phase 1's end)
    ops: list[LocalOp]  # phase 2, replayed on L_r
    dim: int  # the vocabulary dim of the logits
    shard_vocab: int  # S: entries each rank holds along it
    keep: int | None  # padded vocabulary: only positions < keep are real


def _drop_ones(dims: list[list[Factor]]) -> tuple[tuple[Factor, ...], ...]:
    return tuple(tuple(f for f in d if f[1] != 1) for d in dims)


def _start(gather: Gather, shard_shape: tuple[int, ...]) -> Layout:
    dims = [[(f"x{i}", size)] for i, size in enumerate(shard_shape)]
    if gather.gather_dim is None:
        dims[0] = [("rank", gather.tp), *dims[0]]
    else:
        dims[gather.gather_dim] = [("rank", gather.tp), *dims[gather.gather_dim]]
    return Layout(_drop_ones(dims))


def _static_shape(node: Node) -> tuple[int, ...]:
    value = fake_tensor(node)
    if value is None or not all(isinstance(s, int) for s in value.shape):
        raise Refuse(f"{node.name} has no static shape: the shards cannot be proven even")
    return tuple(value.shape)


def _regroup(layout: Layout, shape: tuple[int, ...], node: Node) -> Layout:
    flat = [f for d in layout.dims for f in d]
    dims, i = [], 0
    for size in shape:
        dim, product = [], 1
        while product < size and i < len(flat):
            dim.append(flat[i])
            product *= flat[i][1]
            i += 1
        if product != size:
            raise Refuse(f"{node.name} reshapes across a shard boundary: not a reassembly of the shards")
        dims.append(dim)
    if i != len(flat):
        raise Refuse(f"{node.name}: reshape not understood")
    return Layout(_drop_ones(dims), layout.rank)


def _permutation(node: Node, ndim: int) -> list[int]:
    """out dim i <- in dim perm[i], by running the op on a meta tensor with distinct sizes."""
    found: list[Node] = []
    torch.fx.node.map_arg((node.args[1:], node.kwargs), found.append)
    if found:
        raise Refuse(f"{node.name}: a permutation read from the graph")
    probe = torch.empty([2 + i for i in range(ndim)], device="meta")
    try:
        if node.op == "call_method":
            out = getattr(probe, node.target)(*node.args[1:], **node.kwargs)
        else:
            out = node.target(probe, *node.args[1:], **node.kwargs)
    except Exception:
        raise Refuse(f"{node.name}: permutation not understood") from None
    return [s - 2 for s in out.shape]


def _split(node: Node, state: Layout, names: tuple[str, ...], tp: int) -> Pieces:
    bound = bind(node, names)
    source = fake_tensor(node.args[0])
    if bound is None or source is None:
        raise Refuse(f"{node.name}: split arguments not understood")
    dim = normalise_dim(bound.get("dim", 0), source.dim())
    pieces = fake(node)
    if dim is None or not isinstance(pieces, (list, tuple)) or len(pieces) != tp:
        raise Refuse(f"{node.name} does not split the gathered tensor into its {tp} shards")
    factors = state.dims[dim]
    if not factors or factors[0] != ("rank", tp):
        raise Refuse(f"{node.name} splits a dim that the shards are not stacked along")
    unbind = "dim" == names[1]
    if unbind and len(factors) != 1:
        raise Refuse(f"{node.name}: unbind of a dim holding more than the ranks")
    if not unbind and any(p.shape[dim] * tp != source.shape[dim] for p in pieces):
        raise Refuse(f"uneven shards: {node.name} splits into pieces of unequal size")
    rest = list(state.dims)
    if unbind:
        del rest[dim]
    else:
        rest[dim] = factors[1:]
    return Pieces(tuple(Layout(tuple(rest), r) for r in range(tp)))


def _cat(node: Node, states: dict[Node, Any], stack: bool, tp: int) -> Layout:
    bound = bind(node, ("tensors", "dim"))
    tensors = bound.get("tensors") if bound else None
    if not isinstance(tensors, (list, tuple)) or len(tensors) != tp:
        raise Refuse(f"{node.name} does not concatenate the {tp} shards")
    parts = [states.get(t) for t in tensors]
    if any(not isinstance(p, Layout) or p.rank != r for r, p in enumerate(parts)) or len({p.dims for p in parts}) != 1:
        raise Refuse(f"{node.name} does not concatenate the shards of ranks 0..{tp - 1} in order")
    value = fake_tensor(node)
    dim = normalise_dim(bound.get("dim", 0), value.dim() if value is not None else None)
    if dim is None:
        raise Refuse(f"{node.name}: cat dim not understood")
    dims = list(parts[0].dims)
    if stack:
        dims.insert(dim, (("rank", tp),))
    else:
        dims[dim] = (("rank", tp), *dims[dim])
    return Layout(tuple(dims))


def _not_understood(node: Node, reader: str) -> Refuse:
    key = target_key(node)
    if key in _MASKS:
        return Refuse(f"a padded vocabulary without a known mask: {node.name} masks the gathered logits with a tensor")
    maker = f", made by {made_by(node)}" if made_by(node) else ""  # softmax_topk's x * sign(t), say
    return Refuse(f"{node.name} ({getattr(key, '__name__', key)}{maker}) between the gather and the {reader} is not understood")


def _step(node: Node, states: dict[Node, Any], tp: int, reader: str) -> Any:
    """The layout of `node`'s value from its inputs' (phase 1)."""
    key = target_key(node)
    source = states.get(node.args[0]) if node.args else None
    if key is operator.getitem and isinstance(source, Pieces) and isinstance(node.args[1], int):
        return source.parts[node.args[1]]
    if key in _CATS:
        return _cat(node, states, _CATS[key], tp)
    if not isinstance(source, Layout):
        raise _not_understood(node, reader)
    if key in _SPLITS:
        return _split(node, source, _SPLITS[key], tp)
    if key in _PERMUTES:
        perm = _permutation(node, len(source.dims))
        return Layout(tuple(source.dims[p] for p in perm), source.rank)
    if key in _VIEWS:
        value, before = fake(node), fake(node.args[0])
        if value is None or before is None or value.dtype != before.dtype:
            raise _not_understood(node, reader)  # x.view(torch.int32): the bits read as another dtype, no reshape
        return _regroup(source, _static_shape(node), node)
    raise _not_understood(node, reader)


def _full_dim(layout: Layout, shard_factors: list[Factor]) -> int | None:
    """vd when the layout is the full vocabulary form (see the module docstring), else None."""
    if layout.rank is not None:
        return None
    led = [i for i, d in enumerate(layout.dims) if any(f[0] == "rank" for f in d)]
    if len(led) != 1 or layout.dims[led[0]][0][0] != "rank":
        return None
    rest = [f for d in layout.dims for f in d if f[0] != "rank"]
    return led[0] if rest == shard_factors else None


def _is_index(node: Node) -> bool:
    key = target_key(node)
    if key is operator.getitem:
        return isinstance(fake(node.args[0]), torch.Tensor)
    if key in (aten.select.int, aten.slice.Tensor, "narrow", torch.narrow, aten.narrow.default):
        return True
    cast = as_cast(node)
    return cast is not None


def _prefix(start: Any, stop: Any, step: Any, size: int, node: Node) -> int | None:
    """None for the whole dim; the kept length for a prefix; Refuse for anything else."""
    if start in (None, 0) and step in (None, 1) and (stop is None or (isinstance(stop, int) and stop >= size)):
        return None
    if start in (None, 0) and step in (None, 1) and isinstance(stop, int) and not isinstance(stop, bool):
        keep = stop + size if stop < 0 else stop
        if 0 < keep < size:
            return keep
    raise Refuse(f"a padded vocabulary without a known mask: {node.name} slices the vocabulary [{start}:{stop}:{step}]")


def _getitem(node: Node, dim: int, size: int, reader: str) -> tuple[tuple, int, int | None]:
    """(local index, the vocabulary dim after it, kept prefix) for x[index] on the full logits."""
    index = node.args[1]
    entries = list(index) if isinstance(index, tuple) else [index]
    for e in entries:
        if not (e is None or e is Ellipsis or isinstance(e, slice) or (isinstance(e, int) and not isinstance(e, bool))):
            raise Refuse(f"{node.name}: indexing the gathered logits with {e!r} is not understood")
        if isinstance(e, slice) and any(isinstance(v, Node) for v in (e.start, e.stop, e.step)):
            raise Refuse(f"{node.name}: a slice bound read from the graph")
    ndim = fake_tensor(node.args[0]).dim()
    used = sum(1 for e in entries if e is not None and e is not Ellipsis)
    if entries.count(Ellipsis) > 1:
        raise Refuse(f"{node.name}: index not understood")
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        entries[at : at + 1] = [slice(None)] * (ndim - used)
    entries += [slice(None)] * (ndim - sum(1 for e in entries if e is not None))
    in_dim = out_dim = 0
    new_dim, keep, local = None, None, []
    for e in entries:
        if e is None:
            out_dim += 1
        elif in_dim == dim:
            if not isinstance(e, slice):
                raise Refuse(f"{node.name} picks single vocabulary entries: no {reader} over the vocabulary")
            keep = _prefix(e.start, e.stop, e.step, size, node)
            e, new_dim = slice(None), out_dim
            in_dim, out_dim = in_dim + 1, out_dim + 1
        else:
            in_dim, out_dim = in_dim + 1, out_dim + (0 if isinstance(e, int) else 1)
        local.append(e)
    return tuple(local), new_dim, keep


def _index(node: Node, dim: int, size: int, reader: str) -> tuple[LocalOp | None, int, int | None]:
    """Phase 2: (the op to replay or None, the vocabulary dim after it, kept prefix or None)."""
    key = target_key(node)
    if key is operator.getitem:
        index, new_dim, keep = _getitem(node, dim, size, reader)
        whole = all(e == slice(None) for e in index) and len(index) == fake_tensor(node.args[0]).dim()
        return (None if whole else LocalOp(node, (node.args[0], index), {})), new_dim, keep
    if (cast := as_cast(node)) is not None:
        source = fake_tensor(cast[0])
        if not is_upcast(source.dtype if source is not None else None, cast[1]):
            raise Refuse(f"{node.name}: a cast of the gathered logits that is not a float upcast (a narrowing one, or "
                         f"integer logits made float) where they are indexed, before the {reader}")
        return LocalOp(node, node.args, dict(node.kwargs)), dim, None
    ndim = fake_tensor(node.args[0]).dim()
    if key is aten.select.int:
        at = normalise_dim(node.args[1], ndim)
        if at == dim:
            raise Refuse(f"{node.name} picks single vocabulary entries: no {reader} over the vocabulary")
        return LocalOp(node, node.args, {}), dim - (at < dim), None
    names = ("input", "dim", "start", "end", "step") if key is aten.slice.Tensor else ("input", "dim", "start", "length")
    bound = bind(node, names)
    if bound is None or any(isinstance(v, Node) for k, v in bound.items() if k != "input"):
        raise Refuse(f"{node.name}: slice arguments not understood")
    at = normalise_dim(bound.get("dim", 0), ndim)
    if at != dim:
        return LocalOp(node, node.args, dict(node.kwargs)), dim, None
    start = bound.get("start")
    stop = bound.get("end") if key is aten.slice.Tensor else start + bound["length"] if isinstance(start, int) else None
    return None, dim, _prefix(start, stop, bound.get("step"), size, node)


def chain_between(start: Node, end: Node) -> list[Node]:
    """Nodes on a path from `start` to `end`, both included, in graph order."""
    reach, frontier = {start}, [start]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in reach and user.op != "output":
                reach.add(user)
                frontier.append(user)
    if end not in reach:
        return []
    back, frontier = {end}, [end]
    while frontier:
        node = frontier.pop()
        for source in node.all_input_nodes:
            if source in reach and source not in back:
                back.add(source)
                frontier.append(source)
    return [n for n in start.graph.nodes if n in back]


def reassemble(gather: Gather, logits: Node, reader: str) -> Reassembly:
    """How `logits` is made from the gather's shards (the module docstring); Refuse if it is not understood.
    `reader`: what reads the logits, as refusals name it ("softmax", or "selection" for a bare one)."""
    chain = chain_between(gather.start, logits)
    if not chain:
        raise Refuse("the logits do not come from the gather")
    full_shape = _static_shape(gather.start)
    if gather.gather_dim is None:
        shard_shape = (full_shape[0] // gather.tp, *full_shape[1:])
    else:
        shard_shape = tuple(s // gather.tp if i == gather.gather_dim else s for i, s in enumerate(full_shape))
    shard_factors = [(f"x{i}", s) for i, s in enumerate(shard_shape) if s != 1]
    states: dict[Node, Any] = {gather.start: _start(gather, shard_shape)}
    position = 1
    while position < len(chain) and not _is_index(chain[position]):
        states[chain[position]] = _step(chain[position], states, gather.tp, reader)
        position += 1
    full = chain[position - 1]
    dim = _full_dim(states[full], shard_factors) if isinstance(states[full], Layout) else None
    if dim is None:
        raise Refuse(f"{full.name} is not the shards concatenated along one dim: not recognised as a reassembly of vocabulary shards")
    shape = _static_shape(full)
    local_shape = tuple(s // gather.tp if i == dim else s for i, s in enumerate(shape))
    size, shard_vocab, keep, ops = shape[dim], local_shape[dim], None, []
    for previous, node in zip(chain[position - 1 :], chain[position:]):
        if node.args[0] is not previous or not (_is_index(node) or target_key(node) in _IDENTITY):
            raise _not_understood(node, reader)
        if target_key(node) in _IDENTITY:
            continue
        op, dim, kept = _index(node, dim, size, reader)
        if op is not None:
            ops.append(op)
        if kept is not None:
            keep = size = kept if keep is None else min(keep, kept)
    return Reassembly(chain, local_shape, ops, dim, shard_vocab, keep)


__all__ = ["LocalOp", "Reassembly", "chain_between", "reassemble"]
