"""Seed fold: make a draft's seed forward iteration 0 of the captured region, and drop what the seam cost.

Servers run a draft's seed forward eagerly and replay a captured graph of the recurrent steps. Once
both are traced as one Dynamo graph (`draftfuse.fold(seed, loop)` marks the old seam by passing the
seed's tensors through `draftfuse::seam`, an op that returns copies of them), this pass removes what
only existed to carry values across the seam and computes once the setup both sides computed:

  * the seam marker itself: the loop reads the seed's values directly, as in `loop(*seed(...))`;
  * placeholder allocations that get filled: `buf = zeros(...); buf.copy_(src)` (also `buf[:] = src`
    and `buf.index_copy_(d, arange(buf.size(d)), src)`) becomes `src`;
  * host round trips whose value comes back: `x.cpu()` ... `.to(x.device)` becomes `x`, and
    `full(shape, x.item())` / `tensor(x.item())` / `scalar_tensor(x.item())` a broadcast of `x` on its device;
  * setup computed on both sides: identical pure nodes are merged (CSE that respects in-place writes),
    and integer index arithmetic (positions, lengths, clamps, symbolic sizes) is merged when sympy
    proves both sides equal elementwise, e.g. `clamp(seq_lens - 1, min=0)` and `seq_lens - 1` once
    `seq_lens >= 1` is known. What cannot be proven stays, and the report says why.

Legality. Dynamo graphs are not functional (in-place `copy_`, `index_copy_`, `setitem` are ordinary
nodes that `Node.is_impure()` calls pure), so the pass tracks which allocation each value may live in
and where each allocation is written, and never runs dead-code elimination: it erases only the nodes
its rewrites replaced, and their pure inputs that became dead. A node is merged into an earlier one
only if both are deterministic, compute the same call on the same values (no write in between; same
result dtype, so autocast regions stay apart) and neither result is written later. A buffer is
replaced by its source only if it is a fresh in-graph allocation, fully overwritten before any read,
never written again, with a source of the same layout that is not written afterwards either. Writes
into tensors the caller passed in (static buffers, KV caches) are kept: the caller can observe them.
The opt-in `drop_buffer_writes=True` drops full overwrites, made by the seed, of caller buffers whose
value the loop reads (the loop reads the source instead): use it only when nothing reads those
buffers after the draft. No rewrite may make two graph outputs, or an output and an input, share
memory that they did not share before, the seam marker's removal aside: the loop then reads the
seed's values themselves, as `loop(*seed(...))` does. Calls the pass does not know (user functions allowed in the
graph, higher-order ops) are assumed to write all their inputs.

The proofs. An integer tensor's elementwise value is written as a sympy expression over symbols for
its leaves (arguments, or values not translated), only through operations whose operands all have the
result's shape or a single element, so one symbol always stands for the element at the same index.
Ring operations (+, -, *) are exact under int64/int32 wrap-around; a clamp, maximum/minimum, floor
division, modulo or integer cast is decided by the ranges (a clamp that never clamps disappears) only
when its operands provably fit their dtypes, i.e. nothing wrapped around before it. Ranges come from
dtypes, the ShapeEnv (symbolic sizes, which are int64), producers (`arange`, `topk`/`argmax`
indices, `full`) and the caller: `value_ranges={"seq_lens": (1, None)}` declares every element of the
graph input `seq_lens` to be >= 1 (keys are argument names; `a.b` for attribute `b` of argument `a`).
A declared range is trusted, not checked. fold() hands its options to the pass inside the marker
(`seam_facts`); `fold_seed`'s own arguments add to them (for the same argument, the marker's wins).

Regions. The seed region is everything before the first seam marker. Iterations are counted by
chains of dependent selections (topk, argmax/argmin, max/min over a dim): each link is one iteration,
so a tree step that selects twice (expand, then rerank) counts twice. A graph without a marker is
folded only if its selections form a chain of two or more (a draft loop with its seed inside, as
`@draft_loop` sees it); the seed region is then everything up to the first selection. Parallel
selections (Medusa heads) or a single one leave the graph unchanged ("no seam").

Limits: floating-point setup and boolean masks are merged only when computed identically (no
algebra on them: it would not be bit-exact); a host round trip with computation on the host in
between, and `.tolist()`, are left alone (the capture checks then report the sync).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import sympy
import torch
import torch.fx
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils._sympy.functions import FloorDiv, Max, Min, PythonMod
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from draftfuse.passes._report import PassReport, PassResult, Refusal, Rewrite, copy_graph_module, user_location

log = logging.getLogger(__name__)
PASS_NAME = "seed_fold"
# Each step can expose work for the others (a removed round trip makes two setups identical, a merge
# makes a clamp provable): the pass repeats them until nothing changes, at most this many times.
_MAX_ROUNDS = 8
ValueRangeSpec = Mapping[str, tuple[int | None, int | None]]


# --------------------------------------------------------------------------------------------------
# The seam marker. fold() passes the seed's tensors through it; this pass removes it.


@torch.library.custom_op("draftfuse::seam", mutates_args=())
def _seam(tensors: list[torch.Tensor], facts: str) -> list[torch.Tensor]:
    # Copies, because a custom op may not return its inputs. The pass removes the op, so the copies
    # only run when the graph is compiled without the pass.
    return [t.clone() for t in tensors]


@_seam.register_fake
def _seam_fake(tensors: list[torch.Tensor], facts: str) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


def seam_facts(*, value_ranges: ValueRangeSpec | None = None, drop_buffer_writes: bool = False) -> str:
    """What the caller of fold() states about a draft, as the marker's constant argument: the pass
    reads it as if given to `fold_seed` (computed outside the traced code: json is not traceable)."""
    facts = {"value_ranges": {name: list(bounds) for name, bounds in (value_ranges or {}).items()}}
    facts["drop_buffer_writes"] = drop_buffer_writes
    return json.dumps(facts, sort_keys=True)


def mark_seam(values: Any, facts: str = "{}") -> Any:
    """`values` (a tensor, or a tuple/list/dict holding tensors and other values) with every tensor
    passed through the seam marker, so that the traced graph shows where the seed ends."""
    leaves, spec = tree_flatten(values)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not where:
        return values
    marked = torch.ops.draftfuse.seam.default([leaves[i] for i in where], facts)
    for i, tensor in zip(where, marked):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


def _seam_facts(graph: torch.fx.Graph) -> tuple[dict, bool]:
    """The value ranges and drop_buffer_writes that fold() put in the graph's seam markers."""
    value_ranges, drop_buffer_writes = {}, False
    for seam in [n for n in graph.nodes if _is_seam(n)]:
        facts = json.loads(seam.args[1] if len(seam.args) > 1 else seam.kwargs.get("facts", "{}"))
        value_ranges.update({name: tuple(bounds) for name, bounds in facts.get("value_ranges", {}).items()})
        drop_buffer_writes |= bool(facts.get("drop_buffer_writes"))
    return value_ranges, drop_buffer_writes


def _is_seam(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name == "draftfuse::seam"
    return isinstance(node.target, torch._ops.OpOverloadPacket) and node.target._qualified_op_name == "draftfuse::seam"


# --------------------------------------------------------------------------------------------------
# What a node does to memory. Dynamo graphs mix call_function (torch.*, operator.*) and call_method.

_RANDOM = {
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
    "multinomial", "normal", "poisson", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
    "dropout2d", "dropout3d", "rrelu", "native_dropout", "uniform_", "normal_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "random_", "bernoulli_",
}
# Their values are host scalars or have data-dependent shapes: merging them would leave stale unbacked
# symbols in the graph's metadata, so they are never merged (they are erased when a rewrite kills them).
_HOST_VALUES = {"item", "tolist", "nonzero", "unique", "_local_scalar_dense"}
_IN_PLACE_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul,
}
_KNOWN_MODULES = ("torch", "_operator", "math", "builtins")
_FACTORIES = {
    "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "empty_strided",
}
# Results that never share memory with an argument. Anything else may be a view of its tensor
# arguments (reshape, to, contiguous, getitem...): assuming so only makes the pass more careful.
_FRESH = _FACTORIES | {
    "arange", "tensor", "scalar_tensor", "clone", "add", "sub", "mul", "div", "truediv", "floordiv",
    "floor_divide", "remainder", "mod", "neg", "pow", "matmul", "mm", "bmm", "addmm", "baddbmm", "linear",
    "embedding", "cat", "stack", "where", "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum",
    "exp", "log", "rsqrt", "sqrt", "sin", "cos", "sigmoid", "silu", "gelu", "relu", "tanh", "softmax",
    "log_softmax", "topk", "sort", "argmax", "argmin", "max", "min", "sum", "mean", "amax", "amin",
    "cumsum", "gather", "index_select", "masked_fill", "repeat", "repeat_interleave", "outer", "einsum",
    "rms_norm", "layer_norm", "scaled_dot_product_attention", "lt", "le", "gt", "ge", "eq", "ne",
    "logical_and", "logical_or", "logical_not", "and_", "or_", "xor", "invert", "abs", "rsub",
}
_SELECTIONS = {"topk", "argmax", "argmin", "max", "min"}
_TRANSFERS = {"cpu", "cuda", "to"}


def _name(node: Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.split("::")[-1]
    return getattr(node.target, "__name__", "")


def _value(node: Any) -> Any:
    """The fake value a node carries (Dynamo: example_value, ATen: val)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _tensor_value(node: Any) -> torch.Tensor | None:
    value = _value(node)
    return value if isinstance(value, torch.Tensor) else None


def _alive(node: Node) -> bool:
    return not getattr(node, "_erased", False)


def _memory_inputs(node: Node) -> list[Node]:
    """Inputs that may hold tensors (anything but symbolic or plain scalars)."""
    scalars = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
    return [a for a in node.all_input_nodes if not isinstance(_value(a), scalars)]


def _written(node: Node) -> list[Node] | None:
    """The values `node` writes in place ([] if none); None if unknown: it may write any of its inputs."""
    if node.op == "call_method":
        name = str(node.target)
        in_place = name.endswith("_") and not name.startswith("__")
        return [node.args[0]] if in_place and isinstance(node.args[0], Node) else []
    if node.op == "call_module":
        return None
    if node.op != "call_function":
        return []
    target = node.target
    if target in _IN_PLACE_OPERATORS:
        return [node.args[0]] if isinstance(node.args[0], Node) else []
    if isinstance(target, torch._ops.HigherOrderOperator):
        return None  # its body is a graph of its own, with writes this pass does not look into
    if isinstance(target, torch._ops.OpOverloadPacket):  # an overload is picked at run time: any may run
        mutable = any(getattr(target, name)._schema.is_mutable for name in target.overloads())
        return None if mutable else []
    if isinstance(target, torch._ops.OpOverload):
        written = []
        for i, argument in enumerate(target._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
                written += [a for a in tree_flatten(value)[0] if isinstance(a, Node)]
        return written
    if not (getattr(target, "__module__", None) or "").startswith(_KNOWN_MODULES):
        return None
    written = [node.kwargs["out"]] if isinstance(node.kwargs.get("out"), Node) else []
    name = _name(node)
    if node.kwargs.get("inplace") is True or (name.endswith("_") and not name.startswith("_")):
        first = node.args[0] if node.args else node.kwargs.get("input")
        if isinstance(first, Node):
            written.append(first)
    return written


def _is_random(node: Node) -> bool:
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
        return True
    return _name(node) in _RANDOM


def _is_pure(node: Node) -> bool:
    """No write, no randomness: may be merged with a twin, or erased once a rewrite leaves it unused."""
    if node.op not in ("call_function", "call_method") or _is_seam(node):
        return False
    if _written(node) != [] or _is_random(node):
        return False
    # Calls that return nothing are there for their effect (grad mode switches, torch._check).
    return _value(node) is not None or bool(node.users)


def _is_fresh(node: Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        return False
    return _name(node) in _FRESH


# --------------------------------------------------------------------------------------------------
# Facts about one graph: order, which allocations a value may live in, where each is written.


@dataclasses.dataclass
class _Facts:
    order: dict[Node, int]
    roots: dict[Node, frozenset[Node]]  # the allocations a node's value may live in
    writes: dict[Node, list[int]]  # allocation -> positions of the nodes that may write it
    visible: frozenset[Node]  # allocations the graph's outputs may share
    inputs: frozenset[Node]  # allocations the caller passed in

    def written(self, node: Node, start: int, stop: int = 1 << 62) -> bool:
        """Whether an allocation `node` may live in is written at a position in [start, stop)."""
        for root in self.roots.get(node, ()):
            positions = self.writes.get(root, [])
            if bisect.bisect_left(positions, start) < bisect.bisect_left(positions, stop):
                return True
        return False

    def versions(self, node: Node, at: int) -> tuple:
        """How many writes each allocation under `node` has seen before position `at`."""
        roots = self.roots.get(node, ())
        return tuple(sorted((self.order[r], bisect.bisect_left(self.writes.get(r, []), at)) for r in roots))

    def written_after(self, node: Node) -> bool:
        return self.written(node, self.order[node])

    def shares_output(self, node: Node) -> bool:
        return bool(self.roots.get(node, frozenset()) & self.visible)

    def shares_input(self, node: Node) -> bool:
        return bool(self.roots.get(node, frozenset()) & self.inputs)


def _analyse(graph: torch.fx.Graph) -> _Facts:
    order, roots, writes, inputs = {}, {}, {}, set()
    for position, node in enumerate(graph.nodes):
        order[node] = position
        if node.op in ("placeholder", "get_attr"):
            roots[node] = frozenset([node])
            inputs.add(node)
            continue
        if node.op == "output":
            continue
        memory = _memory_inputs(node)
        roots[node] = frozenset([node])
        if not _is_fresh(node):
            roots[node] = roots[node].union(*(roots[a] for a in memory))
        written = _written(node)
        for target in memory if written is None else written:
            for root in roots[target]:
                writes.setdefault(root, []).append(position)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    visible = frozenset().union(*(roots.get(n, frozenset()) for n in output.all_input_nodes))
    return _Facts(order, roots, writes, visible, frozenset(inputs))


# --------------------------------------------------------------------------------------------------
# Regions: the seed and the iterations.


def _selection_dim(node: Node) -> Any:
    position, default = (2, -1) if _name(node) == "topk" else (1, None)
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)


def _is_selection(node: Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    name = _name(node)
    if isinstance(node.target, torch._ops.OpOverload):
        return any(word in name for word in ("topk", "argmax", "argmin"))
    if name not in _SELECTIONS:
        return False
    dim = _selection_dim(node)  # max(a, b) is elementwise and max(x) a reduction: neither selects
    return name in ("topk", "argmax", "argmin") or isinstance(dim, int) and not isinstance(dim, bool)


def _selection_depths(graph: torch.fx.Graph, facts: _Facts) -> dict[Node, int]:
    """For each selection, the number of selections on its longest chain of dependencies, itself
    included. Values also flow through memory: a read of a buffer depends on what was written there."""
    depth: dict[Node, int] = {}
    written_depth: dict[Node, int] = {}
    selections = {}
    for node in graph.nodes:
        reads = [depth.get(a, 0) for a in node.all_input_nodes]
        reads += [written_depth.get(r, 0) for a in node.all_input_nodes for r in facts.roots.get(a, ())]
        selects = _is_selection(node)
        depth[node] = max(reads, default=0) + selects
        if selects:
            selections[node] = depth[node]
        for target in _written(node) or []:
            for root in facts.roots.get(target, ()):
                written_depth[root] = max(written_depth.get(root, 0), depth[node])
    return selections


@dataclasses.dataclass
class _Regions:
    seed: set[Node]  # the seed's nodes; everything else (and every node a rewrite adds) is the loop
    seed_selections: list[Node]
    loop_selections: list[Node]
    seed_iterations: int
    loop_iterations: int

    def across(self, earlier: Node, later: Node) -> bool:
        return earlier in self.seed and later not in self.seed


def _find_regions(graph: torch.fx.Graph, facts: _Facts) -> _Regions | None:
    depths = _selection_depths(graph, facts)
    seam = next((n for n in graph.nodes if _is_seam(n)), None)
    if seam is not None:
        boundary = facts.order[seam]
    else:
        chain = sorted(set(depths.values()))
        if len(chain) < 2:
            return None
        first = min((n for n, d in depths.items() if d == chain[0]), key=facts.order.get)
        parts = [u for u in first.users if u.op == "call_function" and u.target is operator.getitem]
        boundary = max(facts.order[n] for n in [first, *parts]) + 1  # the first selection and its values
    seed = {n for n in graph.nodes if facts.order[n] < boundary and n.op not in ("placeholder", "get_attr")}
    seed_selections = [n for n in depths if n in seed]
    loop_selections = [n for n in depths if n not in seed]
    return _Regions(
        seed,
        seed_selections,
        loop_selections,
        len({depths[n] for n in seed_selections}),
        len({depths[n] for n in loop_selections}),
    )


# --------------------------------------------------------------------------------------------------
# Rewriting helpers.


def _refuse(report: PassReport, node: Node, reason: str) -> None:
    report.refusals.append(Refusal(node.name, reason, user_location(node)))


def _erase_dead(graph: torch.fx.Graph, nodes: Iterable[Node]) -> list[str]:
    """Erase `nodes` once nothing uses them, and their pure inputs that become dead; the erased names."""
    erased, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        if not _alive(node) or node.users or not (_is_pure(node) or _is_seam(node)):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.append(node.name)
        stack.extend(inputs)
    return erased


def _insert_call(
    graph: torch.fx.Graph, after: Node, origin: Node, target: str, args: tuple, kwargs: dict | None = None
) -> Node:
    """A new call_method node after `after`, with a fake value computed from its inputs' and the stack
    trace of `origin`, the node it stands in for (later passes and error messages see shapes and lines)."""
    kwargs = kwargs or {}
    with graph.inserting_after(after):
        node = graph.call_method(target, args, kwargs)
    fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), _value)
    fake_mode = getattr(fake_args[0], "fake_mode", None)
    if fake_mode is not None:
        with fake_mode:
            node.meta["example_value"] = getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
    if "stack_trace" in origin.meta:
        node.meta["stack_trace"] = origin.meta["stack_trace"]
    return node


def _signature(value: torch.Tensor) -> tuple:
    return (value.dtype, value.device, tuple(map(str, value.shape)))


def _same_sizes(a: Iterable, b: Iterable) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_place = a.dtype == b.dtype and a.device == b.device
    return same_place and _same_sizes(a.shape, b.shape) and _same_sizes(a.stride(), b.stride())


# --------------------------------------------------------------------------------------------------
# 1. The seam marker.


def _remove_seams(graph: torch.fx.Graph, report: PassReport) -> None:
    for seam in [n for n in graph.nodes if _is_seam(n)]:
        carried = seam.args[0]
        for user in list(seam.users):
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                user.replace_all_uses_with(carried[user.args[1]])
        erased = _erase_dead(graph, [*seam.users, seam])
        if _alive(seam):  # something other than getitem read the marker's list: leave it
            _refuse(report, seam, "the seam marker's output list is used whole; marker kept")
            continue
        names = ", ".join(a.name for a in carried if isinstance(a, Node))
        report.rewrites.append(Rewrite("seam marker removed", tuple(erased), f"the loop reads the seed's {names}"))


# --------------------------------------------------------------------------------------------------
# 2. Host round trips.


def _transfer_source(node: Any) -> Node | None:
    """x for x.cpu() / x.cuda() / x.to(device) that keeps the dtype."""
    if not isinstance(node, Node) or node.op != "call_method" or node.target not in _TRANSFERS:
        return None
    if not isinstance(node.args[0], Node):
        return None
    source, result = _tensor_value(node.args[0]), _tensor_value(node)
    if source is None or result is None or source.dtype != result.dtype:
        return None
    return node.args[0]


def _remove_round_trips(graph: torch.fx.Graph, facts: _Facts, report: PassReport) -> bool:
    changed = False
    for back in list(graph.nodes):
        host = _transfer_source(back)
        origin = _transfer_source(host)
        if origin is None or not _alive(back):
            continue
        source, result = _tensor_value(origin), _tensor_value(back)
        if _tensor_value(host).device.type != "cpu" or not _same_layout(source, result):
            continue
        reason = None
        if facts.written(origin, facts.order[host]) or facts.written_after(host) or facts.written_after(back):
            reason = "a tensor of the round trip is written in place after the copy"
        elif facts.shares_output(back) and (facts.shares_output(origin) or facts.shares_input(origin)):
            reason = f"{back.name} is returned and {origin.name} is an input or an output: they would share memory"
        if reason:
            _refuse(report, back, f"host round trip {origin.name} -> {host.name} -> {back.name} kept: {reason}")
            continue
        back.replace_all_uses_with(origin)
        erased = _erase_dead(graph, [back])
        kept = f"; {host.name} stays, something on the host reads it" if _alive(host) else ""
        detail = f"readers of {back.name} read {origin.name}{kept}"
        report.rewrites.append(Rewrite("host round trip removed", tuple(erased), detail))
        changed = True
    return _remove_item_round_trips(graph, facts, report) or changed


def _remove_item_round_trips(graph: torch.fx.Graph, facts: _Facts, report: PassReport) -> bool:
    """full(shape, x.item()) / tensor(x.item()) / scalar_tensor(x.item()) on x's device: a broadcast of x."""
    changed = False
    for item in [n for n in graph.nodes if n.op == "call_method" and n.target == "item"]:
        source = item.args[0]
        source_value = _tensor_value(source)
        for user in list(item.users):
            value = _tensor_value(user)
            name = _name(user)
            if source_value is None or value is None or name not in ("full", "tensor", "scalar_tensor"):
                continue
            fill = user.args[1 if name == "full" else 0] if len(user.args) > (name == "full") else None
            static_shape = all(isinstance(s, int) for s in value.shape)
            if fill is not item or value.device != source_value.device or not static_shape:
                continue
            if source_value.is_floating_point() and not value.is_floating_point():
                continue  # full() would round the Python float; keep it
            if facts.written(source, facts.order[item], facts.order[user]):
                _refuse(report, user, f"{source.name}.item() round trip kept: {source.name} is written in between")
                continue
            # reshape(()) + to(dtype) + expand + clone: the values full() makes, in fresh memory.
            scalar = _insert_call(graph, user, user, "reshape", (source, ()))
            cast = _insert_call(graph, scalar, user, "to", (scalar, value.dtype))
            broadcast = _insert_call(graph, cast, user, "expand", (cast, tuple(value.shape)))
            contiguous = {"memory_format": torch.contiguous_format}
            fresh = _insert_call(graph, broadcast, user, "clone", (broadcast,), contiguous)
            user.replace_all_uses_with(fresh)
            erased = _erase_dead(graph, [user])
            detail = f"{name}({item.name}) -> broadcast of {source.name} on its device"
            report.rewrites.append(Rewrite("host round trip removed", tuple(erased), detail))
            changed = True
    return changed


# --------------------------------------------------------------------------------------------------
# 3. Buffers filled across the seam.


def _full_fill(node: Node) -> tuple[Node, Node] | None:
    """(buffer, source) if `node` overwrites every element of a tensor from a tensor of the same shape:
    copy_, buf[:] = src / buf[...] = src, or index_copy_ along a dim with arange(size of that dim)."""
    if node.op == "call_method" and node.target == "copy_" and len(node.args) >= 2:
        buffer, source = node.args[:2]
    elif node.op == "call_function" and node.target is operator.setitem:
        buffer, index, source = node.args
        indices = index if isinstance(index, tuple) else (index,)
        if not all(_is_one_of(i, (slice(None), Ellipsis)) for i in indices):
            return None
    elif node.op == "call_method" and node.target == "index_copy_" and len(node.args) == 4:
        buffer, dim, index, source = node.args
        if not _is_full_arange(index, _tensor_value(buffer), dim):
            return None
    else:
        return None
    buffer_value, source_value = _tensor_value(buffer), _tensor_value(source)
    if buffer_value is None or source_value is None or not _same_sizes(buffer_value.shape, source_value.shape):
        return None
    return buffer, source


def _is_one_of(value: Any, constants: tuple) -> bool:
    return not isinstance(value, Node) and any(value == c for c in constants)


def _is_full_arange(index: Any, buffer: torch.Tensor | None, dim: Any) -> bool:
    if not isinstance(index, Node) or _name(index) != "arange" or buffer is None or not isinstance(dim, int):
        return False
    if len(index.args) == 1:
        start, end = 0, index.args[0]
    elif len(index.args) == 2:
        start, end = index.args
    else:
        return False
    end = _value(end) if isinstance(end, Node) else end
    if start != 0 or index.kwargs.get("step", 1) != 1 or end is None:
        return False
    return statically_known_true(end == buffer.shape[dim])


def _forward_buffers(
    graph: torch.fx.Graph, facts: _Facts, regions: _Regions, report: PassReport, drop_buffer_writes: bool
) -> bool:
    changed = False
    for fill in list(graph.nodes):
        found = _full_fill(fill) if _alive(fill) else None
        if found is None:
            continue
        buffer, source = found
        callers = facts.roots[buffer] & facts.inputs
        if callers:
            caller = min(callers, key=facts.order.get)
            if fill not in regions.seed or not any(u not in regions.seed for u in caller.users):
                continue  # a write the draft makes for its caller (a KV cache...), not a seam carry
            if buffer is not caller or not drop_buffer_writes:
                option = ""
                if buffer is caller:
                    option = f" (drop_buffer_writes=True drops it if nothing reads {caller.name} after the draft)"
                _refuse(report, fill, f"write into caller-visible {caller.name} kept{option}")
                continue
        elif not (_name(buffer) in _FACTORIES and facts.roots[buffer] == frozenset([buffer])):
            continue  # overwriting a computed tensor or a view is real work
        reason = _why_not_forward(buffer, source, fill, facts, bool(callers))
        if reason:
            _refuse(report, fill, f"{buffer.name} filled from {source.name} kept: {reason}")
            continue
        replacement = source
        if _tensor_value(source).dtype != _tensor_value(buffer).dtype:  # copy_ converts, as .to does
            replacement = _insert_call(graph, fill, fill, "to", (source, _tensor_value(buffer).dtype))
        position = facts.order[fill]
        for user in list(buffer.users):
            if user is not fill and facts.order.get(user, position + 1) > position:
                user.replace_input_with(buffer, replacement)
        fill.replace_all_uses_with(replacement)
        names = [buffer.name, fill.name]
        fill_inputs = fill.all_input_nodes  # the buffer, the fill's source and index (an arange, say)
        graph.erase_node(fill)
        _erase_dead(graph, fill_inputs)  # a caller's buffer is a placeholder: never erased
        rule = "write into caller buffer dropped (drop_buffer_writes)" if callers else "placeholder allocation removed"
        report.rewrites.append(Rewrite(rule, tuple(names), f"readers of {buffer.name} read {source.name}"))
        changed = True
    return changed


def _why_not_forward(buffer: Node, source: Node, fill: Node, facts: _Facts, caller_buffer: bool) -> str | None:
    position = facts.order[fill]
    buffer_value, source_value = _tensor_value(buffer), _tensor_value(source)
    if buffer_value.device != source_value.device:
        return "the fill copies between devices"
    if not _same_sizes(buffer_value.stride(), source_value.stride()):
        return "the source's strides differ from the buffer's"
    if caller_buffer:
        views = [n for n, r in facts.roots.items() if buffer in r and n is not buffer and facts.order[n] < position]
        if any(facts.order.get(u, 0) > position for v in views for u in v.users):
            return f"a view of {buffer.name} taken before the fill is read after it"
    elif any(facts.order[u] < position for u in buffer.users):
        return f"{buffer.name} is used before it is filled"
    if facts.written(buffer, position + 1):
        return f"{buffer.name} is written again later"
    if facts.written(source, position + 1):
        return f"{source.name} is written after the fill, so the buffer keeps its old values"
    if facts.shares_output(buffer) and (facts.shares_output(source) or facts.shares_input(source)):
        return f"{buffer.name} is returned and {source.name} is an input or an output: they would share memory"
    return None


# --------------------------------------------------------------------------------------------------
# 4a. Setup computed twice, identically (CSE that respects in-place writes).


class _Unkeyable(Exception):
    pass


_CONSTANTS = (bool, int, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _key(node: Node, facts: _Facts) -> tuple:
    """What a node computes: its call and its arguments, with the write count of every allocation read."""
    at = facts.order[node]

    def freeze(a: Any) -> Any:
        if isinstance(a, Node):
            return ("node", a, facts.versions(a, at))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(freeze(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, freeze(v)) for k, v in a.items())))
        if isinstance(a, slice):
            return ("slice", freeze(a.start), freeze(a.stop), freeze(a.step))
        if isinstance(a, float):
            return ("float", a.hex())  # 0.0 == -0.0, yet they are different constants
        if a is None or a is Ellipsis or isinstance(a, _CONSTANTS):
            return (type(a).__name__, a)
        raise _Unkeyable(type(a).__name__)

    # The result's metadata too: the same call gives another dtype under autocast, and another
    # requires_grad under no_grad, which Dynamo records as mode switches, not as arguments.
    values = tree_flatten(_value(node))[0]
    result = tuple((*_signature(v), v.requires_grad) if isinstance(v, torch.Tensor) else repr(type(v)) for v in values)
    return (node.op, node.target, freeze(node.args), freeze(dict(node.kwargs)), result)


def _mergeable(node: Node, facts: _Facts) -> bool:
    return (
        _is_pure(node)
        and bool(node.users)
        and _name(node) not in _HOST_VALUES
        and not facts.written_after(node)  # so two equal allocations never both get written
    )


def _merge(graph: torch.fx.Graph, kept: Node, twin: Node, facts: _Facts) -> list[str] | None:
    """Point twin's users at kept and erase twin; None (nothing done) if twin reaches the outputs and
    kept is an output or an input too: the caller would get one tensor where it had two."""
    if facts.shares_output(twin) and (facts.shares_output(kept) or facts.shares_input(kept)):
        return None
    twin.replace_all_uses_with(kept)
    return _erase_dead(graph, [twin])


def _merge_identical(graph: torch.fx.Graph, facts: _Facts, regions: _Regions, report: PassReport) -> bool:
    seen: dict[tuple, Node] = {}
    changed = False
    for node in list(graph.nodes):
        if not _alive(node) or not _mergeable(node, facts):
            continue
        try:
            key = _key(node, facts)
        except _Unkeyable:
            continue
        kept = seen.get(key)
        if kept is None or not _alive(kept):
            seen[key] = node
            continue
        erased = _merge(graph, kept, node, facts)
        if erased is not None:
            where = "across the seam" if regions.across(kept, node) else ""
            report.rewrites.append(Rewrite("setup merged (identical)", (kept.name, *erased), where))
            changed = True
    return changed


# --------------------------------------------------------------------------------------------------
# 4b. Setup proven equal: integer index arithmetic as sympy expressions.

_ADD = {operator.add, torch.add, "add"}
_SUB = {operator.sub, torch.sub, "sub"}
_MUL = {operator.mul, torch.mul, "mul"}
_NEG = {operator.neg, torch.neg, "neg"}
_FLOORDIV = {operator.floordiv, torch.floor_divide, "floor_divide"}
_MOD = {operator.mod, torch.remainder, "remainder"}
_MAXIMUM = {torch.maximum, "maximum"}
_MINIMUM = {torch.minimum, "minimum"}
_CLAMPS = {torch.clamp: ("input", "min", "max"), torch.clip: ("input", "min", "max"), "clamp": ("input", "min", "max"),
           "clip": ("input", "min", "max"), torch.clamp_min: ("input", "min"), "clamp_min": ("input", "min"),
           torch.clamp_max: ("input", "max"), "clamp_max": ("input", "max")}
_SAME_VALUE = {"clone", "contiguous", "to", "long", "int", "short"}  # for an integer result in range
_FILLS = {"full": 1, "full_like": 1, "new_full": 2}  # position of the fill value


class _Unchecked(sympy.Function):
    """A clamp / max / min / division whose operands may have wrapped around: never decided or bounded,
    equal only to itself. Printed as the expression it wraps."""

    def _sympystr(self, printer: Any) -> str:
        return printer.doprint(self.args[0])


def _is_integer(value: Any) -> bool:
    """An integer tensor: bool is left out (its arithmetic saturates), floats too (not associative)."""
    if not isinstance(value, torch.Tensor):
        return False
    return not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)


def _dtype_range(dtype: torch.dtype) -> ValueRanges:
    info = torch.iinfo(dtype)
    return ValueRanges(info.min, info.max)


def _bound(expr: sympy.Expr, ranges: dict) -> ValueRanges | None:
    return None if expr.has(_Unchecked) else bound_sympy(expr, ranges)


def _argument_name(placeholder: Node) -> str:
    """The caller's name of a graph input: Dynamo names argument `seq_lens` L_seq_lens_ (L_kwargs_seq_lens_
    when it came by keyword, as fold() passes it) and attribute `b` of argument `a` L_a_b_."""
    name = str(placeholder.target)
    for prefix in ("L_kwargs_", "L_", "G_"):
        if name.startswith(prefix):
            return name[len(prefix):].removesuffix("_")
    return name


class _Expressions:
    """The elementwise values of integer nodes as sympy expressions, with the ranges of their symbols."""

    def __init__(self, graph: torch.fx.Graph, facts: _Facts, declared: ValueRangeSpec):
        self.facts = facts
        self.memo: dict[Node, sympy.Expr | None] = {}
        self.leaves: dict[tuple, sympy.Symbol] = {}
        self.leaf_nodes: dict[sympy.Symbol, Node] = {}
        self.ranges: dict[sympy.Symbol, ValueRanges] = {}
        self.narrowed: set[sympy.Symbol] = set()  # symbols whose range says more than their dtype
        self.declared: dict[Node, ValueRanges] = {}
        self.unmatched = set(declared)
        shape_envs = {getattr(getattr(_value(n), "fake_mode", None), "shape_env", None) for n in graph.nodes}
        shape_envs |= {_value(n).node.shape_env for n in graph.nodes if isinstance(_value(n), torch.SymInt)}
        for shape_env in shape_envs - {None}:
            # Sizes and symbolic scalars are int64 in torch: a fact the ShapeEnv leaves unbounded.
            self.ranges.update({s: r & _dtype_range(torch.int64) for s, r in shape_env.var_to_range.items()})
            self.narrowed.update(shape_env.var_to_range)
        for node in graph.find_nodes(op="placeholder"):
            for key, (low, high) in declared.items():
                if key.replace(".", "_") == _argument_name(node):
                    low, high = -sympy.oo if low is None else low, sympy.oo if high is None else high
                    self.declared[node] = ValueRanges(low, high)
                    self.unmatched.discard(key)

    def of(self, node: Node) -> sympy.Expr | None:
        """The node's value at each element; None if it is not an integer."""
        if node not in self.memo:
            self.memo[node] = self._translate(node)
        return self.memo[node]

    def _translate(self, node: Node) -> sympy.Expr | None:
        value = _value(node)
        if isinstance(value, torch.SymInt):
            return value.node.expr
        if not _is_integer(value):
            return None
        expr = self._arithmetic(node, value) if _is_pure(node) and not self.facts.written_after(node) else None
        return self._leaf(node, self.facts.order[node]) if expr is None else expr

    def _leaf(self, node: Node, at: int) -> sympy.Symbol:
        versions = self.facts.versions(node, at)
        key = (node, versions)
        if key not in self.leaves:
            writes = sum(count for _, count in versions)
            symbol = sympy.Symbol(node.name + (f"_w{writes}" if writes else ""), integer=True)
            self.leaves[key] = symbol
            self.leaf_nodes[symbol] = node
            limits = _dtype_range(_value(node).dtype)
            known = self.declared.get(node) or self._produced_range(node)
            self.ranges[symbol] = limits if known is None else limits & known
            if known is not None:
                self.narrowed.add(symbol)
        return self.leaves[key]

    def _produced_range(self, node: Node) -> ValueRanges | None:
        """What the producer says about a value: arange(start, end), or indices chosen along a dim."""
        if _name(node) == "arange" and "step" not in node.kwargs and 1 <= len(node.args) <= 2:
            start, end = (0, node.args[0]) if len(node.args) == 1 else node.args
            start, end = self._scalar(start), self._scalar(end)
            if start is None or end is None:
                return None
            return ValueRanges(bound_sympy(start, self.ranges).lower, bound_sympy(end - 1, self.ranges).upper)
        chooser = node
        if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 1:
            chooser = node.args[0]  # the indices of topk(...) or max(x, dim)
        elif _name(node) not in ("argmax", "argmin"):
            return None
        if not isinstance(chooser, Node) or not _is_selection(chooser) or not isinstance(_selection_dim(chooser), int):
            return None
        scores = _tensor_value(chooser.args[0])
        if scores is None or scores.dim() == 0:
            return None
        size = scores.shape[_selection_dim(chooser)]
        size = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
        return ValueRanges(0, bound_sympy(size - 1, self.ranges).upper)

    def _scalar(self, arg: Any) -> sympy.Expr | None:
        if isinstance(arg, bool):
            return None
        if isinstance(arg, int):
            return sympy.Integer(arg)
        if isinstance(_value(arg), torch.SymInt):
            return _value(arg).node.expr
        return None

    def _operand(self, arg: Any, result: torch.Tensor, at: int) -> sympy.Expr | None:
        scalar = self._scalar(arg)
        if scalar is not None or not isinstance(arg, Node):
            return scalar
        value = _tensor_value(arg)
        if not _is_integer(value):
            return None
        if not (_same_sizes(value.shape, result.shape) or statically_known_true(value.numel() == 1)):
            return None  # broadcast across dims: one symbol would stand for different elements
        if self.facts.written(arg, self.facts.order[arg] + 1, at):
            return self._leaf(arg, at)  # written since it was computed: its value as read here
        return self.of(arg)

    def _fits(self, exprs: Iterable[sympy.Expr], *dtypes: torch.dtype) -> bool:
        for expr in exprs:
            bound = _bound(expr, self.ranges)
            if bound is None or not all(bound.issubset(_dtype_range(d)) for d in dtypes):
                return False
        return True

    def _arithmetic(self, node: Node, value: torch.Tensor) -> sympy.Expr | None:
        target, args, kwargs = node.target, list(node.args), dict(node.kwargs)
        at = self.facts.order[node]

        def operands(*items: Any) -> list[sympy.Expr] | None:
            exprs = [self._operand(a, value, at) for a in items]
            return None if any(e is None for e in exprs) else exprs

        def checked(expr: sympy.Expr, inputs: list[sympy.Expr], input_dtypes: list[torch.dtype]) -> sympy.Expr:
            # Decisions about clamp/max/div need the operands' true values: no wrap-around allowed.
            return expr if self._fits(inputs, value.dtype, *input_dtypes) else _Unchecked(expr)

        if target in _ADD | _SUB | _MUL and len(args) == 2 and not kwargs:
            ops = operands(*args)
            if ops is None:
                return None
            a, b = ops
            return a + b if target in _ADD else a - b if target in _SUB else a * b
        if target in _NEG and len(args) == 1 and not kwargs:
            ops = operands(args[0])
            return None if ops is None else -ops[0]
        is_floor_div = target in (torch.div, "div") and kwargs.pop("rounding_mode", None) == "floor"
        if target in _FLOORDIV | _MOD or is_floor_div:
            divisor = args[1] if len(args) == 2 else None
            if kwargs or not isinstance(divisor, int) or isinstance(divisor, bool) or divisor <= 0:
                return None  # a positive constant divisor: then torch's floor and modulo are sympy's
            ops = operands(args[0])
            if ops is None:
                return None
            expr = PythonMod(ops[0], divisor) if target in _MOD else FloorDiv(ops[0], divisor)
            return checked(expr, ops, [_tensor_value(args[0]).dtype] if isinstance(args[0], Node) else [])
        if target in _MAXIMUM | _MINIMUM and len(args) == 2 and not kwargs:
            ops = operands(*args)
            if ops is None:
                return None
            dtypes = [_tensor_value(a).dtype for a in args if _tensor_value(a) is not None]
            return checked((Max if target in _MAXIMUM else Min)(*ops), ops, dtypes)
        if target in _CLAMPS:
            names = _CLAMPS[target]
            bound = dict(zip(names, args)) | kwargs
            if set(bound) - set(names) or len(args) > len(names) or "input" not in bound:
                return None
            ops = operands(*(bound.get(n) for n in names if bound.get(n) is not None))
            if ops is None:
                return None
            expr = ops[0]
            limits = iter(ops[1:])
            if bound.get("min") is not None:
                expr = Max(expr, next(limits))
            if bound.get("max") is not None:
                expr = Min(expr, next(limits))
            return checked(expr, ops, [_tensor_value(bound["input"]).dtype])
        if _name(node) in _FILLS and not kwargs.keys() - {"dtype", "device"}:
            fill = args[_FILLS[_name(node)]] if len(args) > _FILLS[_name(node)] else None
            return self._scalar(fill)  # every element is the fill value (an int or a symbolic size)
        if target in _SAME_VALUE and args and isinstance(args[0], Node):
            if target == "to" and not all(isinstance(a, torch.dtype) for a in args[1:] + list(kwargs.values())):
                return None
            source = _tensor_value(args[0])
            ops = operands(args[0])
            if ops is None or source is None:
                return None
            return ops[0] if source.dtype == value.dtype else checked(ops[0], ops, [source.dtype])
        return None


def _decide(expr: sympy.Expr, ranges: dict) -> sympy.Expr:
    """`expr` with every max/min/modulo/floor division that the value ranges decide replaced by its result."""
    if not expr.args or isinstance(expr, _Unchecked):
        return expr
    expr = expr.func(*(_decide(a, ranges) for a in expr.args))
    if isinstance(expr, (Max, Min, sympy.Max, sympy.Min)):
        is_max = isinstance(expr, (Max, sympy.Max))
        result, *others = expr.args
        for other in others:
            diff = _bound(sympy.expand(result - other), ranges)
            if diff is not None and diff.lower >= 0:
                result = result if is_max else other
            elif diff is not None and diff.upper <= 0:
                result = other if is_max else result
            else:
                return expr
        return result
    if isinstance(expr, (PythonMod, FloorDiv)) and expr.args[1].is_Integer and expr.args[1] > 0:
        bound = _bound(expr.args[0], ranges)
        if bound is not None and bound.lower >= 0 and bound.upper < expr.args[1]:
            return expr.args[0] if isinstance(expr, PythonMod) else sympy.Integer(0)
    return expr


def prove_equal(
    a: sympy.Expr, b: sympy.Expr, ranges: Mapping[sympy.Symbol, ValueRanges]
) -> tuple[bool | None, sympy.Expr]:
    """(True, 0) if a == b for all values of their symbols within `ranges`; (False, a - b) if they
    always differ; (None, a - b) if neither is proven. Max/Min/Mod/FloorDiv are first decided by the
    ranges where they can be (Max(s - 1, 0) is s - 1 for s >= 1); what remains must cancel exactly."""
    diff = sympy.expand(_decide(a, ranges) - _decide(b, ranges))
    if diff == 0:
        return True, diff
    bound = _bound(diff, ranges)
    if bound is not None and (bound.lower > 0 or bound.upper < 0):
        return False, diff
    return None, diff


def _merge_proven(
    graph: torch.fx.Graph, facts: _Facts, regions: _Regions, report: PassReport, declared: ValueRangeSpec
) -> bool:
    exprs = _Expressions(graph, facts, declared)
    for key in sorted(exprs.unmatched):
        report.notes.append(f"value_ranges: no graph input is named {key!r}; its range is unused")
    groups: dict[tuple, list[tuple[Node, sympy.Expr]]] = {}
    candidates = []
    for node in graph.nodes:
        expr = exprs.of(node) if node.op in ("call_function", "call_method", "placeholder") else None
        if expr is None:
            continue
        value = _value(node)
        signature = _signature(value) if isinstance(value, torch.Tensor) else ("symint",)
        groups.setdefault(signature, []).append((node, expr))
        if node.op != "placeholder" and exprs.leaf_nodes.get(expr) is not node and _mergeable(node, facts):
            candidates.append((node, expr, signature))
    changed = False
    for node, expr, signature in candidates:
        if not _alive(node):
            continue
        symbols = _decide(expr, exprs.ranges).free_symbols
        earlier = [
            (other, other_expr)
            for other, other_expr in groups[signature]
            if _alive(other) and facts.order[other] < facts.order[node]
            and (_mergeable(other, facts) or other.op == "placeholder" and not facts.written(other, 0))
            and _decide(other_expr, exprs.ranges).free_symbols == symbols
        ]
        outcomes = [(other, other_expr, *prove_equal(expr, other_expr, exprs.ranges)) for other, other_expr in earlier]
        proven = next((o for o in outcomes if o[2]), None)
        if proven is not None:
            erased = _merge(graph, proven[0], node, facts)
            if erased is not None:
                used = [x for x in (expr, proven[1]) if x.free_symbols & exprs.narrowed]
                given = _given(used[0], exprs, exprs.narrowed) if used else ""
                detail = f"{expr} == {proven[1]}{given}"
                report.rewrites.append(Rewrite("setup merged (proven equal)", (proven[0].name, *erased), detail))
                changed = True
                continue
        # Say why the closest computation on the seed's side that this one clamps or offsets did not merge.
        related = [o for o in outcomes if regions.across(o[0], node) and _related(expr, *o[1:])]
        if related:
            other, other_expr, equal, diff = related[-1]
            why = f"they differ by {diff}" if equal is False else f"not proven{_given(expr, exprs)}{_hint(expr, exprs)}"
            _refuse(report, node, f"kept: {node.name} = {expr} vs the seed's {other.name} = {other_expr}: {why}")
    return changed


def _related(expr: sympy.Expr, other: sympy.Expr, equal: bool | None, diff: sympy.Expr) -> bool:
    """Whether one side is the other offset by a constant, or the other clamped (max/min/mod/div of it):
    the mismatches worth a line in the report, unlike any two expressions that share a symbol."""
    if equal is False:
        return diff.is_number

    def decided_from(outer: sympy.Expr, inner: sympy.Expr) -> bool:
        outer = outer.args[0] if isinstance(outer, _Unchecked) else outer
        return isinstance(outer, (Max, Min, PythonMod, FloorDiv, sympy.Max, sympy.Min)) and inner in outer.args

    return decided_from(expr, other) or decided_from(other, expr)


def _given(expr: sympy.Expr, exprs: _Expressions, only: set | None = None) -> str:
    symbols = [s for s in sorted(expr.free_symbols, key=str) if s in exprs.ranges and (only is None or s in only)]
    known = [f"{s} in [{exprs.ranges[s].lower}, {exprs.ranges[s].upper}]" for s in symbols]
    return f" given {', '.join(known)}" if known else ""


def _hint(expr: sympy.Expr, exprs: _Expressions) -> str:
    leaves = [exprs.leaf_nodes.get(s) for s in sorted(expr.free_symbols, key=str)]
    inputs = [leaf for leaf in leaves if leaf is not None and leaf.op == "placeholder"]
    if not inputs:
        return ""
    names = ", ".join(f"{_argument_name(n)!r}: (low, high)" for n in inputs)
    return f"; value_ranges={{{names}}} lets the proof use what the caller knows"


# --------------------------------------------------------------------------------------------------
# The pass.


def fold_seed(
    gm: torch.fx.GraphModule, *, value_ranges: ValueRangeSpec | None = None, drop_buffer_writes: bool = False
) -> PassResult:
    """Fold the seed into the draft loop of a Dynamo graph: remove the seam marker, placeholder
    allocations, host round trips and (opt-in) seed writes into caller buffers that the loop reads, and
    merge setup computed on both sides (see the module docstring for when each is legal).

    value_ranges: {argument name: (low, high)} (None for unbounded), elementwise facts the proofs may use.
    drop_buffer_writes: also drop the seed's full overwrites of caller buffers that the loop reads.

    Returns a new GraphModule (`gm` is untouched) and a report: the seed region, the iterations found,
    what was removed or merged, and what was refused and why. A graph the pass does not understand
    comes back unchanged, with the reason in the report; the pass never raises on a graph.
    """
    report = PassReport(PASS_NAME)
    new_gm = copy_graph_module(gm)
    verbose = log.isEnabledFor(logging.INFO)  # printing a graph costs more than folding it
    if verbose:
        log.info("%s: graph before:\n%s", PASS_NAME, new_gm.print_readable(print_output=False))
    try:
        _fold(new_gm.graph, report, dict(value_ranges or {}), drop_buffer_writes)
        new_gm.graph.lint()
        new_gm.recompile()
    except Exception as error:  # a pass never breaks a compile: hand back the graph as it came
        log.warning("%s: internal error, graph left unchanged", PASS_NAME, exc_info=True)
        report = PassReport(PASS_NAME, notes=[f"internal error, graph left unchanged: {error!r}"])
        new_gm = copy_graph_module(gm)
    if verbose:
        log.info("%s\ngraph after:\n%s", report, new_gm.print_readable(print_output=False))
    return PassResult(new_gm, report)


def _fold(graph: torch.fx.Graph, report: PassReport, value_ranges: dict, drop_buffer_writes: bool) -> None:
    marked_ranges, marked_drop = _seam_facts(graph)
    value_ranges |= marked_ranges
    drop_buffer_writes |= marked_drop
    regions = _find_regions(graph, _analyse(graph))
    if regions is None:
        report.notes.append(
            "no seam: no draftfuse::seam marker and no chain of two or more dependent selections; graph unchanged"
        )
        return
    seed_nodes = [n for n in graph.nodes if n in regions.seed]
    span = f"{seed_nodes[0].name} .. {seed_nodes[-1].name}" if seed_nodes else "empty"
    seed_selections = ", ".join(n.name for n in regions.seed_selections) or "none"
    loop_selections = ", ".join(n.name for n in regions.loop_selections) or "none"
    report.notes.append(f"seed region: {len(seed_nodes)} nodes ({span}), selections: {seed_selections}")
    report.notes.append(
        f"iterations found: {regions.seed_iterations + regions.loop_iterations} ({regions.seed_iterations} in the "
        f"seed, {regions.loop_iterations} in the loop; loop selections: {loop_selections})"
    )
    _remove_seams(graph, report)
    for _ in range(_MAX_ROUNDS):
        changed = _remove_round_trips(graph, _analyse(graph), report)
        changed |= _forward_buffers(graph, _analyse(graph), regions, report, drop_buffer_writes)
        changed |= _merge_identical(graph, _analyse(graph), regions, report)
        changed |= _merge_proven(graph, _analyse(graph), regions, report, value_ranges)
        if not changed:
            break
    # Rounds revisit what they refused: keep each refusal once, and only about nodes still there.
    alive = {n.name for n in graph.nodes}
    report.refusals[:] = [r for r in dict.fromkeys(report.refusals) if r.node in alive]
    report.notes[:] = list(dict.fromkeys(report.notes))
