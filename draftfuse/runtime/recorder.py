"""The compiled region of a draft, recorded in CUDA graphs and replayed (replay.py calls it without Dynamo).

`GraphRecorder` wraps the Inductor-compiled region (compiled without Inductor's CUDA graphs). Its
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
that memory, on the fast path and to calls through Dynamo alike (whose code may keep an output
anywhere: in a returned object, in an attribute); zero_copy_outputs hands out the main recording's.
A server holding the last draft's outputs while the next runs copies nothing; a caller holding the
outputs of both spares gets copies (the main recording, then one allocation and one copy launch per
output). Calls of one draft are expected on one CUDA stream, as for any CUDA graph runner.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from draftfuse.graph.values import user_frame
from draftfuse.kernels import selection as _selection

log = logging.getLogger("draftfuse")


class GraphRecorder:
    """The compiled region, run plainly once, then captured in a CUDA graph and replayed (see the module doc)."""

    def __init__(self, compiled: Callable[..., Any], static: Sequence[bool], written: set[int], device: torch.device, spares: int = 0,
                 hand_out: bool = True) -> None:
        self.compiled = compiled
        self.check_overlap = getattr(compiled, "check", None)  # checks.guard_written_inputs's, for a region writing inputs
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
        self.selection_workspace: torch.Tensor | None = None  # the selection kernels' in its graphs (_record)
        self.last_seen = 0  # draft_loop's: `calls` when it last looked for a call to build a Replay from
        self.refused: int | None = None  # draft_loop's: the generation a Replay was last refused for
        self.spare_count = spares  # recordings whose outputs are handed to callers (see _Spare); none off CUDA
        self.callers_memory: set[int] = set()  # outputs in the memory of inputs read in place (flat indices)
        self.spares: list[_Spare] = []
        # calls through Dynamo get outputs of their own (replay_for_caller), since Dynamo's code may put them
        # anywhere (returned in an object, stored in an attribute); False: zero_copy_outputs, the recording's
        self.hand_out = hand_out
        # the flat outputs the last call through Dynamo got, if handed out: held weakly (held, a spare would stay busy)
        self.handed_out: list[Any] | None = None

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
        sources = [inputs[i] for i, _ in self.copies]
        if not self.hand_out or self.graph is None:  # off CUDA the region is called: its outputs are new
            self.replay(sources)
            return self.outputs
        tensors = [i for i, t in enumerate(self.flat_outputs()) if isinstance(t, torch.Tensor)]  # (a size: an int)
        outputs = self.replay_for_caller(sources, tensors)
        self.handed_out = [weakref.ref(t) if isinstance(t, torch.Tensor) else None for t in outputs]
        return tree_unflatten(outputs, tree_flatten(self.outputs)[1])

    def last_outputs(self) -> list[Any]:
        """The flat outputs the last call through Dynamo got: the ones handed out to it (None where the caller
        dropped one), or the recording's."""
        if self.handed_out is None or self.graph is None:
            return self.flat_outputs()
        return [ref() if ref is not None else value for ref, value in zip(self.handed_out, self.flat_outputs())]

    def flat_outputs(self) -> list[Any]:
        """The outputs as a flat list (cached on CUDA, where the graph's outputs are the same tensors)."""
        if self.graph is None:
            return tree_flatten(self.outputs)[0]
        if self._flat is None or self._flat[0] is not self.outputs:
            self._flat = (self.outputs, tree_flatten(self.outputs)[0])
        return self._flat[1]

    def _static_pointers(self, inputs: Sequence[Any]) -> list[int]:
        return [v.data_ptr() for v, static in zip(inputs, self.static) if static and isinstance(v, torch.Tensor)]

    def replay(self, sources: Sequence[torch.Tensor], in_place: bool = False) -> None:
        """Run the recorded region on `sources` (the non-static inputs, in order): on CUDA, replay the graph
        (after copying them into the static buffers, unless they are the held inputs it reads in place);
        elsewhere, call the region on them. The outputs are `self.outputs`, overwritten by the next run."""
        if self.device.type != "cuda":
            self.outputs = self.compiled(*self._inputs_with(sources))
            return
        self._bring(sources, in_place)
        self.graph.replay()

    def reads_in_place(self, sources: Sequence[torch.Tensor]) -> bool:
        """Whether the recorded graph reads `sources` where they are: the held inputs, at the addresses
        recorded (the guards pin their shapes, strides and dtypes, so the same memory)."""
        return self.in_place and list(map(torch.Tensor.data_ptr, sources)) == self.in_place_pointers

    def replay_for_caller(self, sources: Sequence[torch.Tensor], kept: Sequence[int], in_place: bool = False) -> list[Any]:
        """`replay`, returning the flat outputs with those at the indices `kept` (the ones the caller
        keeps) the caller's own: no later run writes them. A spare recording whose outputs no tensor
        outside the recorder shares replays, and its outputs are handed out as new tensors over that
        memory (nothing copied); when every spare's outputs are still held (or there are none) the main
        recording replays and the kept outputs are copied (one allocation and one copy launch each).
        `in_place`: reads_in_place(sources), when the caller knows it."""
        if self.spares:
            self._bring(sources, in_place)  # first: recording again (another input tensor) makes new spares
            spare = next((spare for spare in self.spares if spare.free()), None)
            if spare is not None:
                return spare.hand_out(kept)
            self.spares = [spare for spare in self.spares if not spare.retired()]  # the copy path: tidy up here
            self.graph.replay()
        else:
            self.replay(sources, in_place)
        outputs = list(self.flat_outputs())
        callers = self.callers_memory if self.graph is not None else _in_input_memory(outputs, self._read_in_place(self._inputs_with(sources)))
        copied = [i for i in kept if i not in callers]
        for i, copy in zip(copied, caller_copies([outputs[i] for i in copied])):
            outputs[i] = copy
        for i in kept:
            if i in callers:  # a view of a KV cache, a weight or a held input: the caller's memory, as in eager
                outputs[i] = outputs[i].detach()
        return outputs

    def _read_in_place(self, inputs: Sequence[Any]) -> list[Any]:
        """Those of the graph's inputs it reads where the caller keeps them (not a static buffer's copy)."""
        in_place = self.in_place or self.device.type != "cuda"
        return [v for v, static in zip(inputs, self.static) if static or in_place]

    def _bring(self, sources: Sequence[torch.Tensor], in_place: bool = False) -> None:
        """Make the recorded graph read `sources`: nothing to do when they are the held inputs it reads in
        place (`in_place` says so already, or reads_in_place); a tensor elsewhere records again over static
        buffers (for good; over these tensors when one is expanded, see _capture); with static buffers,
        copy the sources into them (one launch). Sources read anywhere but in place are first checked not to
        overlap an input the region writes (its overlap check, when it writes inputs; held inputs were
        checked when recorded), whether the call came through Dynamo or the fast path."""
        in_place = in_place or self.reads_in_place(sources)
        if self.check_overlap is not None and not in_place:
            self.check_overlap(sources, [index for index, _ in self.copies])
        if self.in_place:
            if in_place:
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
                foreign = _in_input_memory(flat, self.inputs)  # never handed out: copied, or views of the caller's
                self.callers_memory = _in_input_memory(flat, self._read_in_place(self.inputs))
                if len(foreign) < len(flat):  # some outputs are in the graph's own memory
                    for _ in range(self.spare_count):
                        graph, outputs = self._record()  # its own memory pool: no other recording writes its outputs
                        spares.append(_Spare(graph, tree_flatten(outputs)[0], foreign, self.callers_memory))
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
        """Capture the region over `self.inputs` in a new CUDA graph (a private memory pool); its outputs.
        The selection kernels in it share one workspace per recorder, made before its first capture (its
        graphs replay one at a time), so that no launch fills a workspace of its own in the graph."""
        if self.selection_workspace is None:
            self.selection_workspace = _selection.graph_workspace(self.device)
        graph = torch.cuda.CUDAGraph()
        stream = _capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), _selection.capturing_with(self.selection_workspace), torch.cuda.graph(graph, stream=stream):
            outputs = self.compiled(*self.inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph, outputs


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device (a tensor's: indexed) for every capture: libraries keep state per stream
    for good (cuBLAS a workspace, 32 MiB on an H200), so a new stream per recording held that much per
    recording, up to torch's pool of 32 streams (three recordings a batch size)."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class _Spare:
    """A recording of the region (a CUDA graph of its own, over the same inputs) whose output tensors are
    handed to the caller instead of copied. It may replay only while no tensor outside it shares its
    outputs' memory: each output storage's use count (the tensors, views included, that refer to it) and
    its storage object's reference count are the counts it had when recorded, and its data pointer is
    the recorded one (a caller's resize_ of a handed-out tensor moves it: the spare is then never free
    again). The use count is what torch's CUDA graph trees read to tell whether an output is alive.
    Memory in use that no reference shows (a tensor dropped after record_stream on another stream, or
    sent to another process) is the caller's to keep alive until that use is done."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: list[Any], foreign: set[int], callers: set[int]) -> None:
        self.graph = graph
        self.outputs = outputs
        self.foreign = foreign  # outputs in an input's memory: not part of the counts
        self.copied = foreign - callers  # of those, the ones in a static buffer's memory: copied when kept
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
        it busy) or over the caller's (a view of a KV cache, say), except one in a static buffer's memory:
        copied, as on the main recording."""
        self.graph.replay()
        outputs = list(self.outputs)
        for i in kept:
            outputs[i] = outputs[i].clone() if i in self.copied else outputs[i].detach()
        return outputs

    def retired(self) -> bool:
        """Whether an output storage moved (a caller's resize_): the spare never replays again."""
        return [s.data_ptr() for s in self.storages] != [pointer for _, _, pointer in self.recorded]


def caller_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` that alias one another as they do (a draft returning `h, h` or `logits,
    logits[:, :4]` gives its caller one tensor twice, or a view of the other): one copy of each storage
    that several share, the views rebuilt over it; the same copy for the same tensor; otherwise one
    allocation each and a single copy launch."""
    shared: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        shared.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(t)
    if len(shared) == len(tensors):  # nothing shared (the usual case): one launch
        copies = [torch.empty_like(t) for t in tensors]
        if copies:
            torch._foreach_copy_(copies, list(tensors))
        return copies
    made: dict[int, torch.Tensor] = {}
    for group in shared.values():
        distinct = {id(t): t for t in group}
        if len(distinct) == 1:
            made[id(group[0])] = group[0].clone()
            continue
        storage = group[0].untyped_storage().clone()
        for t in distinct.values():
            made[id(t)] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())
    return [made[id(t)] for t in tensors]


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
