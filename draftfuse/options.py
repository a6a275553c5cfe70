"""draftfuse's options, parsed and validated once, then carried through the pipeline.

`torch.compile(fn, backend="draftfuse", mode=..., options={...})` and `draft_loop(mode=..., options=...)`
take one `options` dict that mixes draftfuse's keys with Inductor config names:

    "probs":         "exact" (default) | "ones": values of k = 1 selections. "ones" is the constant 1.0
                     (0.0 for log-probabilities) that greedy chains use when nothing reads them.
    "lowering":      "auto" (default) | "torch" | "kernels": how a rewritten selection is computed.
                     "auto" takes draftfuse's one-pass selection kernels where they run (CUDA, Triton,
                     fp32/fp16/bf16, k <= 16, last dim) and torch's argmax/topk elsewhere.
    "half_probs":    "rewrite" (default) | "keep": whether to rewrite selections that read fp16/bf16
                     probabilities. There, two close logits can round to the same probability: the
                     original picks the lower index of the tie, the rewrite the larger logit.
    "softmax_topk":  True (default): the softmax -> topk rewrite, on Dynamo and post-grad graphs.
    "seed_fold":     True (default): the seed fold (Dynamo graph) and setup merging (post-grad graph).
    "vocab_parallel": True (default): all_gather -> softmax -> topk becomes a local selection.
    "spare_recordings": 2 (default) | 1 | 0: draft_loop's recordings of a draft beside the main one,
                     whose outputs it hands out without a copy while nothing else holds them; each
                     costs one more CUDA graph capture and memory pool. 0: outputs copied every call.

Every other key must name an Inductor config entry (`torch._inductor.list_options()`, dashes or
underscores): anything else raises ValueError, since a misspelt option silently ignored would make a
benchmark measure the wrong thing. `mode` becomes Inductor settings as torch.compile's own Inductor
backend makes them (`torch._inductor.list_mode_options`; "reduce-overhead" is `triton.cudagraphs=True`);
settings in `options` win over the mode's.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

import torch

_CHOICES: dict[str, tuple[Any, ...]] = {
    "probs": ("exact", "ones"),
    "lowering": ("auto", "torch", "kernels"),
    "half_probs": ("rewrite", "keep"),
    "softmax_topk": (True, False),
    "seed_fold": (True, False),
    "vocab_parallel": (True, False),
    "spare_recordings": (2, 1, 0),
}


@functools.cache
def _inductor_config_names() -> frozenset[str]:
    return frozenset(torch._inductor.config.get_config_copy())  # a full copy costs ~10 ms: once


@dataclasses.dataclass(frozen=True)
class Options:
    """draftfuse's options (defaults as documented above) and the Inductor settings to compile with."""

    probs: str = "exact"
    lowering: str = "auto"
    half_probs: str = "rewrite"
    softmax_topk: bool = True
    seed_fold: bool = True
    vocab_parallel: bool = True
    spare_recordings: int = 2
    mode: str | None = None
    inductor: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # config patches, the mode's included

    @classmethod
    def parse(cls, mode: str | None = None, options: Mapping[str, Any] | None = None) -> Options:
        """Validate `mode` and `options` (see the module docstring); raises ValueError on a bad key or value."""
        own: dict[str, Any] = {}
        modes = torch._inductor.list_mode_options()
        if mode is not None and mode not in modes:
            raise ValueError(f"mode={mode!r}: pass one of {', '.join(map(repr, modes))} or None")
        inductor = dict(modes[mode]) if mode and mode != "default" else {}
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"draftfuse: options must be a dict of option names to values, not {type(options).__name__}")
        names = [key.replace("-", "_") if isinstance(key, str) else key for key in (options or {})]
        if twice := sorted({name for name in names if names.count(name) > 1}):  # max-autotune and max_autotune
            raise ValueError(f"draftfuse: option {twice[0]!r} is given twice (spelled with - and with _)")
        for key, value in (options or {}).items():
            if not isinstance(key, str):
                raise ValueError(f"draftfuse: option names are strings, not {key!r}")
            if key in _CHOICES:
                own[key] = value
            elif key.replace("-", "_") in _inductor_config_names():
                name = key.replace("-", "_")
                expected = torch._inductor.config.get_type(name)  # as torch.compile checks its options
                if typing.get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
                    raise ValueError(f"draftfuse: Inductor option {key!r} takes a {expected.__name__}, not {value!r}")
                inductor[name] = value
            else:
                raise ValueError(
                    f"draftfuse: unknown option {key!r}. draftfuse's options are {sorted(_CHOICES)}; "
                    "any other key must be an Inductor config name (see torch._inductor.list_options())"
                )
        for key, value in own.items():
            # of the choice's own type: 1 == True == 1.0, yet neither is what a bool or an int option takes
            if not any(type(value) is type(c) and value == c for c in _CHOICES[key]):
                raise ValueError(f"draftfuse: option {key!r} must be one of {_CHOICES[key]}, not {value!r}")
        return cls(**own, mode=mode, inductor=inductor)

    @property
    def uses_cudagraphs(self) -> bool:
        return bool(self.inductor.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs))

    def with_inductor(self, **settings: Any) -> Options:
        """A copy with more Inductor settings (draftfuse's own, such as cudagraph_or_error)."""
        return dataclasses.replace(self, inductor={**self.inductor, **settings})

    @property
    def post_grad(self) -> bool:
        """Whether a post-grad pass is on (the pipeline installs draftfuse's post-grad pass)."""
        return self.softmax_topk or self.seed_fold or self.vocab_parallel

    def pass_key(self) -> tuple:
        """What the passes' behaviour depends on, for cache keys (the Inductor settings key themselves)."""
        return (self.probs, self.lowering, self.half_probs, self.softmax_topk, self.seed_fold, self.vocab_parallel)
