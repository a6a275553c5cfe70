"""A tensor-parallel EAGLE-style draft head: the LM head is vocab-sharded, each rank holds 1/tp of its
rows, and the head all-gathers the logits along the vocabulary before the draft's softmax + topk (or,
in the greedy draft, a bare argmax of the logits, as vLLM's proposer), as servers do. draftfuse's vocab_parallel pass makes each rank select on its own shard and gathers k
candidates per rank (plus the softmax's max and exp-sum) instead of the [B, vocab] logits.

    torchrun --nproc-per-node 2 examples/tp_draft.py                                   # CPU, gloo, tiny, fp32
    torchrun --nproc-per-node 2 examples/tp_draft.py --device cuda --size reference    # NCCL, vocab 128256, bf16
    python examples/tp_draft.py --nproc 4                                              # spawns 4 CPU ranks itself

Checked: the drafted tokens against the same draft run in one process on the full logits (the shard
matmuls concatenated, so the logits are bit-identical): fp32 must be exact. In bf16 the gather path
(the same compiled draft without the rewrite) is the reference too, since both round alike.
Timed, side by side in one process per rank, alternating: the gather path (draft_loop with
{"vocab_parallel": False, "softmax_topk": False}: the unrewritten draft, captured alike) and draftfuse (the
default options). Each call is one CUDA graph replay per rank, the collective included.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import MODE, _max_float_diff, _same_tokens, parse_args
from _layers import causal_mask
from eagle_head import EagleHead, _inputs, draft_chain, draft_tree
from torch import nn

from draftfuse._measure import graph_replays_per_call, time_side_by_side
from draftfuse.runtime.draft_loop import draft_loop


class GatheredLMHead(nn.Module):
    """Rows [rank * S, (rank + 1) * S) of an LM head; the logits are all-gathered along the vocabulary
    (what a column-parallel LM head with gather_output=True does). `rank=None`: the one-process
    reference, every shard's matmul run here and concatenated (bit-identical logits)."""

    def __init__(self, full: nn.Linear, rank: int | None, tp: int) -> None:
        super().__init__()
        shards = full.weight.detach().chunk(tp)
        self.rank, self.tp = rank, tp
        self.weight = nn.Parameter((shards[rank] if rank is not None else full.weight.detach()).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            return torch.cat([F.linear(x, w) for w in self.weight.chunk(self.tp)], dim=-1)
        from torch.distributed import _functional_collectives as funcol

        logits = F.linear(x, self.weight)  # gather_dim as a positive dim: torch 2.13 mis-views a negative one
        return funcol.all_gather_tensor(logits, logits.dim() - 1, dist.group.WORLD)


def draft_greedy(head: EagleHead, token: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, steps: int = 3):
    """draft_chain as vLLM's EAGLE proposer spells it: the greedy token is `logits.argmax(dim=-1)` of the
    gathered logits, with no softmax (localised as a bare selection)."""
    cache_len = head.layer.attn.k_cache.shape[2]
    tokens = []
    for _ in range(steps + 1):
        logits, hidden = head(token, hidden, pos, pos, causal_mask(cache_len, pos))
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(token)
        pos = pos + 1
    return torch.cat(tokens, dim=1)


def _with_lm_head(head: EagleHead, lm_head: nn.Module) -> EagleHead:
    """The same head (same layers, same KV cache) with another LM head."""
    other = copy.copy(head)
    other._modules = dict(head._modules)
    other.lm_head = lm_head
    return other


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3, help="recurrent steps after the seed (default 3)")
    parser.add_argument("--topk", type=int, default=4, help="tree width (default 4)")
    parser.add_argument("--prefix", type=int, help="tokens already in the head's cache (default: half of it)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun (CPU)")
    parser.add_argument("--drafts", nargs="+", choices=["chain", "tree", "greedy"], default=["chain", "tree", "greedy"],
                        help="which drafts (default all: greedy is the chain with a bare argmax, as vLLM's proposer)")


def _check_and_time(label: str, draft, inputs: tuple, reference_inputs: tuple, kwargs: dict, args) -> dict:
    rank, tp = dist.get_rank(), dist.get_world_size()
    runners = {"draftfuse": draft_loop(draft, mode=MODE)}
    if args.rounds > 0 or args.dtype != torch.float32:
        runners = {"gather path": draft_loop(draft, mode=MODE, options={"vocab_parallel": False, "softmax_topk": False}), **runners}
    with torch.no_grad():
        reference = [t.clone() for t in draft(*reference_inputs, **kwargs)]
        outputs = {name: [t.clone() for t in run(*inputs, **kwargs)] for name, run in runners.items()}
    result = {
        "tokens_match": _same_tokens(outputs["draftfuse"], reference),
        "tokens_match_gather_path": _same_tokens(outputs["draftfuse"], outputs["gather path"]) if "gather path" in outputs else None,
        "max_score_diff": _max_float_diff(outputs["draftfuse"], reference),
        "outputs": outputs["draftfuse"],
        "rewrites": [r.rule for record in runners["draftfuse"].compiles for rep in record.reports if rep.pass_name.startswith("vocab_parallel") for r in rep.rewrites],
    }
    if args.rounds > 0:
        calls = {name: (lambda run=run: run(*inputs, **kwargs)) for name, run in runners.items()}
        result["ms_per_draft"] = time_side_by_side(calls, args.device, args.rounds)
        if args.device.type == "cuda":
            result["graph_replays_per_draft"] = {name: graph_replays_per_call(call) for name, call in calls.items()}
    if rank == 0:
        dtype = str(args.dtype).removeprefix("torch.")
        print(f"{label}: tp {tp}, batch {args.batch}, {dtype} on {args.device.type} (size {args.size})")
        verdict = "same" if result["tokens_match"] else "DIFFERENT"
        must = " (fp32, must be exact)" if args.dtype == torch.float32 else " (bf16: for information)"
        print(f"  tokens, draftfuse vs one process on the full logits{must}: {verdict}")
        if result["tokens_match_gather_path"] is not None:
            print(f"  tokens, draftfuse vs the gather path: {'same' if result['tokens_match_gather_path'] else 'DIFFERENT'}")
        print(f"  localised selections: {len(result['rewrites'])} ({result['rewrites'][0] if result['rewrites'] else 'none'})")
        if "ms_per_draft" in result:
            times = " | ".join(f"{name} {ms:.3f} ms" for name, ms in result["ms_per_draft"].items())
            print(f"  time per draft on rank 0 (median of {args.rounds}, alternating): {times}")
        if "graph_replays_per_draft" in result:
            print("  CUDA graph replays per draft: " + " | ".join(f"{n} {r:g}" for n, r in result["graph_replays_per_draft"].items()))
    return result


def run_rank(argv: list[str] | None = None) -> dict:
    """This rank's part (the process group is initialised): check and time both drafts."""
    args = parse_args(__doc__, argv, _add_arguments)
    if args.device.type == "cuda":
        args.device = torch.device("cuda", torch.cuda.current_device())
    rank, tp = dist.get_rank(), dist.get_world_size()
    if args.config.vocab % tp:
        raise SystemExit(f"vocab {args.config.vocab} does not split over {tp} ranks")
    head, token, hidden, pos = _inputs(args)
    sharded = _with_lm_head(head, GatheredLMHead(head.lm_head, rank, tp).to(args.device))
    one_process = _with_lm_head(head, GatheredLMHead(head.lm_head, None, tp).to(args.device))
    if rank:
        warnings.filterwarnings("ignore", message="draftfuse: draft")  # rank 0 says it once
    drafts = {
        "chain": (f"tp eagle head, chain: seed + {args.steps} steps, topk 1", draft_chain, {"steps": args.steps}),
        "tree": (f"tp eagle head, tree: seed + {args.steps} levels, topk {args.topk}", draft_tree, {"steps": args.steps, "k": args.topk}),
        "greedy": (f"tp eagle head, greedy chain (logits.argmax): seed + {args.steps} steps", draft_greedy, {"steps": args.steps}),
    }
    return {
        name: _check_and_time(label, draft, (sharded, token, hidden, pos), (one_process, token, hidden, pos), kwargs, args)
        for name, (label, draft, kwargs) in drafts.items() if name in args.drafts
    }  # fmt: skip


def _spawned(rank: int, world: int, init: str, argv: list[str]) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        run_rank(argv)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(__doc__, argv, _add_arguments)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off: the lent machines need it
    if "RANK" not in os.environ:  # not started by torchrun: spawn CPU ranks
        if args.device.type != "cpu":
            raise SystemExit("on CUDA, start it with torchrun --nproc-per-node N")
        with tempfile.TemporaryDirectory() as tmp:
            torch.multiprocessing.spawn(_spawned, args=(args.nproc, f"file://{tmp}/store", argv), nprocs=args.nproc)
        return
    if args.device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device.type == "cuda" else "gloo")
    try:
        run_rank(argv)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
