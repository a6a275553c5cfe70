"""Measuring the selection alone at one logits shape: every method and k of benchmarks/selection.py, the
temperature-tensor rows, and the memory floor.

Variants per k (benchmarks/selection.py's selection_call):
  softmax+topk                 torch.topk(torch.softmax(x.float(), -1), k): what draft loops run today
  torch.argmax / torch.topk    the selection alone, without probabilities (k = 1 / k > 1)
  draftfuse                    torch.ops.draftfuse.argmax_prob (index and the exact max-probability) / topk_prob
and with a per-row temperature tensor t (rows with "temperature": "tensor"):
  softmax+topk                 torch.topk(torch.softmax(x.float() / t[:, None], -1), k)
  draftfuse                    selection_call("draftfuse", k, None, scale=1 / t)
floor: the logits' bytes read once at the device-to-device copy bandwidth measured in the same run.

On a GPU each call is timed captured in a CUDA graph of calls over rotating logits buffers that span 3x
the L2 cache (_measure.time_in_graph: kernel time, no launch gaps; draftfuse's kernels with a workspace
made before the capture, as its recordings run them), median, p10, p90 over the replays;
host_us_per_call is _measure.host_time of the call run eagerly, and the launch counts are of the eager
call too. On a CPU, perf_counter around single calls, and no host time or launches. Logits: randn * 4.
tokens_match: the outputs of the eager call, and on a GPU those of every call in the timed CUDA graph
after its last replay, are exact against the logits as the method ranks them (x in float32; x / t for
softmax+topk's temperature rows, x * (1 / t) for draftfuse's, which takes 1 / t as its scale): k
distinct indices a row, whose logits are the k largest in descending order (exact ties: either index),
and, where the method returns probabilities (softmax+topk, draftfuse), softmax of those logits at the
indices within a relative error of PROB_RTOL (prob_rel_error: the largest measured; NaN fails).
rewritten (draftfuse's temperature rows): draftfuse's passes rewrite the spelling a draft writes,
topk(softmax(x.float() / t[:, None], -1), k), into a selection with a scale, and its outputs are exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks import selection
from benchmarks._rows import row
from benchmarks.targets import SELECTION_KS
from draftfuse import _measure

PROFILED_CALLS = 5
PROB_RTOL = 1e-4  # float32 probabilities against float64: a wrong row, scale or index is off by far more


def variants(k: int) -> dict[str, str]:
    """benchmarks/selection.py's method names -> the variant names of the rows."""
    torch_variant = "torch.argmax" if k == 1 else "torch.topk"
    return {"softmax+topk": "softmax+topk", "torch": torch_variant, "draftfuse": "draftfuse"}


def _plan() -> list[tuple[int, str | None, str, str]]:
    """(k, temperature, selection_call's method, variant) of every row of a shape, in row order: each k's
    plain rows, then each k's temperature-tensor rows."""
    plan = [(k, None, method, variant) for k in SELECTION_KS for method, variant in variants(k).items()]
    return plan + [(k, "tensor", v, v) for k in SELECTION_KS for v in ("softmax+topk", "draftfuse")]


def _tempered_call(variant: str, k: int, t: torch.Tensor) -> tuple[Callable[[torch.Tensor], object], Callable, str]:
    """The call, the logits as it ranks them (a function of x), and that reference's text."""
    if variant == "softmax+topk":
        return lambda x: torch.topk(torch.softmax(x.float() / t[:, None], -1), k), lambda x: x.float() / t[:, None], "x.float() / t"
    s = 1 / t
    return selection.selection_call("draftfuse", k, None, scale=s), lambda x: x.float() * s[:, None], "x.float() * (1 / t)"


_REWRITTEN: dict[tuple, bool] = {}  # (dtype, k) -> whether the spelling below was rewritten, exact


def rewritten(x: torch.Tensor, t: torch.Tensor, k: int) -> bool:
    """Whether draftfuse's passes rewrite `topk(softmax(x.float() / t[:, None], -1), k)` (a draft's
    per-row temperature tensor) into a selection with a scale, and the rewritten graph's outputs are
    exact (draftfuse.testing.draft_graphs: draftfuse's Dynamo-level and post-grad passes, Inductor's
    decompositions, run eagerly; on CUDA the rewrite calls the selection kernels). Once per dtype and k
    (the rewrite does not depend on the shape), on the first 8 rows."""
    key = (x.dtype, k)
    if key not in _REWRITTEN:
        from draftfuse.testing import draft_graphs

        def draft(logits, temperature):
            return torch.topk(torch.softmax(logits.float() / temperature[:, None], -1), k)

        graphs = draft_graphs(draft, x[:8], t[:8])
        done = any(r.rewrites for r in graphs.reports if r.pass_name.startswith("softmax_topk"))
        values, index = graphs.outputs
        _REWRITTEN[key] = done and exact(x[:8].float() / t[:8, None], (values, index), k, probs=True)[0]
    return _REWRITTEN[key]


def exact(ranked: torch.Tensor, outputs, k: int, probs: bool) -> tuple[bool, float | None]:
    """Whether a selection's outputs are exact against `ranked` (float32 logits as the method ranks them):
    its int64 output holds k distinct indices a row whose logits are the k largest, in descending order
    (exact ties: either index); where `probs`, its floating output is softmax(ranked) (in float64) at those
    indices within PROB_RTOL. Also the probabilities' largest relative error (None without them)."""
    outs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    index = next(t for t in outs if t.dtype == torch.int64).reshape(ranked.shape[0], -1)
    ok = index.shape[-1] == k and torch.equal(ranked.gather(-1, index), torch.topk(ranked, k, dim=-1).values)
    ordered = index.sort(-1).values
    ok = ok and bool((ordered[:, 1:] != ordered[:, :-1]).all())
    if not probs:
        return ok, None
    prob = next(t for t in outs if t.is_floating_point()).reshape(index.shape).double()
    expected = torch.softmax(ranked.double(), -1).gather(-1, index)
    error = ((prob - expected).abs() / expected.clamp_min(1e-300)).max().item()
    return ok and error <= PROB_RTOL, error  # a NaN error compares False


def _measure_call(fn, inputs: list[torch.Tensor], device: torch.device, rounds: int, replays: int, check=None) -> dict:
    call = lambda: fn(inputs[0])  # noqa: E731
    if device.type == "cuda":
        timing = _measure.summary(_measure.time_in_graph(fn, inputs, replays, check=check))
    else:
        timing = _measure.summary([_measure.device_time_us(call, device) for _ in range(rounds)])
    host = _measure.host_time(call, device)
    fields = {**timing, "host_us_per_call": host.us_per_call}
    if host.note:
        fields["host_note"] = host.note
    return fields


def _checked(fn, ranked: Callable, k: int, probs: bool, inputs: list[torch.Tensor], device, rounds: int, replays: int) -> dict:
    """_measure_call's fields, with tokens_match: the eager call's outputs exact, and on a GPU the outputs
    of every call of the timed graph after its last replay; prob_rel_error the largest of them."""
    results = [exact(ranked(inputs[0]), fn(inputs[0]), k, probs)]  # the eager call is also the warm-up (Triton's JIT)
    check = lambda i, out: results.append(exact(ranked(inputs[i]), out, k, probs))  # noqa: E731
    fields = _measure_call(fn, inputs, device, rounds, replays, check)
    errors = [e for _, e in results if e is not None]
    fields.update(tokens_match=all(ok for ok, _ in results), prob_rel_error=max(errors) if errors else None)
    if not results[0][0] or not fields["tokens_match"]:
        failed = "the eager call" if not results[0][0] else "the timed graph's replayed calls"
        fields["notes"] = f"outputs not exact: {failed} (prob_rel_error {fields['prob_rel_error']})"
    return fields


def bench_selection_shape(
    dtype_name: str, vocab: int, batch: int, device: torch.device, rounds: int, replays: int, bandwidth: float | None
) -> list[dict]:
    """Rows of every selection variant and k for one logits shape, and the floor where it is known."""
    dtype = getattr(torch, dtype_name)
    nbytes = batch * vocab * dtype.itemsize
    generator = torch.Generator(device).manual_seed(0)
    buffers = _measure.rotation_count(nbytes, device)
    inputs = [torch.randn(batch, vocab, device=device, generator=generator).mul_(4).to(dtype) for _ in range(buffers)]
    t = torch.rand(batch, device=device, generator=generator) + 0.5  # per-row temperatures in [0.5, 1.5)
    rows = []
    if bandwidth:
        rows.append(row("selection", batch, vocab, None, dtype_name, "floor", median_us=nbytes / bandwidth * 1e6))

    calls = {}
    for k, temperature, method, variant in _plan():
        made = row("selection", batch, vocab, k, dtype_name, variant, temperature=temperature)
        try:
            if temperature is None:
                fn, ranked, reference = selection.selection_call(method, k, None), lambda x: x.float(), "x.float()"
            else:
                fn, ranked, reference = _tempered_call(variant, k, t)
            probs = variant in ("softmax+topk", "draftfuse")
            made.update(_checked(fn, ranked, k, probs, inputs, device, rounds, replays))
            if temperature is not None and variant == "draftfuse":
                made["rewritten"] = rewritten(inputs[0], t, k)
            made["tokens_reference"] = f"exact against {reference}" + (" and softmax of it" if probs else "")
        except Exception as exc:
            made["error"] = _measure.report_error(exc)
        else:
            calls[k, temperature, variant] = lambda fn=fn: fn(inputs[0])
        rows.append(made)
    if device.type == "cuda" and calls:
        # The timed calls sit in a CUDA graph; these counts are of the same calls run eagerly.
        try:
            launches = _measure.count_launches(calls, PROFILED_CALLS)
        except Exception as exc:  # the counts are not worth the run
            print(f"launch counting failed: {_measure.report_error(exc)}", flush=True)
            launches = {}
        for r in rows:
            key = (r["k"], r["temperature"], r["variant"])
            if key in launches:
                r["kernel_launches_per_call"] = launches[key][1]
    return rows


def failed_rows(dtype_name: str, vocab: int, batch: int, error: str) -> list[dict]:
    """The rows of a shape whose setup failed (e.g. out of memory), each with the error."""
    return [row("selection", batch, vocab, k, dtype_name, v, temperature=tmp, error=error) for k, tmp, _, v in _plan()]
