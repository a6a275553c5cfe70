"""Medusa heads, modeled on FasterDecoding/Medusa `medusa/model/medusa_model.py` (`ResBlock`,
`MedusaModel.__init__`'s `medusa_head`, `MedusaModel.forward`).

The patterns kept from there:
  * a head is `nn.Sequential(*([ResBlock(hidden)] * num_layers), nn.Linear(hidden, vocab, bias=False))`:
    note the list repetition, which puts the SAME ResBlock module in the Sequential `num_layers` times;
  * `ResBlock.forward` is `x + SiLU(linear(x))`;
  * every head reads the same last hidden state (a `.clone()` of the base model's output) and the
    heads' logits are stacked on a new leading dim (`torch.stack(medusa_logits, dim=0)`).
Medusa picks candidates with topk per head; here each head's candidates come from softmax -> topk,
the form whose rewrite draftfuse promises (and one softmax over the stacked logits, the other form).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, HEADS, LAYERS, BATCH = 128, 32, 4, 2, 2


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.medusa_head = nn.ModuleList(
            [nn.Sequential(*([ResBlock(HIDDEN)] * LAYERS), nn.Linear(HIDDEN, VOCAB, bias=False)) for _ in range(HEADS)]
        )
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        hidden_states = last_hidden.clone()
        return torch.stack([head(hidden_states) for head in self.medusa_head], dim=0)  # [heads, B, V]


def propose_per_head(heads: MedusaHeads, last_hidden, k: int = 4):
    """softmax -> topk on each head's logits; candidates [heads, B, k] and their probabilities."""
    hidden_states = last_hidden.clone()
    values, indices = [], []
    for head in heads.medusa_head:
        probs = torch.softmax(head(hidden_states), dim=-1)
        top = torch.topk(probs, k, dim=-1)
        values.append(top.values)
        indices.append(top.indices)
    return torch.stack(values, dim=0), torch.stack(indices, dim=0)


def propose_stacked(heads: MedusaHeads, last_hidden, k: int = 4):
    """One softmax over the stacked logits [heads, B, V], then topk."""
    probs = heads(last_hidden).softmax(dim=-1)
    return probs.topk(k, dim=-1)


def make_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed + 1)
    return MedusaHeads(seed=seed).eval(), torch.randn(BATCH, HIDDEN, generator=generator)
