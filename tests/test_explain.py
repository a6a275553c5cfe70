"""`draftfuse.explain`: a golden report for one example, and the obstacles it finds, with file and line."""

import inspect
import os
import sys
from pathlib import Path

import pytest
import torch
from expecttest import TestCase

from draftfuse.explain import explain
from draftfuse.runtime.draft_loop import draft_loop
from draftfuse.runtime.errors import DraftCaptureError, GraphBreakError

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
        # the first obstacle, as draft_loop raises it; the passes report on the graph before it
        self.assertEqual(found, [(GraphBreakError, f"{here}:{_line_in_draft('if token.sum() > 0')}")])
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


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 16)

    def forward(self, hidden):
        return self.lm_head(hidden)


def _host_read_in_the_loop(head, hidden):
    tokens = []
    for _ in range(3):
        token = torch.softmax(head(hidden), -1).argmax(-1)
        if token[0].item() == 3:  # a host read inside the step loop (Dynamo skips such a frame without fullgraph)
            hidden = hidden * 2
        tokens.append(token)
    return torch.stack(tokens, 1)


def _break_first(head, hidden):
    print("drafting")  # a graph break before the first tensor op
    return torch.softmax(head(hidden), -1).argmax(-1)


def _item_used_as_index(head, hidden):
    logits = head(hidden)
    return logits[:, logits[0].argmax().item()]


@pytest.mark.parametrize("draft", [_host_read_in_the_loop, _break_first, _item_used_as_index])
def test_explain_says_what_draft_loop_raises(draft):
    """explain traces as draft_loop compiles: the same verdict, and the same error class, line and fix
    (it traced without fullgraph before, and called a draft one region whose loop Dynamo had skipped)."""
    head, hidden = _Head().requires_grad_(False), torch.randn(2, 8)
    explanation = explain(draft, head, hidden)
    assert not explanation.one_region and "NOT one captured region" in str(explanation)
    with pytest.raises(DraftCaptureError) as raised:
        draft_loop(draft)(head, hidden)
    (first,) = explanation.obstacles
    assert (type(first), first.where, first.fix) == (type(raised.value), raised.value.where, raised.value.fix)


def test_explain_leaves_other_drafts_compiled():
    """explain no longer resets Dynamo's caches: a draft compiled before it replays after it, without a
    compile charged to its max_compiles."""
    head, hidden = _Head().requires_grad_(False), torch.randn(2, 8)
    fast = draft_loop(lambda h, x: torch.softmax(h(x), -1).argmax(-1), max_compiles=1)
    for _ in range(3):
        fast(head, hidden)
    explain(_break_first, head, hidden)
    fast(head, hidden)
    assert len(fast.compiles) == 1


def test_the_command_line_loads_a_file_that_defines_a_dataclass(tmp_path, capsys):
    """`python -m draftfuse explain FILE` runs FILE as a module registered in sys.modules, as an import
    does: a dataclass in it looked its module up there and raised an AttributeError before."""
    from draftfuse.__main__ import explain_file

    target = tmp_path / "draft_with_config.py"
    target.write_text(
        "from __future__ import annotations\n"  # string annotations: dataclasses resolve them in sys.modules
        "import dataclasses, torch\n"
        "@dataclasses.dataclass\n"
        "class Config:\n"
        "    k: int = 1\n"
        "def draft(x, config):\n"
        "    return torch.softmax(x, -1).topk(config.k).indices\n"
        "def explain_target(argv):\n"
        "    return draft, (torch.randn(2, 8), Config()), {}\n"
    )
    explain_file(str(target), [])
    assert "verdict: one captured region" in capsys.readouterr().out


def _select(logits):
    return torch.softmax(logits, -1).topk(1, dim=-1)


def test_explain_of_a_draft_loop_or_fold_uses_its_own_options_and_seam():
    """explain(draft) of a draft_loop reports what that draft's compile does: its options (softmax_topk
    off: no rewrite), and for a fold, the seam (it traced the fold's call inside an enclosing trace,
    which drops the marker: "no seam" where the compile removes it)."""
    logits = torch.randn(2, 8)
    off = {"softmax_topk": False}
    assert "softmax+topk" not in str(explain(draft_loop(_select, options=off), logits))
    assert "softmax+topk(k=1) -> argmax" in str(explain(draft_loop(_select), logits))
    from draftfuse.runtime.fold import fold

    text = str(explain(fold(lambda x: x * 2, _select, options=off), logits))
    assert "seam marker removed" in text and "softmax+topk" not in text
    assert "draftfuse/passes" not in text  # the marker has no user line: none is shown, not draftfuse's own


def test_draft_graphs_of_a_draft_loop_uses_its_options_and_parameter_names():
    """draftfuse.testing.draft_graphs(draft) traced the DraftLoop's call: its inputs were L_args_0_ and its
    options the defaults (probs="ones" drafts showed exact probabilities; helper-68's README audit)."""
    from draftfuse.testing import draft_graphs

    logits = torch.randn(2, 8)
    plain = draft_graphs(_select, logits)
    ones = draft_graphs(draft_loop(_select, options={"probs": "ones"}), logits)
    assert "L_logits_" in ones.before and "L_args_" not in ones.before
    assert "probabilities 1" in ones.report and "probabilities 1" not in plain.report, ones.report
    assert "probabilities 1" not in draft_graphs(draft_loop(_select, options={"probs": "ones"}), logits, options={}).report


def test_explain_of_a_module_traces_its_hooks_and_a_dispatch_mode_is_the_caller_s():
    """explain(module) traced forward alone, so a hook's print that draft_loop(module) raises for was not
    seen ("one captured region"); under a TorchDispatchMode explain named the draft's def line, not the
    call, and left Dynamo's automatic dynamic shapes off for the process (helper-72)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Head(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, -1).topk(1, -1)

    head, x = Head(), torch.randn(2, 8)
    head.register_forward_hook(lambda module, args, out: print("drafted"))
    with pytest.raises(GraphBreakError) as raised:
        draft_loop(head)(x)
    found = explain(head, x)
    assert not found.one_region and [type(o) for o in found.obstacles] == [GraphBreakError]
    assert found.obstacles[0].where == raised.value.where

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    settings = (torch._dynamo.config.automatic_dynamic_shapes, torch._dynamo.config.assume_static_by_default)
    with Passing():
        found = explain(_select, x)  # <- under a mode
    assert "torch.compile skipped the draft" in found.obstacles[0].cause and found.obstacles[0].where.endswith(_line_of("under a mode"))
    assert (torch._dynamo.config.automatic_dynamic_shapes, torch._dynamo.config.assume_static_by_default) == settings


def _line_of(marker: str) -> str:
    for number, text in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# <- {marker}"):
            return f"test_explain.py:{number}"
    raise AssertionError(marker)


def _reads_a_length_each_step(logits, lengths):
    out = []
    for _ in range(3):
        n = int(lengths.max())
        out.append(logits[:, :n].argmax(-1))
    return out


def _nonzero_rows(logits):
    rows = (logits > 0).nonzero()[:, 0]
    return logits[rows].sum()


@pytest.mark.parametrize("draft, args", [
    (_reads_a_length_each_step, (torch.randn(2, 8), torch.tensor([3, 4]))),
    (_nonzero_rows, (torch.randn(2, 8),)),
])  # fmt: skip
def test_a_host_read_is_one_obstacle_not_one_per_step_and_derived_size(draft, args):
    """The read is the obstacle: not again for each loop step, nor for the slice to its length and
    Dynamo's size asserts on it (sym_size, ge, le: reported as "makes a tensor whose size depends on
    the data" before, 21 obstacles for three steps)."""
    (only,) = explain(draft, *args).obstacles
    lines, first = inspect.getsourcelines(draft)
    read = first + next(i for i, line in enumerate(lines) if "int(" in line or ".nonzero()" in line)
    assert only.where.endswith(f":{read}")
    assert ("torch.where instead of nonzero" in only.fix) == (draft is _nonzero_rows)  # the fix for a data-dependent size


def _read_then_nonzero_then_read(logits, lengths):
    total = logits.sum()
    for step in range(2):
        n = int(lengths.max())  # read each step
        if step == 0:
            total = total + (logits > 0).nonzero().sum()  # once, between the two reads
        total = total + logits[:, :n].sum()
    return total


def test_repeated_obstacles_keep_graph_order():
    """A read, a nonzero, the read again: two obstacles, the read first (as draft_loop raises it)."""
    found = explain(_read_then_nonzero_then_read, torch.randn(2, 8), torch.tensor([3, 4])).obstacles
    assert ["int(" in line or ".nonzero()" in line for line in [_source_at(o.where) for o in found]] == [True, True]
    assert [".item()" in str(o) for o in found] == [True, False], [str(o)[:80] for o in found]


def _source_at(where: str) -> str:
    path, line = where.rsplit(":", 1)
    return open(path).read().splitlines()[int(line) - 1]


class _Stepper:
    def __init__(self):
        self.head = _Head().requires_grad_(False)

    def step(self, hidden):
        return torch.softmax(self.head(hidden), -1).topk(1, dim=-1)

    fast = draft_loop(step)


def test_explain_of_a_method_draft_passes_its_instance():
    """explain(draft_loop(worker.step)) and explain(worker.fast) traced the unbound function without its
    instance: TypeError, missing an argument."""
    worker, hidden = _Stepper(), torch.randn(2, 8)
    for draft in (draft_loop(worker.step), worker.fast):
        explanation = explain(draft, hidden)
        assert explanation.one_region and "softmax+topk(k=1) -> argmax" in str(explanation)
