"""Triton kernels behind draftfuse's selection ops: top-k (k = 1 is the argmax) over the last dim of a
[rows, vocab] logits tensor, with softmax probabilities, in one pass over the logits.

Stage 1 splits each row into chunks, one program per (row, chunk), so that a small batch still fills
the GPU. A program walks its chunk tile by tile keeping three things:
  - the running max m and the running sum s of exp(x - m), rescaled when m grows (online softmax);
  - its k best elements as packed int64 keys (order key of the value in the high word, the inverted
    index in the low word), so one integer max picks the larger value and, on ties, the lower index.
Most tiles only update (m, s): a tile is searched for candidates only when its max beats the k-th key
kept so far, or when it holds a NaN (its exp-sum is NaN). On real logits that is a handful of tiles
per row; on adversarial rows (ascending values) it is every tile, which stays correct but is slower.
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

# elements per tile and warps per program, by element size: 16 elements per thread, two 16-byte
# loads for half types and four for fp32, so enough bytes are in flight with registers to spare.
_TILE_CONFIG = {2: (2048, 4), 4: (2048, 4)}
# stage-1 programs aimed for per SM: several resident programs hide the DRAM latency of each.
_PROGRAMS_PER_SM = 8
# Stage 2 reads a row's partials in one block of 16 or of _MAX_SPLITS: two sizes keep the compiled
# variants few (a new power of two would be a new compile), and more splits than this don't pay.
_MAX_SPLITS = 128


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
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _unpack(packed):
    key = (packed >> 32).to(tl.int32)
    index = 0x7FFFFFFF - (packed & 0x7FFFFFFF).to(tl.int32)
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True), index


@triton.jit
def _reduce_tile(x, offs, end, row_max, row_sum, top, top_min):
    tile_max = tl.max(x, 0)
    new_max = tl.where(tile_max > row_max, tile_max, row_max)  # never NaN: NaN compares false
    # while every element seen is -inf, shift by 0 so -inf contributes exp(-inf) = 0, not NaN
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    tile_sum = tl.sum(tl.exp(x - shift), 0)
    row_sum = row_sum * tl.exp(row_max - shift) + tile_sum
    # A NaN shows in tile_sum whether or not tl.max saw it (it may skip NaN on the GPU).
    if (tile_sum != tile_sum) | (_order_key(tile_max) > (top_min >> 32).to(tl.int32)):
        cand = tl.where(offs < end, _pack(_order_key(x), offs), _EMPTY)
        best = tl.max(cand, 0)
        while best > top_min:  # replace the smallest kept key; keys are distinct
            top = tl.where(top == top_min, best, top)
            top_min = tl.min(top, 0)
            cand = tl.where(cand == best, _EMPTY, cand)
            best = tl.max(cand, 0)
    return new_max, row_sum, top, top_min


@triton.jit
def _partials_kernel(
    logits_ptr, row_stride, vocab, chunk,
    part_max_ptr, part_sum_ptr, part_key_ptr,
    K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr,
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
    row_max = tl.full([], float("-inf"), tl.float32)
    row_sum = tl.full([], 0.0, tl.float32)
    # whole tiles load unmasked (16-byte vector loads); the ragged tail, if any, masked
    full_end = start + (end - start) // BLOCK * BLOCK
    for tile in range(start, full_end, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs).to(tl.float32)
        row_max, row_sum, top, top_min = _reduce_tile(x, offs, end, row_max, row_sum, top, top_min)
    if full_end < end:
        offs = full_end + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        row_max, row_sum, top, top_min = _reduce_tile(x, offs, end, row_max, row_sum, top, top_min)
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
    chunk = triton.cdiv(tiles, max(1, min(splits, tiles, _MAX_SPLITS))) * block
    splits = triton.cdiv(vocab, chunk)
    splits_pow2 = 16 if splits <= 16 else _MAX_SPLITS
    part_max = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_key = torch.empty((rows, splits, k), dtype=torch.int64, device=logits.device)
    _partials_kernel[(rows, splits)](
        logits, logits.stride(0), vocab, chunk, part_max, part_sum, part_key,
        K=k, K_POW2=triton.next_power_of_2(k), BLOCK=block, num_warps=num_warps or default_warps,
    )
    _combine_kernel[(rows,)](
        part_max, part_sum, part_key, prob, index, splits,
        K=k, SPLITS_POW2=splits_pow2, KEYS_POW2=triton.next_power_of_2(splits_pow2 * k),
        LOG=log, num_warps=4,
    )
