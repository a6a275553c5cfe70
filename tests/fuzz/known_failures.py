"""The failure classes the fuzzers found, one minimal reproducer each, runnable against any draftfuse:

    python -m tests.fuzz.known_failures            # each case: FAILS (with the evidence) or passes

Found on 9bc0763 (before the core rewrite) and on ea7481a ("Core on one model of graph effects").
Each case is the fuzzer's finding reduced by hand to its core (the fuzzer's own shrunk programs are
longer); the oracle is the one that found it. Inputs are tie-free: documented differences cannot
explain a mismatch.
"""

from __future__ import annotations

import inspect
import sys
import textwrap

import torch

from tests.fuzz import seed_fold, selection
from tests.fuzz.common import Failure, pipeline_available
from tests.fuzz.selection import HandProgram, Out, SelectionProgram
from tests.fuzz.seed_fold import SeedFoldProgram

CASES: dict[str, tuple[str, str, object]] = {}  # name -> (found on, oracle, program)


def _src(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


def _selection(name: str, found: str, oracle: str, fn, args: dict, outs: list[Out], expected: int = 0) -> None:
    CASES[name] = (found, oracle, SelectionProgram(_src(fn), list(args.items()), outs, expected, (), name=fn.__name__))


def _hand(name: str, found: str, fn, args: dict, outs: list[Out]) -> None:
    CASES[name] = (found, "handwritten", HandProgram(_src(fn), list(args.items()), outs, (), name=fn.__name__))


def _fold(name: str, found: str, oracle: str, source: str, tensors: dict, value_ranges: dict | None = None, random: bool = False, views=()) -> None:
    params = list(tensors) + [v[0] for v in views]
    CASES[name] = (found, oracle, SeedFoldProgram(textwrap.dedent(source), list(tensors.items()), list(views), params, value_ranges or {}, random, ()))


X = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 1.0, 2.0]])
INDEX, VALUE = Out("index"), Out("value")


# ---- softmax -> topk, Dynamo level (9bc0763; the fuzzer finds none on ea7481a) ----


def probs_written_in_place(x, w):
    probs = torch.softmax(x, -1)
    probs.mul_(w)  # also div_, masked_fill_(m, 0), probs[:, ids] = 0, neg_, torch.mul(probs, w, out=probs)
    return (probs.argmax(-1),)


_selection("S1 probabilities written in place before the selection", "9bc0763", "dynamo", probs_written_in_place,
           {"x": X, "w": torch.tensor([[64.0, 1, 1, 1], [1, 64.0, 1, 1]])}, [INDEX])


def probs_written_through_transpose(x, w):
    probs = torch.softmax(x, -1)
    q = probs.float()  # the same tensor (already float32)
    probs.t().mul_(w)
    return (q.topk(2, -1).indices,)


_selection("S1b ... through an alias and a transposed view", "9bc0763", "dynamo", probs_written_through_transpose,
           {"x": X, "w": torch.tensor([[64.0, 1], [1, 64.0], [1, 1], [1, 1]])}, [INDEX])


def logits_iadd_between(x, p):
    s = x * 2.0
    x += p  # operator.iadd: not seen as a write; the rewrite's argmax(x) runs after it
    return (torch.softmax(s, -1).argmax(-1), x)


_selection("S2 logits written by += between reading them and the softmax", "9bc0763", "dynamo", logits_iadd_between,
           {"x": X, "p": torch.tensor([[10.0, 0, 0, 0], [0, 10.0, 0, 0]])}, [INDEX, Out("other")])


def logits_out_between(x):
    s = x * 2.0
    torch.mul(x, -1, out=x)  # an out= write: not seen either
    return (torch.softmax(s, -1).topk(2).indices, x)


_selection("S2b ... by torch.mul(x, -1, out=x)", "9bc0763", "dynamo", logits_out_between, {"x": X}, [INDEX, Out("other")])


def logits_written_before_any_read(x):
    x.neg_()  # before anything reads x: the rewrite is legal, but refused as "in-place neg_ between"
    return (torch.softmax(x, -1).topk(2).indices,)


_selection("S6 (missed rewrite) a write before the logits are read blocks the rewrite", "9bc0763", "expect",
           logits_written_before_any_read, {"x": X}, [INDEX], expected=1)


# ---- softmax -> topk through the backend (bd66c8e): fp16/bf16 probabilities read beside the selection ----


def half_probs_counted_against_values(x):
    probs = torch.log_softmax(x.to(torch.bfloat16), -1)
    v, i = torch.topk(probs, 2, -1)
    return (v, i, (probs >= v.amin(-1, keepdim=True)).sum(-1))  # eager: 2 (the two kept)


# rows of distinct values 1 apart (log-probabilities >= 16 bf16 ulps apart: no rounding ties)
X_SPREAD = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(row)) for row in range(7)]).float() * 1.0 - 2.5
_selection("S7 bf16 probabilities read by a mask beside a rewritten topk: Inductor fused the softmax into the mask "
           "and compared unrounded probabilities with the rounded values (counts of 1 where eager keeps 2)",
           "bd66c8e", "backend", half_probs_counted_against_values, {"x": X_SPREAD},
           [Out("value", group=0, log_scale=12.0, floor=torch.bfloat16), Out("index", group=0), Out("other")])


def fp16_cast_counted_against_max(x):
    q = torch.softmax(x, -1).to(torch.float16)
    v, i = q.max(-1)
    return (i, (q >= v.unsqueeze(-1)).sum(-1))  # eager: 1 (the max itself)


_selection("S7b ... float32 probabilities cast to fp16 for the selection and the mask (counts of 0)", "bd66c8e", "backend",
           fp16_cast_counted_against_max, {"x": X_SPREAD}, [INDEX, Out("other")])


# ---- softmax -> topk, hand-written post-grad forms (make_fx; 9bc0763, fixed on ea7481a) ----


def amax_without_dim(x):
    e = torch.exp(x - torch.amax(x))
    p = e / torch.sum(e, -1, keepdim=True)
    return (torch.topk(p, 2, -1).indices,)


_hand("S3 amax without a dim: the pass raises IndexError", "9bc0763", amax_without_dim, {"x": X}, [INDEX])


def amax_without_keepdim(x):  # square: x - amax(x, -1) broadcasts the row maxima along the rows
    e = torch.exp(x - torch.amax(x, -1))
    p = e / torch.sum(e, -1, keepdim=True)
    return (torch.argmax(p, -1),)


_hand("S4 amax without keepdim (square input) taken for a softmax", "9bc0763", amax_without_keepdim,
      {"x": torch.tensor([[0.0, 1.0, 2.5], [5.0, 0.5, 0.0], [1.0, 4.0, 3.5]])}, [INDEX])


def where_two_temperatures(x, c):
    a = (x - torch.amax(x, -1, keepdim=True)) / 2.0
    y = x / 0.25
    b = y - torch.amax(y, -1, keepdim=True)
    e = torch.exp(torch.where(c, a, b))  # an elementwise condition mixes two temperatures
    p = e / torch.sum(e, -1, keepdim=True)
    return (torch.topk(p, 3, -1).indices,)


_hand("S5 where() with two different temperatures taken for Inductor's temperature form", "9bc0763", where_two_temperatures,
      {"x": torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0]]), "c": torch.tensor([[True, False, True, False, True]])}, [INDEX])


# ---- seed fold, Dynamo level (9bc0763: merging was on the Dynamo graph) ----

I2 = {"seq_lens": torch.tensor([3, 5]), "pos": torch.tensor([0, 2])}

_fold("F1 torch.binomial is not known to be random: two draws merged", "9bc0763", "pipeline", """
    B = 2
    def seed(seq_lens, count, prob):
        r0 = torch.binomial(count, prob)
        return (seq_lens, r0, count, prob)
    def loop(c_seq_lens, c_r0, c_count, c_prob):
        d0 = torch.binomial(c_count, c_prob)
        return (c_r0 + 1, d0 + 1)
""", {"seq_lens": torch.tensor([3, 5]), "count": torch.tensor([10.0, 20.0]), "prob": torch.tensor([0.5, 0.25])}, random=True)

_fold("F1b ... and erased once the seam marker's removal leaves it unused (the draw stream shifts)", "9bc0763", "pipeline", """
    B = 2
    def seed(seq_lens, count, prob):
        r0 = torch.binomial(count, prob)
        return (seq_lens, r0)
    def loop(c_seq_lens, c_r0):
        return (torch.randint(0, 1000, (B,)),)
""", {"seq_lens": torch.tensor([3, 5]), "count": torch.tensor([10.0, 20.0]), "prob": torch.tensor([0.5, 0.25])}, random=True)

_fold("F2 a write through torch.einsum('i->i', t) (a view) is not seen: setup merged across it", "9bc0763", "pipeline", """
    B = 2
    def seed(seq_lens, pos):
        a0 = pos * 2
        return (pos, a0)
    def loop(c_pos, c_a0):
        torch.einsum('i->i', c_pos).add_(3)
        b0 = c_pos * 2
        return (c_a0 + 1, b0 + 1)
""", I2)

_fold("F3 torch._foreach_add_ is not seen as a write: setup merged across it", "9bc0763", "pipeline", """
    B = 2
    def seed(seq_lens, pos):
        a0 = pos * 2
        return (pos, a0)
    def loop(c_pos, c_a0):
        torch._foreach_add_([c_pos], 1)
        b0 = c_pos * 2
        return (c_a0 + 1, b0 + 1)
""", I2)

_fold("F4 inputs that alias (a pool and a view of it, passed together) are taken as independent", "9bc0763", "pipeline", """
    B = 2
    def seed(seq_lens, pool, view):
        a0 = view * 2
        return (pool, view, a0)
    def loop(c_pool, c_view, c_a0):
        c_pool.add_(1)
        b0 = c_view * 2
        return (c_a0 + 1, b0 + 1)
""", {"seq_lens": torch.tensor([3, 5]), "pool": torch.tensor([1, 2, 3])}, views=[("view", "pool", "1:3")])

_fold("F5 a declared range is used for the input's value after the draft wrote it", "9bc0763", "pipeline", """
    B = 2
    def seed(seq_lens, pos):
        a0 = seq_lens - 1
        return (seq_lens, a0)
    def loop(c_seq_lens, c_a0):
        c_seq_lens.sub_(3)
        b0 = c_seq_lens - 1
        b1 = (c_seq_lens - 1).clamp(min=0)  # 'proven' equal to b0 from seq_lens >= 1
        return (c_a0 + 1, b0 + 1, b1 + 1)
""", I2, {"seq_lens": (1, None)})

_fold("F6 int32 products that wrap, widened by promotion, 'proven' equal to the int64 product", "9bc0763", "pipeline", """
    B = 2
    def seed(seq_lens, scale):
        a0 = scale * scale + seq_lens
        return (seq_lens, scale, a0)
    def loop(c_seq_lens, c_scale, c_a0):
        b0 = c_scale.long() * c_scale.long() + c_seq_lens
        return (c_a0 + 1, b0 + 1)
""", {"seq_lens": torch.tensor([3, 5]), "scale": torch.tensor([50000, 60000], dtype=torch.int32)})


# ---- seed fold on ea7481a (merging moved to the post-grad graph) ----

_fold("G1 a declared range on an input the loop writes: the write goes to the assume_range copy, the caller's tensor is not updated",
      "ea7481a", "pipeline", """
    B = 2
    def seed(seq_lens, pos):
        return (seq_lens,)
    def loop(c_seq_lens):
        c_seq_lens.sub_(1)
        return (c_seq_lens + 0,)
""", I2, {"seq_lens": (1, None)})

_fold("G2 a forwarded placeholder buffer: a later write through a view of the buffer lands in its source", "ea7481a", "pipeline", """
    B = 2
    def seed(seq_lens, pos):
        a0 = pos + 1
        buf = torch.zeros(B, dtype=torch.int64)
        buf[:] = a0
        return (a0, buf)
    def loop(c_a0, c_buf):
        c_buf.view(-1).add_(5)  # also .detach(), [...], .unsqueeze(0)[0], .reshape, .long(), torch.einsum('i->i', .)
        return (c_a0 + 0,)
""", I2)

_fold("G2b ... and a later write through a view of its source is seen by the buffer", "ea7481a", "pipeline", """
    B = 2
    def seed(seq_lens, pos):
        a0 = pos + 1
        buf = torch.zeros(B, dtype=torch.int64)
        buf[:] = a0
        return (a0, buf)
    def loop(c_a0, c_buf):
        c_a0.view(-1).add_(5)
        return (c_buf + 0,)
""", I2)


def run(name: str) -> Failure | None:
    found, oracle, program = CASES[name]
    if isinstance(program, SeedFoldProgram):
        if oracle == "pipeline" and not pipeline_available():
            oracle = "pass"  # a draftfuse without draftfuse.testing: the Dynamo-level pass
        check = {"pass": seed_fold.check_pass, "pipeline": seed_fold.check_pipeline, "fold": seed_fold.check_fold}[oracle]
        kwargs = {}
    elif isinstance(program, HandProgram):
        check, kwargs = selection.check_handwritten, {}
    else:
        check = {"dynamo": selection.check_dynamo, "expect": selection.check_dynamo, "aten": selection.check_aten,
                 "backend": selection.check_backend}[oracle]
        kwargs = {"expect_rewrites": True} if oracle == "expect" else {}
    try:
        check(program, **kwargs)
    except Failure as failure:
        return failure
    return None


def main() -> int:
    failing = 0
    for name in CASES:
        failure = run(name)
        failing += failure is not None
        print(f"{'FAILS' if failure else 'passes'}  {name}  [found on {CASES[name][0]}]")
        if failure:
            print("       " + str(failure).splitlines()[0][:200])
    print(f"{failing} of {len(CASES)} still fail")
    return 0


if __name__ == "__main__":
    sys.exit(main())
