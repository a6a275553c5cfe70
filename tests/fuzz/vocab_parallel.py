"""Fuzzing the vocab-parallel rewrite of bare selections (argmax, max, topk of the gathered logits, no
softmax) on real ranks: every rank draws the same program from one seed, runs it at one level on its
shard, and compares with the program on the full logits in one process.

Hazards drawn: fp16/bf16 logits and casts that make ties (and fp16 overflow to inf), negative and zero
scales, NaN / +inf / -inf rows, small-integer logits (ties everywhere), a padded vocabulary, every
gather form, keepdim, k up to 4; and forms that must be refused (a smallest selection, the logits also
returned or written in place, topk(sorted=False)), which must leave eager's results.

The rule compared: argmax and max indices exactly (torch.argmax's: the first maximum, NaN first); topk
indices, k = 1 too, as a valid top k (distinct, each holding the value the original's holds: torch's
topk leaves which of equal values comes first unspecified, and on a CPU its k = 1 is not the first
maximum); values bit for bit (they are the chosen logits). A refused program: eager's results exactly.

    python -m tests.fuzz.vocab_parallel --world 2 --start 0 --count 300     # spawns a gloo world
In CI: tests/test_vocab_parallel_ranks.py's "bare_fuzz" case (a few dozen seeds, both levels).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist

from tests.fuzz.common import Chooser, RandomChooser

FORMS = ("gather_dim", "chunk_cat", "view_permute", "into_buffer")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STEPS = (("cast", torch.float32), ("cast", torch.bfloat16), ("cast", torch.float16), ("cast", torch.float64),
         ("mul", 2.0), ("mul", -0.5), ("mul", 0.0), ("div", 0.7), ("div", -3.0))  # fmt: skip
HAZARDS = ("none", "smallest", "returns_logits", "written", "unsorted")


@dataclasses.dataclass
class Program:
    form: str
    dtype: torch.dtype
    values: str  # random | ties | special
    steps: list  # (op, operand), applied to the gathered logits in order
    pad: int  # vocabulary entries of padding dropped by [..., :V - pad]
    kind: str  # argmax | max | topk
    k: int
    keepdim: bool
    hazard: str
    level: str  # dynamo | aten

    @property
    def refused(self) -> bool:
        """Whether the rewrite must refuse: an in-place write of the logits is functional after AOT
        autograd (mul_ becomes mul, a scale like any other; through a padded vocabulary's slice of the
        gathered tensor itself a slice_scatter, which is no gather's logits: left, unreported), and
        topk(k=1) has one order only."""
        if self.hazard == "written":
            return self.level == "dynamo" or (self.pad > 0 and self.writes_the_gathered_tensor)
        return self.hazard != "none" and not (self.hazard == "unsorted" and self.k == 1)


    @property
    def writes_the_gathered_tensor(self) -> bool:
        """Whether the written logits are (a view of) the gathered tensor: every step a cast to its dtype."""
        dtype = self.dtype
        for op, operand in self.steps:
            if op != "cast" or operand != dtype:
                return False
        return True


def generate(c: Chooser, shard: int) -> Program:
    kind = c.pick(("argmax", "max", "topk"))
    hazard = c.pick(HAZARDS) if c.flag(0.3) else "none"
    if hazard == "unsorted" and kind != "topk":
        hazard = "none"
    return Program(
        form=c.pick(FORMS), dtype=c.pick(DTYPES), values=c.pick(("random", "ties", "special")),
        steps=[c.pick(STEPS) for _ in range(c.integer(0, 2))], pad=c.integer(1, shard - 1) if c.flag(0.3) else 0,
        kind=kind, k=c.integer(1, 4) if kind == "topk" else 1, keepdim=c.flag(), hazard=hazard, level=c.pick(("dynamo", "aten")),
    )  # fmt: skip


def full_logits(p: Program, world: int, shard: int, seed: int, rows: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    vocab = world * shard
    if p.values == "ties":
        full = torch.randint(0, 3, (rows, vocab), generator=generator).float()
    else:
        full = torch.randn(rows, vocab, generator=generator) * 4
    if p.values == "special":
        full[0, torch.randint(0, vocab, (3,), generator=generator)] = full[0].max() + 1  # ties, maybe across shards
        full[1, torch.randint(0, vocab, (2,), generator=generator)] = float("nan")
        full[2, torch.randint(0, vocab, (1,), generator=generator)] = float("inf")
        full[3, :shard] = float("-inf")
        full[4] = float("-inf")
    if p.pad:
        full[:, vocab - p.pad :] = 1e4  # the padding would win (or overflow fp16 to inf) if it were not dropped
    return full.to(p.dtype)


def draft(p: Program, gather):
    """The program as a draft of this rank's shard (gather: a _tp form, or the identity on the full logits)."""

    def fn(x):
        logits = gather(x)
        if p.pad:
            logits = logits[..., : logits.shape[-1] - p.pad]
        for op, operand in p.steps:
            logits = logits.to(operand) if op == "cast" else logits * operand if op == "mul" else logits / operand
        if p.hazard == "written":
            logits.mul_(-1.0)
        if p.hazard == "smallest":
            return logits.argmin(dim=-1, keepdim=p.keepdim)
        if p.kind == "argmax":
            out = logits.argmax(dim=-1, keepdim=p.keepdim)
        elif p.kind == "max":
            out = logits.max(dim=-1, keepdim=p.keepdim)
        else:
            out = logits.topk(p.k, dim=-1, sorted=p.hazard != "unsorted")
        return (out, logits) if p.hazard == "returns_logits" else out

    return fn


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def compare(p: Program, got, want, reference: torch.Tensor) -> str:
    """'' when they agree by the module docstring's rule."""
    leaves = lambda out: [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]  # noqa: E731
    got, want = leaves(got), leaves(want)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for g, w in zip(got, want):
        if g.dtype.is_floating_point or p.kind != "topk" or p.refused:
            if not _same(g, w):
                return f"differ:\n{g}\n{w}"
            continue
        if g.shape != w.shape or any(len(set(row)) != len(row) for row in g.reshape(-1, g.shape[-1]).tolist()):
            return f"indices not k distinct entries:\n{g}\n{w}"
        if not _same(reference.gather(-1, g), reference.gather(-1, w)):  # equal values may come in either order
            return f"indices hold other values:\n{g}\n{w}"
    return ""


def check(seed: int, world: int, rank: int, shard: int = 8) -> str:
    """One program on this rank: '' when it passes."""
    from tests import _tp

    p = generate(RandomChooser(seed), shard)
    full = full_logits(p, world, shard, seed)
    x = full[..., rank * shard : (rank + 1) * shard].contiguous()
    got, reports = _tp.run_level(draft(p, _tp.FORMS[p.form]), (x,), p.level, {})
    want = draft(p, lambda logits: logits)(full.clone())
    results = [r for report in reports if report.pass_name.startswith("vocab_parallel") for r in (*report.rewrites, *report.refusals)]
    rewrites = [r for report in reports if report.pass_name.startswith("vocab_parallel") for r in report.rewrites]
    unreported = p.hazard == "written" and p.level == "aten"  # the slice_scatter above
    if len(rewrites) != (0 if p.refused else 1) or len(results) != (len(results) if unreported else 1):
        return f"{p}: expected {'a refusal' if p.refused else 'one rewrite'}:\n" + "\n".join(str(r) for r in reports)
    why = compare(p, got, want, _selected_input(p, full.clone()))
    return f"{p}: {why}" if why else ""


def _selected_input(p: Program, full: torch.Tensor) -> torch.Tensor:
    """What the selection reads, in one process (for the values its indices point at)."""
    logits = full[..., : full.shape[-1] - p.pad] if p.pad else full
    for op, operand in p.steps:
        logits = logits.to(operand) if op == "cast" else logits * operand if op == "mul" else logits / operand
    return logits


def run_seeds(start: int, count: int) -> str:
    """On every rank of a gloo world: the failures of seeds start..start+count, one line each."""
    world, rank, failed = dist.get_world_size(), dist.get_rank(), []
    for seed in range(start, start + count):
        try:
            why = check(seed, world, rank)
        except Exception as error:  # noqa: BLE001
            why = f"raised {error!r}"
        if why:
            failed.append(f"seed {seed}: {why}")
        torch._dynamo.reset()
    return "\n".join(failed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    args = parser.parse_args()
    from tests import _tp

    os.environ["DRAFTFUSE_BARE_FUZZ"] = f"{args.start}:{args.count}"
    result = _tp.run_world(args.world, ["bare_fuzz"])["bare_fuzz"]
    print(result or f"{args.count} seeds from {args.start}: 0 failed")


if __name__ == "__main__":
    main()
