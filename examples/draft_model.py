"""Classic draft-model speculation: an independent small model (two decoder layers, its own embedding,
KV cache and LM head) drafts a greedy chain, its positions advancing by one per step.

Unlike a draft head it sees only tokens, never the target's hidden states. Besides each token it returns
the probability it gave it at the sampling temperature, which the verifier's acceptance rule reads:
draftfuse computes that one value from the logits instead of the whole softmax.

    python examples/draft_model.py                                   # tiny, fp32, CPU
    python examples/draft_model.py --device cuda --size reference    # hidden 4096, vocab 128256, bf16
"""

from __future__ import annotations

import argparse

import torch
from _common import build, compare, parse_args
from _layers import Config, DecoderLayer, RMSNorm, causal_mask
from torch import nn

N_LAYERS = 2


class DraftModel(nn.Module):
    def __init__(self, cfg: Config, batch: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, batch) for _ in range(N_LAYERS))
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, 1] at position pos [1] -> logits [B, 1, vocab]; each layer caches its keys at pos."""
        x = self.embed(tokens)
        mask = causal_mask(self.layers[0].attn.k_cache.shape[2], pos)
        for layer in self.layers:
            x = layer(x, pos, pos, mask)
        return self.lm_head(self.norm(x))


def draft(model: DraftModel, token: torch.Tensor, pos: torch.Tensor, steps: int = 3, temperature: float = 0.7):
    """Seed + `steps` greedy steps from the last accepted token [B, 1] at position pos [1].
    Returns the drafted tokens [B, steps + 1] and their probabilities at `temperature` [B, steps + 1]."""
    tokens, token_probs = [], []
    for _ in range(steps + 1):
        logits = model(token, pos)
        probs = torch.softmax(logits[:, -1].float() / temperature, dim=-1)
        prob, token = probs.topk(1, dim=-1)
        tokens.append(token)
        token_probs.append(prob)
        pos = pos + 1
    return torch.cat(tokens, dim=1), torch.cat(token_probs, dim=1)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3, help="recurrent steps after the seed (default 3)")
    parser.add_argument("--prefix", type=int, help="tokens already in the cache (default: half of it)")


def _inputs(args: argparse.Namespace) -> tuple[DraftModel, torch.Tensor, torch.Tensor]:
    model = build(lambda cfg: DraftModel(cfg, args.batch), args)
    prefix = args.config.cache_len // 2 if args.prefix is None else args.prefix
    needed = prefix + args.steps + 1
    if needed > args.config.cache_len:
        raise SystemExit(f"the draft needs {needed} cache slots; the cache has {args.config.cache_len}")
    generator = torch.Generator(args.device).manual_seed(args.seed)
    token = torch.randint(args.config.vocab, (args.batch, 1), device=args.device, generator=generator)
    return model, token, torch.tensor([prefix], device=args.device)


def run(argv: list[str] | None = None) -> dict:
    """Check and time the draft as the command line `argv` asks (None: sys.argv); the results as a dict."""
    args = parse_args(__doc__, argv, _add_arguments)
    label = f"draft model ({N_LAYERS} layers): seed + {args.steps} steps, topk 1"
    return compare(label, draft, _inputs(args), {"steps": args.steps}, args)


def explain_target(argv: list[str] = ()):
    """What `python -m draftfuse explain examples/draft_model.py` looks at: the chain at tiny size."""
    args = parse_args(__doc__, list(argv), _add_arguments)
    return draft, _inputs(args), {"steps": args.steps}


if __name__ == "__main__":
    run()
