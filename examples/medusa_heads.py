"""Medusa-style heads: several residual heads over the target's last hidden state, head i proposing the
top k candidates for the token i + 2 positions ahead. There is no loop and no KV cache: all heads read
the same hidden state, so the draft is one forward. The selection rewrite still applies to every head.

    python examples/medusa_heads.py                                   # tiny, fp32, CPU
    python examples/medusa_heads.py --device cuda --size reference    # hidden 4096, vocab 128256, bf16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import build, compare, parse_args
from _layers import Config
from torch import nn


class MedusaHead(nn.Module):
    """A residual block (x + silu(W x + b)) and its own LM head."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.block = nn.Linear(cfg.dim, cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden + F.silu(self.block(hidden)))


def propose(heads: nn.ModuleList, hidden: torch.Tensor, k: int = 4):
    """hidden [B, dim], the target's last hidden state -> candidate tokens [B, heads, k] and their probabilities."""
    tokens, probs = [], []
    for head in heads:
        head_probs, head_tokens = torch.softmax(head(hidden).float(), dim=-1).topk(k, dim=-1)
        tokens.append(head_tokens)
        probs.append(head_probs)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, default=4, help="number of Medusa heads (default 4)")
    parser.add_argument("--topk", type=int, default=4, help="candidates per head (default 4)")


def _inputs(args: argparse.Namespace) -> tuple[nn.ModuleList, torch.Tensor]:
    heads = build(lambda cfg: nn.ModuleList(MedusaHead(cfg) for _ in range(args.heads)), args)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    hidden = torch.randn(args.batch, args.config.dim, device=args.device, generator=generator).to(args.dtype)
    return heads, hidden


def run(argv: list[str] | None = None) -> dict:
    """Check and time the draft as the command line `argv` asks (None: sys.argv); the results as a dict."""
    args = parse_args(__doc__, argv, _add_arguments)
    label = f"medusa heads: {args.heads} heads, topk {args.topk}"
    return compare(label, propose, _inputs(args), {"k": args.topk}, args)


def explain_target(argv: list[str] = ()):
    """What `python -m draftfuse explain examples/medusa_heads.py` looks at: the heads at tiny size."""
    args = parse_args(__doc__, list(argv), _add_arguments)
    return propose, _inputs(args), {"k": args.topk}


if __name__ == "__main__":
    run()
