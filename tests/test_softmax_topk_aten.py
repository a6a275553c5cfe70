"""Golden graphs of the softmax -> topk pass on Inductor's post-grad ATen graphs.

There softmax is already decomposed (amax, sub, exp, sum, div; converts around it for half types;
Inductor's own where-form for a temperature) and default arguments are dropped.
"""

import functools

import torch
from expecttest import TestCase
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

from draftfuse.options import Options
from draftfuse.passes.post_grad import PostGradPass
from tests._graphs import fx_graph_text
from tests._oracle import assert_same_selection


class _Recording(PostGradPass):
    """The softmax -> topk pass alone (no setup merging), keeping the graph's text before and after it ran."""

    def __call__(self, graph):
        self.before = fx_graph_text(graph)
        super().__call__(graph)
        self.after = fx_graph_text(graph)

    @property
    def last_report(self):
        return self.reports[-1]


def compiled_with_pass(fn, *args, **options):
    """(the pass's recording, the compiled call's output)."""
    recording = _Recording(Options.parse(options={"seed_fold": False, "lowering": "torch", **options}))
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_pre_pass=recording, fx_graph_cache=False):
        return recording, torch.compile(fn, fullgraph=True)(*args)


def compile_with_pass(fn, *args, **options):
    recording, out = compiled_with_pass(fn, *args, **options)
    for got, want in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(fn(*args))):
        if not want.dtype.is_floating_point:
            assert torch.equal(got, want), (got, want)
    return recording


def _stable_softmax(z):
    """A softmax over the last dim written by hand: Inductor gives z = x / t its temperature form."""
    z = z - z.amax(-1, keepdim=True)
    e = z.exp()
    return e / e.sum(-1, keepdim=True)


class AtenRewrites(TestCase):
    def test_fp32_topk1_max_argmin_topk4(self):
        def f(x):
            p = torch.softmax(x, -1)
            v, i = p.topk(1)
            m = p.max(-1)
            a = p.argmin(-1)
            w, j = p.topk(4)
            return v, i, m.values, m.indices, a, w, j

        rec = compile_with_pass(f, torch.randn(4, 64))
        self.assertEqual(len(rec.last_report.rewrites), 3, str(rec.last_report))  # argmin: refused
        self.assertIn("smallest-probability", rec.last_report.refusals[0].reason)
        self.assertExpectedInline(rec.before, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 64]"):
        amax: "f32[4, 1]" = torch.ops.aten.amax.default(arg0_1, [-1], True)
        sub: "f32[4, 64]" = torch.ops.aten.sub.Tensor(arg0_1, amax);  arg0_1 = amax = None
        exp: "f32[4, 64]" = torch.ops.aten.exp.default(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp, [-1], True)
        div: "f32[4, 64]" = torch.ops.aten.div.Tensor(exp, sum_1);  exp = sum_1 = None

        topk = torch.ops.aten.topk.default(div, 1)
        getitem: "f32[4, 1]" = topk[0]
        getitem_1: "i64[4, 1]" = topk[1];  topk = None

        max_1 = torch.ops.aten.max.dim(div, -1)
        getitem_2: "f32[4]" = max_1[0]
        getitem_3: "i64[4]" = max_1[1];  max_1 = None

        topk_1 = torch.ops.aten.topk.default(div, 4)
        getitem_4: "f32[4, 4]" = topk_1[0]
        getitem_5: "i64[4, 4]" = topk_1[1];  topk_1 = None

        argmin: "i64[4]" = torch.ops.aten.argmin.default(div, -1);  div = None
        return (getitem, getitem_1, getitem_2, getitem_3, argmin, getitem_4, getitem_5)
""")
        self.assertExpectedInline(rec.after, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 64]"):
        amax: "f32[4, 1]" = torch.ops.aten.amax.default(arg0_1, [-1], True)
        sub: "f32[4, 64]" = torch.ops.aten.sub.Tensor(arg0_1, amax);  amax = None
        exp: "f32[4, 64]" = torch.ops.aten.exp.default(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp, [-1], True)
        div: "f32[4, 64]" = torch.ops.aten.div.Tensor(exp, sum_1);  exp = sum_1 = None

        argmax_default: "i64[4, 1]" = torch.ops.aten.argmax.default(arg0_1, 1, True)
        gather_default: "f32[4, 1]" = torch.ops.aten.gather.default(div, 1, argmax_default)

        argmax_default_1: "i64[4]" = torch.ops.aten.argmax.default(arg0_1, 1, False)
        unsqueeze_default: "i64[4, 1]" = torch.ops.aten.unsqueeze.default(argmax_default_1, 1)
        gather_default_1: "f32[4, 1]" = torch.ops.aten.gather.default(div, 1, unsqueeze_default);  unsqueeze_default = None
        squeeze_dim: "f32[4]" = torch.ops.aten.squeeze.dim(gather_default_1, 1);  gather_default_1 = None

        topk_default = torch.ops.aten.topk.default(arg0_1, 4, 1, True, True);  arg0_1 = None
        getitem_6: "i64[4, 4]" = topk_default[1];  topk_default = None
        gather_default_2: "f32[4, 4]" = torch.ops.aten.gather.default(div, 1, getitem_6)

        argmin: "i64[4]" = torch.ops.aten.argmin.default(div, -1);  div = None
        return (gather_default, argmax_default, squeeze_dim, argmax_default_1, argmin, gather_default_2, getitem_6)
""")

    def test_bf16_temperature_and_log_softmax(self):
        def f(x):
            t = torch.softmax(x.float() / 0.7, -1).topk(1)
            lp, tok = torch.log_softmax(x, -1).max(-1)
            return t.values, t.indices, lp, tok

        rec = compile_with_pass(f, torch.randn(4, 64, dtype=torch.bfloat16))
        self.assertEqual(len(rec.last_report.rewrites), 2, str(rec.last_report))
        self.assertExpectedInline(rec.before, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 64]"):
        convert_element_type: "f32[4, 64]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32)

        div_tensor: "f32[4, 64]" = torch.ops.aten.div.Tensor(convert_element_type, 0.7)
        eq_tensor: "b8[4, 64]" = torch.ops.aten.eq.Tensor(div_tensor, div_tensor)
        abs_default: "f32[4, 64]" = torch.ops.aten.abs.default(div_tensor)
        ne_scalar: "b8[4, 64]" = torch.ops.aten.ne.Scalar(abs_default, inf);  abs_default = None
        mul_tensor_1: "b8[4, 64]" = torch.ops.aten.mul.Tensor(eq_tensor, ne_scalar);  eq_tensor = ne_scalar = None
        logical_not_default: "b8[4, 64]" = torch.ops.aten.logical_not.default(mul_tensor_1);  mul_tensor_1 = None
        any_dims: "b8[4, 1]" = torch.ops.aten.any.dims(logical_not_default, [-1], True);  logical_not_default = None
        logical_not_default_1: "b8[4, 1]" = torch.ops.aten.logical_not.default(any_dims);  any_dims = None
        mul_tensor: "f32[4, 64]" = torch.ops.aten.mul.Tensor(convert_element_type, 1);  convert_element_type = None
        amax_default: "f32[4, 1]" = torch.ops.aten.amax.default(mul_tensor, [-1], True)
        sub_tensor: "f32[4, 64]" = torch.ops.aten.sub.Tensor(mul_tensor, amax_default);  mul_tensor = amax_default = None
        div_tensor_1: "f32[4, 64]" = torch.ops.aten.div.Tensor(sub_tensor, 0.7);  sub_tensor = None
        amax_default_1: "f32[4, 1]" = torch.ops.aten.amax.default(div_tensor, [-1], True)
        sub_tensor_1: "f32[4, 64]" = torch.ops.aten.sub.Tensor(div_tensor, amax_default_1);  div_tensor = amax_default_1 = None

        where_self: "f32[4, 64]" = torch.ops.aten.where.self(logical_not_default_1, div_tensor_1, sub_tensor_1);  logical_not_default_1 = div_tensor_1 = sub_tensor_1 = None
        exp: "f32[4, 64]" = torch.ops.aten.exp.default(where_self);  where_self = None
        sum_1: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp, [-1], True)
        div_1: "f32[4, 64]" = torch.ops.aten.div.Tensor(exp, sum_1);  exp = sum_1 = None
        topk = torch.ops.aten.topk.default(div_1, 1);  div_1 = None
        getitem: "f32[4, 1]" = topk[0]
        getitem_1: "i64[4, 1]" = topk[1];  topk = None

        convert_element_type_1: "f32[4, 64]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32);  arg0_1 = None
        amax_1: "f32[4, 1]" = torch.ops.aten.amax.default(convert_element_type_1, [-1], True)
        sub_1: "f32[4, 64]" = torch.ops.aten.sub.Tensor(convert_element_type_1, amax_1);  convert_element_type_1 = amax_1 = None
        exp_1: "f32[4, 64]" = torch.ops.aten.exp.default(sub_1)
        sum_2: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp_1, [-1], True);  exp_1 = None
        log: "f32[4, 1]" = torch.ops.aten.log.default(sum_2);  sum_2 = None
        sub_2: "f32[4, 64]" = torch.ops.aten.sub.Tensor(sub_1, log);  sub_1 = log = None
        convert_element_type_2: "bf16[4, 64]" = torch.ops.prims.convert_element_type.default(sub_2, torch.bfloat16);  sub_2 = None
        max_1 = torch.ops.aten.max.dim(convert_element_type_2, -1);  convert_element_type_2 = None
        getitem_2: "bf16[4]" = max_1[0]
        getitem_3: "i64[4]" = max_1[1];  max_1 = None
        return (getitem, getitem_1, getitem_2, getitem_3)
""")
        self.assertExpectedInline(rec.after, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 64]"):
        convert_element_type: "f32[4, 64]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32)

        div_tensor: "f32[4, 64]" = torch.ops.aten.div.Tensor(convert_element_type, 0.7)
        eq_tensor: "b8[4, 64]" = torch.ops.aten.eq.Tensor(div_tensor, div_tensor)
        abs_default: "f32[4, 64]" = torch.ops.aten.abs.default(div_tensor)
        ne_scalar: "b8[4, 64]" = torch.ops.aten.ne.Scalar(abs_default, inf);  abs_default = None
        mul_tensor_1: "b8[4, 64]" = torch.ops.aten.mul.Tensor(eq_tensor, ne_scalar);  eq_tensor = ne_scalar = None
        logical_not_default: "b8[4, 64]" = torch.ops.aten.logical_not.default(mul_tensor_1);  mul_tensor_1 = None
        any_dims: "b8[4, 1]" = torch.ops.aten.any.dims(logical_not_default, [-1], True);  logical_not_default = None
        logical_not_default_1: "b8[4, 1]" = torch.ops.aten.logical_not.default(any_dims);  any_dims = None
        mul_tensor: "f32[4, 64]" = torch.ops.aten.mul.Tensor(convert_element_type, 1);  convert_element_type = None
        amax_default: "f32[4, 1]" = torch.ops.aten.amax.default(mul_tensor, [-1], True)
        sub_tensor: "f32[4, 64]" = torch.ops.aten.sub.Tensor(mul_tensor, amax_default);  mul_tensor = amax_default = None
        div_tensor_1: "f32[4, 64]" = torch.ops.aten.div.Tensor(sub_tensor, 0.7);  sub_tensor = None
        amax_default_1: "f32[4, 1]" = torch.ops.aten.amax.default(div_tensor, [-1], True)
        sub_tensor_1: "f32[4, 64]" = torch.ops.aten.sub.Tensor(div_tensor, amax_default_1);  div_tensor = amax_default_1 = None

        where_self: "f32[4, 64]" = torch.ops.aten.where.self(logical_not_default_1, div_tensor_1, sub_tensor_1);  logical_not_default_1 = div_tensor_1 = sub_tensor_1 = None
        exp: "f32[4, 64]" = torch.ops.aten.exp.default(where_self);  where_self = None
        sum_1: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp, [-1], True);  exp = None

        argmax_default: "i64[4, 1]" = torch.ops.aten.argmax.default(arg0_1, 1, True)
        reciprocal_default: "f32[4, 1]" = torch.ops.aten.reciprocal.default(sum_1);  sum_1 = None

        convert_element_type_1: "f32[4, 64]" = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32)
        amax_1: "f32[4, 1]" = torch.ops.aten.amax.default(convert_element_type_1, [-1], True)
        sub_1: "f32[4, 64]" = torch.ops.aten.sub.Tensor(convert_element_type_1, amax_1);  convert_element_type_1 = amax_1 = None
        exp_1: "f32[4, 64]" = torch.ops.aten.exp.default(sub_1);  sub_1 = None
        sum_2: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp_1, [-1], True);  exp_1 = None
        log: "f32[4, 1]" = torch.ops.aten.log.default(sum_2);  sum_2 = None

        argmax_default_1: "i64[4]" = torch.ops.aten.argmax.default(arg0_1, 1, False);  arg0_1 = None
        neg_default: "f32[4, 1]" = torch.ops.aten.neg.default(log);  log = None
        squeeze_dim: "f32[4]" = torch.ops.aten.squeeze.dim(neg_default, 1);  neg_default = None
        round_to_default: "bf16[4]" = torch.ops.draftfuse.round_to.default(squeeze_dim, torch.bfloat16);  squeeze_dim = None
        return (reciprocal_default, argmax_default, round_to_default, argmax_default_1)
""")

    def test_the_probs_ones_note_comes_with_a_rewrite_only(self):
        """A post-grad graph after the Dynamo level rewrote its selections has none left: the note on
        probs="ones" was repeated in its report of nothing."""
        rec = compile_with_pass(lambda x: torch.softmax(x, -1).topk(1), torch.randn(4, 64), probs="ones")
        self.assertTrue(any('probs="ones"' in note for note in rec.last_report.notes), str(rec.last_report))
        rec = compile_with_pass(lambda x: x.topk(1), torch.randn(4, 64), probs="ones")
        self.assertEqual((rec.last_report.rewrites, rec.last_report.notes), ([], []), str(rec.last_report))

    def test_probs_ones_and_softmax_kept(self):
        def f(x):
            p = torch.softmax(x, -1)
            return p, p.topk(1)

        rec = compile_with_pass(f, torch.randn(4, 64), probs="ones")
        self.assertExpectedInline(rec.after, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 64]"):
        amax: "f32[4, 1]" = torch.ops.aten.amax.default(arg0_1, [-1], True)
        sub: "f32[4, 64]" = torch.ops.aten.sub.Tensor(arg0_1, amax);  amax = None
        exp: "f32[4, 64]" = torch.ops.aten.exp.default(sub);  sub = None
        sum_1: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp, [-1], True)
        div: "f32[4, 64]" = torch.ops.aten.div.Tensor(exp, sum_1);  exp = sum_1 = None

        argmax_default: "i64[4, 1]" = torch.ops.aten.argmax.default(arg0_1, 1, True);  arg0_1 = None
        full_default: "f32[4, 1]" = torch.ops.aten.full.default([4, 1], 1.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
        return (div, full_default, argmax_default)
""")


    def test_a_hand_written_softmax_of_a_temperature_tensor_in_inductors_signed_form(self):
        """Inductor turns a hand-written stable softmax of x / t (or s * x) with a tensor t into
        where(all_finite(x / t), (x * w - amax(x * w)) / (w * t), ...), w = where(t >= 0, 1, -1): rewritten,
        the selection following the sign of t in each row, the values those of the softmax."""

        def by_division(x, t):
            return _stable_softmax(x / t).topk(4)

        def by_product_of_an_upcast(x, s):
            p = _stable_softmax(s * x.float())
            return p.argmax(-1), p.max(-1)

        x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
        t = torch.tensor([[0.5], [-0.5], [2.0], [-3.0], [1.0], [-1.0]])
        negative = (t < 0).squeeze(1)
        for fn, args, rewrites in ((by_division, (x, t), 1), (by_product_of_an_upcast, (x.bfloat16(), 1 / t), 2)):
            rec, got = compiled_with_pass(fn, *args)
            want = fn(*args)
            self.assertEqual(len(rec.last_report.rewrites), rewrites, str(rec.last_report))
            self.assertEqual(rec.last_report.refusals, [], str(rec.last_report))
            self.assertIn("temperature tensor arg1_1: the order of x * sign", str(rec.last_report))
            want_first, got_first = want.indices[:, 0] if fn is by_division else want[0], got.indices[:, 0] if fn is by_division else got[0]
            self.assertTrue(torch.equal(got_first, want_first))
            self.assertTrue(torch.equal(got_first[negative], args[0][negative].float().argmin(-1)))  # the sign decides
            for got_leaf, want_leaf in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
                torch.testing.assert_close(got_leaf, want_leaf, rtol=0, atol=0) if not want_leaf.dtype.is_floating_point else torch.testing.assert_close(got_leaf, want_leaf)


class AtenRefusals(TestCase):
    def test_integer_logits_in_inductors_temperature_form_are_refused(self):
        """For int8 logits Inductor's form subtracts the row maximum in int8, which wraps (-128 - 100 = 28):
        its z is no softmax input, so values taken from it would be wrong (Inductor's own token is)."""

        def f(x, t):
            return _stable_softmax(x / t).max(-1)

        rec, _ = compiled_with_pass(f, torch.tensor([[-128, 100, 0]], dtype=torch.int8), torch.tensor([[2.0]]))
        self.assertEqual(rec.last_report.rewrites, [], str(rec.last_report))
        self.assertIn("subtracts the row maximum in torch.int8, which wraps", rec.last_report.refusals[0].reason)
        self.assertEqual(rec.before, rec.after)

    def test_the_kernels_do_not_scale_logits_divided_in_float64(self):
        """x / t with t float64 divides in float64; the kernels' scale 1 / t in float32 is 0 for t = 1e50
        (every row then tied, index 0). The selection goes to torch's ops on the float64 values instead."""

        def f(x, t):
            return _stable_softmax(x / t).argmax(-1)

        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 1e36
        t = torch.full((4, 1), 1e50, dtype=torch.float64)
        rec, got = compiled_with_pass(f, x, t, lowering="kernels")
        self.assertTrue(torch.equal(got, f(x, t)))
        self.assertFalse(torch.equal(f(x, t), torch.zeros(4, dtype=torch.long)))
        (rewrite,) = rec.last_report.rewrites
        self.assertIn("not the kernels: the logits are scaled in float64, the kernels scale in float32", rewrite.detail)

    def test_dims_differ_refused_beside_a_tensor_temperature_rewritten(self):
        def f(x, t):
            a = torch.softmax(x, 0).argmax(1)
            b = torch.softmax(x / t, -1).argmax(-1)
            return a, b

        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
        rec = compile_with_pass(f, x, torch.tensor(-0.5))  # the tokens equal eager's (compile_with_pass)
        self.assertEqual(len(rec.last_report.rewrites), 1, str(rec.last_report))
        self.assertEqual(len(rec.last_report.refusals), 1, str(rec.last_report))
        self.assertIn("softmax over dim 0 but selection over dim 1", rec.last_report.refusals[0].reason)
        self.assertIn("temperature tensor arg1_1: the order of x * sign", str(rec.last_report.rewrites[0]))
        self.assertFalse(torch.equal(f(x, torch.tensor(-0.5))[1], x.argmax(-1)))  # the sign decides the tokens
        self.assertExpectedInline(rec.before, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 64]", arg1_1: "f32[]"):
        amax: "f32[1, 64]" = torch.ops.aten.amax.default(arg0_1, [0], True)
        sub: "f32[4, 64]" = torch.ops.aten.sub.Tensor(arg0_1, amax);  amax = None
        exp: "f32[4, 64]" = torch.ops.aten.exp.default(sub);  sub = None
        sum_1: "f32[1, 64]" = torch.ops.aten.sum.dim_IntList(exp, [0], True)
        div: "f32[4, 64]" = torch.ops.aten.div.Tensor(exp, sum_1);  exp = sum_1 = None
        argmax: "i64[4]" = torch.ops.aten.argmax.default(div, 1);  div = None

        div_tensor: "f32[4, 64]" = torch.ops.aten.div.Tensor(arg0_1, arg1_1)
        eq_tensor: "b8[4, 64]" = torch.ops.aten.eq.Tensor(div_tensor, div_tensor)
        abs_default: "f32[4, 64]" = torch.ops.aten.abs.default(div_tensor)
        ne_scalar: "b8[4, 64]" = torch.ops.aten.ne.Scalar(abs_default, inf);  abs_default = None
        mul_tensor_2: "b8[4, 64]" = torch.ops.aten.mul.Tensor(eq_tensor, ne_scalar);  eq_tensor = ne_scalar = None
        logical_not_default: "b8[4, 64]" = torch.ops.aten.logical_not.default(mul_tensor_2);  mul_tensor_2 = None
        any_dims: "b8[4, 1]" = torch.ops.aten.any.dims(logical_not_default, [-1], True);  logical_not_default = None
        logical_not_default_1: "b8[4, 1]" = torch.ops.aten.logical_not.default(any_dims);  any_dims = None
        ge_scalar: "b8[]" = torch.ops.aten.ge.Scalar(arg1_1, 0)
        scalar_tensor_default: "f32[]" = torch.ops.aten.scalar_tensor.default(1, dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
        neg_default: "f32[]" = torch.ops.aten.neg.default(scalar_tensor_default)
        where_self: "f32[]" = torch.ops.aten.where.self(ge_scalar, scalar_tensor_default, neg_default);  ge_scalar = scalar_tensor_default = neg_default = None
        mul_tensor: "f32[4, 64]" = torch.ops.aten.mul.Tensor(arg0_1, where_self);  arg0_1 = None
        amax_default: "f32[4, 1]" = torch.ops.aten.amax.default(mul_tensor, [-1], True)
        sub_tensor: "f32[4, 64]" = torch.ops.aten.sub.Tensor(mul_tensor, amax_default);  mul_tensor = amax_default = None
        mul_tensor_1: "f32[]" = torch.ops.aten.mul.Tensor(where_self, arg1_1);  where_self = arg1_1 = None
        div_tensor_1: "f32[4, 64]" = torch.ops.aten.div.Tensor(sub_tensor, mul_tensor_1);  sub_tensor = mul_tensor_1 = None
        amax_default_1: "f32[4, 1]" = torch.ops.aten.amax.default(div_tensor, [-1], True)
        sub_tensor_1: "f32[4, 64]" = torch.ops.aten.sub.Tensor(div_tensor, amax_default_1);  div_tensor = amax_default_1 = None

        where_self_1: "f32[4, 64]" = torch.ops.aten.where.self(logical_not_default_1, div_tensor_1, sub_tensor_1);  logical_not_default_1 = div_tensor_1 = sub_tensor_1 = None
        exp_1: "f32[4, 64]" = torch.ops.aten.exp.default(where_self_1);  where_self_1 = None
        sum_2: "f32[4, 1]" = torch.ops.aten.sum.dim_IntList(exp_1, [-1], True)
        div_2: "f32[4, 64]" = torch.ops.aten.div.Tensor(exp_1, sum_2);  exp_1 = sum_2 = None
        argmax_1: "i64[4]" = torch.ops.aten.argmax.default(div_2, -1);  div_2 = None
        return (argmax, argmax_1)
""")
        self.assertExpectedInline(rec.after, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 64]", arg1_1: "f32[]"):
        amax: "f32[1, 64]" = torch.ops.aten.amax.default(arg0_1, [0], True)
        sub: "f32[4, 64]" = torch.ops.aten.sub.Tensor(arg0_1, amax);  amax = None
        exp: "f32[4, 64]" = torch.ops.aten.exp.default(sub);  sub = None
        sum_1: "f32[1, 64]" = torch.ops.aten.sum.dim_IntList(exp, [0], True)
        div: "f32[4, 64]" = torch.ops.aten.div.Tensor(exp, sum_1);  exp = sum_1 = None
        argmax: "i64[4]" = torch.ops.aten.argmax.default(div, 1);  div = None

        reciprocal_default: "f32[]" = torch.ops.aten.reciprocal.default(arg1_1);  arg1_1 = None
        sign_default: "f32[]" = torch.ops.aten.sign.default(reciprocal_default);  reciprocal_default = None
        mul_tensor_3: "f32[4, 64]" = torch.ops.aten.mul.Tensor(arg0_1, sign_default);  arg0_1 = sign_default = None
        argmax_default: "i64[4]" = torch.ops.aten.argmax.default(mul_tensor_3, 1, False);  mul_tensor_3 = None
        return (argmax, argmax_default)
""")


class AtenKernelLowering(TestCase):
    def test_lowered_to_draftfuse_ops_in_the_generated_code(self):
        def f(x):
            p = torch.softmax(x, -1)
            return p.max(-1), p.topk(4)

        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        recording = _Recording(Options.parse(options={"seed_fold": False, "lowering": "kernels"}))
        torch._dynamo.reset()
        with inductor_config.patch(post_grad_custom_pre_pass=recording, fx_graph_cache=False):
            got, (code,) = run_and_get_code(torch.compile(f, fullgraph=True), x)
        self.assertIn("torch.ops.draftfuse.argmax_prob.default", code)
        self.assertIn("torch.ops.draftfuse.topk_prob.default", code)
        self.assertNotIn("aten.topk", code)
        want, probs = f(x), torch.softmax(x, -1)
        # bf16 probabilities can tie where the logits do not: the documented case, allowed by the oracle
        assert_same_selection(probs, 1, want[0].indices, got[0].indices, keepdim=False)
        assert_same_selection(probs, 1, want[1].indices, got[1].indices, keepdim=True)
        self.assertExpectedInline(recording.after, """\
class GraphModule(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 64]"):
        argmax_prob_default = torch.ops.draftfuse.argmax_prob.default(arg0_1, False)
        getitem_4: "i64[4]" = argmax_prob_default[0]
        getitem_5: "f32[4]" = argmax_prob_default[1];  argmax_prob_default = None
        round_to_default: "bf16[4]" = torch.ops.draftfuse.round_to.default(getitem_5, torch.bfloat16);  getitem_5 = None

        topk_prob_default = torch.ops.draftfuse.topk_prob.default(arg0_1, 4, False);  arg0_1 = None
        getitem_6: "i64[4, 4]" = topk_prob_default[1]
        getitem_7: "f32[4, 4]" = topk_prob_default[0];  topk_prob_default = None
        round_to_default_1: "bf16[4, 4]" = torch.ops.draftfuse.round_to.default(getitem_7, torch.bfloat16);  getitem_7 = None
        return (round_to_default, getitem_4, round_to_default_1, getitem_6)
""")


class AtenRecognisers(TestCase):
    """Decomposed forms that look like a softmax but are not one: refused (or not matched), and the
    compiled result equals eager. Shapes are square so that a wrong broadcast would still run."""

    def check_not_rewritten(self, fn, *args):
        rec = compile_with_pass(fn, *args)
        self.assertEqual(rec.last_report.rewrites, [], str(rec.last_report))
        return rec.last_report

    def test_max_without_keepdim_is_no_softmax(self):
        def f(x):
            e = torch.exp(x - torch.amax(x, -1))  # broadcasts the row maxima along the rows: not a softmax
            return (e / e.sum(-1, keepdim=True)).argmax(-1)

        report = self.check_not_rewritten(f, torch.randn(6, 6))
        self.assertTrue(any("keepdim" in r.reason for r in report.refusals), str(report))

    def test_where_branches_with_different_temperatures_are_no_softmax(self):
        def f(x, keep):
            a = (x - x.amax(-1, keepdim=True)) / 0.5
            s = x / 2.0
            b = s - s.amax(-1, keepdim=True)
            e = torch.exp(torch.where(keep, a, b))
            return (e / e.sum(-1, keepdim=True)).argmax(-1)

        report = self.check_not_rewritten(f, torch.randn(6, 6), torch.rand(6, 1) > 0.5)
        self.assertTrue(any("scale the logits differently" in r.reason for r in report.refusals), str(report))

    def test_a_negative_constant_temperature_is_refused_for_its_sign(self):
        """Inductor's form of softmax(x / -0.7) was refused as "the two branches of the where scale the
        logits differently (1.43 and 1.0)" (helper-66): the reason is the factor's sign."""

        def f(x):
            return torch.softmax(x / -0.7, -1).argmax(-1)

        report = self.check_not_rewritten(f, torch.randn(6, 6))
        self.assertTrue(any("temperature factor -1.428" in r.reason and "not positive" in r.reason for r in report.refusals), str(report))

    def test_signed_temperature_forms_with_one_piece_off_are_not_rewritten(self):
        """Inductor's where form for softmax(x / t), spelled by hand (make_fx keeps it as written) with one
        piece off: the sign of another tensor or of t - 1, the divisor, the scaled branch or the signed
        branch another tensor's, a signed branch of 2 * x or a second branch times 2 (the order of x / t,
        other values: the kernels' would differ), a temperature that varies along the row. The spelling with nothing off is
        rewritten and selects as the graph does."""
        from torch.fx.experimental.proxy_tensor import make_fx

        from draftfuse.passes import rewrite_softmax_topk

        def signed_form(x, t, other, off):
            one = torch.scalar_tensor(1.0)
            w = torch.where((other if off == "sign of another" else t) >= (1.0 if off == "sign of t - 1" else 0.0), one, -one)
            a = {"signed branch of another": x.flip(-1), "signed branch scaled": x * 2.0}.get(off, x) * w
            first = (a - a.amax(-1, keepdim=True)) / (w * (other if off == "divisor" else t))
            s = x / (other if off == "scaled branch" else t)
            second = (s - s.amax(-1, keepdim=True)) * (2.0 if off == "second branch scaled" else 1.0)
            finite = torch.logical_not(torch.any(torch.logical_not((s == s) * (s.abs() != float("inf"))), -1, keepdim=True))
            e = torch.where(finite, first, second).exp()
            return (e / e.sum(-1, keepdim=True)).argmax(-1)

        gen = torch.Generator().manual_seed(1)
        x = torch.randn(6, 32, generator=gen)
        t = torch.tensor([[0.5], [-0.5], [2.0], [-3.0], [0.7], [-1.0]])
        other = torch.tensor([[-2.0], [0.25], [-1.0], [3.0], [-0.7], [1.5]])
        per_entry = torch.randn(6, 32, generator=gen)
        cases = [("nothing", t), ("sign of another", t), ("sign of t - 1", t), ("divisor", t), ("scaled branch", t), ("signed branch of another", t), ("signed branch scaled", t), ("second branch scaled", t), ("nothing", per_entry)]
        for off, temperature in cases:
            gm = make_fx(functools.partial(signed_form, off=off), tracing_mode="fake")(x, temperature, other)
            result = rewrite_softmax_topk(gm)
            self.assertEqual(len(result.report.rewrites), int(off == "nothing" and temperature is t), (off, str(result.report)))
            self.assertTrue(torch.equal(result.graph_module(x, temperature, other), gm(x, temperature, other)), off)

    def test_torch_2_11s_signed_temperature_form_without_the_where(self):
        """torch 2.11's Inductor gives softmax(x / t) (or x * s) for a tensor t as the where's first branch
        alone, exp((x * w - amax(x * w)) / (w * t)) (the CUDA suite on torch 2.11 found it unrewritten): with
        nothing off, rewritten in the order of x * sign(t), on torch's ops and on the kernels (so are 2 * x
        and x.flip(-1) for x: other logits); with w, t or the divisor not one tensor's, left alone."""
        from torch.fx.experimental.proxy_tensor import make_fx

        from draftfuse.passes import rewrite_softmax_topk

        def bare_form(x, t, other, off, op):
            one = torch.scalar_tensor(1.0)
            w = torch.where((other if off == "sign of another" else t) >= (1.0 if off == "sign of t - 1" else 0.0), one, -one)
            a = {"signed branch of another": x.flip(-1), "scaled by 2": x * 2.0}.get(off, x) * w
            divisor = w * (other if off == "divisor" else t)
            z = (a - a.amax(-1, keepdim=True)) / divisor if op == "div" else (a - a.amax(-1, keepdim=True)) * divisor
            e = z.exp()
            return (e / e.sum(-1, keepdim=True)).argmax(-1)

        gen = torch.Generator().manual_seed(2)
        x = torch.randn(6, 32, generator=gen)
        t = torch.tensor([[0.5], [-0.5], [2.0], [-3.0], [0.7], [-1.0]])
        other = torch.tensor([[-2.0], [0.25], [-1.0], [3.0], [-0.7], [1.5]])
        per_entry = torch.randn(6, 32, generator=gen)
        negative = (t < 0).squeeze(1)
        cases = [("nothing", t, "div", "torch"), ("nothing", t, "div", "kernels"), ("nothing", t, "mul", "kernels"), ("scaled by 2", t, "div", "kernels"),
                 ("sign of another", t, "div", "torch"), ("sign of t - 1", t, "div", "torch"), ("divisor", t, "div", "torch"),
                 ("signed branch of another", t, "div", "kernels"), ("nothing", per_entry, "div", "torch")]  # fmt: skip
        for off, temperature, op, lowering in cases:
            gm = make_fx(functools.partial(bare_form, off=off, op=op), tracing_mode="fake")(x, temperature, other)
            result = rewrite_softmax_topk(gm, lowering=lowering)
            rewritten = off in ("nothing", "scaled by 2", "signed branch of another") and temperature is t
            self.assertEqual(len(result.report.rewrites), int(rewritten), (off, str(result.report)))
            got = result.graph_module(x, temperature, other)
            self.assertTrue(torch.equal(got, gm(x, temperature, other)), off)
            if rewritten:
                logits = x.flip(-1) if off == "signed branch of another" else x
                self.assertTrue(torch.equal(got[negative], logits[negative].argmin(-1)), off)  # the sign of t decides
                self.assertEqual("draftfuse.argmax_prob" in result.graph_module.code, lowering == "kernels", off)

    def test_a_decomposed_softmax_whose_input_is_written_between_its_reads_is_refused(self):
        """The decomposed softmax reads its input at s - amax(s) (the bare temperature form at x * w and
        w * t), before its last node: a write in place in between (make_fx keeps it, Inductor would
        functionalize it) left the rewrite reading the written x or t; one before the first read is the
        value the softmax reads, and is rewritten. A scalar_tensor(1) of an unsigned dtype is no sign
        (-1 is 255): not the temperature form. Found by a review of the bare form's recogniser."""
        from torch.fx.experimental.proxy_tensor import make_fx

        from draftfuse.passes import rewrite_softmax_topk

        def bare(x, t, write="", one_dtype=torch.float32):
            one = torch.scalar_tensor(1, dtype=one_dtype)
            x.neg_() if write == "x before" else None
            w = torch.where(t >= 0, one, -one)
            a = x * w
            z = (a - a.amax(-1, keepdim=True)) / (w * t)
            {"x": x, "t": t}.get(write, torch.empty(0)).neg_()
            e = z.exp()
            return (e / e.sum(-1, keepdim=True)).argmax(-1)

        def plain(x, t, write=""):
            z = x - x.amax(-1, keepdim=True)
            x.neg_()
            e = z.exp()
            return (e / e.sum(-1, keepdim=True)).argmax(-1)

        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        t = torch.tensor([[0.5], [-0.5], [2.0], [-2.0]])
        cases = [(bare, "t", {}, 0), (bare, "x", {}, 0), (plain, "", {}, 0), (bare, "x before", {}, 1), (bare, "", {"one_dtype": torch.uint8}, 0)]
        for fn, write, extra, rewrites in cases:
            run = functools.partial(fn, write=write, **extra)
            gm = make_fx(run, tracing_mode="fake")(x.clone(), t.clone())
            result = rewrite_softmax_topk(gm, lowering="torch")
            self.assertEqual(len(result.report.rewrites), rewrites, (fn.__name__, write, str(result.report)))
            self.assertTrue(torch.equal(result.graph_module(x.clone(), t.clone()), gm(x.clone(), t.clone())), (fn.__name__, write))
            if write in ("t", "x", ""):
                reasons = " ".join(r.reason for r in result.report.refusals)
                self.assertIn("written in place between its reads" if fn is plain or write else "sign is not known", reasons)

    def test_zero_dim_softmax_and_amax_without_dim_do_not_crash(self):
        def f(x, y):
            p = torch.softmax(x, 0)  # 0-d
            e = torch.exp(y - torch.amax(y))  # amax over everything
            q = e / e.sum(-1, keepdim=True)
            return p, q.argmax(-1)

        self.check_not_rewritten(f, torch.tensor(1.5), torch.randn(6, 6))

    def test_a_subtraction_with_alpha_is_no_max_subtracted_softmax(self):
        """aten.sub.Tensor's alpha was not read: x - 2 * amax(x) passed for x - amax(x), whose k = 1 value is
        1 / sum(exp(z)) only when the row's max of z is 0 (values above 1 came out), and a log-softmax form
        z - 2 * log(sum(exp(z))) passed for a log-softmax."""

        def shifted_twice(x):
            z = torch.sub(x, x.amax(-1, keepdim=True), alpha=2.0)  # still a softmax (shift-invariant), not max-subtracted
            e = z.exp()
            return (e / e.sum(-1, keepdim=True)).topk(1, -1)

        def log_sum_twice(x):
            z = x - x.amax(-1, keepdim=True)
            return torch.sub(z, z.exp().sum(-1, keepdim=True).log(), alpha=2.0).max(-1)  # no log-softmax

        x = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
        for fn in (shifted_twice, log_sum_twice):
            rec, got = compiled_with_pass(fn, x)
            self.assertEqual(rec.last_report.rewrites, [], str(rec.last_report))
            torch.testing.assert_close(got.values, fn(x).values)
            torch.testing.assert_close(got.indices, fn(x).indices)

    def test_probs_ones_keeps_exact_values_where_autograd_differentiates_the_graph(self):
        """AOT's forward graph has no requires_grad on its fake tensors, so probs="ones" put the constant 1 into a
        graph whose backward reads the values it saves (v.log()): values 0 and gradients off by up to 0.83."""

        def chosen_log_prob(x):
            z = x - x.amax(-1, keepdim=True)
            e = z.exp()
            v, i = (e / e.sum(-1, keepdim=True)).topk(1, -1)
            return v.log(), i

        x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
        eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = chosen_log_prob(eager_x)
        rec, got = compiled_with_pass(chosen_log_prob, compiled_x, probs="ones")
        self.assertTrue(rec.last_report.rewrites and any("exact values here" in n for n in rec.last_report.notes), str(rec.last_report))
        torch.testing.assert_close(got[0], want[0])
        want[0].sum().backward()
        got[0].sum().backward()
        torch.testing.assert_close(compiled_x.grad, eager_x.grad)

    def test_probs_ones_keeps_exact_values_written_to_an_input_that_requires_grad(self):
        """The values reach autograd through a written input (no output requires grad): the constant was kept."""

        def values_into(x, buffer):
            z = x - x.amax(-1, keepdim=True)
            e = z.exp()
            v, i = (e / e.sum(-1, keepdim=True)).topk(1, -1)
            buffer.copy_(v)
            return i

        x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).requires_grad_()
        want, got = torch.zeros(4, 1, requires_grad=True) * 1, torch.zeros(4, 1, requires_grad=True) * 1
        values_into(x, want)
        compiled_with_pass(values_into, x, got, probs="ones")
        torch.testing.assert_close(got, want)
