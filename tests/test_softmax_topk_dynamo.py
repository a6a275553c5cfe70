"""Golden graphs of the softmax -> topk pass on Dynamo graphs: every spelling it rewrites, every refusal.

Each test shows the graph before and after; EXPECTTEST_ACCEPT=1 regenerates the expected text.
"""

import torch
import torch.nn.functional as F
from expecttest import TestCase

from draftfuse.passes.softmax_topk import rewrite_softmax_topk
from draftfuse.testing import draft_graphs
from tests._graphs import dynamo_graph, graph_text

_G = torch.Generator().manual_seed(0)
X = torch.randn(4, 32, generator=_G)
# tie-free in bfloat16 (a random bf16 row has ties, where topk may return either index): each row a
# permutation of 0, 0.25, ..., 7.75, all exact in bf16
X_BF16 = (torch.stack([torch.randperm(32, generator=_G) for _ in range(4)]) / 4 - 4).to(torch.bfloat16)


class DynamoRewrites(TestCase):
    def rewrite(self, fn, *args, **options):
        gm = dynamo_graph(fn, *args)
        before = graph_text(gm)
        result = rewrite_softmax_topk(gm, **options)
        self.assertEqual(graph_text(gm), before, "the pass must not modify its input")
        # the rewritten module computes the same tokens on these inputs
        for got, want in zip(torch.utils._pytree.tree_leaves(result.graph_module(*args)), torch.utils._pytree.tree_leaves(fn(*args))):
            if not want.dtype.is_floating_point:
                self.assertTrue(torch.equal(got, want), f"{got} != {want}")
        return before, graph_text(result.graph_module), result.report

    def test_topk1_function_kwargs(self):
        def f(x):
            p = torch.softmax(x, dim=-1)
            return torch.topk(p, k=1, dim=-1)

        before, after, report = self.rewrite(f, X)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        p: "f32[4, 32]" = torch.softmax(l_x_, dim = -1);  l_x_ = None

        topk = torch.topk(p, k = 1, dim = -1);  p = None
        getitem: "f32[4, 1]" = topk[0]
        getitem_1: "i64[4, 1]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        argmax: "i64[4, 1]" = torch.argmax(l_x_, dim = 1, keepdim = True)
        amax: "f32[4, 1]" = torch.amax(l_x_, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(l_x_, amax);  l_x_ = amax = None
        exp: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        reciprocal: "f32[4, 1]" = torch.reciprocal(sum_1);  sum_1 = None
        return (reciprocal, argmax)
""")
        self.assertEqual(len(report.rewrites), 1)

    def test_topk1_method_positional_f_softmax_dtype(self):
        def f(x):
            p = F.softmax(x, -1, dtype=torch.float32)
            v, i = p.topk(1)
            return v, i

        before, after, _ = self.rewrite(f, X_BF16)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        p: "f32[4, 32]" = torch.nn.functional.softmax(l_x_, -1, dtype = torch.float32);  l_x_ = None

        topk = p.topk(1);  p = None
        v: "f32[4, 1]" = topk[0]
        i: "i64[4, 1]" = topk[1];  topk = None
        return (v, i)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        argmax: "i64[4, 1]" = torch.argmax(l_x_, dim = 1, keepdim = True)
        to: "f32[4, 32]" = l_x_.to(torch.float32);  l_x_ = None
        amax: "f32[4, 1]" = torch.amax(to, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(to, amax);  to = amax = None
        exp: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        reciprocal: "f32[4, 1]" = torch.reciprocal(sum_1);  sum_1 = None
        return (reciprocal, argmax)
""")

    def test_max_dim_method_softmax(self):
        def f(x):
            probs, token = x.softmax(dim=1).max(dim=1)
            return probs, token

        before, after, _ = self.rewrite(f, X)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        softmax: "f32[4, 32]" = l_x_.softmax(dim = 1);  l_x_ = None
        max_1 = softmax.max(dim = 1);  softmax = None
        probs: "f32[4]" = max_1[0]
        token: "i64[4]" = max_1[1];  max_1 = None
        return (probs, token)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        argmax: "i64[4]" = torch.argmax(l_x_, dim = 1, keepdim = False)
        amax: "f32[4, 1]" = torch.amax(l_x_, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(l_x_, amax);  l_x_ = amax = None
        exp: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        reciprocal: "f32[4, 1]" = torch.reciprocal(sum_1);  sum_1 = None
        squeeze: "f32[4]" = torch.squeeze(reciprocal, dim = 1);  reciprocal = None
        return (squeeze, argmax)
""")

    def test_log_softmax_topk1(self):
        def f(x):
            return torch.log_softmax(x.float(), -1).topk(1, dim=-1)

        before, after, _ = self.rewrite(f, X_BF16)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        float_1: "f32[4, 32]" = l_x_.float();  l_x_ = None
        log_softmax: "f32[4, 32]" = torch.log_softmax(float_1, -1);  float_1 = None
        topk = log_softmax.topk(1, dim = -1);  log_softmax = None
        getitem: "f32[4, 1]" = topk[0]
        getitem_1: "i64[4, 1]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        float_1: "f32[4, 32]" = l_x_.float()

        argmax: "i64[4, 1]" = torch.argmax(l_x_, dim = 1, keepdim = True);  l_x_ = None
        amax: "f32[4, 1]" = torch.amax(float_1, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(float_1, amax);  float_1 = amax = None
        exp: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        log: "f32[4, 1]" = torch.log(sum_1);  sum_1 = None
        neg: "f32[4, 1]" = torch.neg(log);  log = None
        return (neg, argmax)
""")

    def test_argmax_only_indices(self):
        def f(x):
            return F.softmax(x, dim=-1).argmax(dim=-1, keepdim=True)

        before, after, _ = self.rewrite(f, X)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        softmax: "f32[4, 32]" = torch.nn.functional.softmax(l_x_, dim = -1);  l_x_ = None
        argmax: "i64[4, 1]" = softmax.argmax(dim = -1, keepdim = True);  softmax = None
        return (argmax,)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        argmax_1: "i64[4, 1]" = torch.argmax(l_x_, dim = 1, keepdim = True);  l_x_ = None
        return (argmax_1,)
""")

    def test_topk4_tree(self):
        def f(x):
            p = torch.softmax(x, -1)
            return p.topk(4, -1)

        before, after, _ = self.rewrite(f, X)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        p: "f32[4, 32]" = torch.softmax(l_x_, -1);  l_x_ = None

        topk = p.topk(4, -1);  p = None
        getitem: "f32[4, 4]" = topk[0]
        getitem_1: "i64[4, 4]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        topk_1 = torch.topk(l_x_, k = 4, dim = 1, largest = True, sorted = True)
        getitem_2: "i64[4, 4]" = topk_1[1];  topk_1 = None
        amax: "f32[4, 1]" = torch.amax(l_x_, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(l_x_, amax);  l_x_ = amax = None
        gather: "f32[4, 4]" = torch.gather(sub, dim = 1, index = getitem_2)
        exp: "f32[4, 4]" = torch.exp(gather);  gather = None
        exp_1: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp_1, dim = 1, keepdim = True);  exp_1 = None
        div: "f32[4, 4]" = torch.div(exp, sum_1);  exp = sum_1 = None
        return (div, getitem_2)
""")

    def test_temperature_division_and_upcast(self):
        def f(x):
            return torch.softmax(x.float() / 0.7, dim=-1).topk(1)

        before, after, _ = self.rewrite(f, X_BF16)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        float_1: "f32[4, 32]" = l_x_.float();  l_x_ = None
        truediv: "f32[4, 32]" = float_1 / 0.7;  float_1 = None
        softmax: "f32[4, 32]" = torch.softmax(truediv, dim = -1);  truediv = None
        topk = softmax.topk(1);  softmax = None
        getitem: "f32[4, 1]" = topk[0]
        getitem_1: "i64[4, 1]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        float_1: "f32[4, 32]" = l_x_.float()
        truediv: "f32[4, 32]" = float_1 / 0.7;  float_1 = None

        argmax: "i64[4, 1]" = torch.argmax(l_x_, dim = 1, keepdim = True);  l_x_ = None
        amax: "f32[4, 1]" = torch.amax(truediv, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(truediv, amax);  truediv = amax = None
        exp: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        reciprocal: "f32[4, 1]" = torch.reciprocal(sum_1);  sum_1 = None
        return (reciprocal, argmax)
""")

    def test_temperature_multiplication_and_cast_after(self):
        def f(x):
            p = torch.softmax(2.0 * x, dim=-1)
            return p.to(torch.float32).max(-1)

        before, after, _ = self.rewrite(f, X_BF16)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        mul: "bf16[4, 32]" = 2.0 * l_x_;  l_x_ = None
        p: "bf16[4, 32]" = torch.softmax(mul, dim = -1);  mul = None

        to: "f32[4, 32]" = p.to(torch.float32);  p = None
        max_1 = to.max(-1);  to = None
        getitem: "f32[4]" = max_1[0]
        getitem_1: "i64[4]" = max_1[1];  max_1 = None
        return (getitem, getitem_1)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        mul: "bf16[4, 32]" = 2.0 * l_x_

        argmax: "i64[4]" = torch.argmax(l_x_, dim = 1, keepdim = False);  l_x_ = None
        to_1: "f32[4, 32]" = mul.to(torch.float32);  mul = None
        amax: "f32[4, 1]" = torch.amax(to_1, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(to_1, amax);  to_1 = amax = None
        exp: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        reciprocal: "f32[4, 1]" = torch.reciprocal(sum_1);  sum_1 = None
        squeeze: "f32[4]" = torch.squeeze(reciprocal, dim = 1);  reciprocal = None
        round_to_default: "bf16[4]" = torch.ops.draftfuse.round_to.default(squeeze, torch.bfloat16);  squeeze = None
        to_2: "f32[4]" = round_to_default.to(torch.float32);  round_to_default = None
        return (to_2, argmax)
""")

    def test_positive_dim_rank3_keepdim(self):
        def f(x):
            return torch.softmax(x, 2).max(2, keepdim=True)

        before, after, _ = self.rewrite(f, torch.randn(2, 3, 16))
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 3, 16]"):
        l_x_ = L_x_

        softmax: "f32[2, 3, 16]" = torch.softmax(l_x_, 2);  l_x_ = None
        max_1 = softmax.max(2, keepdim = True);  softmax = None
        getitem: "f32[2, 3, 1]" = max_1[0]
        getitem_1: "i64[2, 3, 1]" = max_1[1];  max_1 = None
        return (getitem, getitem_1)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 3, 16]"):
        l_x_ = L_x_

        argmax: "i64[2, 3, 1]" = torch.argmax(l_x_, dim = 2, keepdim = True)
        amax: "f32[2, 3, 1]" = torch.amax(l_x_, dim = 2, keepdim = True)
        sub: "f32[2, 3, 16]" = torch.sub(l_x_, amax);  l_x_ = amax = None
        exp: "f32[2, 3, 16]" = torch.exp(sub);  sub = None
        sum_1: "f32[2, 3, 1]" = torch.sum(exp, dim = 2, keepdim = True);  exp = None
        reciprocal: "f32[2, 3, 1]" = torch.reciprocal(sum_1);  sum_1 = None
        return (reciprocal, argmax)
""")

    def test_softmax_kept_for_other_user(self):
        def f(x):
            p = torch.softmax(x, -1)
            v, i = p.topk(1)
            return p, v, i

        before, after, _ = self.rewrite(f, X)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        p: "f32[4, 32]" = torch.softmax(l_x_, -1);  l_x_ = None

        topk = p.topk(1)
        v: "f32[4, 1]" = topk[0]
        i: "i64[4, 1]" = topk[1];  topk = None
        return (p, v, i)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        p: "f32[4, 32]" = torch.softmax(l_x_, -1)

        argmax: "i64[4, 1]" = torch.argmax(l_x_, dim = 1, keepdim = True);  l_x_ = None
        gather: "f32[4, 1]" = torch.gather(p, dim = 1, index = argmax)
        return (p, gather, argmax)
""")

    def test_probs_ones(self):
        def f(x):
            return torch.softmax(x, -1).topk(1)

        _, after, report = self.rewrite(f, X, probs="ones")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        argmax: "i64[4, 1]" = torch.argmax(l_x_, dim = 1, keepdim = True);  l_x_ = None
        ones_like: "f32[4, 1]" = torch.ones_like(argmax, dtype = torch.float32)
        return (ones_like, argmax)
""")
        self.assertIn('probs="ones"', str(report))


    # ---- the walk back from the softmax stops where it cannot look through: the selection reads that
    # value as the softmax does (each was refused before)

    def test_logits_written_in_place_before_softmax_select_from_the_scaled_copy(self):
        def f(x):
            y = x / 0.5
            x.add_(1)
            return torch.softmax(y, -1).argmax(-1)

        _, after, report = self.rewrite(f, X.clone())  # the golden shows it reads y, not x
        self.assertIn("add_ (add_)", report.rewrites[0].detail)
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        y: "f32[4, 32]" = l_x_ / 0.5

        add_: "f32[4, 32]" = l_x_.add_(1);  l_x_ = add_ = None

        argmax_1: "i64[4]" = torch.argmax(y, dim = 1, keepdim = False);  y = None
        return (argmax_1,)
""")

    def test_negative_temperature_selects_from_the_scaled_logits(self):
        def f(x):
            return torch.softmax(x / -0.5, -1).topk(1)

        _, after, report = self.rewrite(f, X)
        self.assertEqual(len(report.rewrites), 1)
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        truediv: "f32[4, 32]" = l_x_ / -0.5;  l_x_ = None

        argmax: "i64[4, 1]" = torch.argmax(truediv, dim = 1, keepdim = True)
        amax: "f32[4, 1]" = torch.amax(truediv, dim = 1, keepdim = True)
        sub: "f32[4, 32]" = torch.sub(truediv, amax);  truediv = amax = None
        exp: "f32[4, 32]" = torch.exp(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        reciprocal: "f32[4, 1]" = torch.reciprocal(sum_1);  sum_1 = None
        return (reciprocal, argmax)
""")

    def test_temperature_that_reweighs_entries_of_a_row_selects_from_the_reweighed_logits(self):
        # one factor per vocabulary entry is no temperature: the selection reads x / t, not x
        def f(x, t):
            return torch.softmax(x / t, -1).argmax(-1)

        _, after, report = self.rewrite(f, X, torch.rand(32) + 0.5)
        self.assertEqual(len(report.rewrites), 1)
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]", L_t_: "f32[32]"):
        l_x_ = L_x_
        l_t_ = L_t_

        truediv: "f32[4, 32]" = l_x_ / l_t_;  l_x_ = l_t_ = None

        argmax_1: "i64[4]" = torch.argmax(truediv, dim = 1, keepdim = False);  truediv = None
        return (argmax_1,)
""")


class DynamoRefusals(TestCase):
    def refuse(self, fn, *args, reason: str):
        gm = dynamo_graph(fn, *args)
        result = rewrite_softmax_topk(gm)
        self.assertEqual(graph_text(result.graph_module), graph_text(gm), "a refused graph is left unchanged")
        self.assertEqual(result.report.rewrites, [])
        self.assertEqual(len(result.report.refusals), 1, str(result.report))
        self.assertIn(reason, result.report.refusals[0].reason)
        self.assertIn("test_softmax_topk_dynamo.py:", result.report.refusals[0].where)
        return graph_text(gm)

    def test_dims_differ(self):
        def f(x):
            return torch.softmax(x, 0).topk(1, dim=1)

        self.assertExpectedInline(self.refuse(f, X, reason="softmax over dim 0 but selection over dim 1"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        softmax: "f32[4, 32]" = torch.softmax(l_x_, 0);  l_x_ = None
        topk = softmax.topk(1, dim = 1);  softmax = None
        getitem: "f32[4, 1]" = topk[0]
        getitem_1: "i64[4, 1]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")

    def test_k_from_tensor(self):
        def f(x, k):
            return torch.topk(x.softmax(-1), k.item())

        self.assertExpectedInline(self.refuse(f, X, torch.tensor(2), reason="is not a known constant"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]", L_k_: "i64[]"):
        l_x_ = L_x_
        l_k_ = L_k_

        softmax: "f32[4, 32]" = l_x_.softmax(-1);  l_x_ = None
        item: "Sym(s94)" = l_k_.item();  l_k_ = None
        topk = torch.topk(softmax, item);  softmax = item = None
        getitem: "f32[4, s94]" = topk[0]
        getitem_1: "i64[4, s94]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")

    def test_unsorted_topk(self):
        def f(x):
            return torch.softmax(x, -1).topk(3, sorted=False)

        self.assertExpectedInline(self.refuse(f, X, reason="sorted=False"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        softmax: "f32[4, 32]" = torch.softmax(l_x_, -1);  l_x_ = None
        topk = softmax.topk(3, sorted = False);  softmax = None
        getitem: "f32[4, 3]" = topk[0]
        getitem_1: "i64[4, 3]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")

    def test_op_between_softmax_and_selection(self):
        def f(x):
            return (torch.softmax(x, -1) * 2).topk(1)

        self.assertExpectedInline(self.refuse(f, X, reason="between softmax and selection"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]"):
        l_x_ = L_x_

        softmax: "f32[4, 32]" = torch.softmax(l_x_, -1);  l_x_ = None
        mul: "f32[4, 32]" = softmax * 2;  softmax = None
        topk = mul.topk(1);  mul = None
        getitem: "f32[4, 1]" = topk[0]
        getitem_1: "i64[4, 1]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")

    def test_an_integer_cast_is_refused_after_a_softmax_only(self):
        """A cast the rewrite cannot keep (to an integer, to fp8) is news after a softmax; on plain logits
        (x.long().argmax(), the ids of a quantised draft) there is no softmax to name, and it was refused
        as "cast to torch.int64 between softmax and selection" at both levels."""
        self.refuse(lambda x: torch.softmax(x, -1).to(torch.int32).argmax(-1), X, reason="cast to torch.int32 between softmax and selection")
        self.refuse(lambda x: torch.softmax(x, -1).to(torch.float8_e4m3fn).float().argmax(-1), X, reason="round to one value")
        for f in (lambda x: x.to(torch.int32).argmax(-1), lambda x: x.long().argmax(-1), lambda x: x.to(torch.float8_e4m3fn).float().argmax(-1)):
            graphs = draft_graphs(f, X)
            reports = {r.pass_name: r for r in graphs.reports}
            for name in ("softmax_topk", "softmax_topk (post-grad)"):
                self.assertEqual((reports[name].rewrites, reports[name].refusals), ([], []), str(reports[name]))

    def test_smallest_selections_are_refused(self):
        # the smallest probabilities underflow to 0: the original returns the first zero, argmin of the
        # logits the true minimum, so these are left alone
        def f(x):
            p = torch.softmax(x * 30, -1)
            a = torch.argmin(p, -1)
            v, i = torch.min(p, -1)
            w, j = torch.topk(p, 1, largest=False)
            return a, v, i, w, j

        gm = dynamo_graph(f, X)
        result = rewrite_softmax_topk(gm)
        self.assertEqual(result.report.rewrites, [])
        self.assertEqual(len(result.report.refusals), 3)
        for refusal in result.report.refusals:
            self.assertIn("smallest-probability selection", refusal.reason)
        self.assertEqual(graph_text(result.graph_module), graph_text(gm))


class TensorTemperatures(TestCase):
    """softmax(x / t) with t a tensor, one value per row or one for all (SGLang's and vLLM's per-request
    temperatures): the selection follows the order of x * sign(t), whatever t's sign; the values are
    computed from the scaled scores, as the softmax saw them."""

    def check(self, fn, *args, lowering="torch"):
        gm = dynamo_graph(fn, *args)
        result = rewrite_softmax_topk(gm, lowering=lowering)
        self.assertEqual(len(result.report.rewrites), 1, str(result.report))
        self.assertIn("temperature tensor", result.report.rewrites[0].detail)
        inputs = [dict(zip(("x", "t"), args))[str(p.target)[2:-1]] for p in gm.graph.find_nodes(op="placeholder")]
        (got_values, got_index), (want_values, want_index) = result.graph_module(*inputs), fn(*args)
        self.assertTrue(torch.equal(got_index, want_index), (got_index, want_index))
        torch.testing.assert_close(got_values, want_values)
        return graph_text(result.graph_module)

    def test_per_row_temperature_of_any_sign(self):
        def f(x, t):
            return torch.softmax(x / t[:, None], -1).topk(3)

        t = torch.tensor([0.5, -1.0, 2.0, -0.25])
        for lowering in ("torch", "kernels"):  # the kernels' scale operand (their torch reference on a CPU)
            self.check(f, X, t, lowering=lowering)

    def test_an_infinite_temperature_ties_the_row_as_eager(self):
        """x / inf is +-0 everywhere: eager's probabilities are uniform and its argmax and max take the first
        index (topk's choice among ties is its own). The torch form ordered by x * sign(t), x's own order (the
        argmax of x), where the kernels order by x * sign(1 / t), all tied; both follow the kernels' scale now."""
        t = torch.tensor([0.5, float("inf"), float("-inf"), -2.0])
        argmax = lambda x, t: (torch.softmax(x / t[:, None], -1).amax(-1), torch.softmax(x / t[:, None], -1).argmax(-1))  # noqa: E731
        for f in (argmax, lambda x, t: torch.softmax(x.div(t[:, None]), -1).max(-1)):
            for lowering in ("torch", "kernels"):
                self.check(f, X, t, lowering=lowering)

    def test_temperature_tensor_first_in_the_product(self):
        # s * x and torch.mul(s, x) with s of one value per row: the same scaling as x * s (refused before, as
        # if x were the factor, "varies along the softmax dim")
        s = torch.tensor([[0.5], [-1.0], [2.0], [-0.25]])
        for f in (lambda x, t: torch.softmax(t * x, -1).topk(3), lambda x, t: torch.softmax(torch.mul(t, x), -1).topk(3),
                  lambda x, t: torch.softmax((1.0 / t) * x, -1).topk(3)):
            for lowering in ("torch", "kernels"):
                self.check(f, X, s, lowering=lowering)

    def test_scalar_temperature_multiplied(self):
        def f(x, t):
            return torch.softmax(x.float() * t, -1).max(-1)

        after = self.check(f, X_BF16, torch.tensor(-1.5))
        self.assertIn("torch.sign(l_t_)", after)


class KernelLowering(TestCase):
    """lowering="kernels" selects with draftfuse's ops (on a CPU they run their torch reference);
    "auto" takes them only where the Triton kernels run (CUDA), and the report says why not."""

    def test_topk1_and_topk4_lowered_to_kernels(self):
        def f(x):
            p = torch.softmax(x.float(), -1)
            v, i = p.topk(1)
            w, j = p.topk(4)
            return v, i, w, j

        gm = dynamo_graph(f, X_BF16)
        result = rewrite_softmax_topk(gm, lowering="kernels")
        self.assertExpectedInline(graph_text(result.graph_module), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "bf16[4, 32]"):
        l_x_ = L_x_

        argmax_prob_default = torch.ops.draftfuse.argmax_prob.default(l_x_, log = False)
        getitem: "i64[4]" = argmax_prob_default[0]
        unsqueeze: "i64[4, 1]" = torch.unsqueeze(getitem, dim = 1);  getitem = None
        getitem_1: "f32[4]" = argmax_prob_default[1];  argmax_prob_default = None
        unsqueeze_1: "f32[4, 1]" = torch.unsqueeze(getitem_1, dim = 1);  getitem_1 = None

        topk_prob_default = torch.ops.draftfuse.topk_prob.default(l_x_, k = 4, log = False);  l_x_ = None
        getitem_2: "i64[4, 4]" = topk_prob_default[1]
        getitem_3: "f32[4, 4]" = topk_prob_default[0];  topk_prob_default = None
        return (unsqueeze_1, unsqueeze, getitem_3, getitem_2)
""")
        want, got = f(X_BF16), result.graph_module(X_BF16)
        self.assertTrue(torch.equal(want[1], got[1]) and torch.equal(want[3], got[3]))
        self.assertTrue(all("draftfuse." in r.rule for r in result.report.rewrites), str(result.report))

    def test_auto_on_cpu_keeps_the_torch_form_and_says_why(self):
        def f(x):
            return torch.softmax(x, -1).topk(1)

        result = rewrite_softmax_topk(dynamo_graph(f, X), lowering="auto")
        self.assertIn("torch.argmax", graph_text(result.graph_module))
        self.assertIn("run on CUDA", result.report.rewrites[0].detail)

    def test_temperature_with_values_keeps_the_torch_form(self):
        def f(x):
            return torch.softmax(x / 0.7, -1).topk(1)

        result = rewrite_softmax_topk(dynamo_graph(f, X), lowering="kernels")
        self.assertNotIn("draftfuse", graph_text(result.graph_module))
        self.assertIn("values under a constant temperature", result.report.rewrites[0].detail)


# rows of distinct values 1 apart: bf16 log-probabilities >= 16 ulps apart, no rounding ties
X_SPREAD = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(r)) for r in range(4)]).float() - 2.5


def test_half_probabilities_read_beside_the_selection_are_read_rounded_and_aliases_kept():
    """bf16 probabilities that a mask reads beside a rewritten topk are read through draftfuse::round_to
    (stored rounded, as eager has them: Inductor fused unrounded ones into the mask, which then kept fewer
    than k). The probabilities' own output is copied for its readers, a dtype-changing cast becomes
    round_to, but `q = probs.to(probs.dtype)` is probs itself: a write through probs must reach q's readers
    (a copy of q read it unwritten: counts of 2 where eager has 3)."""

    def aliased(x, w):
        probs = torch.log_softmax(x.to(torch.bfloat16), -1)
        q = probs.to(torch.bfloat16)  # the same tensor
        v, i = q.topk(2, -1)
        probs.mul_(w)  # q is written too
        return (v, i, (q >= v.amin(-1, keepdim=True)).sum(-1), q)

    def cast(x):
        q = torch.softmax(x, -1).to(torch.float16)
        v, i = q.max(-1)
        return (i, (q >= v.unsqueeze(-1)).sum(-1), q * 2)

    result = rewrite_softmax_topk(dynamo_graph(cast, X_SPREAD))
    text = graph_text(result.graph_module)
    assert "draftfuse.round_to" in text and ".to(torch.float16)" not in text, text
    assert "stored rounded (round_to)" in result.report.rewrites[0].detail
    w = torch.full((4, 6), 0.5)
    for fn, args in ((aliased, (X_SPREAD, w)), (cast, (X_SPREAD,))):
        want = fn(*[a.clone() for a in args])
        torch._dynamo.reset()
        got = torch.compile(fn, backend="draftfuse")(*[a.clone() for a in args])
        assert torch.equal(want[-2], got[-2]), (fn.__name__, want[-2], got[-2])  # the mask's counts
        assert torch.equal(want[-1], got[-1]), fn.__name__
        assert torch.equal(want[-3], got[-3]), fn.__name__  # indices


def test_half_probabilities_of_a_twin_softmax_are_read_rounded_too():
    """The same softmax spelled again (a helper's own softmax(logits) for a mask) is read beside the values
    as the selection's own probabilities are: its fp16/bf16 output, or the cast that rounds it, is read
    through round_to (before, the mask counted 1 where eager keeps 2)."""

    def twin_of_the_same_scores(x):
        s = x.to(torch.bfloat16)
        probs = torch.log_softmax(s, -1)
        v, i = torch.topk(probs, 2, -1)
        twin = torch.log_softmax(s, -1)
        return (v, i, (twin >= v.amin(-1, keepdim=True)).sum(-1))

    def twin_rounded_by_a_cast(x):
        probs = torch.softmax(x, -1).half()
        v, i = torch.topk(probs, 2, -1)
        twin = torch.softmax(x, -1).half()
        return (v, i, (twin >= v.amin(-1, keepdim=True)).sum(-1))

    x = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(r)) for r in range(7)]).float() - 2.5
    for fn in (twin_of_the_same_scores, twin_rounded_by_a_cast):
        want = fn(x.clone())
        torch._dynamo.reset()
        got = torch.compile(fn, backend="draftfuse")(x.clone())
        assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2]), (fn.__name__, want[2], got[2])


def test_integer_logits_scaled_then_written_in_place_keep_the_write_in_the_values():
    """The values of integer logits scaled into floats are computed from x made float first (Inductor's
    joint-graph pass wraps int8 otherwise); where the scores are written in place before the softmax
    (s4.mul_(0.25)) that recomputation missed the write: 0.865 where eager's top probability is 0.414
    (the Dynamo-level selection fuzzer, seed 720801)."""

    def draft(x):
        s = (x * -1 / 0.5).to(torch.bfloat16).type(torch.float32)
        s.mul_(0.25)
        v, i = torch.topk(torch.softmax(s, dim=-1).to(torch.float64), 1, -1)
        return v, i

    x = torch.tensor([[[-2, 3, 1, 0, 2, -1]], [[-1, -2, 3, 2, 0, 1]]], dtype=torch.int32)
    result = rewrite_softmax_topk(dynamo_graph(draft, x.clone()))
    assert result.report.rewrites, str(result.report)
    want, got = draft(x.clone()), result.graph_module(x.clone())
    assert torch.equal(want[1], got[1])
    assert torch.allclose(want[0], got[0], rtol=1e-6), (want[0].flatten(), got[0].flatten())


def test_post_grad_twin_of_a_narrowing_softmax_is_found():
    """softmax(x, dtype=float16) is refused at the Dynamo level and rewritten after decomposition, where each
    spelling casts x again: the twin a mask reads is no longer the same node's softmax. Found by the values'
    logits computed alike (a functional graph), its values are gathered and its fp16 output read rounded
    (before: the exp-sum's 1/sum rounded against the twin's unrounded maximum, counts of 0 where eager has
    1; the backend fuzzer, seed 620051)."""

    def draft(x):
        probs = x.softmax(-1, dtype=torch.float16)
        v, i = probs.max(-1, keepdim=True)
        twin = x.softmax(-1, dtype=torch.float16)
        return (i, v, (twin >= v).sum(-1))

    x = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(r)) for r in range(7)]).float() - 2.5
    want = draft(x.clone())
    torch._dynamo.reset()
    got = torch.compile(draft, backend="draftfuse")(x.clone())
    assert torch.equal(want[0], got[0]) and torch.equal(want[2], got[2]), (want[2], got[2])
