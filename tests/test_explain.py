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
1 Dynamo graph(s), 0 graph break(s): one captured region

== graph 1 of 1, as Dynamo traced it
class GraphModule(torch.nn.Module):
    def forward(self, L_heads_modules_0_modules_block_parameters_weight_: "f32[64, 64]", L_heads_modules_0_modules_block_parameters_bias_: "f32[64]", L_hidden_: "f32[1, 64]", L_heads_modules_0_modules_lm_head_parameters_weight_: "f32[512, 64]", L_heads_modules_1_modules_block_parameters_weight_: "f32[64, 64]", L_heads_modules_1_modules_block_parameters_bias_: "f32[64]", L_heads_modules_1_modules_lm_head_parameters_weight_: "f32[512, 64]"):
        l_heads_modules_0_modules_block_parameters_weight_ = L_heads_modules_0_modules_block_parameters_weight_
        l_heads_modules_0_modules_block_parameters_bias_ = L_heads_modules_0_modules_block_parameters_bias_
        l_hidden_ = L_hidden_
        l_heads_modules_0_modules_lm_head_parameters_weight_ = L_heads_modules_0_modules_lm_head_parameters_weight_
        l_heads_modules_1_modules_block_parameters_weight_ = L_heads_modules_1_modules_block_parameters_weight_
        l_heads_modules_1_modules_block_parameters_bias_ = L_heads_modules_1_modules_block_parameters_bias_
        l_heads_modules_1_modules_lm_head_parameters_weight_ = L_heads_modules_1_modules_lm_head_parameters_weight_

        linear: "f32[1, 64]" = torch._C._nn.linear(l_hidden_, l_heads_modules_0_modules_block_parameters_weight_, l_heads_modules_0_modules_block_parameters_bias_);  l_heads_modules_0_modules_block_parameters_weight_ = l_heads_modules_0_modules_block_parameters_bias_ = None
        silu: "f32[1, 64]" = torch.nn.functional.silu(linear);  linear = None
        add: "f32[1, 64]" = l_hidden_ + silu;  silu = None
        linear_1: "f32[1, 512]" = torch._C._nn.linear(add, l_heads_modules_0_modules_lm_head_parameters_weight_, None);  add = l_heads_modules_0_modules_lm_head_parameters_weight_ = None

        float_1: "f32[1, 512]" = linear_1.float();  linear_1 = None
        softmax: "f32[1, 512]" = torch.softmax(float_1, dim = -1);  float_1 = None
        topk = softmax.topk(4, dim = -1);  softmax = None
        head_probs: "f32[1, 4]" = topk[0]
        head_tokens: "i64[1, 4]" = topk[1];  topk = None

        linear_2: "f32[1, 64]" = torch._C._nn.linear(l_hidden_, l_heads_modules_1_modules_block_parameters_weight_, l_heads_modules_1_modules_block_parameters_bias_);  l_heads_modules_1_modules_block_parameters_weight_ = l_heads_modules_1_modules_block_parameters_bias_ = None
        silu_1: "f32[1, 64]" = torch.nn.functional.silu(linear_2);  linear_2 = None
        add_1: "f32[1, 64]" = l_hidden_ + silu_1;  l_hidden_ = silu_1 = None
        linear_3: "f32[1, 512]" = torch._C._nn.linear(add_1, l_heads_modules_1_modules_lm_head_parameters_weight_, None);  add_1 = l_heads_modules_1_modules_lm_head_parameters_weight_ = None

        float_2: "f32[1, 512]" = linear_3.float();  linear_3 = None
        softmax_1: "f32[1, 512]" = torch.softmax(float_2, dim = -1);  float_2 = None
        topk_1 = softmax_1.topk(4, dim = -1);  softmax_1 = None
        head_probs_1: "f32[1, 4]" = topk_1[0]
        head_tokens_1: "i64[1, 4]" = topk_1[1];  topk_1 = None

        stack: "i64[1, 2, 4]" = torch.stack([head_tokens, head_tokens_1], dim = 1);  head_tokens = head_tokens_1 = None
        stack_1: "f32[1, 2, 4]" = torch.stack([head_probs, head_probs_1], dim = 1);  head_probs = head_probs_1 = None
        return (stack, stack_1)

== pass seed_fold
[seed_fold] 0 rewrite(s), 0 refusal(s)
  note: no seam: no draftfuse::seam marker and no chain of two or more dependent selections; graph unchanged
(graph unchanged)

== pass softmax_topk
[softmax_topk] 2 rewrite(s), 0 refusal(s)
  rewrote topk, softmax, float_1: softmax+topk(k=4) -> topk(logits) (dim=1, logits=linear_1, values=probs from exp-sum, torch form: no kernel for torch.float32 k=4 on cpu (needs CUDA, Triton, k <= 16))
  rewrote topk_1, softmax_1, float_2: softmax+topk(k=4) -> topk(logits) (dim=1, logits=linear_3, values=probs from exp-sum, torch form: no kernel for torch.float32 k=4 on cpu (needs CUDA, Triton, k <= 16))
--- before
+++ after
@@ -15,7 +15,12 @@
 
-        float_1: "f32[1, 512]" = linear_1.float();  linear_1 = None
-        softmax: "f32[1, 512]" = torch.softmax(float_1, dim = -1);  float_1 = None
-        topk = softmax.topk(4, dim = -1);  softmax = None
-        head_probs: "f32[1, 4]" = topk[0]
-        head_tokens: "i64[1, 4]" = topk[1];  topk = None
+        float_1: "f32[1, 512]" = linear_1.float()
+        topk_2 = torch.topk(linear_1, k = 4, dim = 1, largest = True, sorted = True);  linear_1 = None
+        getitem: "i64[1, 4]" = topk_2[1];  topk_2 = None
+        amax: "f32[1, 1]" = torch.amax(float_1, dim = 1, keepdim = True)
+        sub: "f32[1, 512]" = torch.sub(float_1, amax);  float_1 = amax = None
+        gather: "f32[1, 4]" = torch.gather(sub, dim = 1, index = getitem)
+        exp: "f32[1, 4]" = torch.exp(gather);  gather = None
+        exp_1: "f32[1, 512]" = torch.exp(sub);  sub = None
+        sum_1: "f32[1, 1]" = torch.sum(exp_1, dim = 1, keepdim = True);  exp_1 = None
+        div: "f32[1, 4]" = torch.div(exp, sum_1);  exp = sum_1 = None
 
@@ -26,10 +31,15 @@
 
-        float_2: "f32[1, 512]" = linear_3.float();  linear_3 = None
-        softmax_1: "f32[1, 512]" = torch.softmax(float_2, dim = -1);  float_2 = None
-        topk_1 = softmax_1.topk(4, dim = -1);  softmax_1 = None
-        head_probs_1: "f32[1, 4]" = topk_1[0]
-        head_tokens_1: "i64[1, 4]" = topk_1[1];  topk_1 = None
+        float_2: "f32[1, 512]" = linear_3.float()
+        topk_3 = torch.topk(linear_3, k = 4, dim = 1, largest = True, sorted = True);  linear_3 = None
+        getitem_1: "i64[1, 4]" = topk_3[1];  topk_3 = None
+        amax_1: "f32[1, 1]" = torch.amax(float_2, dim = 1, keepdim = True)
+        sub_1: "f32[1, 512]" = torch.sub(float_2, amax_1);  float_2 = amax_1 = None
+        gather_1: "f32[1, 4]" = torch.gather(sub_1, dim = 1, index = getitem_1)
+        exp_2: "f32[1, 4]" = torch.exp(gather_1);  gather_1 = None
+        exp_3: "f32[1, 512]" = torch.exp(sub_1);  sub_1 = None
+        sum_2: "f32[1, 1]" = torch.sum(exp_3, dim = 1, keepdim = True);  exp_3 = None
+        div_1: "f32[1, 4]" = torch.div(exp_2, sum_2);  exp_2 = sum_2 = None
 
-        stack: "i64[1, 2, 4]" = torch.stack([head_tokens, head_tokens_1], dim = 1);  head_tokens = head_tokens_1 = None
-        stack_1: "f32[1, 2, 4]" = torch.stack([head_probs, head_probs_1], dim = 1);  head_probs = head_probs_1 = None
+        stack: "i64[1, 2, 4]" = torch.stack([getitem, getitem_1], dim = 1);  getitem = getitem_1 = None
+        stack_1: "f32[1, 2, 4]" = torch.stack([div, div_1], dim = 1);  div = div_1 = None
         return (stack, stack_1)

== what keeps the draft from being one captured region
nothing found""")
