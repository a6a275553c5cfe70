"""`draftfuse.explain`: a golden report for one example, and the obstacles it finds, with file and line."""

import inspect
import os
import sys
from pathlib import Path

import torch
from expecttest import TestCase

from draftfuse.explain import explain
from draftfuse.runtime.errors import GraphBreakError, HostSyncError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the examples import their siblings as scripts do

import medusa_heads  # noqa: E402


def _draft_that_breaks(logits, kv):
    kv.add_(1)  # an input written in place that is not static
    token = torch.softmax(logits, dim=-1).argmax(dim=-1)
    if token.sum() > 0:  # a Python branch on a tensor value
        token = token + 1
    return token, token.max().item()  # a host read


def _line_in_draft(code: str) -> int:
    lines, first = inspect.getsourcelines(_draft_that_breaks)
    return first + next(index for index, line in enumerate(lines) if code in line)


class TestExplain(TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_obstacles_named_with_file_and_line(self):
        explanation = explain(_draft_that_breaks, torch.randn(2, 16), torch.zeros(4))
        self.assertFalse(explanation.one_region)
        here = Path(__file__).resolve()
        found = [(type(o), o.where) for o in explanation.obstacles]
        self.assertIn((GraphBreakError, f"{here}:{_line_in_draft('if token.sum() > 0')}"), found)
        self.assertIn((HostSyncError, f"{here}:{_line_in_draft('token.max().item()')}"), found)
        host_sync = next(o for o in explanation.obstacles if isinstance(o, HostSyncError))
        self.assertNotIn("capture_scalar_outputs", host_sync.fix)  # tracing the read would still sync
        written = [w for g in explanation.graphs for w in g.written_inputs]
        self.assertEqual([(w.name, w.static) for w in written], [("kv", False)])
        self.assertIn("NOT one captured region", str(explanation))

    def test_medusa_heads_golden(self):
        fn, args, kwargs = medusa_heads.explain_target(["--heads", "2"])
        cwd = os.getcwd()
        os.chdir(ROOT)  # explain prints paths relative to the working directory
        try:
            text = str(explain(fn, *args, **kwargs))
        finally:
            os.chdir(cwd)
        self.assertExpectedInline(text, """\
draftfuse.explain: propose (examples/medusa_heads.py:32)
verdict: one captured region (1 Dynamo graph(s), 0 graph break(s))

what draftfuse does to the graph:
  [seed_fold] 0 rewrites, 0 refusals
    note: no seam: no draftfuse::seam marker and no chain of two or more dependent selections; no cleanup
  [softmax_topk] 2 rewrites, 0 refusals
    examples/medusa_heads.py:36: softmax+topk(k=4) -> topk(logits) (dim 1; probabilities from the exp-sum; not the kernels: they run on CUDA with Triton, k <= 16, not on cpu)
    examples/medusa_heads.py:36: softmax+topk(k=4) -> topk(logits) (dim 1; probabilities from the exp-sum; not the kernels: they run on CUDA with Triton, k <= 16, not on cpu)""")
