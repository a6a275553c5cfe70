"""What a draft's recorded CUDA graph looks like to the driver, and what replaying it costs the host.

notes/host.md found MTP's graph replaying in 13-21 µs of host time where graphs of each kind of node it
holds (and of all of them in turn), captured on one stream, replay in 4-6 µs. One guess: those probe
graphs are a straight line of nodes, and a graph whose nodes branch (several roots, a node with several
parents or children: work captured on more than one stream) may be launched differently by the driver.
This probe dumps each workload's graphs (draftfuse's main recording and the raw runner's) with
CUDAGraph.debug_dump (cudaGraphDebugDotPrint; every graph of this process keeps its cudaGraph_t for it), counts
their nodes by kind and their edges, roots and branching nodes, and times graph.replay() alone the way
notes/host_breakdown.py does (host µs per call with the GPU kept busy).

    python notes/graph_shape_probe.py [--batches 1 32] [--out DIR]   (GPU; DIR gets the .dot files and a JSON)
"""

import argparse
import collections
import gc
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402

from host_breakdown import BUILDERS, host_us, recorded  # noqa: E402

_new = torch.cuda.CUDAGraph.__new__


def _kept(cls, keep_graph: bool = False):
    """Every CUDA graph of this process keeps its cudaGraph_t (instantiated on its first replay), which
    debug_dump prints; the executable graph that replays is the same."""
    return _new(cls, True)


torch.cuda.CUDAGraph.__new__ = _kept
_init = torch.cuda.CUDAGraph.__init__
if _init is not object.__init__:  # a pybind __init__ (torch 2.11) re-initialises with the caller's keep_graph=False
    torch.cuda.CUDAGraph.__init__ = lambda self, keep_graph=False: _init(self, True)


def shape(dot: str) -> dict:
    """Nodes by kind, edges, roots, and nodes with more than one parent or child, from a DOT dump."""
    nodes = {m.group(1): m.group(2) for m in re.finditer(r'"(graph_\d+_node_\d+)"\[[^\[]*?label="\{(\w+)', dot)}
    edges = re.findall(r'"?(graph_\d+_node_\d+)"?\s*->\s*"?(graph_\d+_node_\d+)"?', dot)
    parents, children = collections.Counter(b for _, b in edges), collections.Counter(a for a, _ in edges)
    return {
        "nodes": len(nodes),
        "kinds": dict(collections.Counter(nodes.values())),
        "edges": len(edges),
        "roots": sum(1 for n in nodes if parents[n] == 0),
        "leaves": sum(1 for n in nodes if children[n] == 0),
        "joins": sum(1 for n in nodes if parents[n] > 1),
        "forks": sum(1 for n in nodes if children[n] > 1),
        "straight line": len(edges) == len(nodes) - 1 and all(c <= 1 for c in parents.values()) and all(c <= 1 for c in children.values()),
    }


def probe(name: str, batch: int, out: Path) -> dict:
    raw, raw_graph, ours, loop = recorded(name, batch, torch.device("cuda"))  # the calls alive: their static buffers
    recorder = loop._replays[0].recorder
    torch.cuda.synchronize()
    row = {"workload": name, "batch": batch}
    for which, graph in (("draftfuse", recorder.graph), ("raw runner", raw_graph)):
        path = out / f"{name}_b{batch}_{which.replace(' ', '_')}.dot"
        graph.enable_debug_mode()
        graph.debug_dump(str(path))  # cudaGraphDebugDotPrint on the kept graph
        row[f"{which} graph"] = shape(path.read_text()) if path.exists() else "no dump"
    row["draftfuse replay alone"] = host_us(recorder.graph.replay, torch.device("cuda"))
    row["raw runner replay alone"] = host_us(raw_graph.replay, torch.device("cuda"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--only", nargs="+", default=list(BUILDERS))
    parser.add_argument("--out", default="graph_shapes")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch in args.batches:
        for name in args.only:
            rows.append(probe(name, batch, out))
            print(json.dumps(rows[-1]), flush=True)
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    (out / "graph_shapes.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
