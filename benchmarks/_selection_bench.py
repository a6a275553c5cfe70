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
tokens_match: the indices pick the k largest logits (of x / t for the temperature rows; exact ties:
either index).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks import selection
from benchmarks._rows import row
from benchmarks.targets import SELECTION_KS
from draftfuse import _measure

PROFILED_CALLS = 5


def variants(k: int) -> dict[str, str]:
    """benchmarks/selection.py's method names -> the variant names of the rows."""
    torch_variant = "torch.argmax" if k == 1 else "torch.topk"
    return {"softmax+topk": "softmax+topk", "torch": torch_variant, "draftfuse": "draftfuse"}


def _plan() -> list[tuple[int, str | None, str, str]]:
    """(k, temperature, selection_call's method, variant) of every row of a shape, in row order: each k's
    plain rows, then each k's temperature-tensor rows."""
    plan = [(k, None, method, variant) for k in SELECTION_KS for method, variant in variants(k).items()]
    return plan + [(k, "tensor", v, v) for k in SELECTION_KS for v in ("softmax+topk", "draftfuse")]


def _tempered_call(variant: str, k: int, t: torch.Tensor) -> Callable[[torch.Tensor], object]:
    if variant == "softmax+topk":
        return lambda x: torch.topk(torch.softmax(x.float() / t[:, None], -1), k)
    return selection.selection_call("draftfuse", k, None, scale=1 / t)


def _picks_largest(logits: torch.Tensor, outputs, k: int) -> bool:
    """Whether the int64 output of a selection picks the k largest of `logits` (exact ties: either index)."""
    index = next(t for t in ((outputs,) if isinstance(outputs, torch.Tensor) else outputs) if t.dtype == torch.int64)
    picked = logits.gather(-1, index.reshape(logits.shape[0], -1)).sort(-1, descending=True).values
    return torch.equal(picked, torch.topk(logits, k, dim=-1).values)


def _measure_call(fn, inputs: list[torch.Tensor], device: torch.device, rounds: int, replays: int) -> dict:
    call = lambda: fn(inputs[0])  # noqa: E731
    if device.type == "cuda":
        timing = _measure.summary(_measure.time_in_graph(fn, inputs, replays))
    else:
        timing = _measure.summary([_measure.device_time_us(call, device) for _ in range(rounds)])
    host = _measure.host_time(call, device)
    fields = {**timing, "host_us_per_call": host.us_per_call}
    if host.note:
        fields["host_note"] = host.note
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
                fn, logits = selection.selection_call(method, k, None), inputs[0].float()
                reference = "torch.topk(logits.float(), k)"
            else:
                fn, logits = _tempered_call(variant, k, t), inputs[0].float() / t[:, None]
                reference = "torch.topk(logits.float() / t, k)"
            match = _picks_largest(logits, fn(inputs[0]), k)  # also the warm-up (Triton's JIT)
            made.update(_measure_call(fn, inputs, device, rounds, replays), tokens_match=match)
            made["tokens_reference"] = reference
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
