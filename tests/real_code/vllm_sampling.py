"""vLLM's draft sampling, modeled on vllm-project/vllm:
  * `vllm/v1/sample/ops/topk_topp_sampler.py`, `random_sample`: the exponential ("Gumbel-max") trick
    `q = torch.empty_like(probs); q.exponential_(); probs.div_(q).argmax(dim=-1)`, IN PLACE on probs;
  * `vllm/v1/spec_decode/eagle.py`, `compute_probs_and_sample_next_token`: per-request temperature
    as a tensor (`torch.where(is_greedy, 1.0, temperature)`, `logits.div_(temperature.view(-1, 1))`),
    `logits.softmax(dim=-1, dtype=torch.float32)`, the out-of-place `probs.div(q).argmax(dim=-1)` and
    a greedy `probs.argmax(dim=-1)` merged with `torch.where(is_greedy, ...)`;
  * `vllm/v1/sample/sampler.py` / `ops/bad_words.py` and the logits processors: tokens banned by
    writing into the scores (`x[:, ids] = ...`, `masked_fill_`), a multiplicative weight (`mul_`);
  * `vllm/v1/sample/ops/topk_topp_sampler.py`, `apply_top_k_top_p` (as HF's TopPLogitsWarper): a
    top-p mask from the ascending sort of the logits, written into the sorted copy and scattered back.

The random draw is passed in (`q`, drawn once with a seeded generator) so that eager and compiled runs
can be compared exactly; vLLM draws it inside the step with `exponential_()`.
"""

from __future__ import annotations

import torch

BATCH, VOCAB = 4, 64


def make_inputs(seed: int = 0):
    """logits [B, V], a per-request temperature tensor (one greedy request, marked -1) and q ~ Exp(1)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, VOCAB, generator=generator) * 3
    temperature = torch.tensor([0.7, -1.0, 1.3, 0.5])
    q = torch.empty(BATCH, VOCAB).exponential_(generator=generator)
    return logits, temperature, q


def temperature_sample(logits, temperature, q):
    """compute_probs_and_sample_next_token, on a copy of the logits (see the note below)."""
    is_greedy = temperature == -1
    temperature = torch.where(is_greedy, 1.0, temperature)
    # vLLM divides its logits in place. Done to an *input* tensor, `x.div_(t); softmax(x)` crashes
    # torch 2.13's Inductor CPU codegen (KeyError in loop fusion; plain torch.compile too), so the
    # division goes into a copy here, as it does in vLLM when `.to(torch.float32)` upcasts bf16 logits.
    scaled = logits.clone()
    scaled.div_(temperature.view(-1, 1))
    probs = scaled.softmax(dim=-1, dtype=torch.float32)
    next_token_ids = probs.div(q).argmax(dim=-1).view(-1)
    greedy_token_ids = probs.argmax(dim=-1)
    return torch.where(is_greedy, greedy_token_ids, next_token_ids), probs


def temperature_in_place_topk(logits_bf16, temperature, k: int = 4):
    """The sampler's in-place division as vLLM writes it for bf16 logits: an upcast copy (`.to(float32)`,
    a cast the rewrite could otherwise look through) divided in place, then softmax -> topk."""
    logits = logits_bf16.to(torch.float32)
    logits.div_(temperature.unsqueeze(dim=1))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    return probs.topk(k, dim=-1)


def temperature_topk(logits, temperature, k: int = 4):
    """Per-request temperature as an out-of-place tensor division, then softmax -> topk."""
    temperature = torch.where(temperature == -1, 1.0, temperature)
    probs = torch.softmax(logits / temperature.unsqueeze(-1), dim=-1)
    return probs.topk(k, dim=-1)


def gumbel_inplace_chained(logits, q):
    """random_sample's own spelling: the in-place division and the argmax in one expression."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    return probs.div_(q).argmax(dim=-1).view(-1)


def gumbel_inplace(logits, q):
    """The same, with the in-place division as its own statement (how most samplers spell it)."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    probs.div_(q)
    return probs.argmax(dim=-1)


def ban_setitem(logits, banned):
    """Banned token ids zeroed in the probabilities by index assignment, then topk."""
    probs = torch.softmax(logits, dim=-1)
    probs[:, banned] = 0
    return probs.topk(2, dim=-1)


def ban_masked_fill(logits, mask):
    probs = torch.softmax(logits, dim=-1)
    probs.masked_fill_(mask, 0)
    return probs.topk(1, dim=-1)


def reweight_mul(logits, weight):
    probs = torch.softmax(logits, dim=-1)
    probs.mul_(weight)
    return probs.max(dim=-1)


def ban_in_a_clone(logits, banned):
    """A write into a clone of the probabilities: the selection still reads the untouched softmax."""
    probs = torch.softmax(logits, dim=-1)
    filtered = probs.clone()
    filtered[:, banned] = 0
    values, tokens = probs.topk(2, dim=-1)
    return values, tokens, filtered.sum(dim=-1)


def sample_with_generators(probs, generators: dict):
    """random_sample with seeded requests: one torch.Generator per request row, drawn row by row."""
    q = torch.empty_like(probs)
    q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)  # <- per-request generator
    return probs.div_(q).argmax(dim=-1).view(-1)


def top_p_then_topk(logits, top_p, k: int = 2):
    """Keep the smallest set of tokens whose probability reaches top_p (per request), then softmax -> topk.
    The sort reads the logits argument and writes nothing (draft_loop must not take it for a written input)."""
    ascending, order = logits.sort(dim=-1, descending=False)
    below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p.unsqueeze(dim=1)
    below[:, -1] = False  # the most likely token always stays
    ascending.masked_fill_(below, -float("inf"))
    kept = ascending.scatter(dim=-1, index=order, src=ascending)
    return torch.softmax(kept, dim=-1).topk(k, dim=-1)
