"""A module draft's hooks, checked on every call: Dynamo does not guard them.

`draft_loop(module)` compiles the module's call, hooks included: its forward pre-hooks and hooks, its
backward hooks, and the global module hooks (`torch.nn.modules.module.register_module_forward_hook`) are
traced into the region. Dynamo guards none of them (torch's `skip_nnmodule_hook_guards`, on by default:
guarding every module's hooks makes the guard tree half as large again), so a hook registered or removed
after the first call would leave the draft running the old ones, on a replay and through Dynamo alike.
`HookWatch` checks the draft module's own hook dicts and the global ones on every call; a change compiles
the draft anew (draft_loop.py). Hooks of its submodules stay unguarded, as under torch.compile.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

_OWN = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")


class HookWatch:
    """Whether the hooks a module's call runs changed since the last look. A hook's key is its handle's id,
    taken from a counter that only grows: a dict's length and largest key change whenever a hook is added
    or removed (one removed and another added too). Per call: the counter, and the dicts' total length."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.own = module.__dict__  # where nn.Module keeps its hook dicts
        self.globals = tuple(getattr(_module, name) for name in _GLOBAL)
        self.seen = self._state()
        self.next_id, self.total = RemovableHandle.next_id, self._total()

    def _state(self) -> list[tuple[int, int]]:
        dicts: list[Mapping[int, object]] = [*(self.own[name] for name in _OWN), *self.globals]
        return [(len(hooks), max(hooks, default=-1)) for hooks in dicts]

    def _total(self) -> int:  # spelled out: a third of the cost of a loop, on every call
        own, (pre, post, backward_pre, backward) = self.own, self.globals
        return (len(own["_forward_pre_hooks"]) + len(own["_forward_hooks"]) + len(own["_backward_pre_hooks"]) + len(own["_backward_hooks"])
                + len(pre) + len(post) + len(backward_pre) + len(backward))  # fmt: skip

    def changed(self) -> bool:
        """Whether a hook was added or removed since the last call (which then becomes the last look)."""
        if RemovableHandle.next_id == self.next_id and self._total() == self.total:
            return False  # no handle made since, none removed: the same hooks
        state = self._state()
        changed, self.seen = state != self.seen, state
        self.next_id, self.total = RemovableHandle.next_id, self._total()
        return changed
