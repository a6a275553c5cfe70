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

The compiled function is generated for each fold with the seed's own signature (positional-only,
keyword-only, *args, **kwargs and defaults as the seed has them; also under torch.no_grad() or
inference_mode()): a call passes through to draft_loop, which binds it once as CPython binds the seed,
so draft(x, s), draft(x, seq_lens=s) and draft(x=x, seq_lens=s) are one graph, and the graph inputs
carry the seed's parameter names (Dynamo names them after the source), so `value_ranges` can name them.
Defaults replaced on the seed after fold (`__defaults__`, `__kwdefaults__`) are read per call (not for a
method whose `self` has a default: the composition keeps the ones it was made with). A seed
behind another decorator's wrapper that takes (*args, **kwargs) and names the function it wraps
(functools.wraps) is called with the draft's arguments as they come, since such a wrapper may add or
fill arguments: `value_ranges` then reaches the inputs the caller passes by keyword only (the report
says when a key matches none). Limits: as for draft_loop.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import linecache
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from draftfuse.options import Options
from draftfuse.passes.seed_fold.seam import mark_seam_undoable, seam_facts, unmark_seam
from draftfuse.runtime.draft_loop import DraftLoop, draft_loop
from draftfuse.runtime.translate import FOLD_LOOP_CALL

_generated = itertools.count()  # each fold's source file has a name of its own


class FoldedDraft:
    """`loop(*seed(...))` compiled as one region; see the module docstring. `.draft` is the DraftLoop
    that runs it (its `.compiles` hold the compile records and pass reports)."""

    def __init__(self, seed: Callable[..., Any], loop: Callable[..., Any], draft: DraftLoop, defaults_of: Any = None) -> None:
        self.seed, self.loop = seed, loop
        # held in a tuple: torch 2.11's Dynamo cannot read an instance attribute holding a data descriptor (a
        # DraftLoop is one), which a fold called inside another compiled region reads
        self._draft = (draft,)
        # the function whose defaults the composition shares (None: none to follow)
        self._defaults_of = defaults_of

    @property
    def draft(self) -> DraftLoop:
        return self._draft[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the composition takes the seed's defaults as they are now (they may be replaced after fold)
        source, composition = self._defaults_of, self.draft._fn
        if source is not None and (composition.__defaults__ is not source.__defaults__ or composition.__kwdefaults__ is not source.__kwdefaults__):
            if not torch.compiler.is_dynamo_compiling():  # (traced in another region, the seed is called: nothing to sync)
                composition.__defaults__, composition.__kwdefaults__ = source.__defaults__, source.__kwdefaults__
        return self.draft(*args, **kwargs)

    def __repr__(self) -> str:
        return f"fold({_name(self.seed)}, {_name(self.loop)})"


def _composition(seed: Callable[..., Any], loop: Callable[..., Any], facts: Any, signature: inspect.Signature | None) -> Callable[..., Any]:
    """The function draft_loop compiles. Where the seed's `signature` is that of the function a call
    reaches, the composition is generated with it (every kind of parameter, the same defaults) and calls
    the seed with each parameter passed the way it is declared: a call is bound once, by draft_loop's
    replay path, as CPython binds the seed, and the graph inputs carry the seed's parameter names. A seed
    read through a wrapper that may fill or add arguments (`signature` None) gets `(*args, **kwargs)`, and
    is called with them as they come."""
    parameters, call = _parameters_and_call(signature)
    # seed, loop and the rest are the closure's (as in a function written by hand, so Dynamo reads them as
    # the frame's own values), with names no parameter of the seed takes
    source = (
        "def make(_df_seed_, _df_loop_, _df_mark_, _df_unmark_, _df_facts_, _df_tuple_, _df_isinstance_):\n"
        f"    def folded{parameters}:\n"
        f"        _df_carried_, _df_undo_ = _df_mark_(_df_seed_({call}), _df_facts_)\n"
        f"        _df_out_ = {FOLD_LOOP_CALL}*_df_carried_) if _df_isinstance_(_df_carried_, _df_tuple_) else {FOLD_LOOP_CALL}_df_carried_)\n"
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
    if signature is not None:
        Parameter = inspect.Parameter
        found = signature.parameters.values()
        folded.__defaults__ = tuple(p.default for p in found if p.kind in _POSITIONAL and p.default is not Parameter.empty) or None
        folded.__kwdefaults__ = {p.name: p.default for p in found if p.kind is Parameter.KEYWORD_ONLY and p.default is not Parameter.empty} or None
    folded.__qualname__ = f"fold({_name(seed)}, {_name(loop)})"
    return folded


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _parameters_and_call(signature: inspect.Signature | None) -> tuple[str, str]:
    """The composition's parameter list, "(tokens, /, hidden, *rows, scale, **kwargs)" (the seed's, without
    defaults or annotations: those are set on the function), and its call of the seed, "tokens, hidden,
    *rows, scale=scale, **kwargs". A **kwargs is named kwargs, whatever the seed calls it, so that a range
    keyed by the name of an argument it takes finds that argument (draftfuse.passes.seed_fold)."""
    if signature is None:
        return "(*args, **kwargs)", "*args, **kwargs"
    Parameter, names = inspect.Parameter, set(signature.parameters)
    parameters, call = [], []
    for p in signature.parameters.values():
        if p.kind is Parameter.VAR_KEYWORD and ("kwargs" not in names or p.name == "kwargs"):
            p = p.replace(name="kwargs")
        parameters.append(p.replace(default=Parameter.empty, annotation=Parameter.empty))
        call.append({Parameter.VAR_POSITIONAL: f"*{p.name}", Parameter.VAR_KEYWORD: f"**{p.name}",
                     Parameter.KEYWORD_ONLY: f"{p.name}={p.name}"}.get(p.kind, p.name))
    return str(signature.replace(parameters=parameters, return_annotation=Parameter.empty)), ", ".join(call)


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


def _static_call(seed: Any) -> Any:
    """A callable object's class's __call__ when it is a staticmethod (it takes no self; Dynamo cannot trace
    the object's call, so the composition calls the function), else None."""
    static = isinstance(inspect.getattr_static(type(seed), "__call__", None), staticmethod)
    return type(seed).__call__ if static and not isinstance(seed, (type, types.FunctionType, types.MethodType)) else None


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


def _same_defaults(fn: Any, composition: Any) -> Any:
    """`fn`, now sharing its defaults with the composition, if the composition's are `fn`'s (else None, as for a
    method whose `self` has a default: the composition keeps the ones it has)."""
    if fn is None:
        return None
    defaults, kwdefaults = composition.__defaults__, composition.__kwdefaults__
    same = (len(fn.__defaults__ or ()) == len(defaults or ()) and all(a is b for a, b in zip(fn.__defaults__ or (), defaults or ()))
            and (fn.__kwdefaults__ or {}).keys() == (kwdefaults or {}).keys()
            and all(fn.__kwdefaults__[k] is v for k, v in (kwdefaults or {}).items()))
    if not same:
        return None
    composition.__defaults__, composition.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    return fn


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
    callee = _static_call(seed) or seed  # a staticmethod __call__: its function
    signature, defaults_of, own = _seed_signature(callee)  # signature None (a builtin): arguments pass as they come
    facts = seam_facts(value_ranges=value_ranges, drop_buffer_writes=drop_buffer_writes)
    folded = _composition(callee, loop, facts, signature if own else None)
    draft = draft_loop(folded, **draft_loop_settings)
    draft.inline_fn = functools.partial(_seed_then_loop, callee, loop)  # traced in an enclosing region: no marker
    return FoldedDraft(seed, loop, draft, _same_defaults(defaults_of, folded) if own else None)


def _seed_then_loop(seed: Callable[..., Any], loop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    carried = seed(*args, **kwargs)
    return loop(*carried) if isinstance(carried, tuple) else loop(carried)


def as_compiled(fn: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], Options, bool | None, tuple]:
    """What a draft_loop or fold compiles for `fn` (the function, its options and dynamic setting) and the
    arguments it is called with (a method's draft puts its instance first); the default options and
    static shapes for a plain function (a module: its call, hooks included). explain and draftfuse.testing
    trace drafts through it."""
    if isinstance(fn, FoldedDraft):
        fn = fn.draft
    if isinstance(fn, DraftLoop):
        return fn._fn, fn._options, fn._dynamic, args if fn._instance is None else (fn._instance, *args)
    if isinstance(fn, torch.nn.Module):  # its call, hooks included, as draft_loop(module) compiles it
        return type(fn).__call__, Options(), False, (fn, *args)
    return fn, Options(), False, args
