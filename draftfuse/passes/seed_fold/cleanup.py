"""The seed fold's rewrites on the Dynamo graph: what only existed to carry values across the seam.

Each takes the graph, its `Effects` and the report, and returns whether it changed the graph. Dynamo
graphs are not functional (in-place writes are ordinary nodes that look pure to FX), so legality is
read off the effects model, and nothing runs graph-wide dead-code elimination: `erase_dead` erases
only what a rewrite left unused, and its pure inputs that became dead in turn.

A common legality rule: no rewrite may make two graph outputs, or an output and an input, share
memory they did not share before (the caller would get one tensor where it had two), the seam
marker's removal aside: the loop then reads the seed's values themselves, as `loop(*seed(...))` does.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from draftfuse.graph.effects import Effects
from draftfuse.graph.values import Node, fake, fake_tensor, input_name, insert_after, is_integer, rewire, same_sizes, user_location
from draftfuse.passes.report import PassReport, Rewrite
from draftfuse.passes.seed_fold.regions import Regions
from draftfuse.passes.seed_fold.seam import is_seam

PASS_NAME = "seed_fold"
_TRANSFERS = {"cpu", "cuda", "to"}


def erase_dead(effects: Effects, nodes: Iterable[Node]) -> list[str]:
    """Erase `nodes` once nothing uses them, and their pure inputs that become dead; the erased names.
    Nodes the effects model has not seen (added by a rewrite) are pure calls of ours."""
    erased, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        if node.graph is None or getattr(node, "_erased", False) or node.users:
            continue
        if not (is_seam(node) or node not in effects.order and node.op in ("call_function", "call_method") or effects.is_erasable(node)):
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        erased.append(node.name)
        stack.extend(inputs)
    return erased


def _alive(node: Node) -> bool:
    return not getattr(node, "_erased", False)


def _call(after: Node, origin: Node, method: str, *args: Any, **kwargs: Any) -> Node:
    return insert_after(after, "call_method", method, args, kwargs, origin=origin, provenance=f"{PASS_NAME}: replaces {origin.name}")


# --------------------------------------------------------------------------------------------------
# The seam marker and the ranges fold() declared.


def remove_seams(graph: torch.fx.Graph, effects: Effects, report: PassReport) -> None:
    for seam in [n for n in graph.nodes if is_seam(n)]:
        carried = seam.args[0]
        for user in list(seam.users):
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                rewire(user, carried[user.args[1]])
        erased = erase_dead(effects, [*seam.users, seam])
        if _alive(seam):  # something other than getitem read the marker's list: leave it
            report.refuse(seam, "the seam marker's output list is used whole; marker kept")
            continue
        names = ", ".join(a.name for a in carried if isinstance(a, Node))
        report.rewrites.append(Rewrite("seam marker removed", tuple(erased), f"the loop reads the seed's {names}", user_location(seam)))


def _spellings(placeholder: Node) -> set[str]:
    """The names a value_ranges key may give a graph input: the user's spelling of its source (seq_lens,
    meta.seq_lens for an attribute, meta['seq_lens'] for a dict entry), a keyword argument by its name. Exact:
    meta.seq_lens is not the argument meta_seq_lens (a range on the wrong input would be trusted)."""
    name = input_name(placeholder)
    return {name, re.sub(r"^kwargs\['([^']+)'\]$", r"\1", name)}


def declare_ranges(graph: torch.fx.Graph, effects: Effects, report: PassReport, value_ranges: dict) -> None:
    """Put `draftfuse::assume_range` on each input with a declared range, for the post-grad proofs."""
    placeholders = graph.find_nodes(op="placeholder")
    written = effects.written_inputs()
    for key, (low, high) in sorted(value_ranges.items()):
        found = [p for p in placeholders if key in _spellings(p)]
        if not found:
            names = ", ".join(sorted({min(_spellings(p), key=len) for p in placeholders if is_integer(fake_tensor(p))}))
            report.notes.append(f"value_ranges: no graph input is named {key!r}; its range is unused (integer inputs: {names})")
            continue
        placeholder = found[0]
        value = fake_tensor(placeholder)
        if not is_integer(value):
            report.notes.append(f"value_ranges: {key!r} is not an integer tensor; its range is unused")
            continue
        info = torch.iinfo(value.dtype)
        if low is not None and low > info.max or high is not None and high < info.min:
            report.notes.append(f"value_ranges: no {value.dtype} value lies in {key!r}'s range [{low}, {high}]; it is unused")
            continue
        if placeholder in written:
            where = user_location(written[placeholder])
            report.notes.append(f"value_ranges: the draft writes {key!r} in place{' at ' + where if where else ''}; its range is unused")
            continue
        readers = list(placeholder.users)
        if not readers:
            continue
        low = None if low is None else int(low)
        high = None if high is None else int(high)
        assume = insert_after(
            placeholders[-1], "call_function", torch.ops.draftfuse.assume_range.default, (placeholder, low, high, key),
            origin=readers[0], provenance=f"{PASS_NAME}: declared range of {key}",
        )  # fmt: skip
        rewire(placeholder, assume, readers)
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        report.rewrites.append(Rewrite("range declared", (placeholder.name,), f"every element of {key} in {bounds}", ""))


# --------------------------------------------------------------------------------------------------
# Host round trips.


def _transfer_source(node: Any) -> Node | None:
    """x for x.cpu() / x.cuda() / x.to(device) that keeps the dtype."""
    if not isinstance(node, Node) or node.op != "call_method" or node.target not in _TRANSFERS:
        return None
    if not isinstance(node.args[0], Node):
        return None
    source, result = fake_tensor(node.args[0]), fake_tensor(node)
    if source is None or result is None or source.dtype != result.dtype:
        return None
    return node.args[0]


def remove_round_trips(graph: torch.fx.Graph, effects: Effects, report: PassReport) -> bool:
    """`x.cpu()` ... `.to(x.device)` becomes x, when nothing writes either copy or x from the first copy on."""
    changed = False
    for back in list(graph.nodes):
        host = _transfer_source(back)
        origin = _transfer_source(host)
        if origin is None or not _alive(back) or not _alive(host):
            continue
        source, result = fake_tensor(origin), fake_tensor(back)
        if fake_tensor(host).device.type != "cpu" or not _same_layout(source, result):
            continue
        reason = None
        if effects.writers([origin], host) or effects.written_after(host) or effects.written_after(back):
            reason = "a tensor of the round trip is written in place after the copy"
        elif effects.would_alias(back, origin):
            reason = f"{back.name} (or a view of it) is returned and {_shown(origin)} is an input or an output: they would share memory"
        if reason:
            report.refuse(back, f"host round trip {origin.name} -> {host.name} -> {back.name} kept: {reason}")
            continue
        rewire(back, origin)
        erased = erase_dead(effects, [back])
        kept = f"; {host.name} stays, something on the host reads it" if _alive(host) else ""
        report.rewrites.append(Rewrite("host round trip removed", tuple(erased), f"readers of {back.name} read {origin.name}{kept}", user_location(back)))
        changed = True
    return remove_item_round_trips(graph, effects, report) or changed


def remove_item_round_trips(graph: torch.fx.Graph, effects: Effects, report: PassReport) -> bool:
    """full(shape, x.item()) / tensor(x.item()) / scalar_tensor(x.item()) on x's device: a broadcast of x."""
    changed = False
    for item in [n for n in graph.nodes if n.op == "call_method" and n.target == "item"]:
        source = item.args[0]
        source_value = fake_tensor(source)
        for user in list(item.users):
            value = fake_tensor(user)
            name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
            if source_value is None or value is None or name not in ("full", "tensor", "scalar_tensor"):
                continue
            fill = user.args[1 if name == "full" else 0] if len(user.args) > (name == "full") else None
            if fill is not item or value.device != source_value.device or not all(isinstance(s, int) for s in value.shape):
                continue
            if not _fills_alike(source_value.dtype, value.dtype):  # full() rounds a Python float, or raises where the cast wraps
                report.refuse(user, f"{source.name}.item() round trip kept: full() of a {source_value.dtype} value as {value.dtype} may not be its cast")
                continue
            if effects.writers([source], item, user):
                report.refuse(user, f"{source.name}.item() round trip kept: {source.name} is written in between")
                continue
            # reshape(()) + to(dtype) + expand + clone: the values full() makes, in fresh memory.
            scalar = _call(user, user, "reshape", source, ())
            cast = _call(scalar, user, "to", scalar, value.dtype)
            broadcast = _call(cast, user, "expand", cast, tuple(value.shape))
            fresh = _call(broadcast, user, "clone", broadcast, memory_format=torch.contiguous_format)
            rewire(user, fresh)
            erased = erase_dead(effects, [user])
            detail = f"{name}({item.name}) -> broadcast of {source.name} on its device"
            report.rewrites.append(Rewrite("host round trip removed", tuple(erased), detail, user_location(user)))
            changed = True
    return changed


def _fills_alike(source: torch.dtype, result: torch.dtype) -> bool:
    """Whether full(shape, x.item(), dtype=result) and x.to(result) agree for every x of dtype `source`:
    full() raises where a value does not fit (int16 of 40000, float16 of 70000), the cast wraps or gives
    inf; an integer full() of a float truncates nothing, it raises or rounds; so the result's range must
    hold the source's."""
    if source == result or source == torch.bool or result == torch.bool:
        return True
    if source.is_complex or result.is_complex or (source.is_floating_point and not result.is_floating_point):
        return False
    wide = torch.finfo(result) if result.is_floating_point else torch.iinfo(result)
    narrow = torch.finfo(source) if source.is_floating_point else torch.iinfo(source)
    return wide.min <= narrow.min and wide.max >= narrow.max


# --------------------------------------------------------------------------------------------------
# Buffers filled across the seam.


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_place = a.dtype == b.dtype and a.device == b.device
    return same_place and same_sizes(a.shape, b.shape) and same_sizes(a.stride(), b.stride())


def _full_fill(node: Node, effects: Effects) -> tuple[Node, Node] | None:
    """(buffer, source) if `node` overwrites every element of a tensor from a tensor of the same shape:
    copy_, buf[:] = src / buf[...] = src, or index_copy_ along a dim with arange(size of that dim), an arange
    nothing wrote since (idx.copy_(idx.flip(0)) makes it a permutation)."""
    if node.op == "call_method" and node.target == "copy_" and len(node.args) >= 2 and not node.kwargs:
        buffer, source = node.args[:2]
    elif node.op == "call_function" and node.target is operator.setitem:
        buffer, index, source = node.args
        indices = index if isinstance(index, tuple) else (index,)
        if not all(not isinstance(i, Node) and (i == slice(None) or i is Ellipsis) for i in indices):
            return None
    elif node.op == "call_method" and node.target == "index_copy_" and len(node.args) == 4:
        buffer, dim, index, source = node.args
        if not _is_full_arange(index, fake_tensor(buffer), dim) or effects.writers([index], index, node):
            return None
    else:
        return None
    if not isinstance(buffer, Node) or not isinstance(source, Node):
        return None
    buffer_value, source_value = fake_tensor(buffer), fake_tensor(source)
    if buffer_value is None or source_value is None or not same_sizes(buffer_value.shape, source_value.shape):
        return None
    return buffer, source


def _is_full_arange(index: Any, buffer: torch.Tensor | None, dim: Any) -> bool:
    if not isinstance(index, Node) or getattr(index.target, "__name__", index.target) != "arange":
        return False
    if buffer is None or not isinstance(dim, int) or index.kwargs.keys() - {"device", "dtype"}:
        return False
    if len(index.args) == 1:
        start, end = 0, index.args[0]
    elif len(index.args) == 2:
        start, end = index.args
    else:
        return False
    end = fake(end) if isinstance(end, Node) else end
    if start != 0 or end is None:
        return False
    return statically_known_true(end == buffer.shape[dim])


def _placeholder_of(graph: torch.fx.Graph, effects: Effects, buffer: Node) -> Node | None:
    """The caller's tensor whose memory `buffer` lives in, if any."""
    return next((p for p in graph.find_nodes(op="placeholder") if effects.memory(p) & effects.memory(buffer)), None)


def forward_buffers(graph: torch.fx.Graph, effects: Effects, regions: Regions, report: PassReport, drop_buffer_writes: bool) -> bool:
    """`buf = zeros(...); buf.copy_(src)`: readers of buf after the fill read src (see why_not_forward)."""
    changed = False
    for fill in list(graph.nodes):
        found = _full_fill(fill, effects) if _alive(fill) and fill in effects.order else None
        if found is None:
            continue
        buffer, source = found
        caller = _placeholder_of(graph, effects, buffer)
        if caller is not None:
            if fill not in regions.seed or not any(u not in regions.seed for u in caller.users):
                continue  # a write the draft makes for its caller (a KV cache...), not a seam carry
            if buffer is not caller or not drop_buffer_writes:
                option = f" (drop_buffer_writes=True drops it if nothing reads {caller.name} after the draft)" if buffer is caller else ""
                report.refuse(fill, f"write into caller-visible {caller.name} kept{option}")
                continue
        elif not _is_fresh_allocation(effects, buffer):
            continue  # overwriting a computed tensor or a view is real work
        reason = why_not_forward(effects, buffer, source, fill, caller is not None)
        if reason:
            report.refuse(fill, f"{buffer.name} filled from {_shown(source)} kept: {reason}")
            continue
        replacement = source
        if fake_tensor(source).dtype != fake_tensor(buffer).dtype:  # copy_ converts, as .to does
            replacement = _call(fill, fill, "to", source, fake_tensor(buffer).dtype)
        position = effects.order[fill]
        later = [u for u in buffer.users if u is not fill and effects.order.get(u, position + 1) > position]
        rewire(buffer, replacement, later)
        rewire(fill, replacement)
        names = [buffer.name, fill.name]
        fill_inputs = fill.all_input_nodes  # the buffer, the fill's source and index (an arange, say)
        graph.erase_node(fill)
        erase_dead(effects, fill_inputs)  # a caller's buffer is a placeholder: never erased
        rule = "write into caller buffer dropped (drop_buffer_writes)" if caller is not None else "placeholder allocation removed"
        report.rewrites.append(Rewrite(rule, tuple(names), f"readers of {buffer.name} read {source.name}", user_location(fill)))
        changed = True
    return changed


def _is_fresh_allocation(effects: Effects, buffer: Node) -> bool:
    """A pure call whose value lives in memory of its own: no earlier value shares it."""
    if not effects.is_pure(buffer):
        return False  # an in-place result, an unknown call, a random draw (dropping it shifts the stream)
    mine = effects.memory(buffer)
    position = effects.order[buffer]
    return bool(mine) and not any(effects.memory(n) & mine for n, p in effects.order.items() if p < position)


# readers of a tensor's storage rather than of its elements: a buffer forwarded to its source (another
# storage, another offset) would make them read elsewhere
_BY_STORAGE = {"as_strided", "as_strided_", "as_strided_scatter", "set_", "storage_offset", "untyped_storage", "data_ptr"}


def _name(node: Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target)).split(".")[0]


def why_not_forward(effects: Effects, buffer: Node, source: Node, fill: Node, caller_buffer: bool) -> str | None:
    position = effects.order[fill]
    buffer_value, source_value = fake_tensor(buffer), fake_tensor(source)
    if buffer_value.device != source_value.device:
        return "the fill copies between devices"
    if not same_sizes(buffer_value.stride(), source_value.stride()):
        return "the source's strides differ from the buffer's"
    views = [n for n, p in effects.order.items() if p < position and n is not buffer and effects.memory(n) & effects.memory(buffer)]
    if any(effects.order.get(u, 0) > position for v in views for u in v.users):
        return f"a view of {buffer.name} taken before the fill is read after it"
    aliases = [n for n in effects.order if n is buffer or effects.memory(n) & effects.memory(buffer)]
    if reader := next((u for n in aliases for u in n.users if _name(u) in _BY_STORAGE), None):
        return f"{reader.name} reads {buffer.name} by its storage ({_name(reader)}), where the source's offset and extent differ"
    if not caller_buffer and any(effects.order[u] < position for u in buffer.users):
        return f"{buffer.name} is used before it is filled"
    if effects.writers([buffer], fill):
        return f"{buffer.name} is written again later"
    if effects.writers([source], fill):
        return f"{source.name} is written after the fill, so the buffer keeps its old values"
    if caller_buffer and effects.memory(buffer) & effects.returned_memory():
        return f"{buffer.name} is returned: the caller reads it after the draft"
    if effects.would_alias(buffer, source):
        return f"{buffer.name} (or a view of it) is returned and {_shown(source)} is an input or an output: they would share memory"
    return None


def _shown(node: Node) -> str:
    """A node as the user knows it: an input by its own name (tok, not Dynamo's l_tok_)."""
    return input_name(node) if node.op == "placeholder" else node.name
