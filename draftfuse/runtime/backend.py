"""The `draftfuse` torch.compile backend: the pipeline's two steps, prepare then lower.

    torch.compile(fn, backend="draftfuse", mode="reduce-overhead")
    torch.compile(fn, backend="draftfuse", options={"probs": "ones", "triton.cudagraphs": True})

torch passes `mode` and `options` to a backend other than Inductor and leaves turning them into
Inductor settings to it (draftfuse.options says how, and which keys are draftfuse's). torch.compile
refuses `mode` and `options` together: put the mode's settings in `options` ("triton.cudagraphs": True
is what "reduce-overhead" sets), or use `draft_loop`, which takes both.

A user's own `post_grad_custom_pre_pass` is kept: it runs first, then draftfuse's, in one
CustomGraphPass whose uuid covers both (None, i.e. no FX graph caching, if the user's has none).
Logging (`TORCH_LOGS=draftfuse`): the Dynamo graph, the graph handed to Inductor, each pass's report
and its before/after graphs.

`Backend(options)` is the same backend with fixed options that keeps a `CompileRecord` per compile
(`.compiles`): `torch.compile(fn, backend=Backend())` for tests and tools that read the reports.

Registered as "draftfuse" twice over, harmlessly: the `torch_dynamo_backends` entry point (the name
works without importing draftfuse) and on import of this module (for a source checkout that is not
installed). torch asserts on a duplicate name, so the import-time registration steps aside when the
name is already taken or the entry point is known to torch's registry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from draftfuse.options import Options
from draftfuse.runtime.pipeline import CompileRecord, lower, prepare

BACKEND_NAME = "draftfuse"


def draftfuse_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """torch.compile backend: draftfuse's passes, then Inductor with `mode` and `options` applied."""
    parsed = _parse(mode, options)
    compiled, _ = lower(prepare(gm, parsed), example_inputs, parsed)
    return compiled


def _parse(mode: str | None, options: dict[str, Any] | None) -> Options:
    if options and "spare_recordings" in options:  # its default too: a dict shared with draft_loop is not checked silently
        raise ValueError("draftfuse: option 'spare_recordings' is draft_loop's (it records its CUDA graphs itself); the backend has none")
    return _for_backend(Options.parse(mode, options))


def _for_backend(options: Options) -> Options:
    """`options`, refusing draft_loop's own: the backend's CUDA graphs are torch's graph trees."""
    if options.spare_recordings != Options.spare_recordings:
        raise ValueError("draftfuse: option 'spare_recordings' is draft_loop's (it records its CUDA graphs itself); the backend has none")
    return options


class Backend:
    """The draftfuse backend with options fixed up front (or taken from torch.compile's mode and
    options when none are given), recording every compile in `compiles`."""

    def __init__(self, options: Options | None = None) -> None:
        self.options = _for_backend(options) if options is not None else None
        self.compiles: list[CompileRecord] = []

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None
    ) -> Callable[..., Any]:
        if self.options is not None and (mode is not None or options):
            raise ValueError(
                "draftfuse: this Backend was built with its options (Backend(options)): torch.compile's "
                f"mode={mode!r}/options={options!r} would be ignored; give them to Backend, or build it without options"
            )
        parsed = self.options or _parse(mode, options)
        compiled, record = lower(prepare(gm, parsed), example_inputs, parsed)
        self.compiles.append(record)
        return compiled


def _register() -> None:
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return  # registered already: a second import, or torch loaded the entry point
    if isinstance(registry._BACKENDS.get(BACKEND_NAME), EntryPoint):
        # torch knows the entry point and registers whatever it loads, possibly this very import:
        # registering here too would trip its duplicate-name assert.
        return
    registry.register_backend(draftfuse_backend, name=BACKEND_NAME)


_register()
