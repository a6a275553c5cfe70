"""A tiny draft for the runtime tests: a seed forward and a Python loop of recurrent steps.

Each forward writes its state into a KV cache with `index_copy_` (so the draft mutates an input in
place, like a real draft's cache) and attends over the cache; tokens are picked with softmax+topk.
Sizes are tiny so that a compile takes seconds on a 2-core CPU.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, BATCH, MAX_LEN = 32, 16, 2, 8


class TinyDraftModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.fuse = nn.Linear(2 * HIDDEN, HIDDEN)  # token embedding + carried hidden state
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, position: torch.Tensor):
        x = self.fuse(torch.cat([self.embed(tokens), hidden], dim=-1))  # [B, H]
        kv_cache.index_copy_(1, position, x.unsqueeze(1))  # write this step's state at `position`
        scores = (self.query(x).unsqueeze(1) * kv_cache).sum(-1)  # [B, MAX_LEN]
        attention = torch.softmax(scores, dim=-1)  # a softmax with no topk after it: not rewritten
        hidden = x + (attention.unsqueeze(-1) * kv_cache).sum(1)
        return self.lm_head(hidden), hidden


def draft(model: TinyDraftModel, tokens, hidden, kv_cache, position, steps: int = 3):
    """Seed forward (fed by the target's last token and hidden state), then `steps` recurrent steps."""
    logits, hidden = model(tokens, hidden, kv_cache, position)
    probs, token = torch.softmax(logits, dim=-1).topk(1, dim=-1)
    all_tokens, all_probs = [token], [probs]
    for step in range(steps):
        logits, hidden = model(token.squeeze(-1), hidden, kv_cache, position + 1 + step)
        probs, token = torch.softmax(logits, dim=-1).topk(1, dim=-1)
        all_tokens.append(token)
        all_probs.append(probs)
    return torch.cat(all_tokens, dim=-1), torch.cat(all_probs, dim=-1)


def make_inputs(device: str = "cpu", seed: int = 0):
    """(model, tokens, hidden, kv_cache, position) for one draft call, deterministic."""
    torch.manual_seed(seed)
    model = TinyDraftModel().to(device)
    tokens = torch.randint(0, VOCAB, (BATCH,), device=device)
    hidden = torch.randn(BATCH, HIDDEN, device=device)
    kv_cache = torch.zeros(BATCH, MAX_LEN, HIDDEN, device=device)
    position = torch.tensor([2], device=device)
    return model, tokens, hidden, kv_cache, position
