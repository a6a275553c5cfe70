"""The test oracle for selection rewrites: what "the same tokens, except the documented cases" means."""

from __future__ import annotations

import torch


def ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of `values`' dtype at each value (float64 result)."""
    info = torch.finfo(values.dtype)
    magnitude = values.double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


def assert_same_selection(probs: torch.Tensor, dim: int, want_index: torch.Tensor, got_index: torch.Tensor, keepdim: bool) -> None:
    """got_index picks, from the probabilities the original selected on, the same values as want_index.

    Equal indices pass. A different index passes only when the original's probabilities tie there,
    which is the documented rounding-tie case (argmax then returns the logits' true maximum while
    topk of the rounded probabilities returns the lower index). Rows with NaN are the other documented
    case and must be excluded by the caller.
    """
    if not keepdim:
        want_index, got_index = want_index.unsqueeze(dim), got_index.unsqueeze(dim)
    assert got_index.shape == want_index.shape, (got_index.shape, want_index.shape)
    picked_want = probs.gather(dim, want_index)
    picked_got = probs.gather(dim, got_index)
    differ = want_index != got_index
    assert torch.equal(picked_want[differ], picked_got[differ]), "indices differ without a tie in the probabilities"


def assert_values_close(want: torch.Tensor, got: torch.Tensor, max_ulps: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    distance = (got.double() - want.double()).abs() / ulp(want)
    worst = distance.max().item() if distance.numel() else 0.0
    assert worst <= max_ulps, f"values differ by {worst:.2f} ulp (allowed {max_ulps})"
