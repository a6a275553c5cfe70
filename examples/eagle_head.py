"""An EAGLE-style draft head, drafting a greedy chain (topk = 1) and a tree (topk = 4).

The head takes the token just accepted and the target model's hidden state for it, concatenates the
token's embedding with that hidden state, projects back to the model width, runs one decoder layer that
writes its own KV cache, and scores the vocabulary with the LM head (the target's, shared, in a server).
Its output hidden state is carried into the next step. The draft function holds the seed (iteration 0,
fed by the target) and the recurrent steps in one Python loop, which draftfuse captures as one region.

    python examples/eagle_head.py                                   # tiny, fp32, CPU
    python examples/eagle_head.py --device cuda --size reference    # hidden 4096, vocab 128256, bf16
"""

from __future__ import annotations

import argparse

import torch
from _common import build, compare, parse_args
from _layers import Config, DecoderLayer, RMSNorm, causal_mask
from torch import nn


class EagleHead(nn.Module):
    def __init__(self, cfg: Config, batch: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.layer = DecoderLayer(cfg, batch)
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        rope_pos: torch.Tensor,
        write_slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T], hidden [B, T, dim] -> logits [B, T, vocab] and the hidden state to carry."""
        x = self.fc(torch.cat([self.embed(tokens), hidden], dim=-1))
        hidden = self.layer(x, rope_pos, write_slots, mask)
        return self.lm_head(self.norm(hidden)), hidden


def draft_chain(head: EagleHead, token: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, steps: int = 3):
    """Seed + `steps` greedy steps. token [B, 1] and hidden [B, 1, dim] come from the target; pos [1] is the
    token's position, where the head's cache gets its next entry. Returns the drafted tokens [B, steps + 1]."""
    cache_len = head.layer.attn.k_cache.shape[2]
    tokens = []
    for _ in range(steps + 1):
        logits, hidden = head(token, hidden, pos, pos, causal_mask(cache_len, pos))
        probs = torch.softmax(logits[:, -1].float(), dim=-1)
        _, token = probs.topk(1, dim=-1)
        tokens.append(token)
        pos = pos + 1
    return torch.cat(tokens, dim=1)


def draft_tree(
    head: EagleHead, token: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, steps: int = 3, k: int = 4
):
    """Seed + `steps` tree levels of `k` nodes (EAGLE-2 style): every step expands each of the k nodes of
    the last level by its own top k and keeps the best k of those k * k by cumulative score (the log-probs
    summed along the path from the seed).

    The seed writes its cache slot at `pos`; level d's nodes write slots pos + 1 + (d - 1) * k + j, all
    at rope position pos + d, and each attends to the prefix and its own ancestors only.
    Returns tokens [B, steps + 1, k], each node's parent in the level before [B, steps, k] and the
    cumulative scores [B, steps + 1, k].
    """
    batch, cache_len = token.shape[0], head.layer.attn.k_cache.shape[2]
    slots = torch.arange(cache_len, device=pos.device)
    visible = causal_mask(cache_len, pos)
    logits, hidden = head(token, hidden, pos, pos, visible)
    scores, tokens = torch.log_softmax(logits[:, -1].float(), dim=-1).topk(k, dim=-1)
    hidden = hidden.expand(-1, k, -1)
    visible = visible.view(1, 1, cache_len).expand(batch, k, -1)  # [B, node, slot]
    level_tokens, level_parents, level_scores = [tokens], [], [scores]
    for depth in range(1, steps + 1):
        node_slots = pos + 1 + (depth - 1) * k + torch.arange(k, device=pos.device)
        visible = visible | (slots == node_slots[:, None])
        logits, hidden = head(tokens, hidden, (pos + depth).expand(k), node_slots, visible[:, None])
        child_scores, child_tokens = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, k, k]
        scores, best = (scores[:, :, None] + child_scores).flatten(1).topk(k, dim=-1)
        parents = best // k
        tokens = child_tokens.flatten(1).gather(1, best)
        hidden = hidden.gather(1, parents[:, :, None].expand(-1, -1, hidden.shape[-1]))
        visible = visible.gather(1, parents[:, :, None].expand(-1, -1, cache_len))
        level_tokens.append(tokens)
        level_parents.append(parents)
        level_scores.append(scores)
    return torch.stack(level_tokens, dim=1), torch.stack(level_parents, dim=1), torch.stack(level_scores, dim=1)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3, help="recurrent steps after the seed (default 3)")
    parser.add_argument("--topk", type=int, default=4, help="tree width (default 4)")
    parser.add_argument("--prefix", type=int, help="tokens already in the head's cache (default: half of it)")


def _inputs(args: argparse.Namespace) -> tuple[EagleHead, torch.Tensor, torch.Tensor, torch.Tensor]:
    head = build(lambda cfg: EagleHead(cfg, args.batch), args)
    cfg = args.config
    prefix = cfg.cache_len // 2 if args.prefix is None else args.prefix
    needed = prefix + 1 + args.steps * args.topk
    if needed > cfg.cache_len:
        raise SystemExit(f"the tree needs {needed} cache slots; the cache has {cfg.cache_len}")
    generator = torch.Generator(args.device).manual_seed(args.seed)
    token = torch.randint(cfg.vocab, (args.batch, 1), device=args.device, generator=generator)
    hidden = torch.randn(args.batch, 1, cfg.dim, device=args.device, generator=generator).to(args.dtype)
    pos = torch.tensor([prefix], device=args.device)
    return head, token, hidden, pos


def run(argv: list[str] | None = None) -> dict:
    """Check and time the draft as the command line `argv` asks (None: sys.argv); the results as a dict."""
    args = parse_args(__doc__, argv, _add_arguments)
    inputs = _inputs(args)
    chain_label = f"eagle head, chain: seed + {args.steps} steps, topk 1"
    chain = compare(chain_label, draft_chain, inputs, {"steps": args.steps}, args)
    tree_label = f"eagle head, tree: seed + {args.steps} levels, topk {args.topk}"
    tree = compare(tree_label, draft_tree, inputs, {"steps": args.steps, "k": args.topk}, args)
    return {"chain": chain, "tree": tree}


def explain_target(argv: list[str] = ()):
    """What `python -m draftfuse explain examples/eagle_head.py` looks at: the tree draft at tiny size."""
    args = parse_args(__doc__, list(argv), _add_arguments)
    return draft_tree, _inputs(args), {"steps": args.steps, "k": args.topk}


if __name__ == "__main__":
    run()
