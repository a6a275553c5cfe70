"""Selection ops for draft loops: the top-k tokens of logits with their softmax probabilities, without
materialising the softmax or sorting the vocabulary.

  torch.ops.draftfuse.argmax_prob(logits, log=False) -> (index, prob)
      index: torch.argmax(logits, -1); prob: the softmax max-probability 1 / sum(exp(x - max))
      (log=True: the log-probability -log(sum(exp(x - max)))), float32.
  torch.ops.draftfuse.topk_prob(logits, k, log=False) -> (prob, index)
      the k largest logits of the last dim in descending order, ties to the lower index (a stable
      descending sort, NaN first as torch sorts it), with prob = exp(v - max) / sum(exp(x - max))
      (log=True: v - max - log(sum)), float32, shape (..., k).

Both reduce over the last dim and compute probabilities in float32 from the logits (the caller
casts). A row whose max is NaN or +-inf gets NaN probabilities, as softmax in float32 does; its index
is torch's (the first NaN, else the first +inf; 0 for a row of -inf). k must be in 1..vocab
(ValueError otherwise, where torch.topk raises a RuntimeError). On CUDA with Triton
installed, fp32/fp16/bf16 logits and k <= 16 run Triton kernels that read the logits once
(draftfuse/kernels/_triton_selection.py); everything else runs the torch reference below. The ops
are torch.library custom ops with fake implementations, so Dynamo, Inductor and CUDA graphs treat
them as ordinary ops; the CUDA path makes no host sync and allocates by shape only.
"""

import functools

import torch

_MAX_KERNEL_K = 16
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _triton_selection():
    """The Triton kernels' module, or None where Triton can't be imported."""
    try:
        from draftfuse.kernels import _triton_selection
    except ImportError:
        return None
    return _triton_selection


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


def _check_k(logits: torch.Tensor, k: int) -> None:
    if logits.dim() == 0 or not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"topk_prob: k={k} out of range for logits of shape {tuple(logits.shape)}")


def _row_max_and_sum(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    row_max = x.amax(-1, keepdim=True)
    return row_max, torch.exp(x - row_max).sum(-1, keepdim=True)


def argmax_prob_reference(logits: torch.Tensor, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of argmax_prob in torch (its CPU implementation and the kernels' test oracle)."""
    _, row_sum = _row_max_and_sum(logits)
    row_sum = row_sum.squeeze(-1)
    return torch.argmax(logits, dim=-1), (-torch.log(row_sum) if log else 1 / row_sum)


def topk_prob_reference(logits: torch.Tensor, k: int, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of topk_prob in torch. A stable sort, because torch.topk orders equal values
    arbitrarily (on CPU too) and the kernels promise the lower index first."""
    _check_k(logits, k)
    values, index = torch.sort(logits, dim=-1, descending=True, stable=True)
    values, index = values[..., :k].float(), index[..., :k].contiguous()
    row_max, row_sum = _row_max_and_sum(logits)
    prob = values - row_max - torch.log(row_sum) if log else torch.exp(values - row_max) / row_sum
    return prob, index


def _use_kernels(logits: torch.Tensor, k: int) -> bool:
    if logits.dim() == 0 or logits.shape[-1] < k:
        return False  # the reference raises torch's error
    return selection_kernels_available(logits.device, logits.dtype, k, logits.stride(-1) == 1)


def _run_kernels(logits: torch.Tensor, k: int, log: bool, prob: torch.Tensor, index: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # a copy only when the leading dims don't flatten to one stride
    _triton_selection().launch_selection(rows, k, log, prob, index)


@torch.library.custom_op("draftfuse::argmax_prob", mutates_args=())
def argmax_prob(logits: torch.Tensor, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, prob): see the module docstring."""
    return argmax_prob_reference(logits, log)


@argmax_prob.register_kernel("cuda")
def _argmax_prob_cuda(logits: torch.Tensor, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_kernels(logits, 1):
        return argmax_prob_reference(logits, log)
    index = logits.new_empty(logits.shape[:-1], dtype=torch.int64)
    prob = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    _run_kernels(logits, 1, log, prob, index)
    return index, prob


@argmax_prob.register_fake
def _argmax_prob_fake(logits: torch.Tensor, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    shape = logits.shape[:-1]
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("draftfuse::topk_prob", mutates_args=())
def topk_prob(logits: torch.Tensor, k: int, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(prob, index): see the module docstring."""
    return topk_prob_reference(logits, k, log)


@topk_prob.register_kernel("cuda")
def _topk_prob_cuda(logits: torch.Tensor, k: int, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_kernels(logits, k):
        return topk_prob_reference(logits, k, log)
    shape = (*logits.shape[:-1], k)
    prob = logits.new_empty(shape, dtype=torch.float32)
    index = logits.new_empty(shape, dtype=torch.int64)
    _run_kernels(logits, k, log, prob, index)
    return prob, index


@topk_prob.register_fake
def _topk_prob_fake(logits: torch.Tensor, k: int, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)
