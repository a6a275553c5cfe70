"""EAGLE tree drafting, modeled on SafeAILab/EAGLE `eagle/model/cnets.py`, `Model.topK_genrate`.

The patterns kept from there:
  * the head is an `nn.Module` holding `self.logsoftmax = nn.LogSoftmax(dim=-1)` and applies it to
    `lm_head(norm(hidden))` *in the model dtype* (no upcast: bf16 log-probabilities in a bf16 model);
  * each level takes `torch.topk(log_probs, top_k, dim=-1)`, adds the parent's cumulative score
    (`cu_scores = topk_p + scores[:, None]`), keeps the best `top_k` of the `top_k * top_k` candidates
    with a second topk over `cu_scores.view(-1)`, and records a parents list whose offsets follow
    EAGLE's `1 + top_k**2 * max(0, i - 1) + (top_k if i > 0 else 0)` numbering;
  * the hidden states of the chosen parents are gathered with `out_hidden[:, parent_ids]`;
  * after the levels, the best `total_tokens` scores are sorted and the tree mask's parent indices
    come from `torch.searchsorted`; EAGLE then reads them on the host: `mask_index.tolist()`,
    `torch.unique(mask_index).tolist()`, `max_depth.item()` to build retrieve indices in Python.

The head itself is a small stand-in for EAGLE's (token embedding ⊕ carried hidden state -> fc -> one
residual block -> RMSNorm -> lm_head); its numerics are irrelevant, its spelling is what matters.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN = 128, 32


class RMSNorm(nn.Module):
    """Llama-style RMSNorm (float32 inside), as EAGLE's head uses before its lm_head."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class EagleHead(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.logsoftmax = nn.LogSoftmax(dim=-1)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat((self.embed_tokens(input_ids).to(hidden.dtype), hidden), dim=-1))
        return x + self.down(torch.nn.functional.silu(self.up(x)))

    def log_probs(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return self.logsoftmax(self.lm_head(self.norm(out_hidden)))  # model dtype, as EAGLE does


def make_inputs(dtype: torch.dtype = torch.float32, seed: int = 0):
    """(head, hidden [1, H], token [1]) in `dtype`: the target's last hidden state and sampled token."""
    generator = torch.Generator().manual_seed(seed + 1)
    head = EagleHead(seed=seed).to(dtype).eval()
    hidden = torch.randn(1, HIDDEN, generator=generator).to(dtype)
    token = torch.randint(0, VOCAB, (1,), generator=generator)
    return head, hidden, token


def tree_level(head: EagleHead, input_hidden, input_ids, scores, top_k: int):
    """One EAGLE level: log_softmax in the model dtype, topk, cumulative scores, the next parents.

    input_hidden [1, top_k, H], input_ids [1, top_k], scores [top_k] (the parents' cumulative scores).
    Returns (topk_index, topk_p, cu_scores, best scores, best flat indices, next ids, next hidden).
    """
    out_hidden = head(input_hidden, input_ids)
    last_p = head.log_probs(out_hidden[0])  # [top_k, V]
    top = torch.topk(last_p, top_k, dim=-1)
    topk_index, topk_p = top.indices, top.values
    cu_scores = topk_p + scores[:, None]
    best = torch.topk(cu_scores.view(-1), top_k, dim=-1)
    parent_rows = best.indices // top_k  # which of this level's inputs each survivor grew from
    next_ids = topk_index.view(-1)[best.indices][None]
    next_hidden = out_hidden[:, parent_rows]
    return topk_index, topk_p, cu_scores, best.values, best.indices, next_ids, next_hidden


def tree_draft(head: EagleHead, hidden, token, top_k: int = 4, depth: int = 2, total_tokens: int = 8):
    """The device part of topK_genrate: seed level, `depth` levels, then the tree's parent indices."""
    scores_list, parents_list, ss_token = [], [], []
    out_hidden = head(hidden, token)  # [1, H]: the seed, fed by the target's token and hidden state
    top = torch.topk(head.log_probs(out_hidden), top_k, dim=-1)
    topk_index, topk_p = top.indices, top.values
    scores = topk_p[0]
    scores_list.append(scores[None])
    parents_list.append(torch.zeros(1, dtype=torch.long, device=hidden.device))
    ss_token.append(topk_index)
    input_ids = topk_index
    input_hidden = out_hidden[None].repeat(1, top_k, 1)
    chosen = torch.arange(top_k, device=hidden.device)
    for i in range(depth):
        offset = 1 + top_k**2 * max(0, i - 1) + (top_k if i > 0 else 0)
        parents_list.append(chosen + offset)
        topk_index, _, cu_scores, scores, chosen, input_ids, input_hidden = tree_level(
            head, input_hidden, input_ids, scores, top_k
        )
        ss_token.append(topk_index)
        scores_list.append(cu_scores)
    all_scores = torch.cat(scores_list, dim=0).view(-1)
    all_tokens = torch.cat(ss_token, dim=0).view(-1)
    picked = torch.sort(torch.topk(all_scores, total_tokens, dim=-1).indices).values
    draft_tokens = torch.cat((token, all_tokens[picked]), dim=0)
    draft_parents = torch.cat(parents_list, dim=0)[picked // top_k].long()
    mask_index = torch.searchsorted(picked, draft_parents - 1, right=False)
    mask_index[draft_parents == 0] = -1  # a boolean-mask write, as EAGLE spells it
    mask_index = mask_index + 1
    return draft_tokens, all_scores, mask_index


def tree_draft_with_host_reads(head: EagleHead, hidden, token, top_k: int = 4, depth: int = 2, total_tokens: int = 8):
    """tree_draft followed by EAGLE's host-side tree bookkeeping (what a capture must reject)."""
    draft_tokens, all_scores, mask_index = tree_draft(head, hidden, token, top_k, depth, total_tokens)
    noleaf_index = torch.unique(mask_index).tolist()  # <- first host read
    position_ids = torch.zeros(total_tokens + 1, dtype=torch.long)
    max_depth = int(mask_index.max().item()) + 1  # <- second host read
    leaf_num = total_tokens - (len(noleaf_index) - 1)
    return draft_tokens, position_ids[:max_depth], leaf_num
