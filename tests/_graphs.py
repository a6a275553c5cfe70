"""Test helpers: capture a function's Dynamo graph and a compiled function's post-grad graphs as text."""

from __future__ import annotations

import torch
import torch.fx

from draftfuse.testing import graph_text  # the helper users' golden tests use, so ours show the same text


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """The one Dynamo graph of fn(*args) (fullgraph), not compiled further."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def fx_graph_text(graph: torch.fx.Graph) -> str:
    """The text of a graph, with the module that holds its constants (get_attr) where it has one."""
    return graph_text(torch.fx.GraphModule(graph.owning_module or torch.nn.Module(), graph))
