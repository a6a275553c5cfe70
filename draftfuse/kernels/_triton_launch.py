"""The host side of draftfuse's Triton selection kernels (_triton_argmax.py for k = 1, _triton_selection.py
for k > 1; each has its design): the per-stream workspace, the grid (splits per row, programs per SM),
and the launch, with repeated shapes launched straight from the compiled kernel (`_ready`).
"""

import contextlib
import functools
import os
import sys
import threading
import warnings

import torch
import triton

from draftfuse.kernels._triton_argmax import _MAXNREG_16BIT, _MAXNREG_MIN_TILES, _argmax_kernel
from draftfuse.kernels._triton_selection import (  # noqa: F401  (the tuning constants live with the kernel)
    _selection_kernel,
    _WS_COLS,
    _INT32_MIN,
    _MAX_SPLITS,
    _TOPK_SPLITS,
    _CANDIDATES,
    _PROGRAMS_PER_SM,
    _BLOCK,
    _PDL,
    _MERGE,
    _MAX_TILES,
    _RESNAP_MIN_K,
    _RESNAP_MIN_ROWS,
)

# (device type, index, stream) -> int32 [capacity rows, _WS_COLS], all INT32_MIN between launches. One per
# stream: launches queued on one stream never overlap, while two streams' launches could share rows. (A
# CUDA graph keeps the workspace its launches found when captured: the one given by `capturing_with`, as
# draftfuse's recorder gives each draft's graphs one of their own; else its capture stream's, or a copy
# per launch filled by a kernel of the graph; two graphs sharing one must not be replayed at the same time.)
_workspaces: dict = {}
_retired: list = []  # workspaces outgrown: kept alive, as a launch still in flight may use one
_side_streams: dict = {}
_capture = threading.local()  # .workspace: what launches captured on this thread use (capturing_with)
_GRAPH_ROWS = 4096  # rows of a graph_workspace, 1 MiB: an EAGLE tree of 10 branches at batch 256 has 2560
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", lambda index: torch.cuda.current_stream(index).cuda_stream)


def _fresh_workspace(rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((rows, _WS_COLS.value), _INT32_MIN, dtype=torch.int32, device=device)


def _workspace(device: torch.device, rows: int) -> torch.Tensor:
    """The device's persistent workspace with room for `rows`; during a CUDA-graph capture the one
    `capturing_with` gives, else the capture stream's, else a per-call one (filled by a kernel of its own)."""
    held = getattr(_capture, "workspace", None)  # first: an eager launch (none held) pays no capture query
    if held is not None and held.device == device and held.shape[0] >= rows and torch.cuda.is_current_stream_capturing():
        return held
    stream = _current_stream(torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    ws = _workspaces.get(key)
    if ws is not None and ws.shape[0] >= rows:
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _warn_fill_in_graph(rows, held.shape[0] if held is not None and held.device == device else None)
        return _fresh_workspace(rows, device)
    capacity = max(rows, 256, 2 * ws.shape[0] if ws is not None else 0)
    new = _allocate_outside_pools(capacity, device) if device.type == "cuda" else _fresh_workspace(capacity, device)
    if ws is not None:
        _retired.append(ws)
    _workspaces[key] = new
    return new


_warned_fill = False
_OUR_FILES = tuple(os.path.dirname(f) + os.sep for f in (torch.__file__, triton.__file__, os.path.dirname(__file__)))


def _warn_fill_in_graph(rows: int, given: int | None) -> None:
    """Once per process: a launch captured with no workspace for it, so the graph fills one per call.
    `given`: the rows of the workspace capturing_with gave, when it was too small."""
    global _warned_fill
    if _warned_fill:
        return
    where = (f"the workspace given to capturing_with has room for {given} rows" if given is not None else
             "the stream it is captured on has no workspace")
    level, frame = 2, sys._getframe(1)  # point at the first frame outside draftfuse, torch and Triton
    while frame is not None and frame.f_code.co_filename.startswith(_OUR_FILES):
        level, frame = level + 1, frame.f_back
    warnings.warn(
        f"draftfuse: a selection kernel for {rows} rows is being captured in a CUDA graph, and {where}: each "
        "replay runs a fill kernel before each such call (up to 2.5 µs more per call on an H200). To avoid "
        "it, capture inside draftfuse.kernels.capturing_with(draftfuse.kernels.graph_workspace(device, rows)), "
        "the workspace made before the capture.", stacklevel=level)
    _warned_fill = True


def graph_workspace(device: torch.device, rows: int | None = None) -> torch.Tensor:
    """A workspace for the launches of CUDA graphs still to be captured (`capturing_with`), with room for
    `rows` (default _GRAPH_ROWS): made and filled now, outside any capture and its memory pool; the
    launches leave it as they find it, so no replay fills it again."""
    return _allocate_outside_pools(rows or _GRAPH_ROWS, device)


@contextlib.contextmanager
def capturing_with(workspace: torch.Tensor):
    """Selection launches captured inside this block, on this thread, use `workspace` (from graph_workspace)
    where it has room for their rows, instead of their capture stream's or a copy filled in the graph."""
    saved = getattr(_capture, "workspace", None)
    _capture.workspace = workspace
    try:
        yield
    finally:
        _capture.workspace = saved


def _allocate_outside_pools(capacity: int, device: torch.device) -> torch.Tensor:
    """A fresh workspace from the caching allocator's ordinary pool, made by a helper thread: CUDA-graph
    trees route every allocation of the warming-up thread (any stream) into their pool and fail the
    recording on tensors left alive there. The current stream waits for the fill; no host sync."""
    made: dict = {}

    def make():
        try:
            with torch.cuda.device(device):
                stream = _side_streams.get(device.index)
                if stream is None:
                    stream = _side_streams[device.index] = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    made["ws"] = _fresh_workspace(capacity, device)
                    made["done"] = torch.cuda.Event()
                    made["done"].record(stream)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            made["error"] = exc

    helper = threading.Thread(target=make, name="draftfuse-workspace")
    helper.start()
    helper.join()
    if "error" in made:
        raise made["error"]
    torch.cuda.current_stream(device).wait_event(made["done"])
    return made["ws"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter (CPU tensors): the split count only shapes the grid


def max_vocab(k: int) -> int:
    """The largest vocabulary the kernel takes (the same for every k: chunks of at most _MAX_TILES
    tiles of up to 4096 elements)."""
    return min(2**31 - 1, _MAX_SPLITS * _MAX_TILES.value * 4096)


_fits: dict = {}  # compiled kernel (specialisation) -> one-warp programs that fit per SM, by registers


def _programs_that_fit(n_regs: int) -> int:
    """One-warp programs per SM that the register file holds (65536 registers, allocated per warp in
    units of 256; at most 32 blocks per SM)."""
    per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    return max(1, min(32, 65536 // per_warp))


def default_programs_per_sm(element_size: int, k: int, scaled: bool) -> int:
    return _PROGRAMS_PER_SM.get((min(element_size, 4), k == 1, scaled), 16)


def _block(vocab: int, k: int, block: int | None = None) -> int:
    """The tile width for this vocab and k: `block` (default _BLOCK), doubled until the row fits in
    _MAX_SPLITS chunks of at most _MAX_TILES tiles (the last program reads every chunk's max and sum
    at once)."""
    block = block or _BLOCK
    while _cdiv(_cdiv(vocab, block), _MAX_TILES.value) > _MAX_SPLITS:
        if block >= 4096:
            raise ValueError(f"vocab {vocab} is too large for the selection kernel with k={k} (max {max_vocab(k)})")
        block *= 2
    return block


def plan(rows: int, vocab: int, k: int, device: torch.device, *, splits=None, block=None, programs_per_sm=16):
    """(splits, chunk, block) for a launch: splits * chunk >= vocab, chunk a multiple of block. The
    grid aims at programs_per_sm programs per SM, rounded down so that it stays within one wave."""
    block = _block(vocab, k, block)
    tiles = _cdiv(vocab, block)
    least = _cdiv(tiles, _MAX_TILES.value)
    if splits is None:  # k > 1 aims at fewer chunks (_TOPK_SPLITS); asked for, any k takes up to _MAX_SPLITS
        splits = min(programs_per_sm * _sm_count(device) // rows, _MAX_SPLITS if k == 1 else _TOPK_SPLITS)
    splits = max(least, min(splits, tiles, _MAX_SPLITS), 1)
    chunk = _cdiv(tiles, splits) * block
    return _cdiv(vocab, chunk), chunk, block


# Launches ready to repeat, for calls without tuning keywords: _ready_key -> (the compiled kernel, grid, its
# constexprs, splits, chunk, candidate room). The key holds all that the plan and Triton's
# specialisation read from a call (every tensor's dtype, the shape, row stride, k, log, the scale's kind,
# 16-byte alignment of each pointer; the ints passed are functions of these), so a hit launches the kernel
# and grid the full path would pick, without its Python: the plan, Triton's argument binding and cache
# lookup (an eager topk_prob call took 109 µs of host time on an H200 host with it, 182 without). An
# entry is made once the kernel's occupancy is known (a key's second call, or its first where another
# shape has taught it). What is not read per call, this module's tuning constants and Triton's knobs, is
# fixed in the entries: code that changes them (a probe) must give the launches a `_ready` of its own.
_ready: dict = {}


def _ready_key(logits: torch.Tensor, k: int, log: bool, prob, index, scale) -> tuple:
    return (logits.device.index, logits.dtype, *logits.shape, logits.stride(0), k, bool(log), prob.dtype, index.dtype,
            None if scale is None else (scale.dtype, scale.numel() == 1),
            *(t is None or t.data_ptr() % 16 == 0 for t in (logits, scale, prob, index)))  # fmt: skip


def _arguments(logits, k, log, prob, index, scale, splits: int, chunk: int, cand: int, ws: torch.Tensor) -> tuple:
    """The kernels' runtime arguments (all but the constexprs), their scratch allocated by shape."""
    rows, vocab = logits.shape
    part = torch.empty((rows, 2, splits), dtype=torch.float32, device=logits.device)
    keys = torch.empty((rows, cand + k * splits), dtype=torch.int64, device=logits.device)
    scale_arg = part if scale is None else scale.reshape(-1).contiguous()  # part: never read; the kernel reads row * 1 (or 0)
    scale_stride = 0 if scale is None or scale_arg.numel() == 1 else 1
    return logits, logits.stride(0), vocab, chunk, splits, scale_arg, scale_stride, part, keys, ws, prob, index, int(log)


def _launch_ready(ready: tuple, logits: torch.Tensor, k, log, prob, index, scale):
    compiled, grid, consts, splits, chunk, cand = ready
    ws = _workspace(logits.device, grid[0])
    args = _arguments(logits, k, log, prob, index, scale, splits, chunk, cand, ws)
    compiled[grid](*args, *consts, stream=_current_stream(logits.device.index))
    return compiled


def launch_selection(
    logits: torch.Tensor,
    k: int,
    log: bool,
    prob: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    block: int | None = None,
    programs_per_sm: int | None = None,
    pdl: bool | None = None,
    maxnreg: int | None = None,
    workspace: torch.Tensor | None = None,
    candidates: int | None = None,
):
    """Top-k of each row of `logits` ([rows, vocab], last dim contiguous) into `prob` (float32) and
    `index` (int64), each holding rows * k contiguous elements, row-major. `scale`: None, or float32
    with one element per row (rows elements) or one for all (1 element): y = logits * scale.
    One kernel launch; scratch sized by shapes only, so it can be captured in a CUDA graph. The
    keywords override the tiling heuristics (tests and the benchmark's tuning use them; `maxnreg`=0 is ptxas's
    own register count, the default but for k = 1 with 16-bit logits and chunks of _MAXNREG_MIN_TILES tiles or
    more; `candidates`, a power of two >= 32, is a row's room for k > 1's candidates before the programs keep
    their own). Returns Triton's compiled kernel (its n_regs, n_spills), None for no rows."""
    rows, vocab = logits.shape
    if vocab > 1 and logits.stride(1) != 1:  # the kernels read a row as one run of memory
        raise ValueError(f"launch_selection: the logits' last dim must be contiguous, not of stride {logits.stride(1)}")
    if rows == 0:
        return None
    device = logits.device
    cuda = device.type == "cuda"
    tuned = any(v is not None for v in (splits, block, programs_per_sm, pdl, maxnreg, workspace, candidates))
    ready_key = None  # Triton compiles and launches for the current device: launches on another aren't kept
    if cuda and not tuned and device.index == torch.cuda.current_device():
        ready_key = _ready_key(logits, k, log, prob, index, scale)
        ready = _ready.get(ready_key)
        if ready is not None:
            return _launch_ready(ready, logits, k, log, prob, index, scale)
    pdl = (_PDL and cuda and _capability(device) >= 9) if pdl is None else pdl
    sort = cuda and _MERGE == "sort"
    programs_per_sm = programs_per_sm or default_programs_per_sm(logits.element_size(), k, scale is not None)
    block = _block(vocab, k, block)
    if maxnreg is None and k == 1 and cuda and logits.element_size() == 2:  # (maxnreg=0: no budget asked)
        _, chunk, _ = plan(rows, vocab, k, device, splits=splits, block=block, programs_per_sm=programs_per_sm)
        maxnreg = _MAXNREG_16BIT if chunk >= _MAXNREG_MIN_TILES * block else 0
    # Never aim past what fits in one wave: Triton compiles a kernel per specialisation (here: dtype,
    # k, scale or not, block, the options, 16-byte alignment of the pointers and of the row stride),
    # and the first launch of each tells how many of its programs fit per SM.
    aligned = tuple(t is None or t.data_ptr() % 16 == 0 for t in (logits, scale, prob, index))
    cand = (candidates or _CANDIDATES) if k > 1 else 0
    if k > 1 and (cand < 32 or cand & (cand - 1)):
        raise ValueError(f"candidates must be a power of two >= 32, not {cand}")
    key = (device.index, logits.dtype, k, scale is not None, block, pdl, maxnreg, sort, aligned, logits.stride(0) % 16 == 0, cand)
    fit = _fits.get(key)
    if fit is not None and splits is None:
        programs_per_sm = min(programs_per_sm, fit)
    splits, chunk, block = plan(rows, vocab, k, device, splits=splits, block=block, programs_per_sm=programs_per_sm)
    ws = workspace if workspace is not None else _workspace(device, rows)
    # On the GPU: no contraction of x * s - max into one fma, whose single rounding would move
    # exp(y - max) away from the float32 softmax of y = fl(x * s) by up to an ulp of y.
    options = {"enable_fp_fusion": False, **({"launch_pdl": True} if pdl else {})} if cuda else {}
    if maxnreg:
        options["maxnreg"] = maxnreg
    args = _arguments(logits, k, log, prob, index, scale, splits, chunk, cand, ws)
    common = dict(BLOCK=block, V=16 // logits.element_size(), HAS_SCALE=scale is not None, GPU=cuda, PDL=pdl,
                  MERGE=128 if splits <= 128 else 256, num_warps=1, **options)
    if k == 1:  # its own kernel (_triton_argmax.py): per-lane state, no candidates
        jit, constexprs = _argmax_kernel, common
    else:
        record = max(32, triton.next_power_of_2(chunk // block))  # the chunk's tiles, at least 32 (one per lane)
        resnap = k >= _RESNAP_MIN_K and rows >= _RESNAP_MIN_ROWS and chunk == block  # one tile a program
        jit, constexprs = _selection_kernel, dict(K=k, CAND=cand, SORT=sort, RECORD=record, RESNAP=resnap, **common)
    kernel = jit[(rows, splits)](*args, **constexprs)
    if fit is None and getattr(kernel, "n_regs", 0):  # the first launch of this kernel: note its occupancy
        _fits[key] = _programs_that_fit(kernel.n_regs)
    elif ready_key is not None and fit is not None:  # the plan is final
        consts = tuple(constexprs[name] for name in jit.arg_names[len(args):])
        if len(_ready) >= 4096:  # shapes without end (a server's every batch size, many times over)
            _ready.clear()
        _ready[ready_key] = (kernel, (rows, splits, 1), consts, splits, chunk, cand)
    return kernel
