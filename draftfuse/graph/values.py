"""What one node of a traced graph is: its fake value, its level, the user's line, an input's name.

Every pass, the capture checks and `explain` read nodes through these functions, so that they agree:

  * `fake(node)`: the fake tensor (or SymInt, or tuple of them) the tracer recorded. Dynamo stores it
    as `meta["example_value"]`, AOT autograd and Inductor as `meta["val"]`; a node has one or the other.
  * `level(graph)`: "dynamo" (torch IR: torch functions, Tensor methods, operator.*) or "aten"
    (ATen overloads, functional after AOT autograd).
  * `user_location(node)`: "file:line" of the user's innermost frame in the node's stack trace.
  * `input_name(placeholder)`: the user's spelling of a graph input ("kv_cache", "self.cache").
  * `argument_name(placeholder)`: the name of the draft's argument (or `a.b` attribute) it came from.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

Node = torch.fx.Node


def fake(node: Any) -> Any:
    """The fake value a node carries (None for a non-node or a node traced without one)."""
    if not isinstance(node, Node):
        return None
    meta = node.meta
    return meta["val"] if "val" in meta else meta.get("example_value")


def fake_tensor(node: Any) -> torch.Tensor | None:
    value = fake(node)
    return value if isinstance(value, torch.Tensor) else None


def meta_key(graph: torch.fx.Graph) -> str:
    """The meta key new nodes of this graph must carry their fake value under."""
    return "example_value" if level(graph) == "dynamo" else "val"


def level(graph: torch.fx.Graph) -> str:
    """"dynamo" for a graph Dynamo traced (fake values under example_value), else "aten"."""
    return "dynamo" if any("example_value" in n.meta for n in graph.nodes) else "aten"


def rank(node: Any) -> int | None:
    value = fake_tensor(node)
    return value.dim() if value is not None else None


def is_call(node: Any, target: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def is_integer(value: Any) -> bool:
    """An integer tensor: bool is left out (its arithmetic saturates), floats too (not associative)."""
    if not isinstance(value, torch.Tensor):
        return False
    return not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)


def same_sizes(a: Any, b: Any) -> bool:
    """Two size (or stride) lists known equal for every value of their symbols."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = list(a), list(b)
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def target_key(node: Node) -> Any:
    """What a call node calls: the callable (call_function) or the method name (call_method)."""
    return node.target if node.op in ("call_function", "call_method") else None


def normalise_dim(dim: Any, ndim: int | None) -> int | None:
    """`dim` (an int or a one-element list) as a non-negative dim of a rank-`ndim` tensor; None if unknown."""
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool) or ndim is None:
        return None
    size = max(ndim, 1)  # a 0-d tensor takes dim 0 or -1
    return dim % size if -size <= dim < size else None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_frame() -> tuple[Any, int]:
    """The innermost frame outside draftfuse, seen from the function that calls this one, and the
    stacklevel that makes warnings.warn from that function point at it."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return frame, level


def user_location(node: Node) -> str:
    """The innermost user frame of a node's stack trace, as "file:line" (empty when unknown, or when every
    frame is draftfuse's own: fold()'s composition, the seam marker, which no user line stands for)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    outside = [f for f in frames if not os.path.abspath(f[0]).startswith(_PACKAGE)]
    return f"{outside[-1][0]}:{outside[-1][1]}" if outside else ""


def user_code(node: Node) -> str:
    """The source text of the user's innermost frame (the last line of the stack trace), or ""."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines()]
    lines = [ln for ln in lines if ln and set(ln) - set("^~ ")]  # not the markers under the code
    return lines[-1] if lines and not lines[-1].startswith("File ") else ""


def source_name(source: Any) -> str:
    """A Dynamo source's name, as its guards spell it ("L['head']._modules['proj']")."""
    return source.name() if callable(source.name) else source.name  # a method in older torch versions


def input_name(placeholder: Node) -> str:
    """The user's spelling of a graph input ("kv_cache", "self.cache[0]"), from Dynamo's source."""
    source = getattr(placeholder, "_dynamo_source", None)
    if source is None:
        return argument_name(placeholder)
    name = source_name(source)
    name = re.sub(r"L\['([^']+)'\]", r"\1", name)
    return re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", name)  # head.layer.attn.k_cache


def argument_name(placeholder: Node) -> str:
    """The draft's argument a graph input came from: Dynamo names argument `seq_lens` L_seq_lens_
    (L_kwargs_seq_lens_ when it came by keyword) and attribute `b` of argument `a` L_a_b_."""
    name = str(placeholder.target)
    for prefix in ("L_kwargs_", "L_", "G_"):
        if name.startswith(prefix):
            return name[len(prefix) :].removesuffix("_")
    return name


def is_python_number(placeholder: Node) -> bool:
    """A graph input that Dynamo made from a Python int or float (an unspecialised module attribute
    such as RMSNorm's eps under dynamic=True): a CPU scalar tensor read with `.item()` in the graph,
    which reads no device memory."""
    grapharg = placeholder.meta.get("grapharg")
    return bool(getattr(grapharg, "pass_arg_as_tensor", False))


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with a fresh copy of `gm`'s graph, sharing its parameters and buffers and keeping
    the Dynamo metadata AOT autograd reads (see `carry_dynamo_metadata`)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(getattr(gm, "meta", {}))
    carry_dynamo_metadata(gm, new)
    return new


def carry_dynamo_metadata(source: torch.fx.GraphModule, target: torch.fx.GraphModule) -> None:
    """Give a copy of a Dynamo GraphModule the metadata AOT autograd reads from the original.

    AOT treats a graph as Dynamo's only if it carries `_param_name_to_source` and each placeholder its
    `_dynamo_source`; without them it takes the graph for an export graph and forgets which inputs are
    static (parameters, KV caches marked static), so CUDA graphs would copy the weights on every replay.
    torch's DDP optimizer carries the same fields for the same reason. Passes never change a graph's
    inputs, so placeholders are matched by position.
    """
    for attr in ("_param_name_to_source", "_source_to_user_stacks"):
        if hasattr(source, attr):
            setattr(target, attr, getattr(source, attr))
    old = source.graph.find_nodes(op="placeholder")
    new = target.graph.find_nodes(op="placeholder")
    if len(old) != len(new):
        raise AssertionError("a draftfuse pass changed the graph's inputs")
    for old_node, new_node in zip(old, new):
        if hasattr(old_node, "_dynamo_source"):
            new_node._dynamo_source = old_node._dynamo_source


REWIRED = "draftfuse_rewired"
PROVENANCE = "draftfuse_provenance"  # node meta: which rewrite made the node


def made_by(node: Node) -> str:
    """Which draftfuse rewrite made `node` ("" if none): one of the Dynamo graph's, or an ATen node traced
    from one (AOT autograd copies a node's meta["custom"] onto the nodes it traces from it)."""
    custom = node.meta.get("custom")
    return node.meta.get(PROVENANCE) or (custom.get(PROVENANCE, "") if isinstance(custom, dict) else "")


def rewire(old: Node, new: Node, readers: list[Node] | None = None) -> None:
    """Point `readers` of `old` (all of them by default) at `new`. Each is marked: the fake value it
    recorded shows the memory it shared with `old`'s value, not with `new`'s, so draftfuse.graph.effects
    then assumes it may share the memory of everything it reads."""
    for reader in list(old.users) if readers is None else readers:
        reader.meta[REWIRED] = True
        reader.replace_input_with(old, new)


def erase_unused(nodes: list[Node], erased: set[Node]) -> None:
    """Erase, in the order given, each of `nodes` that nothing reads any more (inputs stay); each
    erased node joins `erased`."""
    for node in nodes:
        if not node.users and node.op != "placeholder" and node not in erased:
            node.graph.erase_node(node)
            erased.add(node)


def erase_emitted(after: Node, last: Node) -> None:
    """Undo an emission that failed halfway: the nodes after `after` through `last`, last first,
    where nothing reads them."""
    node = last
    while node is not after:
        node, unused = node.prev, node
        if not unused.users:
            unused.graph.erase_node(unused)


def insert_after(
    after: Node, op: str, target: Any, args: tuple, kwargs: dict | None = None, *, origin: Node, provenance: str
) -> Node:
    """A new node right after `after`, with a fake value computed from its inputs' fake values (so later
    passes and Inductor see shapes and dtypes), and the stack trace of `origin`, the node it stands in
    for (so reports and errors name the user's line). `provenance` says which rewrite made it."""
    kwargs = kwargs or {}
    graph = after.graph
    with graph.inserting_after(after):
        node = graph.create_node(op, target, args, kwargs)
    key = meta_key(graph)
    value = _fake_of(op, target, args, kwargs, key, origin)
    if value is not None:
        node.meta[key] = value
    for name in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if name in origin.meta:
            node.meta[name] = origin.meta[name]
    node.meta[PROVENANCE] = provenance
    custom = origin.meta.get("custom")
    node.meta["custom"] = {**(custom if isinstance(custom, dict) else {}), PROVENANCE: provenance}
    return node


def _fake_of(op: str, target: Any, args: tuple, kwargs: dict, key: str, origin: Node) -> Any:
    """The new node's fake value, computed in its inputs' fake mode (None when an input has none)."""
    inputs: list[Node] = []
    torch.fx.node.map_arg((args, kwargs), inputs.append)
    values = [a.meta.get(key) for a in inputs]
    if any(v is None for v in values):
        return None
    # The inputs' own fake mode (inside a compile the tracing context holds another one); a constant
    # such as full() has no tensor inputs: the origin's fake mode serves.
    leaves = torch.utils._pytree.tree_leaves([*values, origin.meta.get(key)])
    fake_mode = next((v.fake_mode for v in leaves if isinstance(v, FakeTensor)), None)
    if fake_mode is None:
        return None
    fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta[key])
    with fake_mode:
        if op == "call_method":
            return getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
        return target(*fake_args, **fake_kwargs)
