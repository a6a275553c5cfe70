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
                                           attribute, meta['seq_lens'] for a dict entry; a positional-only
                                           parameter's name too, which the reports show as args[i]; the
                                           report lists the names when a key matches none);
    drop_buffer_writes=True                the seed's writes into caller buffers that only feed the loop
                                           may be dropped: nothing reads those buffers after the draft.

Every other keyword goes to `draft_loop` (mode, options, zero_copy_outputs, dynamic, max_compiles).
Called inside another compiled region, the draft is traced there as `loop(*seed(...))`, without the
marker (that region's backend would not remove it).

The compiled function is generated for each fold with the seed's own parameters (a seed of plain
positional-or-keyword parameters, the usual one): a call passes through to draft_loop, which binds it
once, and the graph inputs carry the seed's parameter names (Dynamo names them after the source), so
`value_ranges` can name them. A seed with other kinds of parameters gets `(*args, **kwargs)`, its
arguments passed by keyword where its signature allows. A seed's parameters are those a call binds to: a
decorator's wrapper that takes (*args, **kwargs) and names the seed it wraps (functools.wraps, as
torch.no_grad() and inference_mode() do) is taken to pass them on, so the seed's own are used; a wrapper
with parameters of its own is called with those. Limits: as for draft_loop.
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

_generated = itertools.count()  # each fold's source file has a name of its own


class FoldedDraft:
    """`loop(*seed(...))` compiled as one region; see the module docstring. `.draft` is the DraftLoop
    that runs it (its `.compiles` hold the compile records and pass reports)."""

    def __init__(self, seed: Callable[..., Any], loop: Callable[..., Any], draft: DraftLoop, rebind: inspect.Signature | None, defaults_of: Any = None) -> None:
        self.seed, self.loop, self.draft = seed, loop, draft
        self._rebind = rebind  # the seed's signature, to pass arguments by keyword; None: a call passes through
        # the function whose __defaults__ the composition's were copied from (None: none to follow)
        self._defaults_of = _same_defaults(defaults_of, draft._fn.__defaults__) if rebind is None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._rebind is None:
            # the composition takes the seed's parameters and defaults: those as they are now (a seed's
            # __defaults__ may be replaced after fold; the composition's were copied from it)
            if self._defaults_of is not None:
                defaults, composition = self._defaults_of.__defaults__, self.draft._fn
                if composition.__defaults__ is not defaults:
                    composition.__defaults__ = defaults
            try:
                return self.draft(*args, **kwargs)
            except TypeError as e:
                self._raise_unbound(e, args, kwargs)
                raise
        positional, keywords = _by_keyword(self._rebind, args, kwargs)
        return self.draft(*positional, **keywords)

    def __repr__(self) -> str:
        return f"fold({_name(self.seed)}, {_name(self.loop)})"

    def _raise_unbound(self, error: TypeError, args: tuple, kwargs: dict) -> None:
        """Raise a TypeError that says why, if the call does not fit the parameters fold gave the draft."""
        signature = inspect.signature(self.draft._fn)
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            read = ""
            if hasattr(getattr(self.seed, "__func__", self.seed), "__wrapped__"):
                read = (" (read through the seed's __wrapped__: a functools.wraps wrapper that takes (*args, **kwargs) is "
                        "taken to pass them on unchanged; one that adds arguments should take the parameters it is called with)")
            raise TypeError(f"{self!r}: the call does not fit the seed's parameters {signature}{read}: {error}") from error


def _composition(seed: Callable[..., Any], loop: Callable[..., Any], facts: Any, signature: inspect.Signature | None) -> tuple[Callable[..., Any], bool]:
    """The function draft_loop compiles, and whether it takes the seed's own parameters. The usual seed
    takes plain parameters (positional or keyword): the composition is then generated with the same
    parameters and defaults, so a call passes straight through and is bound once, by draft_loop's
    replay path, and the graph inputs carry the seed's parameter names. Any other signature gets
    `(*args, **kwargs)`, the arguments passed by keyword where the seed allows (see _by_keyword)."""
    parameters = list(signature.parameters.values()) if signature is not None else []
    plain = signature is not None and all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
    names = ", ".join(p.name for p in parameters) if plain else "*args, **kwargs"
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
    if plain:
        folded.__defaults__ = tuple(p.default for p in parameters if p.default is not inspect.Parameter.empty) or None
    folded.__qualname__ = f"fold({_name(seed)}, {_name(loop)})"
    return folded, plain


def _seed_signature(seed: Callable[..., Any]) -> tuple[inspect.Signature | None, Any]:
    """The parameters a call of the seed binds to, and the function that holds their defaults (None: none
    to follow, as for a partial). A wrapper that names the function it wraps (functools.wraps) and takes
    `(*args, **kwargs)` passes its arguments on, as torch.no_grad() and inference_mode() do: the
    parameters are the wrapped function's. A wrapper with parameters of its own is called with those (it
    may add or fill arguments of the wrapped function). A callable object's are its class's __call__'s."""
    if isinstance(seed, types.MethodType):
        holder, fn = seed.__self__, seed.__func__
    elif isinstance(seed, types.FunctionType):
        holder, fn = None, seed
    elif isinstance(getattr(type(seed), "__call__", None), types.FunctionType) and not isinstance(seed, type):
        holder, fn = seed, type(seed).__call__
    else:  # a partial, a builtin, a class
        try:
            return inspect.signature(seed), None
        except (TypeError, ValueError):
            return None, None
    fn = inspect.unwrap(fn, stop=lambda f: not _forwards(f))
    try:
        signature = inspect.signature(fn if holder is None else types.MethodType(fn, holder), follow_wrapped=False)
    except (TypeError, ValueError):
        return None, None
    return signature, fn if isinstance(fn, types.FunctionType) else None


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
    signature, defaults_of = _seed_signature(seed)  # signature None (a builtin): arguments pass as they come
    if value_ranges and signature is not None:
        value_ranges = {_as_passed(key, signature): bounds for key, bounds in value_ranges.items()}
    facts = seam_facts(value_ranges=value_ranges, drop_buffer_writes=drop_buffer_writes)
    folded, own_parameters = _composition(seed, loop, facts, signature)
    draft = draft_loop(folded, **draft_loop_settings)
    draft.inline_fn = functools.partial(_seed_then_loop, seed, loop)  # traced in an enclosing region: no marker
    return FoldedDraft(seed, loop, draft, None if own_parameters else signature, defaults_of)


def _as_passed(key: str, signature: inspect.Signature) -> str:
    """A value_ranges key for the input as the composition receives it: where the seed's parameters are not
    all plain, the composition takes (*args, **kwargs) and a parameter passed by position is an element of
    its args (seq_lens, the seed's positional-only parameter 2, is args[2]; rows[1] of the seed's *rows
    after two such parameters is args[3])."""
    kinds = [p.kind for p in signature.parameters.values()]
    Parameter = inspect.Parameter
    if all(kind is Parameter.POSITIONAL_OR_KEYWORD for kind in kinds):
        return key  # the composition takes the seed's own parameters
    head, rest = re.match(r"(\w*)(.*)", key).groups()
    keeps_order = Parameter.VAR_POSITIONAL in kinds  # as _by_keyword passes them
    for position, (name, parameter) in enumerate(signature.parameters.items()):
        if parameter.kind is Parameter.VAR_POSITIONAL:
            element = re.match(r"\[(\d+)\](.*)", rest)
            return f"args[{position + int(element.group(1))}]{element.group(2)}" if name == head and element else key
        by_position = parameter.kind is Parameter.POSITIONAL_ONLY or parameter.kind is Parameter.POSITIONAL_OR_KEYWORD and keeps_order
        if name == head:
            return f"args[{position}]{rest}" if by_position else key
    return key


def _seed_then_loop(seed: Callable[..., Any], loop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    carried = seed(*args, **kwargs)
    return loop(*carried) if isinstance(carried, tuple) else loop(carried)
