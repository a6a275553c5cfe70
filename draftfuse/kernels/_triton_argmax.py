"""Triton kernel behind argmax_prob on CUDA (k = 1): the argmax of each row of [rows, vocab] logits and
its exact softmax probability, in one pass over the logits and one launch.

The grid, the tiles and the end are those of _triton_selection.py's kernel (single-warp programs, one per
(row, chunk); 512-element tiles as [32, J, V], lane axis first, 16-byte loads; each tile's load issued
one tile before its math; the (max, sum) partials, an arrival counter and the row's last program
merging them). What differs is pass 1: every lane keeps its own state and no tile needs the warp.

  lane state: the running max m of y = x * s over its elements, the sum of exp(y - m) (online softmax),
              and the best u = x * sign(s) so far with the first index holding it (u = y unscaled)
  per tile:   each lane's max of its 16 elements, its running (m, sum) rescaled, and, where its max of u
              beats its best strictly, the first of its elements equal to that max: compares in
              registers, no shuffle, no barrier. With a scale, the lane's max of y = x * s = u * |s| is
              its max of u times |s| (rounding is monotone): one lane reduction, not two. Where that
              product is not y's max it changes nothing: s = 0 or NaN give 0 and NaN both ways, and
              s = +-inf gives NaN for a max u of 0 (or -inf) where y's max is -inf or NaN: neither moves
              m (both compare false), and y's NaN (0 * inf) makes the sum NaN either way.
  the chunk:  one loop per sign of s (a branch taken once per program): u is x or -x, which the compiler
              folds into the compares, so a scaled tile costs y's multiplies over an unscaled one (sm_90
              SASS, Triton 3.6: 191-193 instructions a tile against 178-179; 207-209 for s = 0 or NaN,
              whose u needs x * sign(s)).
  chunk end:  three warp reductions: the max of m, the sum rescaled to it, and the max of the packed
              (order key of u, 2**31 - 1 - index) keys, which picks the larger u and, on ties, the lower
              index (a lane's elements ascend, so its strict compares keep its first).

Strict order per lane and the packed ties across lanes give torch.argmax's index: the first maximum,
-0.0 tying with +0.0, and index 0 (the first element) for a row of -inf. NaN: a lane whose elements
hold a NaN of y (or +inf - +inf) ends with a NaN sum; the chunk's sum is then NaN, and only then the
program re-reads its chunk for the first NaN of u (torch puts NaN above everything), which takes the
chunk. Every NaN of u is a NaN of y (x NaN, s NaN, or x = +-inf with s = 0), so none is missed; the
other NaN sums (+inf in y) find none and keep the lanes' answer. Measured on an H200: notes/kernels.md.
"""

import triton
import triton.language as tl

from draftfuse.kernels._triton_keys import _NAN_KEY, _order_key, _pack
from draftfuse.kernels._triton_selection import _BIG_INDEX, _LOG2E, _arrive, _exp2, _lane_max, _program, _tile_y

# The register budget launches give this kernel for 16-bit logits when a program's chunk holds
# _MAXNREG_MIN_TILES tiles or more (launch_selection's maxnreg). Without one, ptxas keeps 64 registers by
# loading the next tile into this tile's last-used ones, late in the loop; given 72 it issues those loads at
# the loop's top (sm_90, Triton 3.6). On an H200, side by side, 16-bit logits with 3-43 tiles a program took
# 0.89-0.94x the time without a scale and 0.94-0.98x with one; with 1-2 tiles 0.98-1.01x, but 1.12-1.19x on
# the grids of 2-tile programs at 15.5 a SM (vocab 32000 batch 64, 262144 batch 8). float32 ran up to 1.16x
# slower: none (notes/kernels.md, "A register budget moves the k = 1 loads").
_MAXNREG_16BIT = 72
_MAXNREG_MIN_TILES = 3


@triton.jit
def _lane_min(x):
    """[32, J, V] -> [32]: each lane's own elements, no shuffles."""
    return tl.min(tl.min(x, 2), 1)


@triton.jit
def _lanes_tile(x, tile, lane_offs, valid, s, s_sign, s_abs, m, lane_sum, best_u, best_i, MASKED: tl.constexpr,
                HAS_SCALE: tl.constexpr, SIGN: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr):
    """Folds one tile into every lane's (m, sum, best u, its first index). SIGN: sign(s) where the caller
    knows it (1 or -1: u is x or -x, no multiply), 0 where it does not (u = x * s_sign)."""
    y = _tile_y(x, valid, s, MASKED, HAS_SCALE)
    if HAS_SCALE:
        # the lane's max of y = x * s = u * |s| is its max of u times |s| (rounding is monotone): one lane
        # reduction serves both (see the module doc for s = 0, inf, NaN)
        u = _tile_y(x, valid, s_sign if SIGN == 0 else SIGN, MASKED, True)  # -inf where masked
        tile_u = _lane_max(u)
        tile_m = tile_u * s_abs
    else:
        tile_m = _lane_max(y)
        u = y
        tile_u = tile_m
    new_m = tl.where(tile_m > m, tile_m, m)  # never NaN: NaN compares false
    # a lane whose elements are all -inf so far shifts by 0, so that they add exp(-inf) = 0, not NaN
    shift = tl.where(new_m == float("-inf"), 0.0, new_m)
    tile_sum = tl.sum(tl.sum(_exp2((y - shift[:, None, None]) * _LOG2E, GPU), 2), 1)
    lane_sum = lane_sum * tl.exp2((m - shift) * _LOG2E) + tile_sum
    first = tile + _lane_min(tl.where(u == tile_u[:, None, None], lane_offs, BLOCK))
    take = tile_u > best_u  # strict: a lane keeps its first maximum
    return new_m, lane_sum, tl.where(take, tile_u, best_u), tl.where(take, first, best_i)


@triton.jit
def _chunk(row_ptr, start, end, lane_offs, s, s_sign, s_abs, m, lane_sum, best_u, best_i,
           HAS_SCALE: tl.constexpr, SIGN: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr):
    """Pass 1 over a program's chunk: its whole tiles, each tile's load issued one tile ahead (masks past
    the whole tiles switch the last off), then the ragged tail."""
    full_end = start + (end - start) // BLOCK * BLOCK
    ahead = tl.load(row_ptr + start + lane_offs, mask=start + lane_offs < full_end, other=0.0)
    for tile in range(start, full_end, BLOCK):
        x = ahead.to(tl.float32)
        next_offs = tile + BLOCK + lane_offs
        ahead = tl.load(row_ptr + next_offs, mask=next_offs < full_end, other=0.0)
        m, lane_sum, best_u, best_i = _lanes_tile(
            x, tile, lane_offs, True, s, s_sign, s_abs, m, lane_sum, best_u, best_i, False, HAS_SCALE, SIGN, BLOCK, GPU
        )
    if full_end < end:
        offs = full_end + lane_offs
        valid = offs < end
        x = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        m, lane_sum, best_u, best_i = _lanes_tile(
            x, full_end, lane_offs, valid, s, s_sign, s_abs, m, lane_sum, best_u, best_i, True, HAS_SCALE, SIGN, BLOCK, GPU
        )
    return m, lane_sum, best_u, best_i


@triton.jit
def _first_nan(row_ptr, start, end, lane_offs, s_sign, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """The index of the chunk's first NaN of u, or _BIG_INDEX: the rare path, when a sum came out NaN."""
    found = tl.full([], _BIG_INDEX, tl.int32)
    tile = start
    while (tile < end) & (found == _BIG_INDEX):
        offs = tile + lane_offs
        valid = offs < end
        u = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        if HAS_SCALE:
            u = u * s_sign
        found = tl.min(_lane_min(tl.where(valid & (u != u), offs, _BIG_INDEX)), 0)
        tile += BLOCK
    return found


@triton.jit(do_not_specialize=["vocab", "splits", "scale_stride", "log"])
def _argmax_kernel(
    logits_ptr, row_stride, vocab, chunk, splits, scale_ptr, scale_stride,
    part_ptr, key_ptr, ws_ptr, prob_ptr, index_ptr, log,
    BLOCK: tl.constexpr, V: tl.constexpr, HAS_SCALE: tl.constexpr, GPU: tl.constexpr, PDL: tl.constexpr,
    MERGE: tl.constexpr,
):
    # the arguments are _selection_kernel's for K = 1 (no candidates)
    row, split, start, end, row_ptr, ws_row, lane_offs, s, s_sign = _program(
        logits_ptr, row_stride, vocab, chunk, scale_ptr, scale_stride, ws_ptr, BLOCK, V, HAS_SCALE, PDL
    )
    s_abs = s * s_sign  # |s| (0 for s = 0, NaN for a NaN s)
    lanes = tl.arange(0, 32)
    m = tl.full([32], float("-inf"), tl.float32)
    lane_sum = tl.zeros([32], tl.float32)
    best_u = tl.full([32], float("-inf"), tl.float32)
    best_i = start + lanes * V  # a lane's first element: the index of a row of -inf (lane 0's wins the ties)

    # specialised on the sign of s (x * sign(s) is x or -x, folded into the compares) but for s = 0 and NaN
    if not HAS_SCALE:
        m, lane_sum, best_u, best_i = _chunk(row_ptr, start, end, lane_offs, s, s_sign, s_abs, m, lane_sum, best_u,
                                             best_i, False, 1.0, BLOCK, GPU)
    elif s > 0:
        m, lane_sum, best_u, best_i = _chunk(row_ptr, start, end, lane_offs, s, s_sign, s_abs, m, lane_sum, best_u,
                                             best_i, True, 1.0, BLOCK, GPU)
    elif s < 0:
        m, lane_sum, best_u, best_i = _chunk(row_ptr, start, end, lane_offs, s, s_sign, s_abs, m, lane_sum, best_u,
                                             best_i, True, -1.0, BLOCK, GPU)
    else:
        m, lane_sum, best_u, best_i = _chunk(row_ptr, start, end, lane_offs, s, s_sign, s_abs, m, lane_sum, best_u,
                                             best_i, True, 0.0, BLOCK, GPU)

    row_max = tl.max(m, 0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(lane_sum * tl.exp2((m - shift) * _LOG2E), 0)
    key = tl.max(_pack(_order_key(best_u), best_i), 0)
    if row_sum != row_sum:
        nan_i = _first_nan(row_ptr, start, end, lane_offs, s_sign, HAS_SCALE, BLOCK)
        if nan_i < _BIG_INDEX:
            key = _pack(tl.full([], _NAN_KEY, tl.int32), nan_i)
    tl.store(key_ptr + row.to(tl.int64) * splits + split, key)
    _arrive(  # K = 1, no candidates: the slots and `own` (here m) are not read
        row, split, splits, row_max, row_sum, s, s_sign, part_ptr, key_ptr, ws_row, ws_row + 32, m.to(tl.int32),
        prob_ptr, index_ptr, log, 1, 0, HAS_SCALE, False, MERGE,
    )
