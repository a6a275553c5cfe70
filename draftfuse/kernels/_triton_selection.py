"""Triton kernels behind draftfuse's selection ops: top-k (k = 1 is the argmax) over the last dim of a
[rows, vocab] logits tensor, with softmax probabilities, in one pass over the logits.

Stage 1 splits each row into chunks, one program per (row, chunk), so that a small batch still fills
the GPU. A program walks its chunk tile by tile keeping two things:
  - the running max m and the running sum s of exp(x - m), rescaled when m grows (online softmax);
  - its k best elements as packed int64 keys (order key of the value in the high word, the inverted
    index in the low word), so one integer max picks the larger value and, on ties, the lower index.
Most tiles only update (m, s): a tile is searched for candidates only when its max beats the k-th key
kept so far, or when it holds a NaN (its exp-sum is NaN). For k > 1 the programs of a row also share
that bound through an int64 per row (atomic max): a key below any program's k-th key can't be in the
row's top k, so each program skips what the others have already beaten. How many tiles are searched
depends on the data: a program's first tile always, few after it when the large logits are scattered,
every tile on ascending rows (still correct, slower).
Stage 2, one program per row, merges the chunks' (m, s) and keys and writes index and probability.

Order and special values follow torch: NaN is above +inf (torch.argmax and torch.sort put it first),
-0.0 equals +0.0, equal values resolve to the lower index. Probabilities are computed in float32 as
exp(v - max) / sum(exp(x - max)) (log: v - max - log(sum)); a row whose max is NaN or +-inf gets NaN
probabilities, as the float32 softmax gives. Limits: k <= 16 (stage 2 merges splits * k keys in one
program), vocab < 2**31, fp32/fp16/bf16 logits with a contiguous last dim.
"""

import torch
import triton
import triton.language as tl

_EMPTY = tl.constexpr(-(2**63))  # below every real packed key
_NEVER_EVICTED = tl.constexpr(2**63 - 1)  # fills the slots past k in a power-of-two slot array
_NAN_KEY = tl.constexpr(2**31 - 1)
_LOG2E = tl.constexpr(1.4426950408889634)

# Elements per tile and warps per program, by element size. One warp per program: every reduction
# is a few shuffles, with no shared memory or barrier on the per-tile critical path (four-warp
# programs of 2048 were 1.5x slower on an H200, notes/kernels.md). 32 elements per thread: four
# 16-byte loads per tile for half types, eight for fp32, the next tile's in flight during reductions.
_TILE_CONFIG = {2: (1024, 1), 4: (1024, 1)}
# stage-1 programs aimed for per SM: 16 one-warp programs fit beside each other (registers allow ~24)
_PROGRAMS_PER_SM = 16
# At most this many splits, and splits * k <= _MAX_MERGE keys for stage 2's k rounds of max.
_MAX_SPLITS = 128
_MAX_MERGE = 512


@triton.jit
def _order_key(x):
    """float32 -> int32 whose signed order is torch's order of the floats."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(2**31), 0, bits)  # -0.0 ties with +0.0
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    return tl.where(x != x, _NAN_KEY, key)  # every NaN above +inf


@triton.jit
def _pack(key, index):
    # the low word holds 2**31 - 1 - index, so among equal keys the lower index packs larger
    return (key.to(tl.int64) << 32) | tl.cast(0x7FFFFFFF - index, tl.int64)  # index may be a scalar


@triton.jit
def _unpack(packed):
    key = (packed >> 32).to(tl.int32)
    index = 0x7FFFFFFF - (packed & 0x7FFFFFFF).to(tl.int32)
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True), index


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
def _reduce_tile(
    x, first, offs, end, row_max, row_sum, top, top_min, bound, bound_ptr, K: tl.constexpr, FAST_EXP: tl.constexpr
):
    tile_max = tl.max(x, 0)
    new_max = tl.where(tile_max > row_max, tile_max, row_max)  # never NaN: NaN compares false
    # while every element seen is -inf, shift by 0 so -inf contributes exp(-inf) = 0, not NaN
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    tile_sum = tl.sum(_exp2((x - shift) * _LOG2E, FAST_EXP), 0)
    row_sum = row_sum * tl.exp(row_max - shift) + tile_sum
    # Search the tile only if its best possible key (its max at its first index) beats what a key
    # must beat to matter: this program's k-th key, or the k-th key of any program of the row (the
    # row's top k all beat both). A NaN shows in tile_sum even where tl.max skips NaN (on the GPU).
    floor = tl.maximum(top_min, bound)
    if (tile_sum != tile_sum) | (_pack(_order_key(tile_max), first) > floor):
        cand = tl.where(offs < end, _pack(_order_key(x), offs), _EMPTY)
        if K == 1:
            top = tl.maximum(top, tl.max(cand, 0))
            top_min = tl.min(top, 0)
        else:
            best = tl.max(cand, 0)
            while best > floor:  # replace the smallest kept key; keys are distinct
                top = tl.where(top == top_min, best, top)
                top_min = tl.min(top, 0)
                floor = tl.maximum(top_min, bound)
                cand = tl.where(cand == best, _EMPTY, cand)
                best = tl.max(cand, 0)
            # Publish this program's k-th key, the row's k-th key is at least that, and take back
            # the largest any program of the row has published. Any value seen is a valid bound,
            # stale or not, so no ordering is needed. (k = 1 shares nothing: its own key suffices.)
            bound = tl.maximum(tl.atomic_max(bound_ptr, top_min, sem="relaxed"), top_min)
    return new_max, row_sum, top, top_min, bound


@triton.jit
def _partials_kernel(
    logits_ptr, row_stride, vocab, chunk,
    part_max_ptr, part_sum_ptr, part_key_ptr, bound_ptr,
    K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr, FAST_EXP: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    out = row * tl.num_programs(1) + split
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    slots = tl.arange(0, K_POW2)
    # distinct placeholders below every real key, so "replace the smallest" replaces exactly one slot
    top = tl.where(slots < K, _EMPTY + slots.to(tl.int64), _NEVER_EVICTED)
    top_min = tl.min(top, 0)
    bound_ptr += row
    # The shared bound arrives with the first searched tile (the first tile always is), through the
    # atomic, whose result Triton broadcasts to all warps. A plain load here would not do: warps
    # reading at different moments could disagree, then branch apart around block reductions.
    bound = tl.full([], _EMPTY, tl.int64)
    row_max = tl.full([], float("-inf"), tl.float32)
    row_sum = tl.full([], 0.0, tl.float32)
    # Whole tiles, each tile's load issued one tile ahead so that its DRAM latency overlaps the
    # reductions of the one before (masks past the whole tiles switch the last prefetch off).
    lanes = tl.arange(0, BLOCK)
    full_end = start + (end - start) // BLOCK * BLOCK
    next_x = tl.load(row_ptr + start + lanes, mask=start + lanes < full_end, other=0.0)
    for tile in range(start, full_end, BLOCK):
        offs = tile + lanes
        x = next_x.to(tl.float32)
        next_x = tl.load(row_ptr + offs + BLOCK, mask=offs + BLOCK < full_end, other=0.0)
        row_max, row_sum, top, top_min, bound = _reduce_tile(
            x, tile, offs, end, row_max, row_sum, top, top_min, bound, bound_ptr, K, FAST_EXP
        )
    if full_end < end:  # the ragged tail
        offs = full_end + lanes
        x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        row_max, row_sum, top, top_min, bound = _reduce_tile(
            x, full_end, offs, end, row_max, row_sum, top, top_min, bound, bound_ptr, K, FAST_EXP
        )
    tl.store(part_max_ptr + out, row_max)
    tl.store(part_sum_ptr + out, row_sum)
    tl.store(part_key_ptr + out * K + slots, top, mask=slots < K)


@triton.jit
def _combine_kernel(
    part_max_ptr, part_sum_ptr, part_key_ptr, prob_ptr, index_ptr, splits,
    K: tl.constexpr, SPLITS_POW2: tl.constexpr, KEYS_POW2: tl.constexpr, LOG: tl.constexpr,
):
    row = tl.program_id(0)
    i = tl.arange(0, SPLITS_POW2)
    part_max = tl.load(part_max_ptr + row * splits + i, mask=i < splits, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + row * splits + i, mask=i < splits, other=0.0)
    row_max = tl.max(part_max, 0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(part_sum * tl.exp(part_max - shift), 0)
    log_sum = tl.log(row_sum)
    # the float32 softmax of a row whose max is NaN, +inf or -inf is NaN everywhere
    finite = (row_max > float("-inf")) & (row_max < float("inf"))
    c = tl.arange(0, KEYS_POW2)
    cand = tl.load(part_key_ptr + row * splits * K + c, mask=c < splits * K, other=_EMPTY)
    for j in tl.static_range(K):
        best = tl.max(cand, 0)
        cand = tl.where(cand == best, _EMPTY, cand)
        value, index = _unpack(best)
        if LOG:
            prob = value - row_max - log_sum
        else:
            prob = tl.exp(value - row_max) / row_sum
        tl.store(prob_ptr + row * K + j, tl.where(finite, prob, float("nan")))
        tl.store(index_ptr + row * K + j, index.to(tl.int64))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter (CPU tensors): the split count only shapes the grid


def launch_selection(
    logits: torch.Tensor,
    k: int,
    log: bool,
    prob: torch.Tensor,
    index: torch.Tensor,
    *,
    splits: int | None = None,
    block: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int | None = None,
) -> None:
    """Top-k of each row of `logits` ([rows, vocab], last dim contiguous) into `prob` (float32) and
    `index` (int64), each holding rows * k contiguous elements, row-major. Launches two kernels and
    allocates scratch whose size depends on shapes only, so it can be captured in a CUDA graph.
    The keywords override the tiling heuristics (tests and the benchmark's tuning use them)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    default_block, default_warps = _TILE_CONFIG[logits.element_size()]
    block = block or default_block
    tiles = triton.cdiv(vocab, block)
    if splits is None:
        target = (programs_per_sm or _PROGRAMS_PER_SM) * _sm_count(logits.device)
        splits = triton.cdiv(target, rows)
    splits = max(1, min(splits, tiles, _MAX_SPLITS, _MAX_MERGE // k))
    chunk = triton.cdiv(tiles, splits) * block
    splits = triton.cdiv(vocab, chunk)
    splits_pow2 = triton.next_power_of_2(max(splits, 16))  # few sizes, few compiled variants
    part_max = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_key = torch.empty((rows, splits, k), dtype=torch.int64, device=logits.device)
    # each row's shared bound on its k-th key starts below every key; k = 1 shares none
    bound = torch.full((rows,), -(2**63), dtype=torch.int64, device=logits.device) if k > 1 else part_key
    _partials_kernel[(rows, splits)](
        logits, logits.stride(0), vocab, chunk, part_max, part_sum, part_key, bound,
        K=k, K_POW2=triton.next_power_of_2(k), BLOCK=block, FAST_EXP=logits.device.type == "cuda",
        num_warps=num_warps or default_warps,
    )
    _combine_kernel[(rows,)](
        part_max, part_sum, part_key, prob, index, splits,
        K=k, SPLITS_POW2=splits_pow2, KEYS_POW2=triton.next_power_of_2(splits_pow2 * k),
        LOG=log, num_warps=1,
    )
