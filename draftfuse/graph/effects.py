"""Effects: which memory each node's value lives in, which memory each node writes, which nodes draw
random numbers. One model for every pass and for the capture checks, on Dynamo and on ATen graphs.

Memory comes from the fake tensors the tracer recorded, not from op names: a node's value lives in
the storages of its fake value (a view shares its base's fake storage, an `out=` result is the out
tensor's, an in-place method returns its input, `einsum` may return a view of an operand: the fakes
say which it did for the shapes traced, and Dynamo guards those shapes). A node traced without a fake
value is assumed to share the memory of every tensor it reads. A rewrite that points a node at other
inputs (draftfuse.graph.values.rewire) leaves its fake showing the old input's memory: so a view's
memory is its inputs' memory, by the positions of the inputs it was a view of when traced.

Writes come from the op's schema: the arguments annotated `Tensor(a!)` (in place, `out=`, lists such
as `_foreach_add_`'s). A Dynamo graph calls torch functions and Tensor methods, not ATen overloads:
they are resolved by name to their ATen op (`x.add_(y)` -> aten.add_, `torch.add(x, y, out=o)` ->
aten.add, whose `out` overload writes `o`), every overload that could bind the call counted; `operator`'s
in-place forms (`x += y`, `x[i] = v`) write their first argument. A call that resolves to nothing
(a user function allowed in the graph, a higher-order op, a method ATen does not know) is unknown: it
may write every tensor it reads and its value may share their memory. Python-level Tensor methods that
ATen lacks but that never write (`float`, `tolist`, ...) are listed by name.

Inputs share memory as they did when traced: the fakes of two arguments that are views of one tensor
share a storage, so a write through one is a write to the other. Arguments that did not share memory
when traced are taken as distinct; torch's compiled graph makes the same assumption (AOT autograd
functionalizes with the aliasing it traced), and `draft_loop` checks it on every call for the inputs
a draft writes.

Randomness comes from the op's `nondeterministic_seeded` tag; unknown calls count as random.

Global state: Dynamo records `with torch.no_grad()`, autocast, inference mode (and the other context
managers it keeps in a graph) as calls of torch functions traced to no value (`_set_grad_enabled`,
`_enter_autocast`, ...). The ops on either side of one run under another grad mode or dtype policy, so a
rewrite must not compute a value on the other side of one (`Effects.state_changes`).
"""

from __future__ import annotations

import bisect
import functools
import inspect
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from torch._dynamo.utils import numpy_operator_wrapper
from torch._library.fake_class_registry import FakeScriptObject
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from draftfuse.graph.values import PROVENANCE, REWIRED, Node, fake

_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul,
})  # fmt: skip
# Operators on tensors that Dynamo (torch 2.11) records as their dunder methods (`positions == 0` as
# positions.__eq__(0)): the in-place ones write their first argument, as `operator`'s do, the others nothing.
_IN_PLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS)
_PURE_DUNDERS = frozenset({
    f"__{name}__" for name in ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "abs", "invert", "getitem")
} | {
    f"__{side}{name}__" for side in ("", "r") for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift")
})  # fmt: skip
# Tensor methods with no ATen op of their name that read but never write (casts, host reads, metadata).
_PYTHON_METHODS = frozenset({
    "bfloat16", "bool", "byte", "cdouble", "cfloat", "char", "double", "float", "half", "int", "long",
    "short", "type", "type_as", "tolist", "numpy", "ndimension", "nelement", "new_tensor", "unique",
    "data_ptr", "const_data_ptr", "untyped_storage", "dim_order", "storage_offset", "get_device",
})  # fmt: skip
_PLAIN_MODULES = ("_operator", "operator", "math", "builtins")  # functions on Python values
# DTensor's conversions between local shards and the global tensor (a collective where the placements
# change): they write nothing, and their value may be the local tensor they read
_DTENSOR_METHODS = frozenset({"to_local", "full_tensor", "redistribute"})


@functools.cache
def _aten_packet(name: str) -> torch._ops.OpOverloadPacket | None:
    if not name or name.startswith("__"):
        return None
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _overloads(node: Node) -> list[torch._ops.OpOverload] | None:
    """The ATen overloads a call may run (not those taking a list where it passes a tensor); None when
    the call resolves to no op."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return [target]
    if node.op == "call_method":
        packet = _aten_packet(str(target))
    elif isinstance(target, torch._ops.OpOverloadPacket):
        packet = target
    elif getattr(target, "__module__", None) and str(target.__module__).startswith("torch"):
        packet = _aten_packet(getattr(target, "__name__", ""))
    else:
        packet = None
    if packet is None:
        return None
    overloads = [getattr(packet, overload) for overload in packet.overloads()]
    return [overload for overload in overloads if not _wants_a_list_for_a_tensor(overload, node)]


def _wants_a_list_for_a_tensor(overload: torch._ops.OpOverload, node: Node) -> bool:
    """Whether the overload takes a list where the call passes one tensor, so the call cannot run it:
    TorchScript's list overloads, such as sort.Tensor(Tensor(a!)[] self) and sort.int(int[](a!) self),
    which write their list, are no `torch.sort(x)` or `x.sort()` (those write nothing)."""
    for position, argument in enumerate(overload._schema.arguments):
        value = _argument(node, position, argument)
        if isinstance(argument.type, torch._C.ListType) and isinstance(value, Node) and isinstance(fake(value), torch.Tensor):
            return True
    return False


def _is_plain_python(node: Node) -> bool:
    """A call on Python values (operator.add, math.sqrt, a Python-level Tensor method that never writes)."""
    if node.op == "call_method":
        return node.target in _PYTHON_METHODS or node.target in _PURE_DUNDERS
    if isinstance(node.target, numpy_operator_wrapper):  # an operator on NumPy arrays (`n.numpy() * 2`), as Dynamo records it
        return getattr(node.target.op, "__module__", None) in _PLAIN_MODULES
    module = getattr(node.target, "__module__", None) or ""
    return module in _PLAIN_MODULES


def _converts_dtensor(node: Node) -> bool:
    """DTensor.from_local(x, mesh, placements), dt.to_local(), dt.full_tensor(), dt.redistribute(...)."""
    if node.op == "call_method":
        return node.target in _DTENSOR_METHODS
    target = node.target
    return getattr(target, "__qualname__", None) == "DTensor.from_local" and str(getattr(target, "__module__", "")).startswith("torch.distributed")


def _argument(node: Node, position: int, argument: Any) -> Any:
    if not argument.kwarg_only and position < len(node.args):
        return node.args[position]
    return node.kwargs.get(argument.name)


@functools.lru_cache(maxsize=None)
def _inplace_signature(target: Any) -> inspect.Signature | None:
    """The signature of a Python function that takes an `inplace` flag (torch.nn.functional's), else None."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return signature if "inplace" in signature.parameters else None


def _passes_inplace(node: Node) -> bool:
    """Whether the call asks its function to write its first argument: `inplace` True by keyword or by
    position, or not a constant (a value the graph computes); a call that does not bind counts too."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not callable(node.target):
        return False
    try:
        signature = _inplace_signature(node.target)
    except TypeError:  # an unhashable target
        signature = None
    if signature is None:
        return False
    try:
        flag = signature.bind(*node.args, **node.kwargs).arguments.get("inplace", False)
    except TypeError:
        return True
    return flag is not False and flag is not None


def written_values(node: Node) -> list[Node] | None:
    """The values `node` writes in place ([] if none); None when unknown: it may write what it reads."""
    if node.op in ("placeholder", "get_attr", "output"):
        return []
    if node.op == "call_module" or isinstance(node.target, torch._ops.HigherOrderOperator):
        return None  # a body of its own, with writes not looked into
    if node.target in (_IN_PLACE_DUNDERS if node.op == "call_method" else _IN_PLACE_OPERATORS):
        return [node.args[0]] if isinstance(node.args[0], Node) else []
    if isinstance(node.target, numpy_operator_wrapper) and node.target.op in _IN_PLACE_OPERATORS:  # `a = n.numpy(); a += 1`
        return [node.args[0]] if node.args and isinstance(node.args[0], Node) else []
    if _converts_dtensor(node):
        return []
    written: list[Node] = []
    if _passes_inplace(node) and node.args and isinstance(node.args[0], Node):
        written.append(node.args[0])  # F.relu(x, inplace=True), F.elu(x, 1.0, True) and friends
    overloads = _overloads(node)
    if overloads is None:
        return written if _is_plain_python(node) else None
    # `out=`, a tuple for ops of several outputs (sort, topk, cummax, frexp), whose schema names each
    # written argument apart (values, indices), so the lookup by name below misses them
    written += [a for a in tree_leaves(node.kwargs.get("out")) if isinstance(a, Node)]
    for overload in overloads:
        for position, argument in enumerate(overload._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written += [a for a in tree_leaves(_argument(node, position, argument)) if isinstance(a, Node)]
    return list(dict.fromkeys(written))


def is_random(node: Node) -> bool:
    """Whether the node may draw random numbers (an unknown call may)."""
    if node.op not in ("call_function", "call_method"):
        return node.op == "call_module"
    overloads = _overloads(node)
    if overloads is None:
        return not (_is_plain_python(node) or _converts_dtensor(node))
    return any(torch.Tag.nondeterministic_seeded in overload.tags for overload in overloads)


def defines_unbacked_symbols(node: Node) -> bool:
    """Its value has a data-dependent size or is a host scalar read from the device (`.item()`,
    `nonzero`): other nodes' metadata refers to the symbols it binds, so it must stay where it is."""
    value = fake(node)
    if value is None:
        return False
    try:
        return bool(free_unbacked_symbols(value))
    except Exception:  # a value kind the helper does not know: assume it binds something
        return True


ALIASES = "draftfuse_aliases"  # node meta: positions of the inputs its value is a view of, as traced


def changes_global_state(node: Node) -> bool:
    """A call made for its effect on torch's global state: a torch function (no ATen op, no function on
    Python values) traced to no value. `torch._check` counts too: nothing is moved across it either."""
    if node.op != "call_function" or PROVENANCE in node.meta or fake(node) is not None:
        return False
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    return getattr(node.target, "__module__", None) not in _PLAIN_MODULES


def _storages(value: Any) -> frozenset[Any] | None:
    """The storages of every tensor in a fake value; None for a value that is not recorded."""
    keys = set()
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            try:
                keys.add(StorageWeakRef(leaf.untyped_storage()))
            except (NotImplementedError, RuntimeError):  # sparse, nested: no plain storage
                return None
    return frozenset(keys)


def _reads_memory(node: Node) -> list[Node]:
    """Inputs that may hold tensors (anything but recorded Python scalars and symbolic sizes)."""
    # and opaque objects (a DeviceMesh or process group the draft passes to a collective): no tensor memory
    scalars = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool, torch.ScriptObject, FakeScriptObject)
    return [a for a in node.all_input_nodes if not isinstance(fake(a), scalars)]


class Effects:
    """The memory and writes of every node of one graph, in graph order. Rebuild after changing the graph."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.order: dict[Node, int] = {}
        self._memory: dict[Node, frozenset[Any]] = {}
        self._writes: dict[Node, frozenset[Any]] = {}
        self.unknown: set[Node] = set()  # calls whose writes are not known
        inputs: set[Any] = set()
        for position, node in enumerate(graph.nodes):
            self.order[node] = position
            if node.op == "output":
                continue
            own = _storages(fake(node)) if ("val" in node.meta or "example_value" in node.meta) else None
            reads = _reads_memory(node)
            if node.op in ("placeholder", "get_attr"):
                own = own if own else frozenset([node])  # a tensor input without a fake: its own memory
                inputs |= own
                self._memory[node] = own
                self._writes[node] = frozenset()
                continue
            read_memory = frozenset().union(*(self._memory.get(a, frozenset([a])) for a in reads))
            if own is not None:
                own = own | self._aliased_memory(node, own, read_memory)
            written = written_values(node)
            if written is None:
                self.unknown.add(node)
                own = (own or frozenset([node])) | read_memory
                writes = read_memory
            else:
                own = own if own is not None and not _converts_dtensor(node) else (own or frozenset([node])) | read_memory
                writes = frozenset().union(*(self._memory.get(a, frozenset([a])) for a in written))
            self._memory[node] = own
            self._writes[node] = writes
        self.inputs = frozenset(inputs)  # the storages of the caller's tensors
        self._nodes = list(self.order)
        self._state_changes = [self.order[n] for n in self._nodes if changes_global_state(n)]
        # memory key -> positions of the nodes that may write it, sorted
        self._writers: dict[Any, list[int]] = {}
        for node, keys in self._writes.items():
            for key in keys:
                self._writers.setdefault(key, []).append(self.order[node])

    def _aliased_memory(self, node: Node, own: frozenset[Any], read_memory: frozenset[Any]) -> frozenset[Any]:
        """The memory of the inputs the node's value is a view of. Which inputs those are is recorded
        (by position) the first time the node is seen, from the fakes as traced; a node a rewrite has
        pointed at other inputs since keeps the record, and one rewired before any record shares all."""
        inputs = node.all_input_nodes
        positions = node.meta.get(ALIASES)
        if positions is None:
            if node.meta.get(REWIRED):
                return read_memory
            positions = [i for i, a in enumerate(inputs) if own & (_storages(fake(a)) or frozenset())]
            node.meta[ALIASES] = positions
        return frozenset().union(*(self._memory.get(inputs[i], frozenset([inputs[i]])) for i in positions if i < len(inputs)))

    def memory(self, node: Node) -> frozenset[Any]:
        """The memory the node's value may live in."""
        return self._memory.get(node, frozenset())

    def writes(self, node: Node) -> frozenset[Any]:
        """The memory the node may write."""
        return self._writes.get(node, frozenset())

    def may_share(self, a: Node, b: Node) -> bool:
        return bool(self.memory(a) & self.memory(b))

    def returned_memory(self) -> frozenset[Any]:
        """The memory the graph's outputs live in, read from the output node as it is now."""
        return frozenset().union(*(self.memory(n) for n in self.graph.output_node().all_input_nodes))

    def would_alias(self, replaced: Node, replacement: Node) -> bool:
        """Reading `replacement` where `replaced` was read would hand the caller an output that shares
        memory with an input or with another output, where it had a tensor of its own."""
        returned = self.returned_memory()
        return bool(self.memory(replaced) & returned) and bool(self.memory(replacement) & (returned | self.inputs))

    def writers(self, values: Iterable[Node], after: Node | int, before: Node | int | None = None) -> list[Node]:
        """Nodes strictly between `after` and `before` (graph order; None: the end) that may write the
        memory of any of `values`."""
        start = after if isinstance(after, int) else self.order[after]
        stop = (1 << 62) if before is None else before if isinstance(before, int) else self.order[before]
        keys = frozenset().union(*(self.memory(v) for v in values))
        positions: set[int] = set()
        for key in keys:
            found = self._writers.get(key, [])
            positions.update(found[bisect.bisect_right(found, start) : bisect.bisect_left(found, stop)])
        return [self._nodes[p] for p in sorted(positions)]

    def state_changes(self, after: Node, before: Node) -> list[Node]:
        """The calls strictly between `after` and `before` (graph order) that change torch's global state
        (grad mode, autocast, ...): see changes_global_state."""
        start, stop = self.order[after], self.order[before]
        found = self._state_changes[bisect.bisect_right(self._state_changes, start) : bisect.bisect_left(self._state_changes, stop)]
        return [self._nodes[p] for p in found]

    def written_after(self, node: Node) -> bool:
        return bool(self.writers([node], node))

    def written_inputs(self) -> dict[Node, Node]:
        """Each graph input the graph writes (through any view of it), with its first writer."""
        owners: dict[Any, list[Node]] = {}
        for placeholder in self.graph.find_nodes(op="placeholder"):
            for key in self._memory[placeholder]:
                owners.setdefault(key, []).append(placeholder)
        first: dict[Node, Node] = {}
        for node, keys in self._writes.items():
            for key in keys:
                for placeholder in owners.get(key, ()):
                    first.setdefault(placeholder, node)
        return first

    def is_erasable(self, node: Node) -> bool:
        """Pure, or a read from the device (`.item()`) whose symbols nothing else refers to any more:
        once unused, erasing it changes nothing but the work done."""
        if self.is_pure(node):
            return True
        if node.op not in ("call_function", "call_method") or node in self.unknown or self._writes.get(node) or is_random(node):
            return False
        try:
            mine = free_unbacked_symbols(fake(node))
            return not any(mine & free_unbacked_symbols(fake(n)) for n in node.graph.nodes if n is not node)
        except Exception:
            return False

    def is_pure(self, node: Node) -> bool:
        """No write, no randomness, no unbacked symbol bound, and a value: may be erased once unused,
        or merged with a twin."""
        if node.op not in ("call_function", "call_method") or node in self.unknown:
            return False
        if self._writes.get(node) or is_random(node) or defines_unbacked_symbols(node):
            return False
        # calls that return nothing are there for their effect (grad mode switches, torch._check)
        return fake(node) is not None or bool(node.users)
