"""The benchmark's result rows: their fields, how one is made, keyed and ordered. Measuring (run.py and its
_*_bench modules) makes rows; benchmarks/report.py reads them (and imports nothing else of the benchmark:
it needs neither torch nor draftfuse).

A row that failed also has "error" (its exception, one line) with null timings; a row may have "notes"
(text: why a target is missed there, which the report prints next to the miss) and "host_note" (why its
host time is null on a GPU: the call waits on the device).
"""

from __future__ import annotations

import re

WORKLOADS = ("mtp", "eagle", "draft_model", "selection")  # the workloads run.py measures
DRAFT_WORKLOADS = ("mtp", "eagle", "draft_model")
TITLES = {
    "mtp": "frozen-KV MTP draft (seed + 3 steps)",
    "eagle": "EAGLE-style head, greedy chain (seed + 3 steps)",
    "draft_model": "independent draft model, 2 layers (seed + 3 steps)",
    "selection": "selection alone: picking tokens from logits",
    "tp_selection": "vocab-parallel selection (tensor parallel)",
}
ROW_KEYS = (
    "workload", "batch", "vocab", "k", "dtype", "temperature", "variant", "median_us", "p10_us", "p90_us",
    "graph_launches_per_call", "kernel_launches_per_call", "host_us_per_call", "tokens_match",
    "compile_cold_s", "compile_warm_s", "tokens_reference",
)  # fmt: skip
DRAFT_VARIANTS = ("eager", "eager_seed+captured_loop", "hand_fold+hand_argmax", "raw_cuda_graph", "draftfuse")
SELECTION_VARIANTS = ("floor", "softmax+topk", "torch.argmax", "torch.topk", "draftfuse")
TP_GATHER = "all_gather+softmax+topk"  # tp_selection's baseline variant: the logits gathered, then selected
_ORDER = (*DRAFT_VARIANTS, *SELECTION_VARIANTS, TP_GATHER)


def results_name(device_name: str) -> str:
    """The NAME of the results files (NAME.json, NAME_tp.json, ...) of a GPU named `device_name`
    (torch.cuda.get_device_name): h200 on an H200, else the name in lower case with dashes."""
    return "h200" if "H200" in device_name else re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def row(workload: str, batch: int, vocab: int | None, k: int | None, dtype: str, variant: str, **fields) -> dict:
    """A row with every field of ROW_KEYS (null unless given) and any extra `fields` ("error", "notes")."""
    made = dict.fromkeys(ROW_KEYS)
    made.update(workload=workload, batch=batch, vocab=vocab, k=k, dtype=dtype, variant=variant, **fields)
    return made


def row_key(r: dict) -> tuple:
    """What a row measures."""
    return tuple(r.get(k) for k in ("workload", "tp", "batch", "vocab", "k", "dtype", "temperature", "variant"))


def unit_key(r: dict) -> tuple:
    """The unit a row was measured in (a draft workload at a batch; a logits shape): run together, side by
    side, so that a unit measured again replaces every row of it (a unit that failed has rows of its
    own, with the error, which must not leave the rows of an earlier run standing beside them)."""
    if r["workload"] in DRAFT_WORKLOADS:
        return (r["workload"], r.get("tp"), r["batch"])
    return (r["workload"], r.get("tp"), r["batch"], r.get("vocab"), r.get("dtype"))


def replace_units(rows: dict[tuple, dict], new: list[dict]) -> None:
    """Add `new` to `rows` (by row_key), first dropping every row of a unit that `new` measures."""
    units = {unit_key(r) for r in new}
    for key in [key for key, r in rows.items() if unit_key(r) in units]:
        del rows[key]
    rows.update((row_key(r), r) for r in new)


def sort_key(r: dict) -> tuple:
    order = (*WORKLOADS, "tp_selection")
    workload = order.index(r["workload"]) if r["workload"] in order else len(order)
    variant = _ORDER.index(r["variant"]) if r["variant"] in _ORDER else len(_ORDER)
    return (workload, r.get("tp") or 0, str(r.get("dtype")), r.get("temperature") or "", r.get("k") or 0,
            r.get("vocab") or 0, r["batch"], variant)  # fmt: skip
