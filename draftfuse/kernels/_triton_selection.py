"""Triton kernel behind draftfuse's topk_prob for k > 1: the top k over the last dim of a [rows, vocab]
logits tensor, with softmax probabilities, in one pass over the logits and one launch; and the parts
that the k = 1 kernel (_triton_argmax.py) shares with it: order keys, the programs' end (`_arrive`)
and the row's merge (`_merge_row`, both k = 1 and k > 1).

Each row is split into chunks, one single-warp program per (row, chunk), so that a small batch still
fills the GPU (up to 256 chunks a row for k = 1, 128 for k > 1); a tile is 512 elements, 16 per lane
as 16-byte loads, the next tile's loads issued before this tile's math, and the grid stays within one
wave. With a scale s per row the softmax is that of y = x * s and the order is that of
u = x * sign(s): the exact order of x * s, which rounding in y could tie for float32 logits. The floors
are in y, whose order is u's but for ties; pass 2 compares u with its floor moved under them (_u_floor).
With an infinite s (a temperature of 0) y is NaN where x = 0, out of u's order, so a k > 1 program runs
on y = u there, and the row's probabilities (NaN in any softmax of y) are made NaN.

Pass 1 (every program) streams its chunk tile by tile: each lane's running max m and sum of exp(y - m)
(online softmax, the lanes combined once after the loop, so that no tile waits on a warp reduction), and each lane's max of y is published (atomic max, only when it grew) to 32 slots
per row shared by all programs of the row, and each tile's max key is kept in registers. Every slot
holds a value of a distinct element (or -inf, from masked tail lanes), so the k-th largest slot bounds
the row's k-th largest value from below: elements under it can't be in the top k. A slot is the max
over ~vocab/32 elements, so this floor lands near the row's true k-th value once the row's programs
have published.
Pass 2 reads the floor and re-reads only the tiles whose max reaches it (usually none or
one, from L1/L2), and appends the elements at or above it to the row's candidates: one atomic add on
a per-row count reserves their places (each element's place from an in-thread count plus one warp
scan), so a program does no merging at all. The floor it read is at most the final one (slots only
grow), so every element of the row's top k is appended (one tile a program, k = 16, 8+ rows: it reads
the slots again beside the hit tile, a later floor). When a row's room (_CANDIDATES keys) runs out,
which takes more than that many elements tied at or above the floor (all-equal or all -inf rows),
each program keeps its best k of what didn't fit in registers, by merge rounds (each round
takes every lane's best remaining candidate and merges them into a sorted top list with a 64-wide
bitonic sort in one warp), and writes them to a [k, splits] area after the candidates.
Merge: each program writes its (m, sum) (the k = 1 kernel also its best key), then counts itself in with
an atomic on a per-row counter; the row's last program (a release/acquire pair orders the others' writes
before its reads) merges the partials, writes index and probability, and resets the counters and
slots. For k > 1 it loads the candidates before their count is known (one per lane while there are
at most 32). With at most 32 appended they hold every element at or above the final floor, at least k,
one per lane: their keys are distinct, so each one's rank among them (32 x 32 compares) is its place in
the output, written at once, and no floor is computed. With more, it drops those under the final floor
first and ranks them so if each lane then holds at most two (its best and second, each ranked among
both); otherwise (a lane holding three, or the room run out) it merges them by rounds, the [k, splits]
area too when the room ran out.
H200 timings: benchmarks/results (k = 4 and 16 at batch 1 take 2.7-4.4 us over the k = 1 kernel).

The counter and slots live in a per-stream workspace (_triton_launch.py) that every launch leaves as
it found it (all INT32_MIN), so a call needs no fill kernel; a call captured on a stream that has none
fills a per-call copy (one more kernel). Two launches must not run at once on two streams sharing one.

Packed keys: an int64 holding the order key of u (an int32 whose signed order is torch's order of
floats: NaN above +inf, -0.0 == +0.0) in the high word and 2**31 - 1 - index in the low word, so
one integer max picks the larger value and, on ties, the lower index. Probabilities are float32:
exp(y - max) / sum(exp(y - max)) (log: y - max - log(sum)); a row whose max of y is NaN or +-inf
gets NaN probabilities, as the float32 softmax gives.

Limits: k <= 16, vocab < 2**31, at most _MAX_TILES tiles per chunk, fp32/fp16/bf16 logits with a
contiguous last dim.
"""

import triton
import triton.language as tl

from draftfuse.kernels._triton_keys import _EMPTY, _NAN_KEY, _NO_KEY, _order_key, _pack, _u_floor, _unpack

_BIG_INDEX = tl.constexpr(2**31 - 1)
_LOG2E = tl.constexpr(1.4426950408889634)
_MAX_TILES = tl.constexpr(256)  # tiles per chunk at most (a program's record of tile maxima: RECORD <= this)
_MAX_SPLITS = 256  # chunks per row at most; the last program reads every chunk's (max, sum) at once: MERGE of them
_TOPK_SPLITS = 128  # k > 1 aims at no more: 256 chunks ran no faster for k > 1 (notes/kernels.md, "256 chunks a row")

_INT32_MIN = -(2**31)
_WS_COLS = tl.constexpr(64)  # workspace columns per row: [0] arrival counter, [1] candidates (k > 1), [32:64] slots (k > 1)
_CANDIDATES = 256  # k > 1: a row's room for candidates (a power of two >= 32)

# 512 elements per tile (16 per lane, as 16-byte vectors; the next tile's loads issued before this
# tile's math) for every dtype, and one-warp programs aimed for per SM by (element size, k == 1,
# scaled): the tiling and grids measured fastest (notes/kernels.md, wave 2; 1024-element tiles were
# within 5% for bf16 k = 1 unscaled, 7-27% slower for k > 1; float32 k = 4 scaled ran at 21 per SM).
# float32 k = 1 with a scale: 21, as without one (H200, side by side against 16: 0.90-0.96x at batch 256 and
# vocab >= 128256, 0.97-1.00x at batch 32-64; the grids differ only where the tiles do not bound them).
_BLOCK = 512
_PROGRAMS_PER_SM = {
    (2, True, False): 24, (2, True, True): 24, (2, False, False): 16, (2, False, True): 16,
    (4, True, False): 21, (4, True, True): 21, (4, False, False): 16, (4, False, True): 16,
}
# Programmatic dependent launch: the kernel may start while the previous kernel in the stream drains (it
# waits, griddepcontrol.wait, before touching memory), hiding the launch gap; sm_90+ only, else off.
_PDL = True
# k > 1, one tile a program (vocab ~32000, batch <= 32): programs read the slots before most others have
# published; at k = 16 ~50 candidates a row pass their floors (past 32: the last program's slower path). From
# this k and batch on they read the slots again beside the hit tile (H200: 0.77-0.96x; batch 1 1.04-1.12x)
_RESNAP_MIN_K, _RESNAP_MIN_ROWS = 16, 8
# k > 1: how a round merges 32 candidates into the top list: "sort" (a 64-wide bitonic sort) or
# "rank" (32 x 32 comparisons; what Triton's interpreter always runs)
_MERGE = "sort"


@triton.jit
def _prefetch_l2(row_ptr, tile, end, BLOCK: tl.constexpr, GPU: tl.constexpr):
    """Pass 1's loop of the k > 1 kernel, 16-bit logits: a hint that brings the tile after the next one
    into L2 (one prefetch.global.L2 per lane, nothing loaded into registers, no wait), clamped to the
    chunk's whole tiles. Side by side on an H200 (notes/kernels.md, "An L2 prefetch two tiles ahead"):
    bf16 at batch 256 took 0.93-0.97x the time at vocab >= 128256 (0.97-1.00 at 32000), batch 1-64
    0.99-1.03x; float32 at batch 256 1.04-1.06x, hence 16-bit only. The k = 1 kernel has none: its
    unscaled bf16 loop took 0.94-0.97x but its scaled one 1.02-1.04x, which would have put a
    temperature's cost past 5 %."""
    if GPU and row_ptr.dtype.element_ty.primitive_bitwidth == 16:
        offs = tl.minimum(tile + 2 * BLOCK + tl.arange(0, 32) * (BLOCK // 32), end - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [row_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    if FAST:
        # tl.exp2 compiles to the IEEE-subnormal form of ex2.approx, whose fix-ups cost three more
        # instructions per element; flushing results under 2**-126 can't move a sum that is >= 1.
        y = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:  # Triton's interpreter runs no PTX
        y = tl.exp2(x)
    return y


@triton.jit
def _max3(x):
    return tl.max(tl.max(tl.max(x, 2), 1), 0)


@triton.jit
def _lane_max(x):
    """[32, J, V] -> [32]: each lane's own elements, no shuffles."""
    return tl.max(tl.max(x, 2), 1)


@triton.jit
def _kth_largest(keys, K: tl.constexpr):
    """The K-th largest of 32 int32 keys (duplicates count): the least of those with fewer than K
    keys above them."""
    above = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), 1)
    return tl.min(tl.where(above < K, keys, _NAN_KEY), 0)


@triton.jit
def _merge_top(top, new, K: tl.constexpr, SORT: tl.constexpr):
    """The K largest of top (sorted, K keys then _EMPTY) and new (32 distinct keys or _EMPTY), sorted.
    SORT: a 64-wide bitonic sort (tl.sort), ~300 instructions for int64 keys in one warp; otherwise
    ranks from 32 x 32 comparisons, ~3x the instructions on a GPU but far fewer steps for Triton's
    interpreter, which runs every step of tl.sort as a numpy call."""
    lanes = tl.arange(0, 32)
    if SORT:
        both = tl.sort(tl.reshape(tl.join(new, top), [64]), descending=True)
        best = tl.max(tl.reshape(both, [2, 32]), 0)  # both is sorted: each column's first row is its max
    else:
        in_top = lanes < K
        valid = new != _EMPTY
        # each key's rank in the union (the keys are distinct, but for top's _EMPTY slots)
        rank_new = tl.sum(((top[None, :] > new[:, None]) & in_top[None, :]).to(tl.int32), 1)
        rank_new += tl.sum(((new[None, :] > new[:, None]) & valid[None, :]).to(tl.int32), 1)
        rank_top = lanes + tl.sum(((new[None, :] > top[:, None]) & valid[None, :]).to(tl.int32), 1)
        at = lanes[:, None]
        best = tl.max(tl.where((rank_new[None, :] == at) & valid[None, :], new[None, :], _EMPTY), 1)
        best = tl.maximum(best, tl.max(tl.where((rank_top[None, :] == at) & in_top[None, :], top[None, :], _EMPTY), 1))
    return tl.where(lanes < K, best, _EMPTY)


@triton.jit
def _insert(cand, top, kth, K: tl.constexpr, SORT: tl.constexpr):
    """Merges the keys of cand ([32, J, V], _EMPTY where none) into top; kth is top's K-th key.
    A round takes each lane's best remaining key; rounds run while some lane's beats kth."""
    lane_best = _lane_max(cand)
    while tl.max(lane_best, 0) > kth:
        top = _merge_top(top, tl.where(lane_best > kth, lane_best, _EMPTY), K, SORT)
        kth = tl.max(tl.where(tl.arange(0, 32) == K - 1, top, _EMPTY), 0)
        taken = cand == lane_best[:, None, None]
        cand = tl.where(taken | (cand <= kth), _EMPTY, cand)
        lane_best = _lane_max(cand)
    return top, kth


@triton.jit
def _tile_y(x, valid, s, MASKED: tl.constexpr, HAS_SCALE: tl.constexpr):
    """y = x * s of a tile (x unscaled), -inf where masked."""
    if HAS_SCALE:
        y = x * s
    else:
        y = x
    if MASKED:
        y = tl.where(valid, y, float("-inf"))
    return y


@triton.jit
def _stream_tile(
    x, valid, t, s, m, lane_sum, tile_keys, own, slots_ptr, publish,
    MASKED: tl.constexpr, HAS_SCALE: tl.constexpr, GPU: tl.constexpr, RECORD: tl.constexpr,
):
    """Pass 1 of k > 1 for one tile: every lane's online softmax (m, sum) over its own elements (no warp
    reduction on the way to the sum), the tile's max key (one warp max of the lanes' keys, which nothing in
    the loop waits on), each lane's max published to the row's slots where it grew."""
    y = _tile_y(x, valid, s, MASKED, HAS_SCALE)
    lane_max = _lane_max(y)
    new_m = tl.where(lane_max > m, lane_max, m)  # never NaN: NaN compares false
    # a lane whose elements are all -inf so far shifts by 0, so that they add exp(-inf) = 0, not NaN
    shift = tl.where(new_m == float("-inf"), 0.0, new_m)
    tile_sum = tl.sum(tl.sum(_exp2((y - shift[:, None, None]) * _LOG2E, GPU), 2), 1)
    lane_sum = lane_sum * tl.exp2((m - shift) * _LOG2E) + tile_sum
    lane_key = _order_key(lane_max)
    # NaN in a lane's elements (or +inf - +inf): it shows in its sum even where tl.max skips NaN (on the GPU)
    tile_key = tl.max(tl.where(tile_sum != tile_sum, _NAN_KEY, lane_key), 0)
    tile_keys = tl.where(tl.arange(0, RECORD) == t, tile_key, tile_keys)
    grew = lane_key > own
    if publish:
        tl.atomic_max(slots_ptr + tl.arange(0, 32), lane_key, mask=grew, sem="relaxed")
    own = tl.where(grew, lane_key, own)
    return new_m, lane_sum, tile_keys, own


@triton.jit
def _program(logits_ptr, row_stride, vocab, chunk, scale_ptr, scale_stride, ws_ptr,
             BLOCK: tl.constexpr, V: tl.constexpr, HAS_SCALE: tl.constexpr, PDL: tl.constexpr):
    """A program's start, in both kernels: (row, split, start, end, row pointer, workspace row, the tile's
    offsets, the scale s and its sign)."""
    if PDL:
        # nothing above this line may touch memory: the previous kernel may still be running
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    ws_row = ws_ptr + row.to(tl.int64) * _WS_COLS
    J: tl.constexpr = BLOCK // (32 * V)
    # Tile element (lane, j, v) is at j * 32 V + lane * V + v: 16-byte loads, each covering 512 contiguous
    # bytes across the warp. The lane axis comes first: Triton gives its 32 threads to the first strided
    # axis, so each thread holds one lane's J * V elements and lane reductions need no shuffles (lane axis
    # second, Triton 3.6 split the threads 4 x 8 over (j, lane): ~1570 SASS instructions a round, not ~770).
    lane_offs = (
        tl.arange(0, 32)[:, None, None] * V + tl.arange(0, J)[None, :, None] * (32 * V) + tl.arange(0, V)[None, None, :]
    )
    if HAS_SCALE:
        s = tl.load(scale_ptr + row.to(tl.int64) * scale_stride).to(tl.float32)
        # u = x * sign(s): the order of x * s without its rounding (0 for s = 0, NaN for a NaN s)
        s_sign = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, s * 0.0))
    else:
        s = 1.0
        s_sign = 1.0
    return row, split, start, end, row_ptr, ws_row, lane_offs, s, s_sign


# Not specialised (one compiled kernel for all their values): ints that only bound loops or masks.
@triton.jit(do_not_specialize=["vocab", "splits", "scale_stride", "log"])
def _selection_kernel(
    logits_ptr, row_stride, vocab, chunk, splits, scale_ptr, scale_stride,
    part_ptr, key_ptr, ws_ptr, prob_ptr, index_ptr, log,
    K: tl.constexpr, BLOCK: tl.constexpr, V: tl.constexpr, CAND: tl.constexpr,
    HAS_SCALE: tl.constexpr, GPU: tl.constexpr, PDL: tl.constexpr, SORT: tl.constexpr, MERGE: tl.constexpr,
    RECORD: tl.constexpr, RESNAP: tl.constexpr,
):
    # GPU: compiled for a GPU (PTX exp), not run by Triton's interpreter; SORT: merge top lists by
    # tl.sort rather than by ranks (see _merge_top); MERGE: a power of two >= splits (128 or 256);
    # RECORD: a power of two >= 32 and >= the chunk's tiles, the length of its record of tile maxima
    row, split, start, end, row_ptr, ws_row, lane_offs, s, s_sign = _program(
        logits_ptr, row_stride, vocab, chunk, scale_ptr, scale_stride, ws_ptr, BLOCK, V, HAS_SCALE, PDL
    )
    if HAS_SCALE:
        # An infinite scale (a temperature of 0): y = x * s is +-inf, or NaN where x = 0, which would rank
        # zeros above every element in the floors and hits (the order is u's). The program then runs on
        # y = u, and the probabilities (NaN in any softmax of such a row) are made NaN through the row's sum.
        infinite = (s == float("inf")) | (s == float("-inf"))
        s = tl.where(infinite, s_sign, s)
    slots_ptr = ws_row + 32
    lanes = tl.arange(0, 32)
    publish = splits > 1
    m = tl.full([32], float("-inf"), tl.float32)
    lane_sum = tl.zeros([32], tl.float32)
    tile_keys = tl.full([RECORD], _NO_KEY, tl.int32)
    own = tl.full([32], _NO_KEY, tl.int32)

    # Pass 1: whole tiles, each tile's load issued one tile ahead so that its DRAM latency overlaps
    # the math of the one before (masks past the whole tiles switch the last prefetch off).
    full_end = start + (end - start) // BLOCK * BLOCK
    next_x = tl.load(row_ptr + start + lane_offs, mask=start + lane_offs < full_end, other=0.0)
    for tile in range(start, full_end, BLOCK):
        offs = tile + lane_offs
        x = next_x.to(tl.float32)
        next_x = tl.load(row_ptr + offs + BLOCK, mask=offs + BLOCK < full_end, other=0.0)
        _prefetch_l2(row_ptr, tile, full_end, BLOCK, GPU)
        m, lane_sum, tile_keys, own = _stream_tile(
            x, offs < end, (tile - start) // BLOCK, s, m, lane_sum, tile_keys, own, slots_ptr, publish,
            False, HAS_SCALE, GPU, RECORD,
        )
    if full_end < end:  # the ragged tail
        offs = full_end + lane_offs
        valid = offs < end
        x = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        m, lane_sum, tile_keys, own = _stream_tile(
            x, valid, (full_end - start) // BLOCK, s, m, lane_sum, tile_keys, own, slots_ptr, publish,
            True, HAS_SCALE, GPU, RECORD,
        )

    row_max = tl.max(m, 0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(lane_sum * tl.exp2((m - shift) * _LOG2E), 0)

    # Pass 2: the floor from the slots, then only the tiles whose max reaches it; their elements at or above
    # it are appended to the row's candidates. The slots are read by a plain L2 load (an atomic read cost
    # ~0.3 us more at batch 1): any snapshot is a valid floor (values of distinct elements, each at most its
    # final value); this program's own lane maxima, maybe not landed yet, are taken in too (same lanes).
    if publish:
        slot_keys = tl.maximum(tl.load(slots_ptr + lanes, cache_modifier=".cg"), own)
    else:
        slot_keys = own
    floor = _kth_largest(slot_keys, K)
    key_row = key_ptr + row.to(tl.int64) * (CAND + K * splits)
    top = tl.full([32], _EMPTY, tl.int64)
    kth = tl.full([], _EMPTY, tl.int64)
    tiles = tl.arange(0, RECORD)
    pending = tile_keys >= floor  # tiles past the chunk hold _NO_KEY: below any floor but _NO_KEY's
    pending = pending & (tiles * BLOCK < end - start)
    while tl.max(pending.to(tl.int32), 0) > 0:
        t = tl.min(tl.where(pending, tiles, RECORD), 0)
        pending = pending & (tiles != t)
        offs = start + t * BLOCK + lane_offs
        valid = offs < end
        if RESNAP and publish:  # a later snapshot of the slots, loaded beside the tile: a floor at least as high
            floor = tl.maximum(floor, _kth_largest(tl.maximum(tl.load(slots_ptr + lanes, cache_modifier=".cg"), own), K))
        if start + (t + 1) * BLOCK <= end:  # a whole tile: unmasked, so 16-byte loads (from L1 or L2)
            x = tl.load(row_ptr + offs).to(tl.float32)
        else:
            x = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        u_floor = _u_floor(floor, s * s_sign) if HAS_SCALE else floor
        u_key = _order_key(x * s_sign) if HAS_SCALE else _order_key(x)
        hit = valid & (u_key >= u_floor)
        at, n = _positions(hit)
        if n > 0:
            at += tl.atomic_add(ws_row + 1, n, sem="relaxed") - _NO_KEY
            keys = _pack(u_key, offs)
            tl.store(key_row + at, keys, mask=hit & (at < CAND))
            # past the row's capacity: this program's best K of what didn't fit, kept in registers
            missed = hit & (at >= CAND)
            if _max3(missed.to(tl.int32)) > 0:
                top, kth = _insert(tl.where(missed, keys, _EMPTY), top, kth, K, SORT)
    # [K, splits] slot-major after the candidates: _EMPTY unless some of this program's didn't fit
    tl.store(key_row + CAND + lanes * splits + split, top, mask=lanes < K)
    if HAS_SCALE:
        row_sum = tl.where(infinite, float("nan"), row_sum)

    _arrive(
        row, split, splits, row_max, row_sum, s, s_sign, part_ptr, key_ptr, ws_row, slots_ptr, own, prob_ptr, index_ptr,
        log, K, CAND, HAS_SCALE, SORT, MERGE,
    )


@triton.jit
def _arrive(
    row, split, splits, row_max, row_sum, s, s_sign, part_ptr, key_ptr, ws_row, slots_ptr, own, prob_ptr, index_ptr, log,
    K: tl.constexpr, CAND: tl.constexpr, HAS_SCALE: tl.constexpr, SORT: tl.constexpr, MERGE: tl.constexpr,
):
    """A program's end: its (max, sum) partial written, it counts itself in, and the row's last program
    merges (its key, for k = 1, and k > 1's candidates are written before)."""
    part_row = part_ptr + row.to(tl.int64) * 2 * splits
    tl.store(part_row + split, row_max)
    tl.store(part_row + splits + split, row_sum)
    tl.debug_barrier()  # every lane's writes above before the release (or, one program a row, the merge's reads)
    last = splits == 1
    if splits > 1:
        # one release: the row's last program sees every program's writes
        arrived = tl.atomic_add(ws_row, 1, sem="acq_rel")
        last = arrived == _NO_KEY + splits - 1
        if last:
            tl.store(ws_row, _NO_KEY)  # leave the counter as found, for the next launch
    if last:
        _merge_row(
            row, splits, s, s_sign, part_row, key_ptr, ws_row, slots_ptr, own, prob_ptr, index_ptr, log,
            K, CAND, HAS_SCALE, SORT, MERGE,
        )


@triton.jit
def _positions(hit):
    """[32, J, V] mask -> each element's count of set elements before it (lane, then j, then v order)
    and the total: the lanes' counts are in-thread, one warp scan adds the lanes before."""
    m = hit.to(tl.int32)
    per_j = tl.sum(m, 2)
    per_lane = tl.sum(per_j, 1)
    before = (tl.cumsum(per_lane, 0) - per_lane)[:, None, None] + (tl.cumsum(per_j, 1) - per_j)[:, :, None]
    return before + tl.cumsum(m, 2) - m, tl.sum(per_lane, 0)


@triton.jit
def _above(keys, valid, floor, s, s_sign, HAS_SCALE: tl.constexpr):
    """The packed keys (valid ones) whose element's y reaches the floor; _EMPTY elsewhere. (Comparing u with
    _u_floor here, as pass 2 does, moved pass 1's loads in the compiled kernel: notes/kernels.md.)"""
    u, _ = _unpack(keys)
    return tl.where(valid & (_order_key(_y_of(u, s, s_sign, HAS_SCALE)) >= floor), keys, _EMPTY)


@triton.jit
def _y_of(u, s, s_sign, HAS_SCALE: tl.constexpr):
    """y = x * s of the element whose order value is u = x * sign(s)."""
    if HAS_SCALE:
        y = (u * s_sign) * s
    else:
        y = u
    return y


@triton.jit
def _merge_row(
    row, splits, s, s_sign, part_row, key_ptr, ws_row, slots_ptr, own, prob_ptr, index_ptr, log,
    K: tl.constexpr, CAND: tl.constexpr, HAS_SCALE: tl.constexpr, SORT: tl.constexpr, MERGE: tl.constexpr,
):
    i = tl.arange(0, MERGE)
    # .cg: straight from L2, where the other programs' writes are
    part_max = tl.load(part_row + i, mask=i < splits, other=float("-inf"), cache_modifier=".cg")
    part_sum = tl.load(part_row + splits + i, mask=i < splits, other=0.0, cache_modifier=".cg")
    row_max = tl.max(part_max, 0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(part_sum * tl.exp2((part_max - shift) * _LOG2E), 0)
    log_sum = tl.log(row_sum)
    # the float32 softmax of a row whose max is NaN, +inf or -inf is NaN everywhere
    finite = (row_max > float("-inf")) & (row_max < float("inf"))
    row64 = row.to(tl.int64)
    if K == 1:
        keys = tl.load(key_ptr + row64 * splits + i, mask=i < splits, other=_EMPTY, cache_modifier=".cg")
        u, index = _unpack(tl.max(keys, 0))
        y = _y_of(u, s, s_sign, HAS_SCALE)
        prob = tl.where(log != 0, y - row_max - log_sum, tl.exp(y - row_max) / row_sum)
        tl.store(prob_ptr + row64, tl.where(finite, prob, float("nan")))
        tl.store(index_ptr + row64, index.to(tl.int64))
    else:
        lanes = tl.arange(0, 32)
        key_row = key_ptr + row64 * (CAND + K * splits)
        # the candidates, loaded before their count is known (the entries past it are masked after)
        flat = lanes[:, None, None] + tl.arange(0, CAND // 32)[None, :, None] * 32 + tl.arange(0, 1)[None, None, :]
        keys = tl.load(key_row + flat, cache_modifier=".cg")
        # the final slots and count (every program has published); reset for the next launch
        appended = tl.atomic_xchg(ws_row + 1, _NO_KEY, sem="relaxed") - _NO_KEY
        if splits > 1:
            slot_keys = tl.atomic_xchg(slots_ptr + lanes, _NO_KEY, sem="relaxed")
        else:
            slot_keys = own
        valid = (flat < appended) & (flat < CAND)
        if appended <= 32:
            # one per lane (places 0..31), and among them every element at or above the final floor, at
            # least K: ranked as they are, with no floor to compute or filter by
            floor = tl.full([], _NO_KEY, tl.int32)
            cand = tl.where(valid, keys, _EMPTY)
        else:
            floor = _kth_largest(slot_keys, K)
            cand = _above(keys, valid, floor, s, s_sign, HAS_SCALE)
        lane_best = _lane_max(cand)
        most = tl.max(tl.sum(tl.sum((cand != _EMPTY).to(tl.int32), 2), 1), 0)  # candidates in a lane, at most
        # the usual cases (distinct keys holding the top K: each one's rank among them is its place): each
        # alone in its lane, or (over 32 appended) two in some lane, at places i and i + 32
        if (most <= 1) & (appended <= CAND):
            _write_top(lane_best, _count_above(lane_best, lane_best), row64, s, s_sign, row_max, row_sum, log_sum,
                       finite, prob_ptr, index_ptr, log, K, HAS_SCALE)
        elif (most <= 2) & (appended <= CAND):
            second = _lane_max(tl.where(cand == lane_best[:, None, None], _EMPTY, cand))
            _write_top(lane_best, _count_above(lane_best, lane_best) + _count_above(lane_best, second), row64, s,
                       s_sign, row_max, row_sum, log_sum, finite, prob_ptr, index_ptr, log, K, HAS_SCALE)
            _write_top(second, _count_above(second, lane_best) + _count_above(second, second), row64, s, s_sign,
                       row_max, row_sum, log_sum, finite, prob_ptr, index_ptr, log, K, HAS_SCALE)
        else:
            top = tl.full([32], _EMPTY, tl.int64)
            kth = tl.full([], _EMPTY, tl.int64)
            top, kth = _insert(cand, top, kth, K, SORT)
            if appended > CAND:  # some programs' candidates didn't fit: their best K are in [K, splits]
                region = key_row + CAND
                for b in range(0, K * splits, CAND):
                    at = b + flat
                    keys = tl.load(region + at, mask=at < K * splits, other=_EMPTY, cache_modifier=".cg")
                    top, kth = _insert(_above(keys, at < K * splits, floor, s, s_sign, HAS_SCALE), top, kth, K, SORT)
            _write_top(top, lanes, row64, s, s_sign, row_max, row_sum, log_sum, finite, prob_ptr, index_ptr, log, K,
                       HAS_SCALE)


@triton.jit
def _count_above(keys, among):  # for each of keys ([32] packed), how many of among ([32], or _EMPTY) are larger
    return tl.sum(((among[None, :] > keys[:, None]) & (among != _EMPTY)[None, :]).to(tl.int32), 1)


@triton.jit
def _write_top(keys, place, row64, s, s_sign, row_max, row_sum, log_sum, finite, prob_ptr, index_ptr, log,
               K: tl.constexpr, HAS_SCALE: tl.constexpr):
    """A row's top K out: each of the [32] packed keys (but _EMPTY) whose `place` is under K, at that place."""
    mask = (keys != _EMPTY) & (place < K)
    u, index = _unpack(keys)
    y = _y_of(u, s, s_sign, HAS_SCALE)
    prob = tl.where(log != 0, y - row_max - log_sum, tl.exp(y - row_max) / row_sum)
    tl.store(prob_ptr + row64 * K + place, tl.where(finite, prob, float("nan")), mask=mask)
    tl.store(index_ptr + row64 * K + place, index.to(tl.int64), mask=mask)
