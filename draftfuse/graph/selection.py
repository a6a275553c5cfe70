"""Selections: nodes that pick entries along one dim (topk, max/min over a dim, argmax, argmin, and
draftfuse's own selection ops), in every spelling of both levels, as one description.

    as_selection(node) -> Selection | None

The softmax -> topk pass rewrites them, the seed fold counts draft iterations by them, the vocab-
parallel pass localises them. `torch.max(a, b)` (elementwise), `x.max()` (a full reduction) and
`argmax` without a dim are not selections.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from draftfuse.graph.values import Node, rewire, target_key

aten = torch.ops.aten

# target: (parameter names in positional order, kind). kind "topk" returns (values, indices) with k
# kept along dim; "max"/"min" return (values, indices) reduced; "argmax"/"argmin" return indices only.
SELECTION_SPELLINGS: dict[Any, tuple[tuple[str, ...], str]] = {
    torch.topk: (("input", "k", "dim", "largest", "sorted"), "topk"),
    "topk": (("input", "k", "dim", "largest", "sorted"), "topk"),
    aten.topk.default: (("input", "k", "dim", "largest", "sorted"), "topk"),
    torch.max: (("input", "dim", "keepdim"), "max"),
    "max": (("input", "dim", "keepdim"), "max"),
    aten.max.dim: (("input", "dim", "keepdim"), "max"),
    torch.min: (("input", "dim", "keepdim"), "min"),
    "min": (("input", "dim", "keepdim"), "min"),
    aten.min.dim: (("input", "dim", "keepdim"), "min"),
    torch.argmax: (("input", "dim", "keepdim"), "argmax"),
    "argmax": (("input", "dim", "keepdim"), "argmax"),
    aten.argmax.default: (("input", "dim", "keepdim"), "argmax"),
    torch.argmin: (("input", "dim", "keepdim"), "argmin"),
    "argmin": (("input", "dim", "keepdim"), "argmin"),
    aten.argmin.default: (("input", "dim", "keepdim"), "argmin"),
}
_DEFAULTS = {"dim": -1, "largest": True, "sorted": True, "keepdim": False}


@dataclasses.dataclass
class Selection:
    node: Node
    kind: str  # topk | max | min | argmax | argmin | argmax_prob | topk_prob (draftfuse's ops)
    input: Node
    dim: Any  # as written (normalise with the input's rank)
    k: Any  # 1 except for topk; may be a Node or a SymInt
    largest: bool
    keepdim: bool  # topk keeps its dim
    sorted: bool

    @property
    def returns_pair(self) -> bool:
        """(values, indices), read through getitem; argmax/argmin return the indices alone."""
        return self.kind not in ("argmax", "argmin")

    @property
    def index_item(self) -> int | None:
        """Which getitem of the result holds the indices (None: the result is the indices)."""
        return {"argmax": None, "argmin": None, "argmax_prob": 0}.get(self.kind, 1)


def readers(sel: Selection) -> dict[int, list[Node]]:
    """The getitems that read a (values, indices) selection, by item: 0 values, 1 indices (none for
    argmax/argmin, whose readers read the indices themselves)."""
    found: dict[int, list[Node]] = {0: [], 1: []}
    for user in sel.node.users if sel.returns_pair else ():
        found[user.args[1]].append(user)
    return found


def rewire_readers(sel: Selection, found: dict[int, list[Node]], index: Node, value: Node | None) -> None:
    """Point what read the selection (`found`: its `readers`) at new nodes: indices at `index`, values at `value`."""
    if not sel.returns_pair:
        rewire(sel.node, index)
    for user in found[1]:
        rewire(user, index)
    for user in found[0]:
        rewire(user, value)


def bind(node: Node, names: Sequence[str]) -> dict[str, Any] | None:
    """Positional and keyword arguments of `node` by parameter name; None if they do not fit."""
    if len(node.args) > len(names):
        return None
    bound = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key not in names or key in bound:
            return None  # an unknown keyword (out=, ...) is not understood
        bound[key] = value
    return bound


def as_selection(node: Node) -> Selection | None:
    if node.op not in ("call_function", "call_method"):
        return None
    spelling = SELECTION_SPELLINGS.get(target_key(node))
    if spelling is None:
        return _as_draftfuse_selection(node)
    names, kind = spelling
    bound = bind(node, names)
    if bound is None or not isinstance(bound.get("input"), Node):
        return None
    if kind in ("max", "min") and ("dim" not in bound or isinstance(bound["dim"], Node)):
        return None  # a full reduction, or torch.max(a, b) elementwise
    if kind in ("argmax", "argmin") and bound.get("dim") is None:
        return None  # argmax over the flattened tensor (its dim defaults to None, not to the last)
    get = lambda name: bound.get(name, _DEFAULTS.get(name))  # noqa: E731
    return Selection(
        node=node, kind=kind, input=bound["input"], dim=get("dim"), k=bound.get("k", 1),
        largest=get("largest") if kind == "topk" else kind in ("max", "argmax"),
        keepdim=True if kind == "topk" else bool(get("keepdim")), sorted=get("sorted") if kind == "topk" else True,
    )  # fmt: skip


def _as_draftfuse_selection(node: Node) -> Selection | None:
    """draftfuse's own ops (what the softmax -> topk rewrite emits): last dim, largest."""
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "draftfuse":
        return None
    name = node.target._schema.name.split("::")[-1]
    if name not in ("argmax_prob", "topk_prob") or not node.args or not isinstance(node.args[0], Node):
        return None
    k = node.args[1] if name == "topk_prob" and len(node.args) > 1 else node.kwargs.get("k", 1)
    return Selection(node, name, node.args[0], -1, k, True, name == "topk_prob", True)
