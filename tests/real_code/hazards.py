"""Capture hazards taken from the public code the other modules model.

  * `RMSNorm` with a Python float attribute, as huggingface/transformers `LlamaRMSNorm`
    (`self.variance_epsilon = eps`, `hidden_states * torch.rsqrt(variance + self.variance_epsilon)`)
    and EAGLE's copy of it in `cnets.py`: under `dynamic=True` Dynamo may turn the float into a
    symbolic value, which is not a read of a device tensor.
  * A server's batch sizes: sglang's and vLLM's CUDA-graph runners capture one graph per batch size
    in a list (`cuda_graph_bs`, `cudagraph_capture_sizes`, a dozen or more entries); a draft called
    with each of them compiles once per size.
  * A token fed back as a slice of the token buffer: HF's generation loop and EAGLE's topK_genrate
    feed `input_ids[:, -1:]`-style views; a view has the shape of the contiguous token but other
    strides, which Dynamo guards on (a recompile the user needs explained).
  * A worker method compiled under another name: servers keep the eager method and a compiled
    alias side by side (sglang's EAGLEWorker calls `self.draft_forward` eagerly or through its
    CUDA-graph runner), e.g. `Worker.fast = draftfuse.draft_loop(Worker.step)`.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN, VOCAB = 16, 32


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps  # a Python float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)  # the float eps
        return self.weight * hidden_states.to(input_dtype)


class NormedHead(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.norm = LlamaStyleRMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))


def normed_greedy(head: NormedHead, hidden):
    """One greedy pick through the RMSNorm: the selection a draft head makes every step."""
    probs, token = torch.softmax(head.lm_head(head.norm(hidden)), dim=-1).topk(1, dim=-1)
    return token, probs


def batch_step(head: nn.Linear, hidden):
    """A draft step whose batch dimension follows the server's current batch size."""
    return torch.softmax(head(hidden), dim=-1).topk(2, dim=-1)


def token_step(embedding: nn.Embedding, lm_head: nn.Linear, token):
    """One greedy step fed by the previous token [B, 1]; returns the next token [B, 1, 1]."""
    probs, token = torch.softmax(lm_head(embedding(token)), dim=-1).topk(1, dim=-1)
    return token, probs


class Worker:
    """A draft worker with an eager method; a compiled alias is attached to the class by the test."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))

    def step(self, hidden):
        probs, token = torch.softmax(self.lm_head(hidden), dim=-1).topk(1, dim=-1)
        return token, probs
