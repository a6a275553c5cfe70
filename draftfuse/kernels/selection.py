"""Selection ops for draft loops: the top-k tokens of logits with their softmax probabilities, without
materialising the softmax or sorting the vocabulary.

  torch.ops.draftfuse.argmax_prob(logits, log=False, scale=None) -> (index, prob)
      index: torch.argmax(logits, -1); prob: the softmax max-probability 1 / sum(exp(x - max))
      (log=True: the log-probability -log(sum(exp(x - max)))), float32.
  torch.ops.draftfuse.topk_prob(logits, k, log=False, scale=None) -> (prob, index)
      the k largest logits of the last dim in descending order, ties to the lower index (a stable
      descending sort, NaN first as torch sorts it), with prob = exp(v - max) / sum(exp(x - max))
      (log=True: v - max - log(sum)), float32, shape (..., k).

scale: None, or a tensor holding s = 1 / temperature for each row, of shape logits.shape[:-1], or a
0-d tensor for every row; floating point, used in float32, on the logits' device; any sign, also 0.
With it both ops select and weigh y = x * s: the order is the exact order of the real products x * s
(that of x for s > 0, of -x for s < 0; for s = 0 every element ties, so the lowest indices win),
which float32 rounding of the products could tie for float32 logits; the probabilities are the
float32 softmax of y = fl32(x * s): exp(y_v - max y) / sum(exp(y - max y)). NaN rules stay those of x
(a NaN element is above every other); an element whose product alone is NaN (x = 0 with s = +-inf) is
ordered as x * sign(s), 0, while the row's probabilities are NaN; a NaN scale makes every element NaN
(indices 0..k-1, NaN probabilities). Without it (None) both ops
are exactly the unscaled ones.

Both reduce over the last dim and compute probabilities in float32 from the logits (the caller
casts). A row whose max (of y) is NaN or +-inf gets NaN probabilities, as softmax in float32 does;
its index is torch's (the first NaN, else the first +inf; 0 for a row of -inf). k must be in
1..vocab (ValueError otherwise, where torch.topk raises a RuntimeError). Logits: dense, of a
floating-point, bool, uint8 or int8..int64 dtype, as torch.topk takes (ValueError for others: uint16-64,
complex, float8, sparse); integer logits are ordered exactly, scaled or not. On CUDA with Triton
installed, fp32/fp16/bf16 logits and k <= 16 run one Triton kernel launch that reads the logits once
(_triton_argmax.py for k = 1, _triton_selection.py for k > 1, launched by _triton_launch.py); everything
else runs the torch reference below. The ops
are torch.library custom ops with fake implementations, so Dynamo, Inductor and CUDA graphs treat
them as ordinary ops; the CUDA path makes no host sync and allocates by shape only, besides a
per-stream workspace of counters that each launch leaves as it found it (created on the first call,
outside CUDA-graph capture; see _triton_launch.py): calls on different streams use different
workspaces, and two CUDA graphs captured on one stream must not be replayed at the same time. A
capture inside `capturing_with(graph_workspace(device))` uses that workspace instead (draftfuse's
recorder gives each draft's graphs one, made before their capture): no fill kernel in the graph.
"""

import contextlib
import functools
from typing import Any

import torch

_MAX_KERNEL_K = 16
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _triton_selection():
    """The Triton kernels' module, or None where Triton can't be imported."""
    try:
        from draftfuse.kernels import _triton_launch
    except ImportError:
        return None
    return _triton_launch


def selection_kernels_available(
    device: torch.device | str, dtype: torch.dtype, k: int = 1, last_dim_contiguous: bool = True
) -> bool:
    """Whether argmax_prob / topk_prob run as Triton kernels for logits of this device and dtype, with
    this k (1 for argmax_prob). Outside this, the ops still work, through the torch reference."""
    return (
        torch.device(device).type == "cuda"
        and dtype in _KERNEL_DTYPES
        and 1 <= k <= _MAX_KERNEL_K
        and last_dim_contiguous
        and _triton_selection() is not None
    )


def graph_workspace(device: torch.device | str, rows: int | None = None) -> Any:
    """A workspace for the selection kernels of CUDA graphs to be captured on `device` (made now, outside
    any capture), with room for launches of up to `rows` rows (default 4096), or None where the kernels
    don't run there. Capture inside `capturing_with(it)`: each selection call in the graph then runs one
    kernel, where a bare torch.cuda.graph capture adds a fill kernel per call (and warns once). Every
    launch leaves it as found, so graphs may share it, but two graphs holding one must not be replayed at
    the same time."""
    launch, device = _triton_selection(), torch.device(device)
    return launch.graph_workspace(device, rows) if launch is not None and device.type == "cuda" else None


def capturing_with(workspace: Any) -> contextlib.AbstractContextManager:
    """Selection launches captured in this block use `workspace` (graph_workspace's; None: as without)."""
    launch = _triton_selection()
    return launch.capturing_with(workspace) if launch is not None and workspace is not None else contextlib.nullcontext()


# what torch.topk selects on (its CPU and CUDA kernels), bool besides: not uint16/32/64, complex or float8
_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.uint8, torch.int8,
                 torch.int16, torch.int32, torch.int64)


def _check_logits(logits: torch.Tensor, k: int, op: str = "topk_prob") -> None:
    """ValueError for logits the ops do not take (their dtype, a sparse layout, 0-d) or a k out of range."""
    if logits.dtype not in _LOGIT_DTYPES or logits.layout != torch.strided:
        raise ValueError(f"{op}: logits of dtype {logits.dtype} and layout {logits.layout}: pass a dense tensor of "
                         "a floating-point, bool or int8-int64 dtype (uint8 too), as torch.topk takes")
    if logits.dim() == 0 or not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"{op}: k={k} out of range for logits of shape {tuple(logits.shape)}")


def check_scale(logits: torch.Tensor, scale: torch.Tensor | None) -> None:
    """ValueError unless scale is None, or 0-d or of shape logits.shape[:-1], floating point, on the
    logits' device."""
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise ValueError(f"scale must be a floating-point tensor, got {scale!r:.80}")
    if scale.dim() != 0 and tuple(scale.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"scale must be 0-d or of shape {tuple(logits.shape[:-1])} (one per row), got {tuple(scale.shape)}"
        )
    if scale.device != logits.device:
        raise ValueError(f"scale is on {scale.device}, logits on {logits.device}")


def _scaled(logits: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, order): y = fl32(x * s), the values whose softmax is taken, and a tensor whose order is
    the exact order of x * s: x * sign(s) (sign(0) = 0: all tie; NaN where x is, and everywhere for a
    NaN scale)."""
    x = logits.float()  # the order of 16- and 32-bit floats, exactly (torch's CUDA sort misplaces NaN in bfloat16)
    if not logits.dtype.is_floating_point:
        exact = logits.long()  # integers as they are (float64 would round int64 above 2**53)
    else:
        exact = x if logits.dtype in (torch.float16, torch.bfloat16, torch.float32) else logits.double()
    if scale is None:
        return x, exact
    check_scale(logits, scale)
    s = scale.float().unsqueeze(-1) if scale.dim() else scale.float()  # broadcasts against the logits
    sign = torch.where(s.isnan(), s, torch.sign(s))  # torch.sign(nan) is 0; here a NaN scale makes all NaN
    if logits.dtype.is_floating_point:
        return x * s, exact * sign
    # integers: ~x = -x - 1 reverses the order and never wraps; a NaN scale ties all (indices 0..k-1, as
    # all-NaN rows order), and y is NaN, as are the probabilities
    return x * s, torch.where(sign > 0, exact, torch.where(sign < 0, ~exact, torch.zeros_like(exact)))


def _descending_order(order: torch.Tensor) -> torch.Tensor:
    """Indices of `order` (float32, float64 or int64) from the largest, NaN above everything (the first NaN first), ties
    (-0.0 with +0.0 too) to the lower index. Two stable sorts, since neither torch.sort nor torch.argmax
    places NaN reliably on CUDA: by value with NaN set aside, then NaN first."""
    nan = order.isnan()
    by_value = torch.sort(order.masked_fill(nan, 0), dim=-1, descending=True, stable=True).indices
    nan_first = torch.sort(nan.gather(-1, by_value).to(torch.int8), dim=-1, descending=True, stable=True).indices
    return by_value.gather(-1, nan_first)


def _row_max_and_sum(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    row_max = y.amax(-1, keepdim=True)
    return row_max, torch.exp(y - row_max).sum(-1, keepdim=True)


def argmax_prob_reference(
    logits: torch.Tensor, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of argmax_prob in torch (its CPU implementation and the kernels' test oracle).
    The selected element has the row's largest y, so its probability is 1 / sum(exp(y - max))."""
    _check_logits(logits, 1, "argmax_prob")  # 0-d logits: no vocab to select from
    y, order = _scaled(logits, scale)
    _, row_sum = _row_max_and_sum(y)
    row_sum = row_sum.squeeze(-1)
    return _descending_order(order)[..., 0].contiguous(), (-torch.log(row_sum) if log else 1 / row_sum)


def topk_prob_reference(
    logits: torch.Tensor, k: int, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of topk_prob in torch. A stable sort, because torch.topk orders equal values
    arbitrarily (on CPU too) and the kernels promise the lower index first."""
    _check_logits(logits, k)
    y, order = _scaled(logits, scale)
    index = _descending_order(order)[..., :k].contiguous()
    values = y.gather(-1, index)
    row_max, row_sum = _row_max_and_sum(y)
    prob = values - row_max - torch.log(row_sum) if log else torch.exp(values - row_max) / row_sum
    return prob, index


def _use_kernels(logits: torch.Tensor, k: int) -> bool:
    if logits.dim() == 0 or logits.shape[-1] < k:
        return False  # the reference raises torch's error
    return (
        selection_kernels_available(logits.device, logits.dtype, k, logits.stride(-1) == 1)
        and logits.shape[-1] <= _triton_selection().max_vocab(k)
    )


def _run_kernels(
    logits: torch.Tensor, k: int, log: bool, prob: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None = None
) -> None:
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # a copy only when the leading dims don't flatten to one stride
    scale = None if scale is None else scale.float()  # checked by the caller: 0-d or one per row
    launch = _triton_selection().launch_selection
    if logits.device.type != "cuda" or logits.device.index == torch.cuda.current_device():  # (CPU: Triton's interpreter)
        launch(rows, k, log, prob, index, scale)
    else:  # Triton launches on the current device
        with torch.cuda.device(logits.device):
            launch(rows, k, log, prob, index, scale)


@torch.library.custom_op("draftfuse::argmax_prob", mutates_args=())
def argmax_prob(
    logits: torch.Tensor, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, prob): see the module docstring."""
    return argmax_prob_reference(logits, log, scale)


@argmax_prob.register_kernel("cuda")
def _argmax_prob_cuda(
    logits: torch.Tensor, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_scale(logits, scale)
    if not _use_kernels(logits, 1):
        return argmax_prob_reference(logits, log, scale)
    index = logits.new_empty(logits.shape[:-1], dtype=torch.int64)
    prob = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    _run_kernels(logits, 1, log, prob, index, scale)
    return index, prob


@argmax_prob.register_fake
def _argmax_prob_fake(
    logits: torch.Tensor, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_logits(logits, 1, "argmax_prob")  # as the real op: errors at trace time, not at run time
    check_scale(logits, scale)
    shape = logits.shape[:-1]
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("draftfuse::topk_prob", mutates_args=())
def topk_prob(
    logits: torch.Tensor, k: int, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prob, index): see the module docstring."""
    return topk_prob_reference(logits, k, log, scale)


@topk_prob.register_kernel("cuda")
def _topk_prob_cuda(
    logits: torch.Tensor, k: int, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_scale(logits, scale)
    if not _use_kernels(logits, k):
        return topk_prob_reference(logits, k, log, scale)
    shape = (*logits.shape[:-1], k)
    prob = logits.new_empty(shape, dtype=torch.float32)
    index = logits.new_empty(shape, dtype=torch.int64)
    _run_kernels(logits, k, log, prob, index, scale)
    return prob, index


@topk_prob.register_fake
def _topk_prob_fake(
    logits: torch.Tensor, k: int, log: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_logits(logits, k)
    check_scale(logits, scale)
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)
