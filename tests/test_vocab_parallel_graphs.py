"""Golden graphs of the vocab-parallel pass: each form it rewrites at each level, and every refusal.

In one process, on torch's fake process group (2 ranks, rank 0: collectives trace but move no data):
the graphs are what every rank compiles. tests/test_vocab_parallel_ranks.py runs them on real gloo
ranks and checks the numbers. EXPECTTEST_ACCEPT=1 regenerates the expected text.
"""

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase

from draftfuse.passes.vocab_parallel import rewrite_vocab_parallel
from draftfuse.testing import draft_graphs
from tests import _tp
from tests._graphs import dynamo_graph, graph_text

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
X = torch.randn(3, 8)  # this rank's shard: 3 rows, 8 of the 16 vocabulary entries


def local_part(after: str) -> str:
    """A rewritten graph up to its collective: what each rank computes on its own shard (the merge
    after it is the same in every rewrite and shown whole in test_gather_dim_softmax_topk4)."""
    lines = after.splitlines()
    cut = next(i for i, line in enumerate(lines) if "all_gather_into_tensor" in line)
    return "\n".join(lines[: cut + 1])


class _FakeGroup(TestCase):
    @classmethod
    def setUpClass(cls):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        cls.owns_group = not dist.is_initialized()
        if cls.owns_group:
            dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        _tp._MESH.clear()

    @classmethod
    def tearDownClass(cls):
        _tp._MESH.clear()
        if cls.owns_group:
            dist.destroy_process_group()
        torch._dynamo.reset()

    def rewrite(self, fn, *args, **options):
        gm = dynamo_graph(fn, *args)
        before = graph_text(gm)
        result = rewrite_vocab_parallel(gm, **options)
        self.assertEqual(graph_text(gm), before, "the pass must not modify its input")
        return before, graph_text(result.graph_module), result.report.format(nodes=True)

    def refusal(self, fn, *args, **options) -> str:
        before, after, report = self.rewrite(fn, *args, **options)
        self.assertEqual(after, before, "a refusal leaves the graph unchanged")
        return report


class Rewrites(_FakeGroup):
    def test_gather_dim_softmax_topk4(self):
        def draft(x):
            return torch.softmax(_tp.gather_dim(x).float(), dim=-1).topk(4, dim=-1)

        before, after, report = self.rewrite(draft, X)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[3, 8]"):
        l_x_ = L_x_

        tensor: "f32[6, 8]" = torch.ops._c10d_functional.all_gather_into_tensor(l_x_, 2, '0');  l_x_ = None

        res: "f32[6, 8]" = torch.ops._c10d_functional.wait_tensor(tensor);  tensor = None

        chunk = torch.chunk(res, 2, dim = 0);  res = None
        getitem: "f32[3, 8]" = chunk[0]
        getitem_1: "f32[3, 8]" = chunk[1];  chunk = None
        res_1: "f32[3, 16]" = torch.cat((getitem, getitem_1), dim = -1);  getitem = getitem_1 = None

        float_1: "f32[3, 16]" = res_1.float();  res_1 = None
        softmax: "f32[3, 16]" = torch.softmax(float_1, dim = -1);  float_1 = None
        topk = softmax.topk(4, dim = -1);  softmax = None
        getitem_2: "f32[3, 4]" = topk[0]
        getitem_3: "i64[3, 4]" = topk[1];  topk = None
        return (getitem_2, getitem_3)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[3, 8]"):
        l_x_ = L_x_

        topk_1 = torch.topk(l_x_, k = 4, dim = 1, largest = True, sorted = True)
        getitem_4: "f32[3, 4]" = topk_1[0]
        getitem_5: "i64[3, 4]" = topk_1[1];  topk_1 = None
        to: "f32[3, 4]" = getitem_5.to(torch.float32);  getitem_5 = None
        float_2: "f32[3, 8]" = l_x_.float();  l_x_ = None
        amax: "f32[3, 1]" = torch.amax(float_2, dim = 1, keepdim = True)
        sub: "f32[3, 8]" = torch.sub(float_2, amax);  float_2 = None
        exp: "f32[3, 8]" = torch.exp(sub);  sub = None
        sum_1: "f32[3, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        cat: "f32[3, 10]" = torch.cat([getitem_4, to, amax, sum_1], 1);  getitem_4 = to = amax = sum_1 = None
        all_gather_into_tensor: "f32[6, 10]" = torch.ops._c10d_functional.all_gather_into_tensor(cat, 2, '0');  cat = None
        wait_tensor: "f32[6, 10]" = torch.ops._c10d_functional.wait_tensor(all_gather_into_tensor);  all_gather_into_tensor = None
        reshape: "f32[2, 3, 10]" = wait_tensor.reshape([2, 3, 10]);  wait_tensor = None
        narrow: "f32[2, 3, 4]" = reshape.narrow(2, 0, 4)
        permute: "f32[3, 2, 4]" = narrow.permute([1, 0, 2]);  narrow = None
        reshape_1: "f32[3, 8]" = permute.reshape([3, 8]);  permute = None
        arange: "i64[2]" = torch.arange(2, device = device(type='cpu'))
        mul: "i64[2]" = torch.mul(arange, 8);  arange = None
        reshape_2: "i64[2, 1, 1]" = mul.reshape([2, 1, 1]);  mul = None
        narrow_1: "f32[2, 3, 4]" = reshape.narrow(2, 4, 4)
        to_1: "i64[2, 3, 4]" = narrow_1.to(torch.int64);  narrow_1 = None
        add: "i64[2, 3, 4]" = torch.add(to_1, reshape_2);  to_1 = reshape_2 = None
        permute_1: "i64[3, 2, 4]" = add.permute([1, 0, 2]);  add = None
        reshape_3: "i64[3, 8]" = permute_1.reshape([3, 8]);  permute_1 = None
        sort = torch.sort(reshape_1, dim = 1, descending = True, stable = True);  reshape_1 = None
        getitem_6: "i64[3, 8]" = sort[1]
        narrow_2: "i64[3, 4]" = getitem_6.narrow(1, 0, 4);  getitem_6 = None
        gather: "i64[3, 4]" = torch.gather(reshape_3, dim = 1, index = narrow_2);  reshape_3 = narrow_2 = None
        narrow_3: "f32[2, 3, 1]" = reshape.narrow(2, 8, 1)
        narrow_4: "f32[2, 3, 1]" = reshape.narrow(2, 9, 1);  reshape = None
        amax_1: "f32[1, 3, 1]" = torch.amax(narrow_3, dim = 0, keepdim = True)
        sub_1: "f32[2, 3, 1]" = torch.sub(narrow_3, amax_1);  narrow_3 = None
        exp_1: "f32[2, 3, 1]" = torch.exp(sub_1);  sub_1 = None
        mul_1: "f32[2, 3, 1]" = torch.mul(narrow_4, exp_1);  narrow_4 = None
        eq: "b8[2, 3, 1]" = torch.eq(exp_1, 0);  exp_1 = None
        zeros_like: "f32[2, 3, 1]" = torch.zeros_like(mul_1, dtype = torch.float32)
        where: "f32[2, 3, 1]" = torch.where(eq, zeros_like, mul_1);  eq = zeros_like = mul_1 = None
        sum_2: "f32[3, 1]" = torch.sum(where, dim = 0, keepdim = False);  where = None
        getitem_7: "f32[3, 8]" = sort[0];  sort = None
        narrow_5: "f32[3, 4]" = getitem_7.narrow(1, 0, 4);  getitem_7 = None
        float_3: "f32[3, 4]" = narrow_5.float();  narrow_5 = None
        squeeze: "f32[3, 1]" = torch.squeeze(amax_1, dim = 0);  amax_1 = None
        sub_2: "f32[3, 4]" = torch.sub(float_3, squeeze);  float_3 = squeeze = None
        exp_2: "f32[3, 4]" = torch.exp(sub_2);  sub_2 = None
        div: "f32[3, 4]" = torch.div(exp_2, sum_2);  exp_2 = sum_2 = None
        return (div, gather)
""")
        self.assertExpectedInline(report, """\
[vocab_parallel] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:63: all_gather+softmax+topk(k=4) -> local topk + all_gather of 10 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; probabilities from the merged max and exp-sum) [tensor, res, chunk, getitem, getitem_1, res_1, float_1, softmax, topk]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")

    def test_view_permute_argmax_post_grad(self):
        def draft(x):
            return torch.argmax(torch.softmax(_tp.view_permute(x), dim=-1), dim=-1)

        before, after, report = _tp.aten_graphs(draft, X)
        self.assertExpectedInline(before, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[3, 8]"):
        all_gather_into_tensor: "f32[6, 8]" = torch.ops._c10d_functional.all_gather_into_tensor.default(arg0_1, 2, '0');  arg0_1 = None

        wait_tensor: "f32[6, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None

        view: "f32[2, 3, 8]" = torch.ops.aten.view.default(wait_tensor, [2, 3, 8]);  wait_tensor = None
        permute: "f32[3, 2, 8]" = torch.ops.aten.permute.default(view, [1, 0, 2]);  view = None
        clone: "f32[3, 2, 8]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format);  permute = None
        view_1: "f32[3, 16]" = torch.ops.aten.view.default(clone, [3, 16]);  clone = None

        amax: "f32[3, 1]" = torch.ops.aten.amax.default(view_1, [-1], True)
        sub: "f32[3, 16]" = torch.ops.aten.sub.Tensor(view_1, amax);  view_1 = amax = None
        exp: "f32[3, 16]" = torch.ops.aten.exp.default(sub);  sub = None
        sum_1: "f32[3, 1]" = torch.ops.aten.sum.dim_IntList(exp, [-1], True)
        div: "f32[3, 16]" = torch.ops.aten.div.Tensor(exp, sum_1);  exp = sum_1 = None
        argmax: "i64[3]" = torch.ops.aten.argmax.default(div, -1);  div = None
        return (argmax,)
""")
        self.assertExpectedInline(after, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[3, 8]"):
        argmax_default: "i64[3, 1]" = torch.ops.aten.argmax.default(arg0_1, 1, True)
        gather_default: "f32[3, 1]" = torch.ops.aten.gather.default(arg0_1, 1, argmax_default);  arg0_1 = None
        convert_element_type_default: "f32[3, 1]" = torch.ops.prims.convert_element_type.default(argmax_default, torch.float32);  argmax_default = None
        cat_default: "f32[3, 2]" = torch.ops.aten.cat.default([gather_default, convert_element_type_default], 1);  gather_default = convert_element_type_default = None
        all_gather_into_tensor_default: "f32[6, 2]" = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default, 2, '0');  cat_default = None
        wait_tensor_default: "f32[6, 2]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
        view_default: "f32[2, 3, 2]" = torch.ops.aten.view.default(wait_tensor_default, [2, 3, 2]);  wait_tensor_default = None
        slice_tensor: "f32[2, 3, 1]" = torch.ops.aten.slice.Tensor(view_default, 2, 0, 1)
        permute_default: "f32[3, 2, 1]" = torch.ops.aten.permute.default(slice_tensor, [1, 0, 2]);  slice_tensor = None
        clone_default: "f32[3, 2, 1]" = torch.ops.aten.clone.default(permute_default, memory_format = torch.contiguous_format);  permute_default = None
        view_default_1: "f32[3, 2]" = torch.ops.aten.view.default(clone_default, [3, 2]);  clone_default = None
        iota_default: "i64[2]" = torch.ops.prims.iota.default(2, start = 0, step = 1, dtype = torch.int64, device = device(type='cpu'), requires_grad = False)
        mul_tensor: "i64[2]" = torch.ops.aten.mul.Tensor(iota_default, 8);  iota_default = None
        view_default_2: "i64[2, 1, 1]" = torch.ops.aten.view.default(mul_tensor, [2, 1, 1]);  mul_tensor = None
        slice_tensor_1: "f32[2, 3, 1]" = torch.ops.aten.slice.Tensor(view_default, 2, 1, 2);  view_default = None
        convert_element_type_default_1: "i64[2, 3, 1]" = torch.ops.prims.convert_element_type.default(slice_tensor_1, torch.int64);  slice_tensor_1 = None
        add_tensor: "i64[2, 3, 1]" = torch.ops.aten.add.Tensor(convert_element_type_default_1, view_default_2);  convert_element_type_default_1 = view_default_2 = None
        permute_default_1: "i64[3, 2, 1]" = torch.ops.aten.permute.default(add_tensor, [1, 0, 2]);  add_tensor = None
        clone_default_1: "i64[3, 2, 1]" = torch.ops.aten.clone.default(permute_default_1, memory_format = torch.contiguous_format);  permute_default_1 = None
        view_default_3: "i64[3, 2]" = torch.ops.aten.view.default(clone_default_1, [3, 2]);  clone_default_1 = None
        argmax_default_1: "i64[3, 1]" = torch.ops.aten.argmax.default(view_default_1, 1, True);  view_default_1 = None
        gather_default_1: "i64[3, 1]" = torch.ops.aten.gather.default(view_default_3, 1, argmax_default_1);  view_default_3 = argmax_default_1 = None
        squeeze_dim: "i64[3]" = torch.ops.aten.squeeze.dim(gather_default_1, 1);  gather_default_1 = None
        return (squeeze_dim,)
""")
        self.assertExpectedInline(report.format(nodes=True), """\
[vocab_parallel (post-grad)] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:146: all_gather+softmax+argmax(k=1) -> local argmax + all_gather of 2 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; not the kernels: they run on CUDA with Triton, k <= 16, not on cpu) [all_gather_into_tensor, wait_tensor, view, permute, clone, view_1, amax, sub, exp, sum_1, div, argmax]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")

    def test_dtensor_full_tensor_log_softmax_temperature(self):
        _tp._mesh()

        def draft(x):
            return torch.log_softmax(_tp.dtensor_full(x) / 0.7, dim=-1).topk(2, dim=-1)

        before, after, report = self.rewrite(draft, X)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, G_import_tests_dot_tp_MESH_0_ : torch.distributed.device_mesh.DeviceMesh, L_x_: "f32[3, 8]"):
        g_import_tests_dot_tp_mesh_0_ = G_import_tests_dot_tp_MESH_0_
        l_x_ = L_x_

        from_local: "DTensor(f32[3, 16], S(1))" = torch.distributed.tensor._api.from_local(l_x_, g_import_tests_dot_tp_mesh_0_, [torch.distributed.tensor.placement_types.Shard(dim=-1)]);  l_x_ = g_import_tests_dot_tp_mesh_0_ = None
        full_tensor: "f32[3, 16]" = from_local.full_tensor();  from_local = None

        truediv: "f32[3, 16]" = full_tensor / 0.7;  full_tensor = None
        log_softmax: "f32[3, 16]" = torch.log_softmax(truediv, dim = -1);  truediv = None
        topk = log_softmax.topk(2, dim = -1);  log_softmax = None
        getitem: "f32[3, 2]" = topk[0]
        getitem_1: "i64[3, 2]" = topk[1];  topk = None
        return (getitem, getitem_1)
""")
        self.assertExpectedInline(local_part(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, G_import_tests_dot_tp_MESH_0_ : torch.distributed.device_mesh.DeviceMesh, L_x_: "f32[3, 8]"):
        g_import_tests_dot_tp_mesh_0_ = G_import_tests_dot_tp_MESH_0_
        l_x_ = L_x_

        from_local: "DTensor(f32[3, 16], S(1))" = torch.distributed.tensor._api.from_local(l_x_, g_import_tests_dot_tp_mesh_0_, [torch.distributed.tensor.placement_types.Shard(dim=-1)]);  l_x_ = g_import_tests_dot_tp_mesh_0_ = None

        to_local: "f32[3, 8]" = from_local.to_local();  from_local = None
        topk_1 = torch.topk(to_local, k = 2, dim = 1, largest = True, sorted = True)
        getitem_2: "f32[3, 2]" = topk_1[0]
        getitem_3: "i64[3, 2]" = topk_1[1];  topk_1 = None
        to: "f32[3, 2]" = getitem_3.to(torch.float32);  getitem_3 = None
        truediv_1: "f32[3, 8]" = to_local / 0.7;  to_local = None
        amax: "f32[3, 1]" = torch.amax(truediv_1, dim = 1, keepdim = True)
        sub: "f32[3, 8]" = torch.sub(truediv_1, amax);  truediv_1 = None
        exp: "f32[3, 8]" = torch.exp(sub);  sub = None
        sum_1: "f32[3, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        cat: "f32[3, 6]" = torch.cat([getitem_2, to, amax, sum_1], 1);  getitem_2 = to = amax = sum_1 = None
        all_gather_into_tensor: "f32[6, 6]" = torch.ops._c10d_functional.all_gather_into_tensor(cat, 2, '0');  cat = None""")
        self.assertExpectedInline(report, """\
[vocab_parallel] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:206: all_gather+log_softmax+topk(k=2) -> local topk + all_gather of 6 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; log-probabilities from the merged max and exp-sum) [full_tensor, truediv, log_softmax, topk]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")

    def test_padded_vocabulary_masks_this_ranks_padding(self):
        def draft(x):
            full = _tp.chunk_cat(x)
            return torch.softmax(full[:, :13], dim=-1).max(dim=-1)

        _, after, report = self.rewrite(draft, X)
        self.assertExpectedInline(local_part(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[3, 8]"):
        l_x_ = L_x_

        arange: "i64[8]" = torch.arange(8, device = device(type='cpu'))
        ge: "b8[8]" = torch.ge(arange, 8);  arange = None
        masked_fill: "f32[3, 8]" = l_x_.masked_fill(ge, -inf);  l_x_ = ge = None
        argmax: "i64[3, 1]" = torch.argmax(masked_fill, dim = 1, keepdim = True)
        gather: "f32[3, 1]" = torch.gather(masked_fill, dim = 1, index = argmax)
        to: "f32[3, 1]" = argmax.to(torch.float32);  argmax = None
        amax: "f32[3, 1]" = torch.amax(masked_fill, dim = 1, keepdim = True)
        sub: "f32[3, 8]" = torch.sub(masked_fill, amax);  masked_fill = None
        exp: "f32[3, 8]" = torch.exp(sub);  sub = None
        sum_1: "f32[3, 1]" = torch.sum(exp, dim = 1, keepdim = True);  exp = None
        cat: "f32[3, 4]" = torch.cat([gather, to, amax, sum_1], 1);  gather = to = amax = sum_1 = None
        all_gather_into_tensor: "f32[6, 4]" = torch.ops._c10d_functional.all_gather_into_tensor(cat, 2, '0');  cat = None""")
        self.assertExpectedInline(report, """\
[vocab_parallel] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:253: all_gather+softmax+max(k=1) -> local argmax + all_gather of 4 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; padded vocabulary: 13 real of 16, the rest masked; probabilities from the merged max and exp-sum) [tensor, res, chunk, getitem, getitem_1, full, getitem_2, softmax, max_1]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")

    def test_into_buffer_probs_ones_and_kernels(self):
        def draft(x):
            return torch.softmax(_tp.into_buffer(x), dim=-1).topk(1, dim=-1)

        _, after, report = self.rewrite(draft, X, probs="ones", lowering="kernels")
        self.assertExpectedInline(local_part(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[3, 8]"):
        l_x_ = L_x_

        argmax_prob_default = torch.ops.draftfuse.argmax_prob.default(l_x_, log = False)
        getitem_2: "i64[3]" = argmax_prob_default[0];  argmax_prob_default = None
        unsqueeze: "i64[3, 1]" = torch.unsqueeze(getitem_2, dim = 1);  getitem_2 = None
        gather: "f32[3, 1]" = torch.gather(l_x_, dim = 1, index = unsqueeze);  l_x_ = None
        to: "f32[3, 1]" = unsqueeze.to(torch.float32);  unsqueeze = None
        cat: "f32[3, 2]" = torch.cat([gather, to], 1);  gather = to = None
        all_gather_into_tensor: "f32[6, 2]" = torch.ops._c10d_functional.all_gather_into_tensor(cat, 2, '0');  cat = None""")
        self.assertExpectedInline(report, """\
[vocab_parallel] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:280: all_gather+softmax+topk(k=1) -> local draftfuse.argmax_prob + all_gather of 2 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; probabilities 1 (probs='ones')) [out, tensor, res, copy_, view, movedim, reshape, softmax, topk]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")

    def test_a_bare_argmax_of_padded_gathered_logits(self):
        """vLLM's greedy EAGLE draft: its LogitsProcessor all-gathers the vocab-parallel LM head's logits and
        drops the padding ([..., :org_vocab_size]); the proposer takes logits.argmax(dim=-1), no softmax. It
        was left gathering the full logits, with no word."""

        def draft(x):
            logits = _tp.gather_dim(x)[..., :13]
            return logits.argmax(dim=-1)

        before, after, report = self.rewrite(draft, X)
        self.assertExpectedInline(local_part(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[3, 8]"):
        l_x_ = L_x_

        arange: "i64[8]" = torch.arange(8, device = device(type='cpu'))
        ge: "b8[8]" = torch.ge(arange, 8);  arange = None
        masked_fill: "f32[3, 8]" = l_x_.masked_fill(ge, -inf);  l_x_ = ge = None
        argmax_1: "i64[3, 1]" = torch.argmax(masked_fill, dim = 1, keepdim = True)
        gather: "f32[3, 1]" = torch.gather(masked_fill, dim = 1, index = argmax_1);  masked_fill = None
        to: "f32[3, 1]" = argmax_1.to(torch.float32);  argmax_1 = None
        cat: "f32[3, 2]" = torch.cat([gather, to], 1);  gather = to = None
        all_gather_into_tensor: "f32[6, 2]" = torch.ops._c10d_functional.all_gather_into_tensor(cat, 2, '0');  cat = None""")
        self.assertIn("argmax", after.split("all_gather_into_tensor")[-1])  # the merge
        self.assertExpectedInline(report, """\
[vocab_parallel] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:307: all_gather+argmax(k=1) -> local argmax + all_gather of 2 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; padded vocabulary: 13 real of 16, the rest masked) [tensor, res, chunk, getitem, getitem_1, res_1, logits, argmax]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")

    def test_a_bare_topk_and_max_through_a_cast_and_a_scale(self):
        """topk and max of the gathered logits themselves, their values read: each rank replays the cast
        and the constant scale on its shard; the values are the chosen logits, in the selection's dtype."""

        def topk(x):
            return (_tp.gather_dim(x.bfloat16()).float() * -0.5).topk(3, dim=-1)

        def max_post_grad(x):
            return _tp.gather_dim(x).max(dim=-1)

        before, after, report = self.rewrite(topk, X)
        self.assertExpectedInline(local_part(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[3, 8]"):
        l_x_ = L_x_

        bfloat16: "bf16[3, 8]" = l_x_.bfloat16();  l_x_ = None

        float_2: "f32[3, 8]" = bfloat16.float();  bfloat16 = None
        mul_1: "f32[3, 8]" = float_2 * -0.5;  float_2 = None
        topk_1 = torch.topk(mul_1, k = 3, dim = 1, largest = True, sorted = True);  mul_1 = None
        getitem_4: "f32[3, 3]" = topk_1[0]
        getitem_5: "i64[3, 3]" = topk_1[1];  topk_1 = None
        to: "f32[3, 3]" = getitem_5.to(torch.float32);  getitem_5 = None
        cat: "f32[3, 6]" = torch.cat([getitem_4, to], 1);  getitem_4 = to = None
        all_gather_into_tensor: "f32[6, 6]" = torch.ops._c10d_functional.all_gather_into_tensor(cat, 2, '0');  cat = None""")
        self.assertExpectedInline(report, """\
[vocab_parallel] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:334: all_gather+topk(k=3) -> local topk + all_gather of 6 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; values: the chosen logits) [tensor, res, chunk, getitem, getitem_1, res_1, float_1, mul, topk]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")
        _, after, report = _tp.aten_graphs(max_post_grad, X)
        self.assertExpectedInline(local_part(after), """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[3, 8]"):
        argmax_default: "i64[3, 1]" = torch.ops.aten.argmax.default(arg0_1, 1, True)
        gather_default: "f32[3, 1]" = torch.ops.aten.gather.default(arg0_1, 1, argmax_default);  arg0_1 = None
        convert_element_type_default: "f32[3, 1]" = torch.ops.prims.convert_element_type.default(argmax_default, torch.float32);  argmax_default = None
        cat_default: "f32[3, 2]" = torch.ops.aten.cat.default([gather_default, convert_element_type_default], 1);  gather_default = convert_element_type_default = None
        all_gather_into_tensor_default: "f32[6, 2]" = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default, 2, '0');  cat_default = None""")
        self.assertExpectedInline(report.format(nodes=True), """\
[vocab_parallel (post-grad)] 1 rewrite, 0 refusals
  tests/test_vocab_parallel_graphs.py:337: all_gather+max(k=1) -> local argmax + all_gather of 2 numbers per row (tp 2, group '0', dim 1, 8 entries per shard; values: the chosen logits) [all_gather_into_tensor, wait_tensor, split, getitem, getitem_1, cat, max_1]
  note: each rank selects on its own shard; one all_gather carries k candidates per rank (after a softmax, with its max and exp-sum)""")

    def test_the_post_grad_pass_leaves_a_dynamo_rewrites_merge_alone(self):
        """The merge's argmax over the gathered candidates is itself an argmax of gathered values: the
        post-grad pass read it as a bare selection and refused it ("permute ... not understood") after
        every k = 1 rewrite. Its ATen nodes carry the rewrite's provenance now, and are no candidate."""
        for draft in (lambda x: _tp.gather_dim(x).argmax(dim=-1), lambda x: torch.softmax(_tp.gather_dim(x), -1).argmax(dim=-1)):
            reports = {r.pass_name: r for r in draft_graphs(draft, X).reports}
            self.assertEqual(len(reports["vocab_parallel"].rewrites), 1)
            post_grad = reports["vocab_parallel (post-grad)"]
            self.assertEqual((post_grad.rewrites, post_grad.refusals), ([], []), str(post_grad))

    def test_pipeline_runs_it_before_softmax_topk(self):
        def draft(x):
            return torch.softmax(_tp.gather_dim(x), dim=-1).topk(2, dim=-1)

        graphs = draft_graphs(draft, X)
        self.assertEqual([r.pass_name for r in graphs.reports][:3], ["seed_fold", "vocab_parallel", "softmax_topk"])
        self.assertEqual(len(graphs.reports[1].rewrites), 1)
        self.assertNotIn("softmax", graphs.after)
        off = draft_graphs(draft, X, options={"vocab_parallel": False})
        self.assertNotIn("vocab_parallel", [r.pass_name for r in off.reports])
        self.assertIn("cat", off.after)  # the full logits are gathered, then softmax_topk selects on them

    def test_graph_without_a_gather_gets_no_report(self):
        graphs = draft_graphs(lambda x: torch.softmax(x, dim=-1).topk(2, dim=-1), X)
        self.assertEqual([r.pass_name for r in graphs.reports], ["seed_fold", "softmax_topk", "softmax_topk (post-grad)", "merge_setup"])


class Refusals(_FakeGroup):
    def test_gathered_logits_with_other_users(self):
        def draft(x):
            full = _tp.gather_dim(x)
            return torch.softmax(full, dim=-1).topk(2, dim=-1), full

        self.assertExpectedInline(self.refusal(draft, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:404: refused: the gathered logits have other users: res_1 is also read by output [topk]""")

    def test_uneven_dtensor_shards(self):
        from torch.distributed.tensor import DTensor, Shard

        mesh = _tp._mesh()

        def draft(x):
            full = DTensor.from_local(x, mesh, [Shard(1)], shape=(3, 15), stride=(15, 1)).full_tensor()
            return torch.softmax(full, dim=-1).argmax(dim=-1)

        self.assertExpectedInline(self.refusal(draft, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:417: refused: uneven shards: 15 entries over 2 ranks (DTensor pads the last shards); not proven even [argmax]""")

    def test_padded_vocabulary_without_a_known_mask(self):
        def draft(x):
            return torch.softmax(_tp.gather_dim(x)[:, 1:], dim=-1).argmax(dim=-1)

        def masked(x, mask):
            return torch.softmax(_tp.gather_dim(x).masked_fill(mask, float("-inf")), dim=-1).argmax(dim=-1)

        self.assertExpectedInline(self.refusal(draft, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:425: refused: a padded vocabulary without a known mask: getitem_2 slices the vocabulary [1:None:None] [argmax]""")
        self.assertExpectedInline(self.refusal(masked, X, torch.zeros(16, dtype=torch.bool)), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:428: refused: a padded vocabulary without a known mask: masked_fill masks the gathered logits with a tensor [argmax]""")

    def test_process_group_not_identified(self):
        def draft(x):
            return torch.softmax(_tp.gather_dim(x), dim=-1).argmax(dim=-1)

        gm = dynamo_graph(draft, X)
        (collective,) = [n for n in gm.graph.nodes if "all_gather" in str(n.target)]
        collective.args = (*collective.args[:2], "no-such-group")
        gm.recompile()
        result = rewrite_vocab_parallel(gm)
        self.assertExpectedInline(result.report.format(nodes=True), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:439: refused: process group 'no-such-group' cannot be identified in this process (RuntimeError) [argmax]""")

    def test_symbolic_shapes(self):
        def draft(x):
            return torch.softmax(_tp.gather_dim(x), dim=-1).argmax(dim=-1)

        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        torch.compile(draft, backend=backend, fullgraph=True, dynamic=True)(X)
        self.assertExpectedInline(rewrite_vocab_parallel(graphs[0]).report.format(nodes=True), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:452: refused: res has no static shape: the shards cannot be proven even [argmax]""")

    def test_k_larger_than_a_shard_and_the_wrong_dim(self):
        def large_k(x):
            return torch.softmax(_tp.gather_dim(x), dim=-1).topk(9, dim=-1)

        def batch_gathered(x):
            from torch.distributed import _functional_collectives as funcol

            return torch.softmax(funcol.all_gather_tensor(x, 0, dist.group.WORLD), dim=-1).argmax(dim=-1)

        self.assertExpectedInline(self.refusal(large_k, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:468: refused: k=9 is larger than one shard (8 entries) [topk]""")
        self.assertExpectedInline(self.refusal(batch_gathered, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:473: refused: the shards are concatenated along dim 0, the softmax is over dim 1 [argmax]""")

    def test_shards_out_of_order(self):
        def draft(x):
            from torch.distributed import _functional_collectives as funcol

            first, second = torch.chunk(funcol.all_gather_tensor(x, 0, dist.group.WORLD), 2, dim=0)
            return torch.softmax(torch.cat([second, first], dim=-1), dim=-1).argmax(dim=-1)

        self.assertExpectedInline(self.refusal(draft, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:487: refused: cat does not concatenate the shards of ranks 0..1 in order [argmax]""")

    def test_softmax_topk_rules_and_half_probs(self):
        def temperature(x, t):
            return torch.softmax(_tp.gather_dim(x) / t, dim=-1).argmax(dim=-1)

        def half(x):
            return torch.softmax(_tp.gather_dim(x), dim=-1).to(torch.bfloat16).topk(2, dim=-1)

        self.assertExpectedInline(self.refusal(temperature, X, torch.tensor(0.7)), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:495: refused: temperature l_t_ is a tensor (it may differ by rank): not localised, the selection stays on the gathered logits [argmax]""")
        self.assertExpectedInline(self.refusal(half, X, half_probs="keep"), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:498: refused: reads half-precision probabilities and half_probs="keep" [topk]""")

    def test_bare_selections_refused_with_the_reason(self):
        """A bare selection of gathered logits that is not localised says why (it used to pass unreported)."""

        def returns_logits(x):  # vLLM's spec decode keeps the logits for rejection sampling too
            logits = _tp.gather_dim(x)
            return logits.argmax(dim=-1), logits

        def smallest(x):
            return _tp.gather_dim(x).argmin(dim=-1)

        def unsorted(x):
            return _tp.gather_dim(x).topk(2, dim=-1, sorted=False)

        def integers(x):
            return _tp.gather_dim(x).long().argmax(dim=-1)

        def written(x):
            logits = _tp.gather_dim(x)
            logits.mul_(2.0)
            return logits.argmax(dim=-1)

        def int32(x):  # refused as "cast to torch.int32 between softmax and selection", with no softmax
            return _tp.gather_dim(x).to(torch.int32).argmax(dim=-1)

        def negated(x):  # the op is named with what reads it: no softmax here either
            return (-_tp.gather_dim(x)).argmax(dim=-1)

        def beams(x):  # an op broadcasting the gathered logits is found behind (not only one of their shape)
            return (_tp.gather_dim(x)[:, None, :] + torch.zeros(3, 4, 1)).argmax(dim=-1)

        self.assertExpectedInline(self.refusal(returns_logits, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:512: refused: the gathered logits have other users: res_1 is also read by output [argmax]""")
        self.assertExpectedInline(self.refusal(smallest, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:515: refused: a smallest selection (argmin) of the gathered logits: not localised [argmin]""")
        self.assertExpectedInline(self.refusal(unsorted, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:518: refused: topk(sorted=False): its order is unspecified, a rewrite could permute it [topk]""")
        self.assertExpectedInline(self.refusal(integers, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:521: refused: a selection of torch.int64 values: not exact in a float payload [argmax]""")
        self.assertExpectedInline(self.refusal(written, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:526: refused: the gathered logits have other users: res_1 is also read by mul_ [argmax]""")
        self.assertExpectedInline(self.refusal(int32, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:529: refused: a selection of torch.int32 values: not exact in a float payload [argmax]""")
        self.assertExpectedInline(_tp.aten_graphs(int32, X)[2].format(), """\
[vocab_parallel (post-grad)] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:529: refused: a selection of torch.int32 values: not exact in a float payload""")
        self.assertExpectedInline(self.refusal(negated, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:532: refused: neg (neg) between the gather and the selection is not understood [argmax]""")
        self.assertExpectedInline(self.refusal(beams, X), """\
[vocab_parallel] 0 rewrites, 1 refusal
  tests/test_vocab_parallel_graphs.py:535: refused: add (add) between the gather and the selection is not understood [argmax]""")

    def test_a_selection_of_values_computed_from_gathered_ones_is_not_reported(self):
        """Sequence parallelism gathers the hidden states (along the rows), then the full head: the argmax
        reads no gathered logits, and was refused as "logits (matmul) between the gather and the softmax"."""
        from torch.distributed import _functional_collectives as funcol

        weight = torch.randn(16, 8)

        def draft(h):
            return (funcol.all_gather_tensor(h, 0, dist.group.WORLD) @ weight.T).argmax(dim=-1)

        before, after, report = self.rewrite(draft, X)
        self.assertEqual(after, before)
        self.assertExpectedInline(report, """[vocab_parallel] 0 rewrites, 0 refusals""")

    def test_internal_error_is_a_refusal(self):
        from draftfuse.passes.vocab_parallel import emit

        def draft(x):
            return torch.softmax(_tp.gather_dim(x), dim=-1).argmax(dim=-1)

        original = emit.local_logits

        def broken(*args):
            original(*args)  # new nodes in the graph, then a failure: they must go again
            raise RuntimeError("boom")

        emit.local_logits = broken
        try:
            report = self.refusal(draft, X)
        finally:
            emit.local_logits = original
        self.assertIn("internal error: RuntimeError('boom')", report)

    def test_gathered_logits_scattered_into_a_larger_vocabulary_are_refused_with_the_reason(self):
        """vLLM's EAGLE-3 scatters its draft vocabulary's logits into a -inf tensor of the target's, then
        selects: under TP the gathered logits reach the selection through a write in place, and the pass
        said nothing (0 rewrites, 0 refusals)."""
        targets = torch.tensor([1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 0, 2, 4, 6])

        def scattered(x):
            logits = _tp.gather_dim(x)
            full = logits.new_full((logits.shape[0], 24), float("-inf"))
            full[:, targets] = logits
            return full.argmax(dim=-1), torch.softmax(full, dim=-1).topk(2, dim=-1)

        def into_a_view(x):
            logits = _tp.gather_dim(x)
            full = logits.new_full((logits.shape[0], 24), float("-inf"))
            full[:, :16].copy_(logits)
            return full.argmax(dim=-1)

        def selected_before_the_write(x, buf):  # the buffer reused after the selection: nothing to report
            first = buf.argmax(dim=-1)
            buf.copy_(_tp.gather_dim(x))
            return first

        def padded(x):  # the vocabulary grows after the gather: refused (it used to pass unreported)
            return torch.nn.functional.pad(_tp.gather_dim(x), (0, 8), value=float("-inf")).argmax(dim=-1)

        def scattered_functionally(x):  # no write in place: scatter returns a new tensor
            logits = _tp.gather_dim(x)
            full = logits.new_full((logits.shape[0], 24), float("-inf"))
            ids = targets.expand(logits.shape[0], -1)
            return full.scatter(1, ids, logits).float().argmax(dim=-1), torch.slice_scatter(full, logits, 1, 0, 16).max(-1)

        self.assertIn("written into full by copy_ before the selection", self.refusal(into_a_view, X))
        self.assertIn("pads the gathered logits before the selection", self.refusal(padded, X))
        self.assertIn("pads the gathered logits before the selection", _tp.aten_graphs(padded, X)[2].format())
        # after AOT autograd the writes are functional (slice_scatter, index_put): refused there too (they
        # passed unreported, which a draft whose gather only the post-grad pass sees, DTensor's on torch 2.11, shows)
        for draft, writer in ((into_a_view, "slice_scatter"), (scattered, "index_put")):
            report = _tp.aten_graphs(draft, X)[2].format()
            self.assertRegex(report, f"scattered into full(_default)? by {writer} before the selection")
        report = self.refusal(scattered_functionally, X)
        self.assertIn("0 rewrites, 2 refusals", report)
        self.assertIn("scattered into full by scatter before the selection", report)
        self.assertIn("scattered into full by slice_scatter before the selection", report)
        self.assertIn("2 refusals", _tp.aten_graphs(scattered_functionally, X)[2].format())
        self.assertExpectedInline(self.rewrite(selected_before_the_write, X, torch.randn(3, 16))[2], """[vocab_parallel] 0 rewrites, 0 refusals""")
        self.assertExpectedInline(self.refusal(scattered, X), """\
[vocab_parallel] 0 rewrites, 2 refusals
  tests/test_vocab_parallel_graphs.py:608: refused: the gathered logits are written into full by setitem before the selection (as vLLM's EAGLE-3 scatters its draft vocabulary into the target's, or a buffer gathered into again): not localised [argmax]
  tests/test_vocab_parallel_graphs.py:608: refused: the gathered logits are written into full by setitem before the selection (as vLLM's EAGLE-3 scatters its draft vocabulary into the target's, or a buffer gathered into again): not localised [topk]""")

    def test_gathered_logits_viewed_as_another_dtype_are_refused(self):
        """`g.view(torch.int32)` keeps the shape, and was taken for a reshape: every rank then selected on its
        shard's own values, not the reinterpreted bits, and picked other tokens (helper-70)."""

        def as_int32(x):
            return _tp.gather_dim(x).view(torch.int32).float().argmax(dim=-1)

        def as_half(x):
            return torch.softmax(_tp.gather_dim(x).view(torch.float16).float(), dim=-1).topk(2, dim=-1)

        self.assertIn("view (view) between the gather and the selection is not understood", self.refusal(as_int32, X))
        self.assertIn("between the gather and the softmax is not understood", self.refusal(as_half, X.bfloat16()))
        for draft, x in ((as_int32, X), (as_half, X.bfloat16())):
            self.assertIn("view.dtype", _tp.aten_graphs(draft, x)[2].format())  # post-grad refused it already

    def test_a_gather_into_a_buffer_the_draft_is_given_is_refused_with_the_reason(self):
        """A CUDA-graph runner's static buffer passed in: `dist.all_gather_into_tensor(buf, x)` is a gather and a
        copy_ into the input, which the reassembly then views. The Dynamo-level pass said nothing (helper-64); the
        post-grad one refuses it (the written input is an output). vLLM's own form, the buffer made by the draft
        (`_all_gather_out_place`), is still rewritten."""

        def into_an_input(x, buf):
            dist.all_gather_into_tensor(buf, x)
            return torch.softmax(buf.view(2, *x.shape).movedim(0, 1).reshape(x.shape[0], -1), -1).topk(2, -1)

        def into_its_own(x):
            out = torch.empty((x.shape[0] * 2, *x.shape[1:]), dtype=x.dtype)
            dist.all_gather_into_tensor(out, x)
            return torch.softmax(out.reshape(2, *x.shape).movedim(0, 1).reshape(x.shape[0], -1), -1).topk(2, -1)

        report = self.refusal(into_an_input, X, torch.empty(6, 8))
        self.assertIn("0 rewrites, 1 refusal", report)
        self.assertIn("written into l_buf_ by copy_ before the selection (an input of the draft", report)
        self.assertIn("1 rewrite, 0 refusals", self.rewrite(into_its_own, X)[2])

    def test_dtensor_redistributed_then_full_tensor(self):
        """redistribute(mesh, [Replicate()]).full_tensor(): the redistribute gathers, full_tensor() of the
        replicated result is to_local(). Refused at the Dynamo level as "placed [Replicate()]", rewritten
        only after decomposition (helper-70); rewritten at both levels now."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = _tp._mesh()

        def draft(x):
            full = DTensor.from_local(x, mesh, [Shard(1)]).redistribute(mesh, [Replicate()]).full_tensor()
            return torch.softmax(full, dim=-1).topk(2, dim=-1)

        _, _, report = self.rewrite(draft, X)
        self.assertIn("all_gather+softmax+topk(k=2) -> local topk + all_gather of 6 numbers per row", report)


def test_an_unknown_option_raises():
    """As rewrite_softmax_topk: a misspelt option is the caller's error, not a note in the report."""
    with pytest.raises(ValueError, match="probs must be one of"):
        rewrite_vocab_parallel(torch.fx.symbolic_trace(lambda x: x + 1), probs="bogus")
