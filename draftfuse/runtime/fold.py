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
                                           disagree on can be proven equal and computed once (a key
                                           names an input as written: seq_lens, meta.seq_lens for an
                                           attribute, meta['seq_lens'] for a dict entry; the reports list
                                           the names when a key matches none);
    drop_buffer_writes=True                the seed's writes into caller buffers that only feed the loop
                                           may be dropped: nothing reads those buffers after the draft.

Every other keyword goes to `draft_loop` (mode, options, zero_copy_outputs, dynamic, max_compiles).
Called inside another compiled region, the draft is traced there as `loop(*seed(...))`, without the
marker (that region's backend would not remove it).

The compiled function is generated for each fold with the seed's own parameters (a seed of plain
positional-or-keyword parameters, the usual one, also under torch.no_grad() or inference_mode()): a call
passes through to draft_loop, which binds it once, and the graph inputs carry the seed's parameter names
(Dynamo names them after the source), so `value_ranges` can name them. A seed with other kinds of
parameters gets `(*args, **kwargs)`, each call's arguments passed by keyword where its signature allows
(one graph whichever way the caller passes them). A seed behind another decorator's wrapper that takes
(*args, **kwargs) and names the function it wraps (functools.wraps) is called with the draft's
arguments as they come, since such a wrapper may add or fill arguments: `value_ranges` then reaches
the inputs the caller passes by keyword only (the report says when a key matches none). Limits: as for
draft_loop.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import linecache
import os
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

from draftfuse.passes.seed_fold.seam import mark_seam_undoable, seam_facts, unmark_seam
from draftfuse.runtime.draft_loop import DraftLoop, draft_loop
from draftfuse.runtime.translate import FOLD_LOOP_LINE

_generated = itertools.count()  # each fold's source file has a name of its own


class FoldedDraft:
    """`loop(*seed(...))` compiled as one region; see the module docstring. `.draft` is the DraftLoop
    that runs it (its `.compiles` hold the compile records and pass reports)."""

    def __init__(self, seed: Callable[..., Any], loop: Callable[..., Any], draft: DraftLoop, defaults_of: Any = None,
                 rebind: inspect.Signature | None = None) -> None:
        self.seed, self.loop, self.draft = seed, loop, draft
        # the function whose __defaults__ the composition's were copied from (None: none to follow)
        self._defaults_of = _same_defaults(defaults_of, draft._fn.__defaults__)
        self._rebind = rebind  # the seed's own signature, to pass every argument the same way (None: as it comes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a composition of the seed's own parameters takes its defaults as they are now (a seed's __defaults__
        # may be replaced after fold; the composition's were copied from it)
        if self._defaults_of is not None:
            defaults, composition = self._defaults_of.__defaults__, self.draft._fn
            if composition.__defaults__ is not defaults:
                composition.__defaults__ = defaults
        if self._rebind is not None:  # draft(x, s) and draft(x, seq_lens=s): one call, one compile
            positional, kwargs = _by_keyword(self._rebind, args, kwargs)
            args = tuple(positional)
        return self.draft(*args, **kwargs)

    def __repr__(self) -> str:
        return f"fold({_name(self.seed)}, {_name(self.loop)})"


def _composition(seed: Callable[..., Any], loop: Callable[..., Any], facts: Any, parameters: list[inspect.Parameter] | None) -> Callable[..., Any]:
    """The function draft_loop compiles. The usual seed takes plain parameters (positional or keyword) of
    its own: the composition is generated with the same `parameters` and defaults, so a call is bound
    once, by draft_loop's replay path, and the graph inputs carry the seed's parameter names. Any other
    seed (other kinds of parameters, or parameters read through a wrapper's __wrapped__, which may fill
    what a call leaves out) gets `(*args, **kwargs)` (`parameters` None), and is called with them as they come."""
    names = ", ".join(p.name for p in parameters) if parameters is not None else "*args, **kwargs"
    # seed, loop and the rest are the closure's (as in a function written by hand, so Dynamo reads them as
    # the frame's own values), with names no parameter of the seed takes
    source = (
        "def make(_df_seed_, _df_loop_, _df_mark_, _df_unmark_, _df_facts_, _df_tuple_, _df_isinstance_):\n"
        f"    def folded({names}):\n"
        f"        _df_carried_, _df_undo_ = _df_mark_(_df_seed_({names}), _df_facts_)\n"
        "        _df_out_ = _df_loop_(*_df_carried_) if _df_isinstance_(_df_carried_, _df_tuple_) else _df_loop_(_df_carried_)\n"
        "        _df_unmark_(_df_undo_)\n"
        "        return _df_out_\n"
        "    return folded\n"
    )
    scope: dict[str, Any] = {}
    # named inside the package, so that errors and reports point past it at the user's code; its source
    # in linecache, so that it has a source file as inspect sees it (torch 2.11's torch.compile runs a
    # function without one inside a wrapper frame that every such function shares: Dynamo's cache and
    # guards then belong to that wrapper, and the draft could not replay without Dynamo)
    filename = os.path.join(os.path.dirname(__file__), f"<fold of {_name(seed)} {next(_generated)}>")
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), scope)
    folded = scope["make"](seed, loop, mark_seam_undoable, unmark_seam, facts, tuple, isinstance)
    assert "_df_loop_(" in source.splitlines()[FOLD_LOOP_LINE - 1]  # where translate looks for a loop that does not take the seed's values
    if parameters is not None:
        folded.__defaults__ = tuple(p.default for p in parameters if p.default is not inspect.Parameter.empty) or None
    folded.__qualname__ = f"fold({_name(seed)}, {_name(loop)})"
    return folded


def _seed_signature(seed: Callable[..., Any]) -> tuple[inspect.Signature | None, Any, bool]:
    """The seed's parameters, the function that holds their defaults (None: none to follow, as for a
    partial), and whether they are those of the function a call reaches (False: read through the
    __wrapped__ of a wrapper that may add or fill arguments, for the names of keyword arguments only). A
    wrapper that names the function it wraps (functools.wraps) and takes `(*args, **kwargs)` is looked
    through; torch's own (torch.no_grad(), inference_mode()) pass the arguments on as they came. A
    wrapper with parameters of its own is called with those. A callable object's are its class's
    __call__'s."""
    if isinstance(seed, types.MethodType):
        holder, fn = seed.__self__, seed.__func__
    elif isinstance(seed, types.FunctionType):
        holder, fn = None, seed
    elif isinstance(getattr(type(seed), "__call__", None), types.FunctionType) and not isinstance(seed, type):
        holder, fn = seed, type(seed).__call__
    else:  # a partial, a builtin, a class
        try:
            return inspect.signature(seed), None, False
        except (TypeError, ValueError):
            return None, None, False
    own = True
    while _forwards(fn) and hasattr(fn, "__wrapped__"):
        own = own and _torch_decorator(fn)
        fn = fn.__wrapped__
    try:
        signature = inspect.signature(fn if holder is None else types.MethodType(fn, holder), follow_wrapped=False)
    except (TypeError, ValueError):
        return None, None, False
    return signature, fn if isinstance(fn, types.FunctionType) else None, own


def _torch_decorator(wrapper: Any) -> bool:
    """torch.no_grad(), inference_mode(), enable_grad() and the like as decorators: their wrapper calls the
    function with the arguments as they came, so it is as if the call reached the function."""
    code = getattr(wrapper, "__code__", None)
    return code is not None and code.co_filename.endswith(os.path.join("torch", "utils", "_contextlib.py"))


def _forwards(fn: Any) -> bool:
    """Whether `fn` takes exactly (*args, **kwargs)."""
    try:
        kinds = [p.kind for p in inspect.signature(fn, follow_wrapped=False).parameters.values()]
    except (TypeError, ValueError):
        return False
    return kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def _same_defaults(fn: Any, defaults: tuple | None) -> Any:
    """`fn` if its __defaults__ are still the ones the composition copied (else None: those are kept)."""
    found = getattr(fn, "__defaults__", None)
    same = found == defaults if found is None or defaults is None else len(found) == len(defaults) and all(a is b for a, b in zip(found, defaults))
    return fn if same and fn is not None else None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def fold(
    seed: Callable[..., Any],
    loop: Callable[..., Any],
    *,
    value_ranges: Mapping[str, tuple[int | None, int | None]] | None = None,
    drop_buffer_writes: bool = False,
    **draft_loop_settings: Any,
) -> FoldedDraft:
    """Compose `seed` and `loop` into one draft compiled as one captured region (see the module docstring)."""
    signature, defaults_of, own = _seed_signature(seed)  # signature None (a builtin): arguments pass as they come
    plain = own and all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
    facts = seam_facts(value_ranges=value_ranges, drop_buffer_writes=drop_buffer_writes)  # checked as given
    if value_ranges and own and not plain:  # positions are the seed's own: a range may name args[i] too
        received = {_as_received(key, signature): bounds for key, bounds in value_ranges.items()}
        facts = seam_facts(value_ranges=received, drop_buffer_writes=drop_buffer_writes)
    folded = _composition(seed, loop, facts, list(signature.parameters.values()) if plain else None)
    draft = draft_loop(folded, **draft_loop_settings)
    draft.inline_fn = functools.partial(_seed_then_loop, seed, loop)  # traced in an enclosing region: no marker
    return FoldedDraft(seed, loop, draft, defaults_of if plain else None, signature if own and not plain else None)


def _by_keyword(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """The same call with every argument that may go by keyword passed by keyword (its own function
    binds it the same way), so that a call's style does not change the graph's inputs."""
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


def _as_received(key: str, signature: inspect.Signature) -> str:
    """A value_ranges key of a composition that takes (*args, **kwargs), with the spelling of its input
    when the call passes it by position: seq_lens, the seed's parameter 2, is args[2] then (the key becomes
    "seq_lens|args[2]": the pass takes either); rows[1] of the seed's *rows after two parameters is args[3]."""
    head, rest = re.match(r"(\w*)(.*)", key).groups()
    for position, (name, parameter) in enumerate(signature.parameters.items()):
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            element = re.match(r"\[(\d+)\](.*)", rest)
            return f"{key}|args[{position + int(element.group(1))}]{element.group(2)}" if name == head and element else key
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) and name == head:
            return f"{key}|args[{position}]{rest}"
    return key


def _seed_then_loop(seed: Callable[..., Any], loop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    carried = seed(*args, **kwargs)
    return loop(*carried) if isinstance(carried, tuple) else loop(carried)
