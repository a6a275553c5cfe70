"""A frozen-KV MTP drafter, written the way servers write it and then with `draftfuse.fold`.

The drafter is one decoder layer in the multi-token-prediction style: the bonus token's embedding and
the target's hidden state are normalised, concatenated and projected, then the layer's queries attend
to the target model's KV cache, which the draft reads and never writes ("frozen KV"). So the draft
never extends the sequence: the rope position is `seq_lens - 1` in every iteration, and the attention
mask is the same too. Tokens are picked with softmax + topk(1); the layer's hidden state is carried.
One draft is the seed (fed by the bonus tokens and hidden states) and 3 steps.

The server layout: `seed_step` runs eagerly (setup, forward, softmax/topk, the results copied into
freshly allocated per-draft buffers, attention metadata brought to the host), its outputs are copied
into the static input buffers of `draft_steps`, compiled separately with mode="reduce-overhead",
which recomputes its own setup from them and replays. The folded layout is
`fold(worker.seed_step, worker.draft_steps)` on the same worker: one compiled region in which the seed
is iteration 0; the seed fold removes the buffers, the host round trip and the duplicated setup (the
loop's defensive `clamp(seq_lens - 1, min=0)` is proven equal to the seed's `seq_lens - 1` because
the fold is told `seq_lens >= 1`). The folded draft also gets draftfuse's softmax -> topk rewrite
(argmax for k = 1); `--keep-softmax` turns it off, to see what the fold alone is worth.

The weights are random, except that the LM head is the embedding shifted by one token, so each step's
best token (the previous one plus one) leads by a wide margin, far wider than the bf16 rounding
differences between eager and compiled code: "tokens match" compares the layouts, not luck. The probabilities
are not saturated at the tiny size, so the fp32 comparison of them checks the whole computation.
Speed does not depend on weight values.

    python examples/mtp_frozen_kv.py                          # tiny, fp32, CPU, batch 1
    python examples/mtp_frozen_kv.py --device cuda            # reference size, bf16, batch 1 8 32

On CUDA it prints, per batch size, the time per draft of both layouts measured side by side (CUDA
events, alternating, median) and the CUDA graph replays per draft (cudaGraphLaunch in a profiler trace).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from draftfuse._measure import graph_replays_per_call, time_side_by_side
from draftfuse.runtime.fold import fold


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    kv_len: int  # the target's frozen KV cache: prefix length the draft attends to
    steps: int = 3  # recurrent steps after the seed

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES = {
    "tiny": Size(hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, kv_len=32),
    "reference": Size(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, kv_len=2048),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class MTPDrafter(nn.Module):
    """One MTP layer over a frozen KV cache. Call it with the setup (rope tables, mask) precomputed."""

    def __init__(self, size: Size, rope_base: float = 500000.0) -> None:
        super().__init__()
        h, self.size, self.rope_base = size.hidden, size, rope_base
        self.embed = nn.Embedding(size.vocab, h)
        self.enorm, self.hnorm = RMSNorm(h), RMSNorm(h)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.attn_norm, self.mlp_norm, self.final_norm = RMSNorm(h), RMSNorm(h), RMSNorm(h)
        self.q_proj = nn.Linear(h, size.heads * size.head_dim, bias=False)
        self.o_proj = nn.Linear(size.heads * size.head_dim, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * size.intermediate, bias=False)
        self.down = nn.Linear(size.intermediate, h, bias=False)
        self.lm_head = nn.Linear(h, size.vocab, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        h = self.size.hidden
        # The embedding passes through eh_proj almost unchanged and the head is the embedding shifted
        # by one token (scaled so the logits of the tiny size are not saturated): see the module doc.
        nn.init.normal_(self.embed.weight)
        self.eh_proj.weight.normal_(std=0.1 / math.sqrt(2 * h))
        self.eh_proj.weight[:, :h] += torch.eye(h, device=self.eh_proj.weight.device)
        self.lm_head.weight.copy_(self.embed.weight.roll(1, dims=0) * (2.0 / math.sqrt(h)))
        for linear in (self.q_proj, self.o_proj, self.gate_up, self.down):
            linear.weight.normal_(std=1.0 / math.sqrt(linear.in_features))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, head_dim // 2] for one position per sequence, in float32 whatever the weights' dtype."""
        head_dim = self.size.head_dim
        inv_freq = self.rope_base ** -(torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
        angles = positions[:, None].float() * inv_freq[None, :]
        return angles.cos(), angles.sin()

    def forward(self, tokens, hidden, cos, sin, keys, values, kv_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B]; hidden [B, H]; cos/sin [B, head_dim/2]; keys/values [B, kv_heads, kv_len, head_dim];
        kv_mask [B, kv_len] (True: attend). Returns the new hidden state [B, H] and the logits [B, vocab]."""
        size, batch = self.size, tokens.shape[0]
        x = self.eh_proj(torch.cat([self.enorm(self.embed(tokens)), self.hnorm(hidden)], dim=-1))
        # The query heads of one KV head go along the query-length dim: one token per sequence, so
        # grouped-query attention over the frozen cache needs no copy of the keys and values.
        q = self.q_proj(self.attn_norm(x)).view(batch, size.kv_heads, size.heads // size.kv_heads, size.head_dim)
        q1, q2 = q.float().chunk(2, dim=-1)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1).type_as(x)
        mask = kv_mask[:, None, None, :]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.o_proj(attn.reshape(batch, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return x, self.lm_head(self.final_norm(x))


def _kv_mask(seq_lens: torch.Tensor, kv_len: int) -> torch.Tensor:
    return torch.arange(kv_len, device=seq_lens.device)[None, :] < seq_lens[:, None]


class FrozenKVMTPWorker:
    """A server's draft worker for one batch size: seed step, draft steps, and the static buffers that
    the steps' CUDA graph reads (a server keeps one set per captured batch size)."""

    def __init__(self, model: MTPDrafter, batch: int) -> None:
        self.model, self.steps = model, model.size.steps
        weight = model.embed.weight
        self.static_topk_p = torch.zeros(batch, 1, device=weight.device)
        self.static_topk_index = torch.zeros(batch, 1, dtype=torch.long, device=weight.device)
        self.static_hidden = torch.zeros(batch, model.size.hidden, dtype=weight.dtype, device=weight.device)
        self.static_seq_lens = torch.zeros(batch, dtype=torch.int32, device=weight.device)
        for buffer in (self.static_topk_p, self.static_topk_index, self.static_hidden, self.static_seq_lens):
            torch._dynamo.mark_static_address(buffer)
        self.compiled_steps = torch.compile(self.draft_steps, mode="reduce-overhead", fullgraph=True)

    def seed_step(self, bonus_tokens, hidden_states, keys, values, seq_lens):
        """Iteration 0, fed by the target: the setup, one forward, softmax + topk."""
        positions = seq_lens - 1  # frozen KV: the draft's position is the last accepted one
        cos, sin = self.model.rope(positions)
        kv_mask = _kv_mask(seq_lens, keys.shape[2])
        hidden, logits = self.model(bonus_tokens, hidden_states, cos, sin, keys, values, kv_mask)
        p, index = torch.softmax(logits.float(), dim=-1).topk(1, dim=-1)
        # The per-draft buffers the steps read, allocated and filled as a server's seed does.
        topk_p = torch.zeros(bonus_tokens.shape[0], 1, device=p.device)
        topk_index = torch.zeros(bonus_tokens.shape[0], 1, dtype=torch.long, device=p.device)
        topk_p.copy_(p)
        topk_index.copy_(index)
        # Attention metadata lives on the host in servers: here the CPU waits for the GPU.
        seq_lens_host = seq_lens.cpu()
        return topk_p, topk_index, hidden, keys, values, seq_lens_host

    def draft_steps(self, topk_p, topk_index, hidden, keys, values, seq_lens):
        """The recurrent steps, captured separately in a server; recomputes its own setup."""
        seq_lens = seq_lens.to(keys.device, non_blocking=True)
        positions = (seq_lens - 1).clamp(min=0)
        cos, sin = self.model.rope(positions)
        kv_mask = _kv_mask(seq_lens, keys.shape[2])
        tokens, probs = [topk_index[:, 0]], [topk_p[:, 0]]
        for _ in range(self.steps):
            hidden, logits = self.model(tokens[-1], hidden, cos, sin, keys, values, kv_mask)
            p, index = torch.softmax(logits.float(), dim=-1).topk(1, dim=-1)
            tokens.append(index[:, 0])
            probs.append(p[:, 0])
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def draft_server_layout(self, bonus_tokens, hidden_states, keys, values, seq_lens):
        """Eager seed, copies into the static buffers, one replay of the captured steps."""
        seeded = self.seed_step(bonus_tokens, hidden_states, keys, values, seq_lens)
        topk_p, topk_index, hidden, keys, values, seq_lens_host = seeded
        self.static_topk_p.copy_(topk_p)
        self.static_topk_index.copy_(topk_index)
        self.static_hidden.copy_(hidden)
        self.static_seq_lens.copy_(seq_lens_host, non_blocking=True)
        tokens, probs = self.compiled_steps(
            self.static_topk_p, self.static_topk_index, self.static_hidden, keys, values, self.static_seq_lens
        )
        return tokens.clone(), probs.clone()  # the next replay overwrites the graph's own outputs


def make_inputs(size: Size, batch: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple:
    """What the target hands the drafter: bonus tokens, hidden states, its KV cache, sequence lengths."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    kv_shape = (batch, size.kv_heads, size.kv_len, size.head_dim)
    bonus_tokens = torch.randint(size.vocab, (batch,), generator=generator)
    hidden_states = torch.randn(batch, size.hidden, generator=generator)
    keys, values = torch.randn(kv_shape, generator=generator), torch.randn(kv_shape, generator=generator)
    seq_lens = torch.randint(size.kv_len // 2, size.kv_len + 1, (batch,), generator=generator, dtype=torch.int32)
    inputs = (
        bonus_tokens.to(device),
        hidden_states.to(device, dtype),
        keys.to(device, dtype),
        values.to(device, dtype),
        seq_lens.to(device),
    )
    # The target's KV cache stays where it is: static, so CUDA graphs read it in place.
    torch._dynamo.mark_static_address(inputs[2])
    torch._dynamo.mark_static_address(inputs[3])
    return inputs


def compare_layouts(
    size: Size,
    batch: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    rounds: int,
    seed: int = 0,
    keep_softmax: bool = False,
) -> dict:
    """Build the drafter and both layouts for one batch size; compare their outputs and speed.

    keep_softmax: turn off draftfuse's softmax -> topk rewrite in the folded draft (on by default), to
    see what the fold alone is worth."""
    torch.manual_seed(seed)
    with device:
        model = MTPDrafter(size).to(dtype).requires_grad_(False)
    worker = FrozenKVMTPWorker(model, batch)
    options = {"softmax_topk": False} if keep_softmax else None
    folded = fold(worker.seed_step, worker.draft_steps, value_ranges={"seq_lens": (1, None)}, options=options)
    inputs = make_inputs(size, batch, device, dtype, seed)
    layouts = {"eager seed + captured steps": worker.draft_server_layout, "folded": folded}
    with torch.no_grad():
        outputs = {name: draft(*inputs) for name, draft in layouts.items()}
        (server_tokens, server_probs), (folded_tokens, folded_probs) = outputs.values()
        result = {
            "batch": batch,
            "tokens": folded_tokens,
            "probs": folded_probs,
            "tokens_match": torch.equal(server_tokens, folded_tokens),
            "max_prob_diff": (server_probs - folded_probs).abs().max().item(),
            "seed_fold_report": folded.draft.compiles[-1].reports[0],
            # setup merging runs on Inductor's post-grad graph; absent on an FX graph cache hit
            "merge_report": next((r for r in folded.draft.compiles[-1].reports if r.pass_name == "merge_setup"), None),
        }
        calls = {name: (lambda draft=draft: draft(*inputs)) for name, draft in layouts.items()}
        if rounds > 0:
            result["ms_per_draft"] = time_side_by_side(calls, device, rounds)
        if device.type == "cuda":
            result["graph_replays_per_draft"] = {name: graph_replays_per_call(call) for name, call in calls.items()}
    return result


def _print(result: dict, size_name: str, dtype: torch.dtype, device: torch.device, rounds: int) -> None:
    print(f"frozen-KV MTP draft, seed + {SIZES[size_name].steps} steps: batch {result['batch']}, "
          f"{str(dtype).removeprefix('torch.')} on {device} (size {size_name})")
    verdict = "same" if result["tokens_match"] else "DIFFERENT"
    print(f"  tokens, folded vs eager seed + captured steps: {verdict}; "
          f"probabilities differ by at most {result['max_prob_diff']:.3g}")
    report = result["seed_fold_report"]
    print(f"  seed fold: {len(report.rewrites)} rewrites, {len(report.refusals)} refusals")
    merged = result["merge_report"]
    if merged is not None:
        proven = [r.detail for r in merged.rewrites if r.rule == "setup merged (proven equal)"]
        print(f"  setup merged: {sum(len(r.nodes) for r in merged.rewrites)} computations" + (f"; proven: {'; '.join(proven)}" if proven else ""))
    if "ms_per_draft" in result:
        times = " | ".join(f"{name} {ms * 1e3:.1f} us" for name, ms in result["ms_per_draft"].items())
        print(f"  time per draft (median of {rounds}, alternating): {times}")
    if "graph_replays_per_draft" in result:
        replays = " | ".join(f"{name} {n:g}" for name, n in result["graph_replays_per_draft"].items())
        print(f"  CUDA graph replays per draft: {replays}")


def run(argv: list[str] | None = None) -> list[dict]:
    """Parse the command line, compare both layouts for each batch size, print and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--size", choices=sorted(SIZES), help="default: tiny on a CPU, reference on CUDA")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 tiny, bfloat16 reference")
    parser.add_argument("--batch", type=int, nargs="+", help="default: 1 on a CPU, 1 8 32 on CUDA")
    parser.add_argument("--rounds", type=int, default=100, help="timed drafts per layout; 0 only compares outputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-softmax", action="store_true", help="fold only: no softmax -> topk rewrite in the folded draft"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    size_name = args.size or ("reference" if device.type == "cuda" else "tiny")
    dtype = getattr(torch, args.dtype or ("float32" if size_name == "tiny" else "bfloat16"))
    batches = args.batch or ([1, 8, 32] if device.type == "cuda" else [1])
    results = []
    for batch in batches:
        size = SIZES[size_name]
        result = compare_layouts(
            size, batch, device=device, dtype=dtype, rounds=args.rounds, seed=args.seed, keep_softmax=args.keep_softmax
        )
        _print(result, size_name, dtype, device, args.rounds)
        results.append(result)
    return results


if __name__ == "__main__":
    run()
