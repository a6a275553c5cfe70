"""Replaying a compiled draft at the cost of a raw CUDA graph replay.

A call through torch.compile pays, before any kernel runs, Dynamo's frame evaluation (guards, then
bytecode that fetches every parameter from its module: work that grows with the parameters) and CUDA
graph trees' bookkeeping; together about 100 us of host time per draft. A server's hand-written
runner pays ~20 us: copy the call's tensors into static buffers, replay. draftfuse gets there in two
parts:

  * `GraphRecorder` (recorder.py) wraps the Inductor-compiled region: recorded in a CUDA graph on its
    second call, replayed from then on, its outputs handed out from spare recordings (see there).
  * `Replay` is a recorded call that bypasses Dynamo: it checks Dynamo's own guards for the compiled
    frame (C++: argument shapes, dtypes, devices, the Python values the draft specialised on, module
    attributes, grad mode), plus an identity guard added to that guard tree for every weight and buffer
    (a replaced one fails it), the address of every KV cache the draft writes (a new view of the same
    memory is the same input; other memory fails), and the data pointers of the tensors read in place
    (one C-level map, for `p.data = ...`); then hands the call's other tensors to the recorder (read in
    place, or copied into its static buffers), replays (a free spare when outputs are the caller's), and
    rebuilds the return value as Dynamo's code did: graph outputs, the call's own arguments (objects and
    containers returned as they are), and constants.
A Replay is built only where it is sound: Dynamo's code for the frame must do nothing but call the
graph (no attribute, item or enclosing-variable stores, no other calls: a side effect would be skipped),
every non-static graph input must be found from the call's arguments by its Dynamo source, and every
returned value must be a graph output, an argument, a tensor the graph reads (fetched by its source), or
a Python constant the guards pin (one passed through from an argument, at any depth of its tuples, lists
and dicts, that no guard holds is not: Dynamo returns it as it comes; nor is one Dynamo's code reads anew
through an attribute or a function's defaults or closure). Its guards are those of the cache
entry that ran (the one whose guards passed before the call, or the one it compiled), which must pass
after the call too (draft_loop.py). Anything else keeps the draft on the Dynamo path, which is always
correct. When any guard fails, the call takes the Dynamo path, which
recompiles (or raises RecompileError past max_compiles) and records a new Replay.
"""

from __future__ import annotations

import collections
import dis
import functools
import inspect
import operator
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from draftfuse.graph.values import source_name, user_frame
from draftfuse.runtime.recorder import GraphRecorder, log

# Python values Dynamo returns as constants: pinned by its guards unless passed through from an argument
_PINNED = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_VALUE_GUARDS = {"EQUALS_MATCH", "ID_MATCH", "NONE_MATCH", "TRUE_MATCH", "FALSE_MATCH"}
_SIDE_EFFECT_OPS = {"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "DELETE_ATTR", "DELETE_SUBSCR", "DELETE_GLOBAL", "IMPORT_NAME"}
_ALLOWED_NAMES = ("__compiled_fn", "__import_torch_dot__dynamo_dot_utils", "record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit")
# attributes Dynamo's code reads to rebuild a returned constant from where the draft found it (a default
# of a function inside a decorator's closure: fn.__closure__[1].cell_contents.__defaults__[0]); reads only,
# and a value read through them must be one a guard holds (_unsettled)
_FUNCTION_READS = {"__closure__", "cell_contents", "__defaults__", "__kwdefaults__"}


def warn_no_fast_replay(why: str) -> None:
    """Say (once per recording) that a draft's calls stay on the Dynamo path: correct, but each pays
    Dynamo's guards and argument handling on the host (about 100 us)."""
    _, level = user_frame()
    warnings.warn(f"draftfuse: no fast replay for this draft: {why}; its calls go through Dynamo (correct, slower on the host)", stacklevel=level)


def _attribute_store(target: str = "obj.attr") -> str:
    return f"a side effect (an attribute store, {target} = value or {target} += 1, which Dynamo's code makes on every call)"


def _impure_instruction(code: Any, fetched: set[str], pinned: Callable[[str], bool]) -> str:
    """What in Dynamo's code for a frame does more than fetch the graph's inputs (`fetched`: their sources,
    such as L['head']._modules['proj']._parameters['weight']), call the compiled graph and build the return
    value ("" if nothing): a store, or a load of anything else (which it could call, or return as it finds
    it then). An attribute read off an argument must lie on the way to a graph input's source, and a read
    that stops short of one (or goes through a function's closure or defaults) must be a value that a guard
    holds (`pinned`): Dynamo reads meta.n, state.sub or fn.__defaults__[0] anew on each call to return it,
    which a Replay would return as the recorded call's. Reads of an argument by subscripts alone are left
    to the return value's template (argument_paths: the call's own values)."""
    chain = None  # the source that the value on top of the stack was read from, while it is an argument's
    instructions = list(dis.get_instructions(code))
    count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    arguments = {*code.co_varnames[:count], *code.co_freevars}  # the frame's locals as the guards see them
    held: dict[str, str] = {}  # temporaries holding a read of an argument: their sources
    copied = None
    for i, instruction in enumerate(instructions):
        op, arg = instruction.opname, instruction.argval
        if op.startswith("LOAD_FAST"):  # LOAD_FAST_CHECK, LOAD_FAST_LOAD_FAST (Python 3.13: the last is on top)
            op, arg = "LOAD_FAST", arg[-1] if isinstance(arg, tuple) else arg
        if op == "STORE_ATTR":  # torch 2.11's code stores attributes so; 2.13's calls a helper (below)
            return _attribute_store(f".{arg}")
        if op in _SIDE_EFFECT_OPS:
            return f"a side effect ({op} {arg})"
        if op in ("STORE_DEREF", "DELETE_DEREF") and arg in code.co_freevars:
            return f"a side effect ({op} {arg}: a variable of an enclosing function)"
        if chain is not None and op == "LOAD_CONST" and i + 1 < len(instructions) and instructions[i + 1].opname == "BINARY_SUBSCR":
            chain += f"[{arg!r}]"
            continue
        if chain is not None and op == "BINARY_SUBSCR":
            continue
        if chain is not None and op == "COPY" and arg == 1:
            copied = chain
            continue
        if op == "STORE_FAST" and copied is not None:
            held[arg], chain, copied = copied, copied, None
            continue
        if chain is not None and op in ("LOAD_ATTR", "LOAD_METHOD"):
            chain += f".{arg}"
            if arg not in _FUNCTION_READS and not any(source == chain or source.startswith((chain + ".", chain + "[")) for source in fetched):
                return f"a read of {chain} that is no graph input's source (returned as it is found then)"
            continue
        if chain is not None and (why := _unsettled(chain, fetched, pinned)):  # the read ends here: its value is used
            return why
        chain = copied = None
        if op in ("LOAD_FAST", "LOAD_DEREF") and arg in arguments:
            chain = f"L[{arg!r}]"
            continue
        if op == "LOAD_FAST" and arg in held:  # a temporary Dynamo keeps a read in (COPY 1, STORE_FAST tmp_3)
            chain = held[arg]
            continue
        if op in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD"):
            name = str(arg)
            if name == "object_setattr_ignore_descriptor":  # the helper Dynamo's code stores attributes with
                return _attribute_store()
            if not name.startswith(_ALLOWED_NAMES):
                return f"a load of {name!r} ({op}: a global, or an attribute that is no graph input)"
    return _unsettled(chain, fetched, pinned) if chain is not None else ""


def _unsettled(chain: str, fetched: set[str], pinned: Callable[[str], bool]) -> str:
    """Why the value read from `chain` may not be taken as the recorded call's ("" if it may): a graph input,
    an argument or a subscript of one (the template's argument paths), or a value a guard holds."""
    steps = chain[re.match(r"L\[[^\]]*\]", chain).end():]
    if chain in fetched or not re.search(r"\.(?![^\[]*\])", steps) or pinned(chain):
        return ""
    return f"a read of {chain} that is no graph input's source and that no guard holds (returned as it is found then)"


def _guard_nodes(root: Any) -> dict[str, Any]:
    """Every GuardManager node of a guard tree, by its source's name."""
    found, stack = {}, [root]
    while stack:
        node = stack.pop()
        try:
            found.setdefault(node.get_source(), node)
        except Exception:
            pass
        stack.extend(node.get_child_managers())
        if hasattr(node, "get_key_value_managers"):  # a dict's entries (a ModuleList's modules, say)
            stack.extend(m for pair in node.get_key_value_managers().values() for m in pair if m is not None)
    return found


def _source(path: tuple) -> str:
    """Dynamo's name for the argument at `path`: ("kv", 0) -> "L['kv'][0]"."""
    return "L" + "".join(f"[{step!r}]" for step in path)


def _pinned(nodes: dict[str, Any], path: tuple) -> bool:
    """Whether a guard of the tree holds the argument at `path` to its value (or its identity)."""
    return _holds_value(nodes.get(_source(path)))


def _holds_value(node: Any) -> bool:
    """Whether a guard node (or None) holds its source to a value (or an identity)."""
    return node is not None and any(type(g).__name__ in _VALUE_GUARDS for g in node.get_leaf_guards())


def _fetcher(placeholder: Any, value: Any, scope: dict[str, Any]) -> Callable[[dict[str, Any]], Any] | None:
    """f_locals -> the graph input that `placeholder` stands for, by its Dynamo source; None if the
    source is not an expression over the call's arguments that finds `value`."""
    name = source_name(placeholder._dynamo_source)
    try:
        code = compile(name, "<draftfuse source>", "eval")
        if eval(code, {}, scope) is not value:
            raise LookupError(name)
    except Exception:
        warn_no_fast_replay(f"input {name} is not found from the arguments")
        return None
    if (plain := re.fullmatch(r"L\['(\w+)'\]", name)) is not None:
        return operator.itemgetter(plain.group(1))  # an argument itself: a dict lookup
    return eval(compile(f"lambda L: {name}", "<draftfuse input fetch>", "eval"), {})  # one compiled function


def _static_check(statics: list[tuple[str, torch.Tensor, bool]]) -> Callable[[dict[str, Any]], bool]:
    """One compiled function f_locals -> whether each source still finds the memory the graph reads: the
    recorded address where a guard of the tree pins the tensor's shape and strides (a new view of the same
    memory, as servers pass `buf[:n]` each step, is the same input), else the recorded tensor itself. The
    sources are Dynamo's, checked by `_fetcher` to evaluate over the call's locals."""
    if not statics:
        return lambda f_locals: True
    terms = " and ".join(f"({name}).data_ptr() == {value.data_ptr()}" if pinned else f"({name}) is V[{i}]"
                         for i, (name, value, pinned) in enumerate(statics))  # fmt: skip
    return eval(compile(f"lambda L: {terms}", "<draftfuse static input check>", "eval"), {"V": [v for _, v, _ in statics]})


IDENTITY_GUARD = "is the tensor the recorded graph reads"  # a weight's guard, as a failure of it reads


def _add_identity_guard(node: Any, value: Any, name: str) -> None:
    verbose = [f"draftfuse: {name} {IDENTITY_GUARD}"]
    try:
        node.add_id_match_guard(id(value), verbose, None)  # torch 2.13: (id, code parts, user stack)
    except TypeError:
        node.add_id_match_guard(id(value), verbose)  # torch 2.11


class Replay:
    """A recorded call of a draft that runs without Dynamo; see the module docstring. `build` returns
    None (and logs why) where a Replay would not be sound."""

    def __init__(
        self,
        guard: Any,
        recorder: GraphRecorder,
        fetchers: list[Callable],
        held: list[torch.Tensor],
        template: tuple,
        statics: list[tuple[str, torch.Tensor, bool]],
    ) -> None:
        self.guard = guard  # Dynamo's guard manager for the frame, with identity guards added
        self.recorder = recorder
        self.fetchers = fetchers  # per non-static input, in the recorder's order: f_locals -> tensor
        self.same_static = _static_check(statics)  # KV caches, and static tensors no guard node holds: one call
        self.checked_by_source = [name for name, _, _ in statics]
        self.held = held  # the static tensors the graph reads and writes in place (weights, buffers, KV caches)
        self.pointers = [t.data_ptr() for t in held]
        self.leaves, self.spec, self.aliased = template
        self.flat_tuple = self.spec == tree_flatten(tuple(range(len(self.leaves))))[1]  # rebuilt without pytree
        self.graph_leaves = sorted({where for kind, where in self.leaves if kind == "graph"})
        only_graph = self.flat_tuple and all(kind == "graph" for kind, _ in self.leaves)
        self.only_graph = [where for _, where in self.leaves] if only_graph else None  # a tuple of graph outputs
        self.generation = recorder.generation

    @property
    def stale(self) -> bool:
        """Recorded again since (a weight moved), or its cache entry is gone: torch._dynamo.reset(), or an
        entry Dynamo dropped (its guard manager then belongs to no entry, and its guards alone still pass)."""
        return self.generation != self.recorder.generation or self.guard.cache_entry is None

    @classmethod
    def build(cls, entry: Any, recorder: GraphRecorder, placeholders: list[Any], f_locals: dict[str, Any], output: Any) -> Replay | None:
        nodes = _guard_nodes(entry.guard_manager.root)
        why = cls._unsound(entry, recorder, placeholders, nodes)
        if why:
            warn_no_fast_replay(why)
            return None
        scope = {"L": f_locals}
        held, statics = [], []
        for index, (placeholder, value, static) in enumerate(zip(placeholders, recorder.last_call_inputs, recorder.static)):
            if not static:
                continue
            # A weight, buffer or KV cache: the same tensor at the same address (`held`). A weight's identity
            # is a guard added to its node in Dynamo's guard tree (another weight recompiles); a KV cache is
            # checked here by address (its node pins shape and strides), and any tensor without a node by
            # identity: another KV cache, or a moved one, goes through Dynamo unchanged, whose compiled
            # draft raises for it (draft_loop's address check).
            held.append(value)
            name = source_name(placeholder._dynamo_source)
            node = nodes.get(name)
            if node is not None and index not in recorder.written:
                _add_identity_guard(node, value, name)
                continue
            if _fetcher(placeholder, value, scope) is None:
                return None
            statics.append((name, value, node is not None))
        fetchers = [_fetcher(placeholders[i], recorder.last_call_inputs[i], scope) for i, _ in recorder.copies]
        if any(f is None for f in fetchers):
            return None
        returned_inputs = {id(v): p for p, v in zip(placeholders, recorder.last_call_inputs) if isinstance(v, torch.Tensor)}
        template = cls._template(recorder, f_locals, output, nodes, returned_inputs, scope)
        if isinstance(template, str):
            warn_no_fast_replay(template)
            return None
        return cls(entry.guard_manager, recorder, fetchers, held, template, statics)

    @staticmethod
    def _unsound(entry: Any, recorder: GraphRecorder, placeholders: list[Any], nodes: dict[str, Any]) -> str:
        fetched = {source_name(p._dynamo_source) for p in placeholders}
        if impure := _impure_instruction(entry.code, fetched, lambda source: _holds_value(nodes.get(source))):
            return f"Dynamo's code for the draft does more than call the graph: {impure}"
        if len(placeholders) != len(recorder.inputs) or len(recorder.last_call_inputs) != len(placeholders):
            return "the graph's inputs are not the recorded ones"
        if not all(isinstance(v, torch.Tensor) for v in recorder.last_call_inputs):
            return "a graph input is a symbolic size or a Python number (dynamic shapes)"
        return ""

    @staticmethod
    def _template(recorder: GraphRecorder, f_locals: dict[str, Any], output: Any, nodes: dict[str, Any], inputs: dict[int, Any], scope: dict) -> tuple | str:
        """How to rebuild the return value: per leaf a graph output, an argument (the call's own object, by
        its path), or a constant; or why it cannot be rebuilt without Dynamo's code. A Python value that is
        also an argument is kept only if the guards pin that argument: Dynamo passes an unguarded one
        through as it comes, and a constant equal to it cannot be told apart from it."""
        graph_outputs = {id(t): i for i, t in enumerate(recorder.last_outputs()) if isinstance(t, torch.Tensor)}
        paths = argument_paths(f_locals)  # at any depth: Dynamo returns cfg["meta"]["n"] as it finds it, unguarded
        if paths is None:
            return "the arguments hold too many values to tell the returned ones apart from them"
        # a container that is an argument stays one leaf: the call's own list, not a new one
        leaves, spec = tree_flatten(output, is_leaf=lambda x: isinstance(x, (list, tuple, dict)) and id(x) in paths)
        plan, aliased = [], []
        for leaf in leaves:
            found = paths.get(id(leaf), [])
            if not isinstance(leaf, _PINNED) and found:  # an argument returned (a written buffer, an object passed
                plan.append(("argument", found[0]))  # through): the call's own, as eager returns it, not the recorded call's
                # One object under several arguments here (a warm-up's one dummy for two buffers), or an argument that
                # is also a tensor the graph reads by another source (out is self.kv): which of them Dynamo returns is
                # told apart only while they are one object.
                same = [functools.partial(_follow, path=path) for path in found]
                if isinstance(leaf, torch.Tensor) and id(leaf) in inputs:
                    if (fetch := _fetcher(inputs[id(leaf)], leaf, scope)) is None:
                        return "the draft returns a tensor the graph reads that is not found from the arguments"
                    same.append(fetch)
                if len(same) > 1:
                    aliased.append(same)
            elif isinstance(leaf, torch.Tensor) and id(leaf) in graph_outputs:
                plan.append(("graph", graph_outputs[id(leaf)]))
            elif isinstance(leaf, torch.Tensor) and id(leaf) in inputs:  # a tensor the graph read (self.kv): the call's
                if (fetch := _fetcher(inputs[id(leaf)], leaf, scope)) is None:
                    return "the draft returns a tensor the graph reads that is not found from the arguments"
                plan.append(("fetch", fetch))
            elif isinstance(leaf, _PINNED) and all(_pinned(nodes, path) for path in found):
                plan.append(("constant", leaf))
            elif isinstance(leaf, _PINNED):
                return f"the draft returns {_source(found[0])} = {leaf!r}, an argument its guards do not pin (passed through)"
            else:
                return (f"the draft returns a {type(leaf).__name__} that is neither a graph output nor an argument (or in one): "
                        "a tensor made outside the graph, or an object from elsewhere")
        return plan, spec, aliased

    def matches(self, f_locals: dict[str, Any], explain: bool = False) -> bool:
        """Whether this recording may run the call; with `explain`, the reason it may not is logged."""
        if self.stale:
            return False
        try:
            if not self.guard.check(f_locals):
                if explain:
                    log.debug("draftfuse: replay missed: %s", self.guard.check_verbose(f_locals).verbose_code_parts)
                return False
            if list(map(torch.Tensor.data_ptr, self.held)) != self.pointers:
                if explain:
                    log.debug("draftfuse: replay missed: a static tensor's storage moved")
                return False
            if not self.same_static(f_locals):
                if explain:
                    log.debug("draftfuse: replay missed: a weight, buffer or KV cache is another tensor")
                return False
            if self.aliased and not all(len({id(get(f_locals)) for get in same}) == 1 for same in self.aliased):
                if explain:
                    log.debug("draftfuse: replay missed: arguments that were one object when recorded are not now")
                return False
        except Exception as error:
            if explain:
                log.debug("draftfuse: replay missed: %r", error)
            return False
        return True

    def run(self, f_locals: dict[str, Any], clone: bool) -> Any:
        sources = [fetch(f_locals) for fetch in self.fetchers]
        in_place = self.recorder.reads_in_place(sources)
        outputs = self.recorder.replay_for_caller(sources, self.graph_leaves if clone else (), in_place)
        if self.only_graph is not None:
            return tuple([outputs[i] for i in self.only_graph])
        values = []
        for kind, where in self.leaves:
            if kind == "graph":
                values.append(outputs[where])
            elif kind == "argument":
                values.append(_follow(f_locals, where))
            elif kind == "fetch":
                values.append(where(f_locals))
            else:
                values.append(where)
        return tuple(values) if self.flat_tuple else tree_unflatten(values, self.spec)


def argument_paths(f_locals: dict[str, Any], most: int = 100_000) -> dict[int, list[tuple]] | None:
    """id -> the paths (shallowest first) of every value in a call's arguments, through tuples, lists and
    dicts at any depth (each container walked once); None past `most` values."""
    found: dict[int, list[tuple]] = {}
    queue, walked = collections.deque(((name,), value) for name, value in f_locals.items()), set()
    while queue and most > 0:
        path, value = queue.popleft()
        most -= 1
        found.setdefault(id(value), []).append(path)
        if isinstance(value, (tuple, list, dict)) and id(value) not in walked:
            walked.add(id(value))
            queue.extend(((*path, key), item) for key, item in (value.items() if isinstance(value, dict) else enumerate(value)))
    return None if queue else found


def _follow(f_locals: dict[str, Any], path: tuple) -> Any:
    value = f_locals[path[0]]
    for step in path[1:]:
        value = value[step]
    return value
