"""`fold(seed, loop)`: a worker's separate seed step and draft loop, compiled as one captured region.

    draft = draftfuse.fold(worker.seed_step, worker.draft_steps)
    tokens, probs = draft(bonus_tokens, hidden_states, keys, values, seq_lens)

`draft(*args, **kwargs)` computes `loop(*seed(*args, **kwargs))` when the seed returns a tuple and
`loop(seed(*args, **kwargs))` otherwise. Both may be plain functions or bound methods. The composition
is compiled by `draft_loop` (one Dynamo graph, Inductor, one CUDA graph under the default
mode="reduce-overhead"): on a GPU one draft is one graph replay, the seed being its first iteration.

The seed's outputs pass through the `draftfuse::seam` marker, which tells the seed-fold pass
(draftfuse.passes.seed_fold, run by the backend) where the old seam was; the pass removes the marker
and what only carried values across it. What the caller knows and the pass cannot see travels in the
marker too:

    value_ranges={"seq_lens": (1, None)}   every element of the seed's argument `seq_lens` is >= 1
                                           (None: unbounded), so clamps and maxima the two sides
                                           disagree on can be proven equal and computed once;
    drop_buffer_writes=True                the seed's writes into caller buffers that only feed the loop
                                           may be dropped: nothing reads those buffers after the draft.

Every other keyword goes to `draft_loop` (mode, options, zero_copy_outputs, dynamic, max_compiles).

The seed's arguments are passed to the compiled region by keyword where its signature allows, so the
graph inputs carry the seed's parameter names (Dynamo names them after the source) and `value_ranges`
can name them. Limits: as for draft_loop; in addition, every fold shares the code object of one
composition function, so torch's recompile_limit (8 by default) bounds the number of live folds that
are called with the same kinds of arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from draftfuse.passes.seed_fold.seam import mark_seam, seam_facts
from draftfuse.runtime.draft_loop import DraftLoop, draft_loop


class FoldedDraft:
    """`loop(*seed(...))` compiled as one region; see the module docstring. `.draft` is the DraftLoop
    that runs it (its `.compiles` hold the compile records and pass reports)."""

    def __init__(self, seed: Callable[..., Any], loop: Callable[..., Any], draft: DraftLoop) -> None:
        self.seed, self.loop, self.draft = seed, loop, draft
        try:
            self._signature: inspect.Signature | None = inspect.signature(seed)
        except (TypeError, ValueError):  # a builtin or C function: pass the arguments as they come
            self._signature = None
        # The usual seed takes plain parameters: then positional arguments map to names by position,
        # with no binding per call (that would cost more than the rest of a replayed call).
        parameters = self._signature.parameters.values() if self._signature is not None else ()
        plain = self._signature is not None and all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
        self._names = [p.name for p in parameters] if plain else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._names is not None and len(args) <= len(self._names) and (not kwargs or kwargs.keys().isdisjoint(self._names[: len(args)])):
            return self.draft(**dict(zip(self._names, args)), **kwargs)
        if self._signature is None:
            return self.draft(*args, **kwargs)
        positional, keywords = _by_keyword(self._signature, args, kwargs)
        return self.draft(*positional, **keywords)

    def __repr__(self) -> str:
        return f"fold({_name(self.seed)}, {_name(self.loop)})"


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _by_keyword(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """The same call with every argument that may go by keyword passed by keyword."""
    bound = signature.bind(*args, **kwargs)
    Parameter = inspect.Parameter
    keeps_order = any(p.kind is Parameter.VAR_POSITIONAL for p in signature.parameters.values())
    positional, keywords = [], {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is Parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif kind is Parameter.VAR_KEYWORD:
            keywords.update(value)
        elif kind is Parameter.POSITIONAL_ONLY or kind is Parameter.POSITIONAL_OR_KEYWORD and keeps_order:
            positional.append(value)  # before a *args, a name would collide with the positional slot
        else:
            keywords[name] = value
    return positional, keywords


def fold(
    seed: Callable[..., Any],
    loop: Callable[..., Any],
    *,
    value_ranges: Mapping[str, tuple[int | None, int | None]] | None = None,
    drop_buffer_writes: bool = False,
    **draft_loop_settings: Any,
) -> FoldedDraft:
    """Compose `seed` and `loop` into one draft compiled as one captured region (see the module docstring)."""
    facts = seam_facts(value_ranges=value_ranges, drop_buffer_writes=drop_buffer_writes)

    def folded(*args: Any, **kwargs: Any) -> Any:
        carried = mark_seam(seed(*args, **kwargs), facts)
        return loop(*carried) if isinstance(carried, tuple) else loop(carried)

    folded.__qualname__ = f"fold({_name(seed)}, {_name(loop)})"
    return FoldedDraft(seed, loop, draft_loop(folded, **draft_loop_settings))
