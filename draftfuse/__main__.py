"""`python -m draftfuse demo` and `python -m draftfuse explain FILE`.

demo: draftfuse's main job on a built-in draft head. It compiles the head's draft (a seed and three
recurrent steps, each picking its token with softmax -> topk(1)) with torch.compile's default backend
(Inductor) and with draftfuse's, then prints what draftfuse rewrote, whether the tokens are identical,
the time per draft of eager, Inductor and draftfuse side by side, and on a GPU the CUDA graph replays per
draft. The head is small enough that the demo, two compiles included, runs in under a minute on a
2-core CPU.

explain: `draftfuse.explain` on the draft that FILE's `explain_target(argv)` returns (examples/eagle_head.py,
medusa_heads.py and draft_model.py define one): `python -m draftfuse explain [--graphs] FILE [ARGS...]`,
the arguments after FILE going to that function.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftfuse._measure import graph_replays_per_call, time_side_by_side
from draftfuse.explain import explain
from draftfuse.runtime import backend


class _DemoHead(nn.Module):
    """A one-layer draft head over the target's frozen KV cache (MTP-style: the draft writes no KV).

    The token's embedding and the target's hidden state are projected to one vector, which attends to
    the target's cache up to each row's sequence length, goes through an MLP and is scored by the LM head.
    """

    def __init__(self, dim: int, heads: int, vocab: int, kv_len: int, batch: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.SiLU(), nn.Linear(4 * dim, dim, bias=False))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        # The target's keys and values for the prefix: read, never written, by the draft.
        kv_shape = (batch, heads, kv_len, dim // heads)
        self.register_buffer("k_cache", torch.randn(kv_shape), persistent=False)
        self.register_buffer("v_cache", torch.randn(kv_shape), persistent=False)

    def forward(self, token: torch.Tensor, hidden: torch.Tensor, visible: torch.Tensor):
        """token [B], hidden [B, dim], visible [B, kv_len] -> logits [B, vocab] and the next hidden state."""
        x = self.fc(torch.cat([self.embed(token), hidden], dim=-1))
        q = self.wq(F.rms_norm(x, x.shape[-1:])).unflatten(-1, (self.heads, -1))[:, :, None]
        attn = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=visible[:, None, None])
        x = x + self.wo(attn.flatten(1))
        x = x + self.mlp(F.rms_norm(x, x.shape[-1:]))
        return self.lm_head(F.rms_norm(x, x.shape[-1:])), x


def _draft(head: _DemoHead, token: torch.Tensor, hidden: torch.Tensor, seq_lens: torch.Tensor, steps: int = 3):
    """Seed (iteration 0, fed by the target's token and hidden state) + `steps` greedy steps: tokens [B, steps + 1]."""
    tokens = []
    for _ in range(steps + 1):
        # Frozen KV: every iteration sees the same prefix, so this setup is the same in each of them.
        visible = torch.arange(head.k_cache.shape[2], device=seq_lens.device) < seq_lens[:, None]
        logits, hidden = head(token, hidden, visible)
        _, token = torch.softmax(logits.float(), dim=-1).topk(1, dim=-1)
        token = token.squeeze(-1)
        tokens.append(token)
    return torch.stack(tokens, dim=1)


def demo(device: str = "cpu", batch: int = 1, rounds: int = 50) -> None:
    device = torch.device(device)
    if device.type == "cpu":
        # The demo's few small C++ kernels compile faster in this process than through Inductor's pool
        # of worker processes, each of which imports torch first: on 2 cores that halves the compile time.
        torch._inductor.config.compile_threads = 1
        # A batch-1 draft this small gains nothing from splitting ops across threads, and on a busy
        # machine OpenMP threads waiting for each other make the timings swing tenfold.
        torch.set_num_threads(1)
    dim, heads, vocab, kv_len = 128, 4, 8192, 128
    torch.manual_seed(0)
    with device:
        head = _DemoHead(dim, heads, vocab, kv_len, batch).requires_grad_(False)
        inputs = (head, torch.randint(vocab, (batch,)), torch.randn(batch, dim), torch.full((batch,), kv_len // 2))
    print(
        f"draftfuse demo: a one-layer draft head (hidden {dim}, vocab {vocab}, frozen KV {kv_len}), "
        f"batch {batch}, seed + 3 steps, float32 on {device}"
    )

    drafts = {
        "eager": _draft,
        "Inductor": torch.compile(_draft, mode="reduce-overhead", fullgraph=True),
        "draftfuse": torch.compile(_draft, backend=(recording := backend.Backend()), mode="reduce-overhead", fullgraph=True),
    }
    tokens = {}
    for name, draft in drafts.items():
        start = time.perf_counter()
        tokens[name] = draft(*inputs).clone()  # a copy: the next CUDA graph replay reuses the output's memory
        if name != "eager":
            print(f"compiled with {name} in {time.perf_counter() - start:.1f} s")

    print("\nwhat draftfuse did to the draft's Dynamo graph:")
    (record,) = recording.compiles
    for report in record.reports:  # post-grad ones only when Inductor's FX graph cache missed (the passes ran)
        print(report.format())

    same = all(torch.equal(tokens["eager"], t) for t in tokens.values())
    verdict = "identical" if same else "DIFFERENT"
    print(f"\ntokens: {verdict} in eager, Inductor and draftfuse: {tokens['draftfuse'].tolist()}")
    calls = {name: (lambda draft=draft: draft(*inputs)) for name, draft in drafts.items()}
    times = time_side_by_side(calls, device, rounds)
    timings = " | ".join(f"{name} {ms:.3f} ms" for name, ms in times.items())
    print(f"time per draft (median of {rounds}, alternating): {timings}")
    if device.type == "cuda":
        replays = {name: graph_replays_per_call(calls[name]) for name in ("Inductor", "draftfuse")}
        print("CUDA graph replays per draft: " + " | ".join(f"{n} {r:g}" for n, r in replays.items()))
    else:
        print("(on a CPU there are no CUDA graphs: run `python -m draftfuse demo --device cuda` on a GPU for replays)")
    if not same:
        raise SystemExit(1)


def explain_file(path: str, argv: list[str], graphs: bool = False) -> None:
    """Print `explain` of the draft that `path`'s `explain_target(argv)` returns (with graphs and diffs
    when asked)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise SystemExit(f"{path}: no such file")
    sys.path.insert(0, str(file.parent))  # as when the file runs as a script: its sibling modules import
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does (dataclasses, pickling and typing look it up there)
    spec.loader.exec_module(module)
    if not hasattr(module, "explain_target"):
        raise SystemExit(f"{path} has no explain_target(argv) returning (draft function, args, kwargs)")
    fn, args, kwargs = module.explain_target(argv)
    print(explain(fn, *args, **kwargs).format(graphs=graphs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m draftfuse", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="compile a built-in draft head with and without draftfuse")
    demo_parser.add_argument("--device", default="cpu")
    demo_parser.add_argument("--batch", type=int, default=1)
    demo_parser.add_argument("--rounds", type=int, default=50, help="timing rounds (default 50)")
    explain_parser = commands.add_parser("explain", help="what draftfuse does to a file's draft; what stops capture")
    explain_parser.add_argument("--graphs", action="store_true", help="also print each graph and each pass's diff")
    explain_parser.add_argument("file", help="a Python file defining explain_target(argv)")
    explain_parser.add_argument("target_args", nargs=argparse.REMAINDER, help="arguments for explain_target")
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args.device, args.batch, args.rounds)
    else:
        explain_file(args.file, args.target_args, args.graphs)


if __name__ == "__main__":
    main()
