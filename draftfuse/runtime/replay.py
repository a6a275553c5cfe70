"""Replaying a compiled draft at the cost of a raw CUDA graph replay.

A call through torch.compile pays, before any kernel runs, Dynamo's frame evaluation (guards, then
bytecode that fetches every parameter from its module: work that grows with the parameters) and CUDA
graph trees' bookkeeping; together about 100 us of host time per draft. A server's hand-written
runner pays ~20 us: copy the call's tensors into static buffers, replay. draftfuse gets there in two
parts:

  * `GraphRecorder` wraps the Inductor-compiled region (compiled without Inductor's CUDA graphs). Its
    first call runs the region (the warm-up), its second captures it in a `torch.cuda.CUDAGraph` (a
    private memory pool) and replays it. Parameters, buffers and the static inputs a draft writes are
    read where they are. Every other tensor input is first read where that call's tensor is, and the
    recorder holds on to it: a server passes the same persistent buffers on every call, and then no
    call copies anything (the check is one data pointer per input: the same memory, of the shape,
    strides and dtype the guards pin, is the same input). The first call with a tensor elsewhere
    records once more, over static buffers, and from then on every call copies its inputs into them.
    Off CUDA it calls the region.
    Outputs a caller keeps must not be written by its next call. Instead of copying them on every call,
    the recorder captures two spare recordings of the region (CUDA graphs of their own, each with its
    own output memory): a call replays a spare none of whose outputs any tensor outside the recorder
    refers to (a storage use count, as torch's CUDA graph trees read it) and hands out new tensors over
    that memory. A server holding the last draft's outputs while the next runs copies nothing; a
    caller holding the outputs of both spares gets copies (the main recording, then one allocation and
    one copy launch per output). Calls of one draft are expected on one CUDA stream, as for any CUDA
    graph runner.
  * `Replay` is a recorded call that bypasses Dynamo: it checks Dynamo's own guards for the compiled
    frame (C++: argument shapes, dtypes, devices, the Python values the draft specialised on, module
    attributes, grad mode), plus an identity guard added to that guard tree for every static tensor
    (a replaced weight or KV cache fails it) and the data pointers of those tensors (one C-level map,
    for `p.data = ...`); then hands the call's non-static tensors to the recorder (read in place, or
    copied into its static buffers), replays (a free spare when outputs are the caller's), and rebuilds
    the return value from the graph's outputs as Dynamo's code did.
A Replay is built only where it is sound: Dynamo's code for the frame must do nothing but call the
graph (no attribute or item stores, no other calls: a side effect would be skipped), every non-static
graph input must be found from the call's arguments by its Dynamo source, and every returned value
must be a graph output, an argument, or a constant the guards pin. Anything else keeps the draft on
the Dynamo path, which is always correct. When any guard fails, the call takes the Dynamo path, which
recompiles (or raises RecompileError past max_compiles) and records a new Replay.
"""

from __future__ import annotations

import dis
import logging
import operator
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from draftfuse.graph.values import source_name, user_frame

log = logging.getLogger("draftfuse")

_SIDE_EFFECT_OPS = {"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "DELETE_ATTR", "DELETE_SUBSCR", "DELETE_GLOBAL", "IMPORT_NAME"}
_ALLOWED_NAMES = ("__compiled_fn", "__import_torch_dot__dynamo_dot_utils", "record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit")


class GraphRecorder:
    """The compiled region, run plainly once, then captured in a CUDA graph and replayed (see the module doc)."""

    def __init__(self, compiled: Callable[..., Any], static: Sequence[bool], written: set[int], device: torch.device, spares: int = 0) -> None:
        self.compiled = compiled
        self.static = list(static)  # per graph input: a weight, buffer or written input (True), read where it is
        self.written = written  # graph inputs the region writes in place (static): checked by address only
        self.device = device
        self.calls = 0  # calls through Dynamo (the fast path does not count)
        self.unrecorded_calls = 0  # since the last recording: the first runs plainly (warm-up), the second records
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured = False  # recorded (off CUDA: the static inputs are, and the region is called)
        self.generation = 0  # counts captures: a Replay of an older one is stale
        self.inputs: list[Any] = []  # what the graph reads: the static inputs, and the tensors in `copies`
        self.copies: list[tuple[int, torch.Tensor]] = []  # (input index, the tensor the graph reads it from)
        self.buffers: list[torch.Tensor] = []  # those tensors (the held inputs, or static buffers), in order
        self.outputs: Any = None  # the graph's output tensors (static once captured)
        self._flat: tuple[Any, list[Any]] | None = None
        self.last_call_inputs: Sequence[Any] = ()  # the latest call's inputs, until a Replay is built
        self.pointers: list[int] = []  # data pointers of the static inputs the graph reads in place
        self.sizes: tuple = ()  # the inputs' shapes and strides, and the numbers among them, when recorded
        self.in_place = device.type == "cuda"  # the graph reads the capture call's own input tensors (see the doc)
        self.in_place_pointers: list[int] = []  # their data pointers, while it does
        self.last_seen = 0  # draft_loop's: `calls` when it last looked for a call to build a Replay from
        self.refused: int | None = None  # draft_loop's: the generation a Replay was last refused for
        self.spare_count = spares  # recordings whose outputs are handed to callers (see _Spare); none off CUDA
        self.spares: list[_Spare] = []

    def __call__(self, *inputs: Any) -> Any:
        self.calls += 1
        self.unrecorded_calls += 1
        self.last_call_inputs = inputs
        moved = self.captured and self._static_pointers(inputs) != self.pointers
        if moved or (self.captured and _sizes(inputs) != self.sizes):
            # A static input moved, or (dynamic=True) the sizes are not the recording's. Run plainly:
            # for another KV cache draft_loop's address check raises, and the recording stays; for a
            # moved weight (p.data = ...) or other sizes record again on the next call, and the Replays
            # of this recording are stale.
            outputs = self.compiled(*inputs)
            log.info("draftfuse: %s: ran the region plainly, recording again", "a weight or buffer moved" if moved else "other sizes")
            self._forget()
            self.unrecorded_calls, self.buffers, self.outputs = 1, [], outputs
            return outputs
        if not self.captured and self.unrecorded_calls >= 2:
            self._capture(inputs)
        if not self.captured:
            self.outputs = self.compiled(*inputs)
            return self.outputs
        self.replay([inputs[i] for i, _ in self.copies])
        return self.outputs

    def flat_outputs(self) -> list[Any]:
        """The outputs as a flat list (cached on CUDA, where the graph's outputs are the same tensors)."""
        if self.graph is None:
            return tree_flatten(self.outputs)[0]
        if self._flat is None or self._flat[0] is not self.outputs:
            self._flat = (self.outputs, tree_flatten(self.outputs)[0])
        return self._flat[1]

    def _static_pointers(self, inputs: Sequence[Any]) -> list[int]:
        return [v.data_ptr() for v, static in zip(inputs, self.static) if static and isinstance(v, torch.Tensor)]

    def replay(self, sources: Sequence[torch.Tensor]) -> None:
        """Run the recorded region on `sources` (the non-static inputs, in order): on CUDA, replay the graph
        (after copying them into the static buffers, unless they are the held inputs it reads in place);
        elsewhere, call the region on them. The outputs are `self.outputs`, overwritten by the next run."""
        if self.device.type != "cuda":
            self.outputs = self.compiled(*self._inputs_with(sources))
            return
        self._bring(sources)
        self.graph.replay()

    def replay_for_caller(self, sources: Sequence[torch.Tensor], kept: Sequence[int]) -> list[Any]:
        """`replay`, returning the flat outputs with those at the indices `kept` (the ones the caller
        keeps) the caller's own: no later run writes them. A spare recording whose outputs no tensor
        outside the recorder shares replays, and its outputs are handed out as new tensors over that
        memory (nothing copied); when every spare's outputs are still held (or there are none) the main
        recording replays and the kept outputs are copied (one allocation and one copy launch each)."""
        if self.spares:
            self._bring(sources)  # first: recording again (another input tensor) makes new spares
            spare = next((spare for spare in self.spares if spare.free()), None)
            if spare is not None:
                return spare.hand_out(kept)
            self.spares = [spare for spare in self.spares if not spare.retired()]  # the copy path: tidy up here
            self.graph.replay()
        else:
            self.replay(sources)
        outputs = list(self.flat_outputs())
        if kept:
            copies = [torch.empty_like(outputs[i]) for i in kept]
            torch._foreach_copy_(copies, [outputs[i] for i in kept])
            for i, copy in zip(kept, copies):
                outputs[i] = copy
        return outputs

    def _bring(self, sources: Sequence[torch.Tensor]) -> None:
        """Make the recorded graph read `sources`: nothing to do when they are the held inputs it reads in
        place; a tensor elsewhere records again over static buffers (for good; over these tensors when one
        is expanded, see _capture); with static buffers, copy the sources into them (one launch)."""
        if self.in_place:
            if list(map(torch.Tensor.data_ptr, sources)) == self.in_place_pointers:
                return
            self.in_place = False
            self._capture(self._inputs_with(sources))
            log.info("draftfuse: an input tensor of the recorded region is another one: recorded again")
            if self.in_place:
                return
        if sources:
            torch._foreach_copy_(self.buffers, sources)

    def _inputs_with(self, sources: Sequence[torch.Tensor]) -> list[Any]:
        """The recorded inputs, with `sources` in place of the non-static ones."""
        inputs = list(self.inputs)
        for (index, _), source in zip(self.copies, sources):
            inputs[index] = source
        return inputs

    def _forget(self) -> None:
        """Drop the recording: the Replays of it are stale from now on (a capture starts with this)."""
        self.graph, self.captured, self.outputs, self._flat, self.spares = None, False, None, None, []
        self.generation += 1

    def _capture(self, inputs: Sequence[Any]) -> None:
        cuda = self.device.type == "cuda"
        # Until this recording is made the recorder holds none: a capture that fails (out of memory, say)
        # leaves it unrecorded (a later call records again), never an older graph over new buffers.
        self._forget()
        self.pointers = self._static_pointers(inputs)
        self.sizes = _sizes(inputs)
        if cuda and any(isinstance(v, torch.Tensor) and not static and torch._debug_has_internal_overlap(v) == 1 for v, static in zip(inputs, self.static)):
            self.in_place = True  # an expanded input (stride 0) cannot be copied into a buffer of its strides: read in place
        self.inputs, self.copies = [], []
        for index, (value, static) in enumerate(zip(inputs, self.static)):
            if isinstance(value, torch.Tensor) and not static:
                if not cuda:
                    buffer = None
                elif self.in_place:
                    buffer = value  # the caller's own tensor, held (its memory stays allocated while the graph reads it)
                else:
                    buffer = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
                self.copies.append((index, buffer))
                value = buffer
            self.inputs.append(value)
        self.buffers = [buffer for _, buffer in self.copies]
        self.in_place_pointers = [b.data_ptr() for b in self.buffers] if cuda and self.in_place else []
        if cuda:
            self.graph, self.outputs = self._record()
            spares = []
            try:
                flat = self.flat_outputs()
                foreign = _in_input_memory(flat, self.inputs)  # copied, never handed out
                if len(foreign) < len(flat):  # some outputs are in the graph's own memory
                    for _ in range(self.spare_count):
                        graph, outputs = self._record()  # its own memory pool: no other recording writes its outputs
                        spares.append(_Spare(graph, tree_flatten(outputs)[0], foreign))
            except RuntimeError as error:  # out of memory: the main recording (and any spare made) serves
                if "out of memory" not in str(error):
                    self._forget()  # unrecorded, as after a failed main capture
                    raise
                _, level = user_frame()
                reason = str(error).splitlines()[0]
                warnings.warn(f"draftfuse: {len(spares)} of {self.spare_count} spare recordings for this draft ({reason}): "
                              "its outputs are copied when those are held", stacklevel=level)  # fmt: skip
            self.spares = spares
        self.captured = True  # off CUDA: the static inputs are recorded, the region is called on each call's

    def _record(self) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Capture the region over `self.inputs` in a new CUDA graph (a private memory pool); its outputs."""
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            outputs = self.compiled(*self.inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph, outputs


class _Spare:
    """A recording of the region (a CUDA graph of its own, over the same inputs) whose output tensors are
    handed to the caller instead of copied. It may replay only while no tensor outside it shares its
    outputs' memory: each output storage's use count (the tensors, views included, that refer to it) and
    its storage object's reference count are the counts it had when recorded, and its data pointer is
    the recorded one (a caller's resize_ of a handed-out tensor moves it: the spare is then never free
    again). The use count is what torch's CUDA graph trees read to tell whether an output is alive.
    Memory in use that no reference shows (a tensor dropped after record_stream on another stream, or
    sent to another process) is the caller's to keep alive until that use is done."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: list[Any], foreign: set[int]) -> None:
        self.graph = graph
        self.outputs = outputs
        self.foreign = foreign  # outputs in an input's memory: copied when kept, not part of the counts
        self.storages = _distinct_storages([t for i, t in enumerate(outputs) if i not in foreign])  # held: part of the recorded counts
        self.recorded = self._state()

    def _state(self) -> list[tuple[int, int, int]]:
        # A caller's t.untyped_storage() is the storage object held here (torch keeps one per storage): a
        # caller holding it shows in the object's reference count, not in the storage's use count.
        return [(torch._C._storage_Use_Count(s._cdata), sys.getrefcount(s), s.data_ptr()) for s in self.storages]

    def free(self) -> bool:
        return self._state() == self.recorded

    def hand_out(self, kept: Sequence[int]) -> list[Any]:
        """Replay; the flat outputs, those at `kept` as new tensors over the spare's memory (held, they keep
        it busy), except one in an input's memory (a view of a KV cache, say): copied, as on the main
        recording."""
        self.graph.replay()
        outputs = list(self.outputs)
        for i in kept:
            outputs[i] = outputs[i].clone() if i in self.foreign else outputs[i].detach()
        return outputs

    def retired(self) -> bool:
        """Whether an output storage moved (a caller's resize_): the spare never replays again."""
        return [s.data_ptr() for s in self.storages] != [pointer for _, _, pointer in self.recorded]


def _distinct_storages(tensors: Sequence[Any]) -> list[Any]:
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            storages.setdefault(storage._cdata, storage)
    return list(storages.values())


def _in_input_memory(outputs: Sequence[Any], inputs: Sequence[Any]) -> set[int]:
    """The outputs that are no tensor of the graph's own memory: in an input tensor's memory (a view of a
    KV cache, say), or not tensors at all."""
    held = {v.untyped_storage().data_ptr() for v in inputs if isinstance(v, torch.Tensor)}
    return {i for i, t in enumerate(outputs) if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in held}


def _sizes(inputs: Sequence[Any]) -> tuple:
    """What a recording of a dynamic-shape region is specific to: each tensor input's shape and strides,
    and each other input (a size, under dynamic=True) itself."""
    return tuple((v.shape, v.stride()) if isinstance(v, torch.Tensor) else v for v in inputs)


def _no_fast_replay(why: str) -> None:
    """Say (once per recording) that a draft's calls stay on the Dynamo path: correct, but each pays
    Dynamo's guards and argument handling on the host (about 100 us)."""
    _, level = user_frame()
    warnings.warn(f"draftfuse: no fast replay for this draft: {why}; its calls go through Dynamo (correct, slower on the host)", stacklevel=level)


def _dynamo_code_is_pure(code: Any, fetched: set[str]) -> bool:
    """Whether Dynamo's code for a frame only fetches the graph's inputs (attributes named in their
    sources, `fetched`), calls the compiled graph and builds the return value: no store, and no load of
    anything else it could call."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in _SIDE_EFFECT_OPS:
            return False
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD"):
            name = str(instruction.argval)
            if not (name.startswith(_ALLOWED_NAMES) or instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and name in fetched):
                return False
    return True


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


def _fetcher(placeholder: Any, value: Any, scope: dict[str, Any]) -> Callable[[dict[str, Any]], Any] | None:
    """f_locals -> the graph input that `placeholder` stands for, by its Dynamo source; None if the
    source is not an expression over the call's arguments that finds `value`."""
    name = source_name(placeholder._dynamo_source)
    try:
        code = compile(name, "<draftfuse source>", "eval")
        if eval(code, {}, scope) is not value:
            raise LookupError(name)
    except Exception:
        _no_fast_replay(f"input {name} is not found from the arguments")
        return None
    if (plain := re.fullmatch(r"L\['(\w+)'\]", name)) is not None:
        return operator.itemgetter(plain.group(1))  # an argument itself: a dict lookup
    return eval(compile(f"lambda L: {name}", "<draftfuse input fetch>", "eval"), {})  # one compiled function


def _identity_check(identities: list[tuple[str, torch.Tensor]]) -> Callable[[dict[str, Any]], bool]:
    """One compiled function f_locals -> whether each source still finds its recorded tensor (the
    sources are Dynamo's, checked by `_fetcher` to evaluate over the call's locals)."""
    if not identities:
        return lambda f_locals: True
    terms = " and ".join(f"({name}) is V[{i}]" for i, (name, _) in enumerate(identities))
    return eval(compile(f"lambda L: {terms}", "<draftfuse identity check>", "eval"), {"V": [v for _, v in identities]})


def _add_identity_guard(node: Any, value: Any, name: str) -> None:
    verbose = [f"draftfuse: {name} is the tensor the recorded graph reads"]
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
        identities: list[tuple[str, torch.Tensor]],
    ) -> None:
        self.guard = guard  # Dynamo's guard manager for the frame, with identity guards added
        self.recorder = recorder
        self.fetchers = fetchers  # per non-static input, in the recorder's order: f_locals -> tensor
        self.same_static = _identity_check(identities)  # KV caches, and static tensors no guard node holds: one call
        self.checked_by_source = [name for name, _ in identities]
        self.held = held  # the static tensors the graph reads and writes in place (weights, buffers, KV caches)
        self.pointers = [t.data_ptr() for t in held]
        self.leaves, self.spec = template
        self.flat_tuple = self.spec == tree_flatten(tuple(range(len(self.leaves))))[1]  # rebuilt without pytree
        self.graph_leaves = sorted({where for kind, where in self.leaves if kind == "graph"})
        only_graph = self.flat_tuple and all(kind == "graph" for kind, _ in self.leaves)
        self.only_graph = [where for _, where in self.leaves] if only_graph else None  # a tuple of graph outputs
        self.generation = recorder.generation
        self.check_arguments = getattr(recorder.compiled, "check", None)  # this compile's overlap check, if it writes inputs

    @property
    def stale(self) -> bool:
        return self.generation != self.recorder.generation

    @classmethod
    def build(cls, entry: Any, recorder: GraphRecorder, placeholders: list[Any], f_locals: dict[str, Any], output: Any) -> Replay | None:
        why = cls._unsound(entry, recorder, placeholders)
        if why:
            _no_fast_replay(why)
            return None
        nodes = _guard_nodes(entry.guard_manager.root)
        scope = {"L": f_locals}
        held, identities = [], []
        for index, (placeholder, value, static) in enumerate(zip(placeholders, recorder.last_call_inputs, recorder.static)):
            if not static:
                continue
            # A weight, buffer or KV cache: the same tensor at the same address (`held`). A weight's identity
            # is a guard added to its node in Dynamo's guard tree (another weight recompiles); a KV cache's
            # is checked here, as is any tensor without a node: another KV cache, or a moved one, goes
            # through Dynamo unchanged, whose compiled draft raises for it (draft_loop's address check).
            held.append(value)
            name = source_name(placeholder._dynamo_source)
            node = nodes.get(name)
            if node is not None and index not in recorder.written:
                _add_identity_guard(node, value, name)
                continue
            if _fetcher(placeholder, value, scope) is None:
                return None
            identities.append((name, value))
        fetchers = [_fetcher(placeholders[i], recorder.last_call_inputs[i], scope) for i, _ in recorder.copies]
        if any(f is None for f in fetchers):
            return None
        template = cls._template(recorder, f_locals, output)
        if template is None:
            _no_fast_replay("the draft returns a tensor that is neither a graph output nor an argument")
            return None
        return cls(entry.guard_manager, recorder, fetchers, held, template, identities)

    @staticmethod
    def _unsound(entry: Any, recorder: GraphRecorder, placeholders: list[Any]) -> str:
        fetched = {m for p in placeholders for m in re.findall(r"\.(\w+)", source_name(p._dynamo_source))}
        if not _dynamo_code_is_pure(entry.code, fetched):
            return "Dynamo's code for the draft does more than call the graph (a side effect, such as an attribute store)"
        if len(placeholders) != len(recorder.inputs) or len(recorder.last_call_inputs) != len(placeholders):
            return "the graph's inputs are not the recorded ones"
        if not all(isinstance(v, torch.Tensor) for v in recorder.last_call_inputs):
            return "a graph input is a symbolic size or a Python number (dynamic shapes)"
        return ""

    @staticmethod
    def _template(recorder: GraphRecorder, f_locals: dict[str, Any], output: Any) -> tuple | None:
        graph_outputs = {id(t): i for i, t in enumerate(tree_flatten(recorder.outputs)[0]) if isinstance(t, torch.Tensor)}
        arguments = {id(t): path for path, t in tensor_leaves(f_locals)}
        leaves, spec = tree_flatten(output)
        plan = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) in graph_outputs:
                    plan.append(("graph", graph_outputs[id(leaf)]))
                elif id(leaf) in arguments:
                    plan.append(("argument", arguments[id(leaf)]))
                else:
                    return None
            else:
                plan.append(("constant", leaf))
        return plan, spec

    def matches(self, f_locals: dict[str, Any], explain: bool = False) -> bool:
        """Whether this recording may run the call; with `explain`, the reason it may not is logged."""
        if self.stale:
            return False  # recorded again since (a weight moved)
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
        except Exception as error:
            if explain:
                log.debug("draftfuse: replay missed: %r", error)
            return False
        return True

    def run(self, f_locals: dict[str, Any], clone: bool) -> Any:
        sources = [fetch(f_locals) for fetch in self.fetchers]
        outputs = self.recorder.replay_for_caller(sources, self.graph_leaves if clone else ())
        if self.only_graph is not None:
            return tuple([outputs[i] for i in self.only_graph])
        values = []
        for kind, where in self.leaves:
            if kind == "graph":
                values.append(outputs[where])
            elif kind == "argument":
                values.append(_follow(f_locals, where))
            else:
                values.append(where)
        return tuple(values) if self.flat_tuple else tree_unflatten(values, self.spec)


def tensor_leaves(f_locals: dict[Any, Any]) -> list[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for the tensors among a call's arguments (by name or position), at most one level
    into lists, tuples and dicts."""
    found = []
    for name, value in f_locals.items():
        if isinstance(value, torch.Tensor):
            found.append(((name,), value))
        elif isinstance(value, (tuple, list)):
            found += [((name, i), v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
        elif isinstance(value, dict):
            found += [((name, k), v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    return found


def _follow(f_locals: dict[str, Any], path: tuple) -> Any:
    value = f_locals[path[0]]
    for step in path[1:]:
        value = value[step]
    return value
