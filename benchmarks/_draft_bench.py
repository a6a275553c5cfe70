"""Measuring one draft workload at one batch size: every variant of benchmarks/_drafts.py, side by side.

In one process, every variant on the same inputs (the timing itself is draftfuse/_measure.py's):
  * compile_cold_s: the first call of each compiled variant (compile and CUDA-graph warm-up or capture
    included), in a fresh Inductor cache directory on a GPU (run.py opens it). compile_warm_s, at each
    workload's first batch only: torch._dynamo.reset(), a fresh torch.compile of the same function, its
    first call (Inductor's FX graph cache can hit). The compiled code of that second compile is the one timed.
  * median_us, p10_us, p90_us: warm-up, then `rounds` rounds in which the variants alternate call by call;
    each call timed with CUDA events from an idle device (synchronised before): the device's view of one
    draft, launch gaps included.
  * host_us_per_call (after the check below, on its second input set): _measure.host_times, the time for
    the Python call to return with the GPU kept busy behind a long GPU sleep (checked still busy when the
    batch ended), elapsed / calls; the median of 5 batches, the variants taking turns.
  * tokens_match, tokens_reference, probs_max_abs_diff, tokens_changed_by_inputs: after the timing, one
    call of each variant on the workload's inputs, then Workload.vary() (other tokens, hidden states and
    positions, written into the same input tensors: benchmarks/_drafts.py), then one call of each on those;
    every call's output tensors cloned as it returns, before any other call runs. Per input set, a
    variant's integer outputs (the drafted tokens) must equal its references' (`eager` and
    `hand_fold+hand_argmax`, named in tokens_reference) exactly, and its floating outputs (the tokens'
    probabilities of mtp and draft_model) must be within PROBS_TOLERANCE of theirs: tokens_match is both.
    probs_max_abs_diff: the largest absolute difference of those probabilities (null where the draft
    returns none). tokens_changed_by_inputs: the variant's tokens after vary() differ from its tokens
    before, which shows the check saw the inputs; where the eager draft's did not change, each row's
    notes say so. A variant that replays stale work drafts the same tokens twice and misses its references.
  * graph and kernel launches per call: torch.profiler over a few more calls of each variant, after the
    check and host_us_per_call.
On a CPU there are no CUDA events, graphs, launches or a device to keep busy: those fields are null and
the times are perf_counter's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from benchmarks import _drafts
from benchmarks._rows import DRAFT_VARIANTS, row
from draftfuse import _measure

# CUDA graph trees record on the 2nd call and replay from the 3rd; the rounds after that let clocks settle.
WARMUP_ROUNDS = _measure.WARMUP_CALLS + 7
PROFILED_CALLS = 5
# Largest absolute difference allowed between a variant's probabilities and its references'. Each is
# computed in float32 from the draft's logits, which the LM head returns in the weights' dtype: bf16 at the
# reference size, where the drafted token's logit is 7.97 to 8.38 (draft_model) or 9.88 to 10.44 (mtp) at
# batch 8 (see _drafts), and bf16 values below 16 are at most 2^-4 apart. Eager and compiled code round the
# matmuls, norms and carried hidden states differently, so a logit can land one bf16 step away, which
# moves p by p (1 - p) * 2^-4 / temperature: at most 0.022 at temperature 0.7, 0.016 at 1. On a CPU the
# largest difference was 0.009 (mtp; draft_model 1e-5) at the reference size in bf16, batch 1, and under
# 1e-6 at the tiny size in fp32; on the H200 (reference size, batches 1-64) 0.0093 (mtp) and 0.0223 (draft_model,
# batch 8 and 32: one bf16 step at temperature 0.7), between eager and the hand edit alike. 0.05 allows two such steps. A wrong temperature moves the probabilities
# by far more: 1.0 for 0.7 changes draft_model's by 0.10 to 0.49 at the tiny size (batches 1 to 32) and
# by 0.37 to 0.51 at the reference size (batch 8).
PROBS_TOLERANCE = 0.05
TOKEN_REFERENCES = {
    "eager": ("hand_fold+hand_argmax",),
    "eager_seed+captured_loop": ("eager", "hand_fold+hand_argmax"),
    "hand_fold+hand_argmax": ("eager",),
    "raw_cuda_graph": ("eager", "hand_fold+hand_argmax"),
    "draftfuse": ("eager", "hand_fold+hand_argmax"),
}


def _log(message: str) -> None:
    print(message, flush=True)


def _first_call_s(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _split(outputs: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the integer outputs: drafted tokens, the floating ones: their probabilities), each in output order."""
    return [t for t in outputs if not t.is_floating_point()], [t for t in outputs if t.is_floating_point()]


def _checked_outputs(built: _drafts.Workload, calls: dict, errors: dict) -> dict[str, list[tuple]]:
    """Each variant's outputs on the workload's inputs, then on the inputs built.vary() writes: one call of
    each variant per input set, its outputs cloned as it returns, before the next call. A variant that
    raises is dropped from `calls` (its error kept in `errors`)."""
    outputs: dict[str, list[tuple]] = {}
    for vary in (None, built.vary):
        if vary is not None:
            vary()
        for variant, call in list(calls.items()):
            try:
                outputs.setdefault(variant, []).append(tuple(t.clone() for t in call()))
            except Exception as exc:
                del calls[variant], outputs[variant]
                errors[variant] = _measure.report_error(exc)
    return outputs


def _compare(mine: list[tuple], theirs: list[tuple]) -> tuple[bool, list[float]]:
    """(per input set, the tokens equal (torch.equal: shapes and values) and the probabilities of equal
    shapes; the largest absolute difference of each pair of probability tensors)."""
    equal, diffs = len(mine) == len(theirs), []
    for outputs, reference in zip(mine, theirs):
        (tokens, probs), (ref_tokens, ref_probs) = _split(outputs), _split(reference)
        equal &= len(tokens) == len(ref_tokens) and all(map(torch.equal, tokens, ref_tokens))
        equal &= len(probs) == len(ref_probs) and all(p.shape == r.shape for p, r in zip(probs, ref_probs))
        diffs += [(p.double() - r.double()).abs().max().item() for p, r in zip(probs, ref_probs) if p.numel()]
    return equal, diffs


def _changed(outputs: list[tuple]) -> bool:
    """Whether one variant's tokens after vary() differ from its tokens before."""
    before, after = (_split(o)[0] for o in outputs)
    return not all(map(torch.equal, before, after))


def _check_fields(variant: str, outputs: dict[str, list[tuple]]) -> dict:
    """tokens_match, tokens_reference, probs_max_abs_diff and tokens_changed_by_inputs of `variant`'s row
    (see the module docstring); only the last where none of its references ran."""
    references = [r for r in TOKEN_REFERENCES[variant] if r in outputs]
    if not references:
        return {"tokens_changed_by_inputs": _changed(outputs[variant])}
    equal, diffs = True, []
    for reference in references:
        same, found = _compare(outputs[variant], outputs[reference])
        equal, diffs = equal and same, diffs + found
    worst = math.nan if any(map(math.isnan, diffs)) else max(diffs, default=None)
    within = worst is None or worst <= PROBS_TOLERANCE  # NaN compares False: not within
    return {
        "tokens_match": equal and within,
        "tokens_reference": ", ".join(references),
        "probs_max_abs_diff": worst,
        "tokens_changed_by_inputs": _changed(outputs[variant]),
    }


def _compile_all(built: _drafts.Workload, device: torch.device, label: str, errors: dict, seconds: dict) -> dict:
    """A fresh call of each variant, made and called once; the first call's seconds of compiled ones."""
    calls = {}
    for variant, make in built.variants.items():
        if variant in errors:
            continue
        try:
            calls[variant] = make()
            first = _first_call_s(calls[variant], device)
        except Exception as exc:
            calls.pop(variant, None)
            errors[variant] = _measure.report_error(exc)
            continue
        if variant != "eager":
            seconds[variant] = first
            _log(f"{label}: {variant} compiled in {first:.1f} s")
    return calls


def bench_draft(
    workload: str, size: str, batch: int, device: torch.device, dtype: torch.dtype, rounds: int, warm_compile: bool
) -> list[dict]:
    """One row per variant of `workload` at `batch` (see the module docstring for what each field is)."""
    dtype_name = str(dtype).removeprefix("torch.")
    built = _drafts.WORKLOADS[workload](size, batch, device, dtype)
    errors: dict[str, str] = {}
    cold: dict[str, float] = {}
    warm: dict[str, float] = {}
    calls = _compile_all(built, device, f"{workload} batch {batch} (cold)", errors, cold)
    if warm_compile:
        calls.clear()
        torch._dynamo.reset()  # forget every compile (and CUDA graph): the next compiles start over
        calls = _compile_all(built, device, f"{workload} batch {batch} (warm)", errors, warm)

    samples = _measure.time_alternating(calls, device, rounds, WARMUP_ROUNDS, errors)
    outputs = _checked_outputs(built, calls, errors)
    insensitive = "eager" in outputs and not _changed(outputs["eager"])
    host = _measure.host_times(calls, device)
    launches = {}
    if device.type == "cuda" and calls:
        try:
            launches = _measure.count_launches(calls, PROFILED_CALLS)
        except Exception as exc:  # the counts are not worth the run
            _log(f"launch counting failed: {_measure.report_error(exc)}")

    rows = []
    for variant in DRAFT_VARIANTS:
        fields = {"compile_cold_s": cold.get(variant), "compile_warm_s": warm.get(variant)}
        if variant in errors or variant not in samples:
            fields["error"] = errors.get(variant, "not run")
        else:
            fields.update(_measure.summary(samples[variant]), host_us_per_call=host[variant].us_per_call)
            if host[variant].note:
                fields["host_note"] = host[variant].note
            graphs, kernels = launches.get(variant, (None, None))
            fields.update(graph_launches_per_call=graphs, kernel_launches_per_call=kernels)
            fields.update(_check_fields(variant, outputs))
            if insensitive and "tokens_match" in fields:
                fields["notes"] = (
                    "the eager draft's tokens were the same after Workload.vary() changed its inputs: "
                    "tokens_match does not show that this variant reads its inputs"
                )
        rows.append(row(workload, batch, built.vocab, 1, dtype_name, variant, **fields))
    return rows
