"""Golden tests of what draftfuse does to your draft.

    import draftfuse.testing
    from expecttest import TestCase

    class MyDraftTest(TestCase):
        def test_greedy_chain(self):
            graphs = draftfuse.testing.draft_graphs(draft, head, token, hidden, pos)
            self.assertExpectedInline(graphs.after, '''...''')      # the Dynamo graph after draftfuse's passes
            self.assertExpectedInline(graphs.post_grad, '''...''')  # the ATen graph after its post-grad passes
            self.assertIn("softmax+topk(k=1) -> argmax", graphs.report)

`draft_graphs(fn, *args, options=None, **kwargs)` traces `fn(*args, **kwargs)` as one Dynamo graph
(fullgraph), runs draftfuse's pipeline on it as the backend does, and gives stable text
(`torch._dynamo.testing.normalize_gm`): the graph as traced (`before`), after the Dynamo-level passes
(`after`), and the functional ATen graph after draftfuse's post-grad passes (`post_grad`: AOT autograd
with Inductor's decompositions and joint-graph passes, as Inductor builds it, then draftfuse's
softmax -> topk and setup merging; Inductor's own later fusions and code generation are not run), plus
the passes' reports (`reports`, and `report` as text with node names). `EXPECTTEST_ACCEPT=1` writes the
expected text into your test. `outputs` are what the post-grad graph computed when run eagerly on
your arguments, to compare with `fn`'s (where an output is an input the draft writes in place, it
shows the value after the write). Random ops stay ATen ops in `post_grad`, as with Inductor's
`fallback_random`.
The draft runs once (its in-place writes happen, as in any call); `options` are draftfuse's options
(the backend's keys); for a `draft_loop` or `fold` draft they default to the draft's own, and its
function is traced (graph inputs named after its parameters). Shapes and ints are static unless marked
dynamic (torch._dynamo.mark_dynamic): a graph does not depend on the arguments of an earlier call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.testing import normalize_gm

from draftfuse.options import Options
from draftfuse.passes.report import PassReport
from draftfuse.runtime.fold import as_compiled
from draftfuse.runtime.tracing import own_code
from draftfuse.runtime.pipeline import post_grad_pass, prepare


@dataclasses.dataclass
class DraftGraphs:
    before: str  # the Dynamo graph as traced
    after: str  # after draftfuse's Dynamo-level passes
    post_grad: str  # the functional ATen graph after draftfuse's post-grad passes
    reports: list[PassReport]  # Dynamo-level passes, then post-grad ones
    outputs: Any  # what the post-grad graph computed on the arguments

    @property
    def report(self) -> str:
        return "\n".join(str(r) for r in self.reports)


def graph_text(gm: torch.fx.GraphModule) -> str:
    """A GraphModule as stable text (names normalised as torch's own golden tests do)."""
    return normalize_gm(gm.print_readable(print_output=False))


def draft_graphs(fn: Callable[..., Any], *args: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> DraftGraphs:
    """Trace `fn(*args, **kwargs)` and run draftfuse's passes on it (see the module docstring)."""
    fn, own, _, args = as_compiled(fn, args)  # a draft_loop or fold: its function, under its options
    parsed = own if options is None else Options.parse(None, options)
    found: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # fullgraph=True: one graph, or Dynamo raises. The backend may still run twice, when Dynamo restarts
        # the trace from inside it (a float64 0-d tensor turned into a Python float: TensorifyScalarRestartAnalysis)
        found.clear()
        prepared = prepare(gm, parsed)
        found.update(before=graph_text(gm), after=graph_text(prepared.graph_module), reports=list(prepared.reports))
        return _post_grad(prepared.graph_module, example_inputs, parsed, found)

    # Static unless marked dynamic: Dynamo's automatic dynamic shapes would otherwise turn a size or int
    # argument that differed in an earlier trace of the same function into a symbol (k = 4, then k = 8).
    with torch.no_grad(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        outputs = torch.compile(own_code(fn), backend=backend, fullgraph=True)(*args, **kwargs)
    return DraftGraphs(found["before"], found["after"], found["post_grad"], found["reports"], outputs)


def _post_grad(gm: torch.fx.GraphModule, example_inputs: list[Any], options: Options, found: dict[str, Any]) -> Callable[..., Any]:
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.decomposition import select_decomp_table

    def forward_compiler(graph_module: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        # what Inductor runs before post-grad (random ops stay ATen ops, as with Inductor's fallback_random:
        # its replacement of them needs a real compile's context)
        with torch._inductor.config.patch({**options.inductor, "fallback_random": True}):
            graph_module = _recursive_joint_graph_passes(graph_module)
            graph_module.graph.eliminate_dead_code()
            passes = post_grad_pass(options, gm)  # the user's own post-grad pass first, as the backend runs it
            passes(graph_module.graph)
        graph_module.recompile()
        found["post_grad"] = graph_text(graph_module)
        found["reports"] += passes.reports
        return graph_module.forward

    return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler, decompositions=select_decomp_table())
