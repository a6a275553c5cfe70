"""Golden graphs of the seed fold: a seed and a loop composed as fold() composes them, before and after.

Each test captures the combined Dynamo graph (seed, seam marker, loop), runs the pass, shows both
graphs (EXPECTTEST_ACCEPT=1 regenerates them), checks the report, and runs the folded graph against
`loop(*seed(...))` in eager mode: same values, same writes into the caller's buffers. Setup merging
happens after AOT autograd, on the functional graph: `merged` runs the whole pipeline without code
generation (draftfuse.testing.draft_graphs) and returns the setup-merging report, after checking that
graph computes what the composition computes too.
"""

import torch
from expecttest import TestCase

from draftfuse.passes.seed_fold import fold_seed, mark_seam, seam_facts
from draftfuse.testing import draft_graphs
from tests._graphs import graph_text

B, H, V, L = 2, 4, 8, 6
torch.manual_seed(0)
EMBED = torch.randn(V, H)
HEAD = torch.randn(H, V)
FREQ = torch.rand(H)
CACHE = torch.randn(B, L, H)  # a draft model's own KV cache: the caller's, written by the draft
STATIC_HIDDEN = torch.zeros(B, H)  # a captured loop's static input buffer, written by the seed


def frozen_forward(tokens, hidden, position, mask, keys):
    """A toy draft layer over a frozen KV cache: position enters like rope, mask hides the padding."""
    x = hidden + EMBED[tokens] + torch.cos(position[:, None] * FREQ)
    attn = ((keys @ x[:, :, None]).squeeze(-1) * mask).softmax(-1)
    x = x + (attn[:, :, None] * keys).sum(1)
    return x, x @ HEAD


def own_cache_forward(tokens, hidden, position):
    """A toy draft model with its own KV cache: writes its state at `position`, attends to the prefix."""
    x = hidden + EMBED[tokens] + torch.cos(position[:, None] * FREQ)
    CACHE[torch.arange(B), position] = x
    attn = ((CACHE @ x[:, :, None]).squeeze(-1) * (torch.arange(L) <= position[:, None])).softmax(-1)
    x = x + (attn[:, :, None] * CACHE).sum(1)
    return x, x @ HEAD


def frozen_seed(tokens, hidden, keys, seq_lens):
    position = seq_lens - 1
    mask = torch.arange(L) < seq_lens[:, None]
    x, logits = frozen_forward(tokens, hidden, position, mask, keys)
    _, index = logits.softmax(-1).topk(1)
    return index[:, 0], x, keys, seq_lens


def frozen_loop(tokens, hidden, keys, seq_lens):
    position = seq_lens - 1  # loop
    mask = torch.arange(L) < seq_lens[:, None]  # loop
    drafted = [tokens]
    for _ in range(2):
        hidden, logits = frozen_forward(drafted[-1], hidden, position, mask, keys)
        drafted.append(logits.softmax(-1).topk(1)[1][:, 0])
    return torch.stack(drafted, 1)


def own_cache_seed(tokens, hidden, seq_lens):
    x, logits = own_cache_forward(tokens, hidden, seq_lens)
    _, index = logits.softmax(-1).topk(2)
    return index, x, seq_lens


def own_cache_loop(index, hidden, seq_lens):
    drafted = [index]
    for step in range(2):
        hidden, logits = own_cache_forward(drafted[-1][:, 0], hidden, seq_lens + 1 + step)
        drafted.append(logits.softmax(-1).topk(2)[1])
    return torch.stack(drafted, 1)


def server_seed(tokens, hidden, keys, seq_lens):
    """A seed as servers write it: per-draft buffers allocated and filled, the captured loop's static
    input written, attention metadata brought to the host."""
    position = seq_lens - 1
    mask = torch.arange(L) < seq_lens[:, None]
    x, logits = frozen_forward(tokens, hidden, position, mask, keys)
    p, index = logits.softmax(-1).topk(2)
    topk_p = torch.zeros(B, 2)
    topk_index = torch.zeros(B, 2, dtype=torch.long)
    topk_p.copy_(p)
    topk_index.copy_(index)
    STATIC_HIDDEN.copy_(x)
    return topk_p, topk_index, keys, seq_lens.cpu()


def server_loop(topk_p, topk_index, keys, seq_lens_host):
    seq_lens = seq_lens_host.to(keys.device)
    position = seq_lens - 1
    mask = torch.arange(L) < seq_lens[:, None]
    hidden, drafted, probs = STATIC_HIDDEN, [topk_index], [topk_p]
    for _ in range(2):
        hidden, logits = frozen_forward(drafted[-1][:, 0], hidden, position, mask, keys)
        p, index = logits.softmax(-1).topk(2)
        drafted.append(index)
        probs.append(p)
    return torch.stack(drafted, 1), torch.stack(probs, 1)


def differing_loop(tokens, hidden, keys, seq_lens):
    position = (seq_lens - 1).clamp(min=0)  # the seed's seq_lens - 1 only if seq_lens >= 1 is known
    mask = torch.arange(L) < (seq_lens + 1)[:, None]  # two slots more than the seed's position
    drafted = [tokens]
    for _ in range(2):
        hidden, logits = frozen_forward(drafted[-1], hidden, position, mask, keys)
        drafted.append(logits.softmax(-1).topk(1)[1][:, 0])
    return torch.stack(drafted, 1)


def frozen_args():
    tokens, seq_lens = torch.tensor([1, 5]), torch.tensor([3, 6])
    return dict(tokens=tokens, hidden=torch.randn(B, H), keys=torch.randn(B, L, H), seq_lens=seq_lens)


def capture(fn, kwargs):
    """The one Dynamo graph of fn(**kwargs) and the inputs it was called with."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(**kwargs)
    assert len(graphs) == 1
    return graphs[0]


def line_of(code):
    """The line number of `code` in this file."""
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, 1) if code in line)


def composed(seed, loop, **facts):
    """seed and loop composed as fold() composes them, arguments by keyword."""
    marker = seam_facts(**facts)

    def draft(**kwargs):
        return loop(*mark_seam(seed(**kwargs), marker))

    return draft


ITERATIONS = "iterations found: 3 (1 in the seed, 2 in the loop; loop selections: topk_1, topk_2)"


class SeedFold(TestCase):
    def fold(self, seed, loop, kwargs, *, facts=None, compare_buffers=True, **options):
        """(graph before, graph after, report); checks the input graph is untouched and the folded
        graph computes what the eager composition computes, buffer writes included unless told not to."""
        buffers = {"CACHE": CACHE, "STATIC_HIDDEN": STATIC_HIDDEN} if compare_buffers else {}
        initial = {name: b.clone() for name, b in buffers.items()}
        gm, inputs = capture(composed(seed, loop, **(facts or {})), kwargs)
        before = graph_text(gm)
        result = fold_seed(gm, **options)
        self.assertEqual(graph_text(gm), before, "the pass must not modify its input")
        results = []
        for run in (lambda: loop(*seed(**kwargs)), lambda: result.graph_module(*inputs)):
            for name, b in buffers.items():
                b.copy_(initial[name])
            out = run()
            results.append((torch.utils._pytree.tree_leaves(out), [b.clone() for b in buffers.values()]))
        for want, got in zip(*(torch.utils._pytree.tree_leaves(r) for r in results)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        return before, graph_text(result.graph_module), result.report

    def rules(self, report):
        return [r.rule for r in report.rewrites]

    def merged(self, seed, loop, kwargs, *, facts=None, compare_buffers=True):
        """The setup-merging report of the whole pipeline on the composition (post-grad graph)."""
        buffers = {"CACHE": CACHE, "STATIC_HIDDEN": STATIC_HIDDEN} if compare_buffers else {}
        initial = {name: b.clone() for name, b in buffers.items()}
        want = loop(*seed(**kwargs))
        for name, b in buffers.items():
            b.copy_(initial[name])
        graphs = draft_graphs(composed(seed, loop, **(facts or {})), **kwargs)
        for w, g in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(graphs.outputs)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        (report,) = [r for r in graphs.reports if r.pass_name == "merge_setup"]
        return report

    def merged_lines(self, report, rule="setup merged (identical)"):
        return {int(r.where.rsplit(":", 1)[1]) for r in report.rewrites if r.rule == rule and r.where}

    def test_frozen_kv_constant_position_topk1(self):
        before, after, report = self.fold(frozen_seed, frozen_loop, frozen_args())
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_kwargs_seq_lens_: "i64[2]", G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", G_FREQ_: "f32[4]", L_kwargs_keys_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]"):
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        g_freq_ = G_FREQ_
        l_kwargs_keys_ = L_kwargs_keys_
        g_head_ = G_HEAD_

        position: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange: "i64[6]" = torch.arange(6)
        getitem: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mask: "b8[2, 6]" = arange < getitem;  arange = getitem = None

        getitem_1: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem_1;  l_kwargs_hidden_ = getitem_1 = None
        getitem_2: "i64[2, 1]" = position[(slice(None, None, None), None)];  position = None
        mul: "f32[2, 4]" = getitem_2 * g_freq_;  getitem_2 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        getitem_3: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_3;  getitem_3 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        mul_1: "f32[2, 6]" = squeeze * mask;  squeeze = mask = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * l_kwargs_keys_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(1);  softmax_1 = None
        index: "i64[2, 1]" = topk[1];  topk = None

        seed_output: "i64[2]" = index[(slice(None, None, None), 0)];  index = None

        seam_default = torch.ops.draftfuse.seam.default([seed_output, x_1, l_kwargs_keys_, l_kwargs_seq_lens_], '{"drop_buffer_writes": false, "value_ranges": {}}');  seed_output = x_1 = l_kwargs_keys_ = l_kwargs_seq_lens_ = None
        mark: "i64[2]" = seam_default[0]
        mark_1: "f32[2, 4]" = seam_default[1]
        mark_2: "f32[2, 6, 4]" = seam_default[2]
        mark_3: "i64[2]" = seam_default[3];  seam_default = None

        position_1: "i64[2]" = mark_3 - 1

        arange_1: "i64[6]" = torch.arange(6)
        getitem_12: "i64[2, 1]" = mark_3[(slice(None, None, None), None)];  mark_3 = None
        mask_1: "b8[2, 6]" = arange_1 < getitem_12;  arange_1 = getitem_12 = None

        getitem_13: "f32[2, 4]" = g_embed_[mark]
        add_3: "f32[2, 4]" = mark_1 + getitem_13;  mark_1 = getitem_13 = None
        getitem_14: "i64[2, 1]" = position_1[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_14 * g_freq_;  getitem_14 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_3 + cos_1;  add_3 = cos_1 = None

        getitem_15: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = mark_2 @ getitem_15;  getitem_15 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        mul_4: "f32[2, 6]" = squeeze_1 * mask_1;  squeeze_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_16: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_16 * mark_2;  getitem_16 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(1);  softmax_3 = None
        getitem_18: "i64[2, 1]" = topk_1[1];  topk_1 = None
        getitem_19: "i64[2]" = getitem_18[(slice(None, None, None), 0)];  getitem_18 = None

        getitem_20: "f32[2, 4]" = g_embed_[getitem_19];  g_embed_ = None
        add_6: "f32[2, 4]" = x_3 + getitem_20;  x_3 = getitem_20 = None
        getitem_21: "i64[2, 1]" = position_1[(slice(None, None, None), None)];  position_1 = None
        mul_6: "f32[2, 4]" = getitem_21 * g_freq_;  getitem_21 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_6 + cos_2;  add_6 = cos_2 = None

        getitem_22: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = mark_2 @ getitem_22;  getitem_22 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        mul_7: "f32[2, 6]" = squeeze_2 * mask_1;  squeeze_2 = mask_1 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * mark_2;  getitem_23 = mark_2 = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(1);  softmax_5 = None
        getitem_25: "i64[2, 1]" = topk_2[1];  topk_2 = None
        getitem_26: "i64[2]" = getitem_25[(slice(None, None, None), 0)];  getitem_25 = None

        stack: "i64[2, 3]" = torch.stack([mark, getitem_19, getitem_26], 1);  mark = getitem_19 = getitem_26 = None
        return (stack,)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_kwargs_seq_lens_: "i64[2]", G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", G_FREQ_: "f32[4]", L_kwargs_keys_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]"):
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        g_freq_ = G_FREQ_
        l_kwargs_keys_ = L_kwargs_keys_
        g_head_ = G_HEAD_

        position: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange: "i64[6]" = torch.arange(6)
        getitem: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mask: "b8[2, 6]" = arange < getitem;  arange = getitem = None

        getitem_1: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem_1;  l_kwargs_hidden_ = getitem_1 = None
        getitem_2: "i64[2, 1]" = position[(slice(None, None, None), None)];  position = None
        mul: "f32[2, 4]" = getitem_2 * g_freq_;  getitem_2 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        getitem_3: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_3;  getitem_3 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        mul_1: "f32[2, 6]" = squeeze * mask;  squeeze = mask = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * l_kwargs_keys_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(1);  softmax_1 = None
        index: "i64[2, 1]" = topk[1];  topk = None

        seed_output: "i64[2]" = index[(slice(None, None, None), 0)];  index = None

        position_1: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange_1: "i64[6]" = torch.arange(6)
        getitem_12: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)];  l_kwargs_seq_lens_ = None
        mask_1: "b8[2, 6]" = arange_1 < getitem_12;  arange_1 = getitem_12 = None

        getitem_13: "f32[2, 4]" = g_embed_[seed_output]
        add_3: "f32[2, 4]" = x_1 + getitem_13;  x_1 = getitem_13 = None
        getitem_14: "i64[2, 1]" = position_1[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_14 * g_freq_;  getitem_14 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_3 + cos_1;  add_3 = cos_1 = None

        getitem_15: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_15;  getitem_15 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        mul_4: "f32[2, 6]" = squeeze_1 * mask_1;  squeeze_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_16: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_16 * l_kwargs_keys_;  getitem_16 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(1);  softmax_3 = None
        getitem_18: "i64[2, 1]" = topk_1[1];  topk_1 = None
        getitem_19: "i64[2]" = getitem_18[(slice(None, None, None), 0)];  getitem_18 = None

        getitem_20: "f32[2, 4]" = g_embed_[getitem_19];  g_embed_ = None
        add_6: "f32[2, 4]" = x_3 + getitem_20;  x_3 = getitem_20 = None
        getitem_21: "i64[2, 1]" = position_1[(slice(None, None, None), None)];  position_1 = None
        mul_6: "f32[2, 4]" = getitem_21 * g_freq_;  getitem_21 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_6 + cos_2;  add_6 = cos_2 = None

        getitem_22: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_22;  getitem_22 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        mul_7: "f32[2, 6]" = squeeze_2 * mask_1;  squeeze_2 = mask_1 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * l_kwargs_keys_;  getitem_23 = l_kwargs_keys_ = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(1);  softmax_5 = None
        getitem_25: "i64[2, 1]" = topk_2[1];  topk_2 = None
        getitem_26: "i64[2]" = getitem_25[(slice(None, None, None), 0)];  getitem_25 = None

        stack: "i64[2, 3]" = torch.stack([seed_output, getitem_19, getitem_26], 1);  seed_output = getitem_19 = getitem_26 = None
        return (stack,)
""")
        self.assertEqual(report.refusals, [])
        self.assertIn(ITERATIONS, report.notes)
        # position, the mask and the rope stand-in: once, in the seed (merged after AOT autograd)
        merged = self.merged(frozen_seed, frozen_loop, frozen_args())
        self.assertEqual(merged.refusals, [])
        lines = self.merged_lines(merged)
        self.assertLessEqual({line_of("position = seq_lens - 1  # loop"), line_of("mask = torch.arange(L) < seq_lens[:, None]  # loop"), line_of("torch.cos(position")}, lines)

    def test_advancing_position_own_kv_cache_topk2(self):
        args = dict(tokens=torch.tensor([1, 5]), hidden=torch.randn(B, H), seq_lens=torch.tensor([1, 2]))
        before, after, report = self.fold(own_cache_seed, own_cache_loop, args)
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", L_kwargs_seq_lens_: "i64[2]", G_FREQ_: "f32[4]", G_CACHE_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]"):
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_freq_ = G_FREQ_
        g_cache_ = G_CACHE_
        g_head_ = G_HEAD_

        getitem: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem;  l_kwargs_hidden_ = getitem = None
        getitem_1: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mul: "f32[2, 4]" = getitem_1 * g_freq_;  getitem_1 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        arange: "i64[2]" = torch.arange(2)
        g_cache_[(arange, l_kwargs_seq_lens_)] = x;  setitem = g_cache_;  arange = setitem = None

        getitem_2: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = g_cache_ @ getitem_2;  getitem_2 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        arange_1: "i64[6]" = torch.arange(6)
        getitem_3: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        le: "b8[2, 6]" = arange_1 <= getitem_3;  arange_1 = getitem_3 = None
        mul_1: "f32[2, 6]" = squeeze * le;  squeeze = le = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * g_cache_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(2);  softmax_1 = None
        index: "i64[2, 2]" = topk[1];  topk = None

        seam_default = torch.ops.draftfuse.seam.default([index, x_1, l_kwargs_seq_lens_], '{"drop_buffer_writes": false, "value_ranges": {}}');  index = x_1 = l_kwargs_seq_lens_ = None
        mark: "i64[2, 2]" = seam_default[0]
        mark_1: "f32[2, 4]" = seam_default[1]
        mark_2: "i64[2]" = seam_default[2];  seam_default = None

        getitem_10: "i64[2]" = mark[(slice(None, None, None), 0)]
        add_3: "i64[2]" = mark_2 + 1
        add_4: "i64[2]" = add_3 + 0;  add_3 = None

        getitem_11: "f32[2, 4]" = g_embed_[getitem_10];  getitem_10 = None
        add_5: "f32[2, 4]" = mark_1 + getitem_11;  mark_1 = getitem_11 = None
        getitem_12: "i64[2, 1]" = add_4[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_12 * g_freq_;  getitem_12 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_5 + cos_1;  add_5 = cos_1 = None

        arange_2: "i64[2]" = torch.arange(2)
        g_cache_[(arange_2, add_4)] = x_2;  setitem_1 = g_cache_;  arange_2 = setitem_1 = None

        getitem_13: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = g_cache_ @ getitem_13;  getitem_13 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        arange_3: "i64[6]" = torch.arange(6)
        getitem_14: "i64[2, 1]" = add_4[(slice(None, None, None), None)];  add_4 = None
        le_1: "b8[2, 6]" = arange_3 <= getitem_14;  arange_3 = getitem_14 = None
        mul_4: "f32[2, 6]" = squeeze_1 * le_1;  squeeze_1 = le_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_15: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_15 * g_cache_;  getitem_15 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(2);  softmax_3 = None
        getitem_17: "i64[2, 2]" = topk_1[1];  topk_1 = None

        getitem_18: "i64[2]" = getitem_17[(slice(None, None, None), 0)]
        add_8: "i64[2]" = mark_2 + 1;  mark_2 = None
        add_9: "i64[2]" = add_8 + 1;  add_8 = None

        getitem_19: "f32[2, 4]" = g_embed_[getitem_18];  g_embed_ = getitem_18 = None
        add_10: "f32[2, 4]" = x_3 + getitem_19;  x_3 = getitem_19 = None
        getitem_20: "i64[2, 1]" = add_9[(slice(None, None, None), None)]
        mul_6: "f32[2, 4]" = getitem_20 * g_freq_;  getitem_20 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_10 + cos_2;  add_10 = cos_2 = None

        arange_4: "i64[2]" = torch.arange(2)
        g_cache_[(arange_4, add_9)] = x_4;  setitem_2 = g_cache_;  arange_4 = setitem_2 = None

        getitem_21: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = g_cache_ @ getitem_21;  getitem_21 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        arange_5: "i64[6]" = torch.arange(6)
        getitem_22: "i64[2, 1]" = add_9[(slice(None, None, None), None)];  add_9 = None
        le_2: "b8[2, 6]" = arange_5 <= getitem_22;  arange_5 = getitem_22 = None
        mul_7: "f32[2, 6]" = squeeze_2 * le_2;  squeeze_2 = le_2 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * g_cache_;  getitem_23 = g_cache_ = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(2);  softmax_5 = None
        getitem_25: "i64[2, 2]" = topk_2[1];  topk_2 = None

        stack: "i64[2, 3, 2]" = torch.stack([mark, getitem_17, getitem_25], 1);  mark = getitem_17 = getitem_25 = None
        return (stack,)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", L_kwargs_seq_lens_: "i64[2]", G_FREQ_: "f32[4]", G_CACHE_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]"):
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_freq_ = G_FREQ_
        g_cache_ = G_CACHE_
        g_head_ = G_HEAD_

        getitem: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem;  l_kwargs_hidden_ = getitem = None
        getitem_1: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mul: "f32[2, 4]" = getitem_1 * g_freq_;  getitem_1 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        arange: "i64[2]" = torch.arange(2)
        g_cache_[(arange, l_kwargs_seq_lens_)] = x;  setitem = g_cache_;  arange = setitem = None

        getitem_2: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = g_cache_ @ getitem_2;  getitem_2 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        arange_1: "i64[6]" = torch.arange(6)
        getitem_3: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        le: "b8[2, 6]" = arange_1 <= getitem_3;  arange_1 = getitem_3 = None
        mul_1: "f32[2, 6]" = squeeze * le;  squeeze = le = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * g_cache_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(2);  softmax_1 = None
        index: "i64[2, 2]" = topk[1];  topk = None

        getitem_10: "i64[2]" = index[(slice(None, None, None), 0)]
        add_3: "i64[2]" = l_kwargs_seq_lens_ + 1
        add_4: "i64[2]" = add_3 + 0;  add_3 = None

        getitem_11: "f32[2, 4]" = g_embed_[getitem_10];  getitem_10 = None
        add_5: "f32[2, 4]" = x_1 + getitem_11;  x_1 = getitem_11 = None
        getitem_12: "i64[2, 1]" = add_4[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_12 * g_freq_;  getitem_12 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_5 + cos_1;  add_5 = cos_1 = None

        arange_2: "i64[2]" = torch.arange(2)
        g_cache_[(arange_2, add_4)] = x_2;  setitem_1 = g_cache_;  arange_2 = setitem_1 = None

        getitem_13: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = g_cache_ @ getitem_13;  getitem_13 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        arange_3: "i64[6]" = torch.arange(6)
        getitem_14: "i64[2, 1]" = add_4[(slice(None, None, None), None)];  add_4 = None
        le_1: "b8[2, 6]" = arange_3 <= getitem_14;  arange_3 = getitem_14 = None
        mul_4: "f32[2, 6]" = squeeze_1 * le_1;  squeeze_1 = le_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_15: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_15 * g_cache_;  getitem_15 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(2);  softmax_3 = None
        getitem_17: "i64[2, 2]" = topk_1[1];  topk_1 = None

        getitem_18: "i64[2]" = getitem_17[(slice(None, None, None), 0)]
        add_8: "i64[2]" = l_kwargs_seq_lens_ + 1;  l_kwargs_seq_lens_ = None
        add_9: "i64[2]" = add_8 + 1;  add_8 = None

        getitem_19: "f32[2, 4]" = g_embed_[getitem_18];  g_embed_ = getitem_18 = None
        add_10: "f32[2, 4]" = x_3 + getitem_19;  x_3 = getitem_19 = None
        getitem_20: "i64[2, 1]" = add_9[(slice(None, None, None), None)]
        mul_6: "f32[2, 4]" = getitem_20 * g_freq_;  getitem_20 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_10 + cos_2;  add_10 = cos_2 = None

        arange_4: "i64[2]" = torch.arange(2)
        g_cache_[(arange_4, add_9)] = x_4;  setitem_2 = g_cache_;  arange_4 = setitem_2 = None

        getitem_21: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = g_cache_ @ getitem_21;  getitem_21 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        arange_5: "i64[6]" = torch.arange(6)
        getitem_22: "i64[2, 1]" = add_9[(slice(None, None, None), None)];  add_9 = None
        le_2: "b8[2, 6]" = arange_5 <= getitem_22;  arange_5 = getitem_22 = None
        mul_7: "f32[2, 6]" = squeeze_2 * le_2;  squeeze_2 = le_2 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * g_cache_;  getitem_23 = g_cache_ = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(2);  softmax_5 = None
        getitem_25: "i64[2, 2]" = topk_2[1];  topk_2 = None

        stack: "i64[2, 3, 2]" = torch.stack([index, getitem_17, getitem_25], 1);  index = getitem_17 = getitem_25 = None
        return (stack,)
""")
        # Positions advance: each step's own (seq_lens + 1 + step; the seed's is seq_lens itself) stays,
        # and `+ 0` is proven away. Every cache write stays, and no read after a write is merged
        # with a read before it.
        self.assertEqual(report.refusals, [])
        self.assertEqual(after.count("] = x"), 3)
        self.assertEqual(after.count("= g_cache_ @"), 3)
        merged = self.merged(own_cache_seed, own_cache_loop, args)
        proven = [r.detail for r in merged.rewrites if r.rule == "setup merged (proven equal)"]
        self.assertEqual(proven, ["seq_lens + 1 == seq_lens + 1"])  # seq_lens + 1 + 0 is seq_lens + 1

    def test_placeholder_zeros_copy_into_buffer_and_host_round_trip(self):
        before, after, report = self.fold(server_seed, server_loop, frozen_args())
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_kwargs_seq_lens_: "i64[2]", G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", G_FREQ_: "f32[4]", L_kwargs_keys_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]", G_STATIC_HIDDEN_: "f32[2, 4]"):
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        g_freq_ = G_FREQ_
        l_kwargs_keys_ = L_kwargs_keys_
        g_head_ = G_HEAD_
        g_static_hidden_ = G_STATIC_HIDDEN_

        position: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange: "i64[6]" = torch.arange(6)
        getitem: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mask: "b8[2, 6]" = arange < getitem;  arange = getitem = None

        getitem_1: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem_1;  l_kwargs_hidden_ = getitem_1 = None
        getitem_2: "i64[2, 1]" = position[(slice(None, None, None), None)];  position = None
        mul: "f32[2, 4]" = getitem_2 * g_freq_;  getitem_2 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        getitem_3: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_3;  getitem_3 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        mul_1: "f32[2, 6]" = squeeze * mask;  squeeze = mask = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * l_kwargs_keys_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(2);  softmax_1 = None
        p: "f32[2, 2]" = topk[0]
        index: "i64[2, 2]" = topk[1];  topk = None

        topk_p: "f32[2, 2]" = torch.zeros(2, 2)

        topk_index: "i64[2, 2]" = torch.zeros(2, 2, dtype = torch.int64)

        copy_: "f32[2, 2]" = topk_p.copy_(p);  p = copy_ = None

        copy__1: "i64[2, 2]" = topk_index.copy_(index);  index = copy__1 = None

        copy__2: "f32[2, 4]" = g_static_hidden_.copy_(x_1);  x_1 = copy__2 = None

        seed_output: "i64[2]" = l_kwargs_seq_lens_.cpu();  l_kwargs_seq_lens_ = None

        seam_default = torch.ops.draftfuse.seam.default([topk_p, topk_index, l_kwargs_keys_, seed_output], '{"drop_buffer_writes": false, "value_ranges": {}}');  topk_p = topk_index = l_kwargs_keys_ = seed_output = None
        mark: "f32[2, 2]" = seam_default[0]
        mark_1: "i64[2, 2]" = seam_default[1]
        mark_2: "f32[2, 6, 4]" = seam_default[2]
        mark_3: "i64[2]" = seam_default[3];  seam_default = None

        seq_lens: "i64[2]" = mark_3.to(device(type='cpu'));  mark_3 = None

        position_1: "i64[2]" = seq_lens - 1

        arange_1: "i64[6]" = torch.arange(6)
        getitem_11: "i64[2, 1]" = seq_lens[(slice(None, None, None), None)];  seq_lens = None
        mask_1: "b8[2, 6]" = arange_1 < getitem_11;  arange_1 = getitem_11 = None

        getitem_12: "i64[2]" = mark_1[(slice(None, None, None), 0)]

        getitem_13: "f32[2, 4]" = g_embed_[getitem_12];  getitem_12 = None
        add_3: "f32[2, 4]" = g_static_hidden_ + getitem_13;  g_static_hidden_ = getitem_13 = None
        getitem_14: "i64[2, 1]" = position_1[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_14 * g_freq_;  getitem_14 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_3 + cos_1;  add_3 = cos_1 = None

        getitem_15: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = mark_2 @ getitem_15;  getitem_15 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        mul_4: "f32[2, 6]" = squeeze_1 * mask_1;  squeeze_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_16: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_16 * mark_2;  getitem_16 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(2);  softmax_3 = None
        p_1: "f32[2, 2]" = topk_1[0]
        index_1: "i64[2, 2]" = topk_1[1];  topk_1 = None

        getitem_19: "i64[2]" = index_1[(slice(None, None, None), 0)]

        getitem_20: "f32[2, 4]" = g_embed_[getitem_19];  g_embed_ = getitem_19 = None
        add_6: "f32[2, 4]" = x_3 + getitem_20;  x_3 = getitem_20 = None
        getitem_21: "i64[2, 1]" = position_1[(slice(None, None, None), None)];  position_1 = None
        mul_6: "f32[2, 4]" = getitem_21 * g_freq_;  getitem_21 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_6 + cos_2;  add_6 = cos_2 = None

        getitem_22: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = mark_2 @ getitem_22;  getitem_22 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        mul_7: "f32[2, 6]" = squeeze_2 * mask_1;  squeeze_2 = mask_1 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * mark_2;  getitem_23 = mark_2 = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(2);  softmax_5 = None
        p_2: "f32[2, 2]" = topk_2[0]
        index_2: "i64[2, 2]" = topk_2[1];  topk_2 = None

        stack: "i64[2, 3, 2]" = torch.stack([mark_1, index_1, index_2], 1);  mark_1 = index_1 = index_2 = None
        stack_1: "f32[2, 3, 2]" = torch.stack([mark, p_1, p_2], 1);  mark = p_1 = p_2 = None
        return (stack, stack_1)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_kwargs_seq_lens_: "i64[2]", G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", G_FREQ_: "f32[4]", L_kwargs_keys_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]", G_STATIC_HIDDEN_: "f32[2, 4]"):
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        g_freq_ = G_FREQ_
        l_kwargs_keys_ = L_kwargs_keys_
        g_head_ = G_HEAD_
        g_static_hidden_ = G_STATIC_HIDDEN_

        position: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange: "i64[6]" = torch.arange(6)
        getitem: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mask: "b8[2, 6]" = arange < getitem;  arange = getitem = None

        getitem_1: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem_1;  l_kwargs_hidden_ = getitem_1 = None
        getitem_2: "i64[2, 1]" = position[(slice(None, None, None), None)];  position = None
        mul: "f32[2, 4]" = getitem_2 * g_freq_;  getitem_2 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        getitem_3: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_3;  getitem_3 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        mul_1: "f32[2, 6]" = squeeze * mask;  squeeze = mask = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * l_kwargs_keys_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(2);  softmax_1 = None
        p: "f32[2, 2]" = topk[0]
        index: "i64[2, 2]" = topk[1];  topk = None

        copy__2: "f32[2, 4]" = g_static_hidden_.copy_(x_1);  x_1 = copy__2 = None

        position_1: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange_1: "i64[6]" = torch.arange(6)
        getitem_11: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)];  l_kwargs_seq_lens_ = None
        mask_1: "b8[2, 6]" = arange_1 < getitem_11;  arange_1 = getitem_11 = None

        getitem_12: "i64[2]" = index[(slice(None, None, None), 0)]

        getitem_13: "f32[2, 4]" = g_embed_[getitem_12];  getitem_12 = None
        add_3: "f32[2, 4]" = g_static_hidden_ + getitem_13;  g_static_hidden_ = getitem_13 = None
        getitem_14: "i64[2, 1]" = position_1[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_14 * g_freq_;  getitem_14 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_3 + cos_1;  add_3 = cos_1 = None

        getitem_15: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_15;  getitem_15 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        mul_4: "f32[2, 6]" = squeeze_1 * mask_1;  squeeze_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_16: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_16 * l_kwargs_keys_;  getitem_16 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(2);  softmax_3 = None
        p_1: "f32[2, 2]" = topk_1[0]
        index_1: "i64[2, 2]" = topk_1[1];  topk_1 = None

        getitem_19: "i64[2]" = index_1[(slice(None, None, None), 0)]

        getitem_20: "f32[2, 4]" = g_embed_[getitem_19];  g_embed_ = getitem_19 = None
        add_6: "f32[2, 4]" = x_3 + getitem_20;  x_3 = getitem_20 = None
        getitem_21: "i64[2, 1]" = position_1[(slice(None, None, None), None)];  position_1 = None
        mul_6: "f32[2, 4]" = getitem_21 * g_freq_;  getitem_21 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_6 + cos_2;  add_6 = cos_2 = None

        getitem_22: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_22;  getitem_22 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        mul_7: "f32[2, 6]" = squeeze_2 * mask_1;  squeeze_2 = mask_1 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * l_kwargs_keys_;  getitem_23 = l_kwargs_keys_ = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(2);  softmax_5 = None
        p_2: "f32[2, 2]" = topk_2[0]
        index_2: "i64[2, 2]" = topk_2[1];  topk_2 = None

        stack: "i64[2, 3, 2]" = torch.stack([index, index_1, index_2], 1);  index = index_1 = index_2 = None
        stack_1: "f32[2, 3, 2]" = torch.stack([p, p_1, p_2], 1);  p = p_1 = p_2 = None
        return (stack, stack_1)
""")
        self.assertEqual(
            self.rules(report)[:4],
            ["seam marker removed", "host round trip removed"] + ["placeholder allocation removed"] * 2,
        )
        (refusal,) = report.refusals
        self.assertIn("caller-visible g_static_hidden_ kept (drop_buffer_writes=True drops it", refusal.reason)
        self.assertTrue(refusal.where.endswith(f"test_seed_fold.py:{line_of('STATIC_HIDDEN.copy_(x)')}"), refusal.where)

    def test_drop_buffer_writes_is_opt_in(self):
        # The caller promised nothing reads STATIC_HIDDEN after the draft: its contents may differ.
        facts = {"drop_buffer_writes": True}
        _, after, report = self.fold(server_seed, server_loop, frozen_args(), facts=facts, compare_buffers=False)
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_kwargs_seq_lens_: "i64[2]", G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", G_FREQ_: "f32[4]", L_kwargs_keys_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]", G_STATIC_HIDDEN_: "f32[2, 4]"):
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        g_freq_ = G_FREQ_
        l_kwargs_keys_ = L_kwargs_keys_
        g_head_ = G_HEAD_
        g_static_hidden_ = G_STATIC_HIDDEN_

        position: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange: "i64[6]" = torch.arange(6)
        getitem: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mask: "b8[2, 6]" = arange < getitem;  arange = getitem = None

        getitem_1: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem_1;  l_kwargs_hidden_ = getitem_1 = None
        getitem_2: "i64[2, 1]" = position[(slice(None, None, None), None)];  position = None
        mul: "f32[2, 4]" = getitem_2 * g_freq_;  getitem_2 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        getitem_3: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_3;  getitem_3 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        mul_1: "f32[2, 6]" = squeeze * mask;  squeeze = mask = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * l_kwargs_keys_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(2);  softmax_1 = None
        p: "f32[2, 2]" = topk[0]
        index: "i64[2, 2]" = topk[1];  topk = None

        position_1: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange_1: "i64[6]" = torch.arange(6)
        getitem_11: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)];  l_kwargs_seq_lens_ = None
        mask_1: "b8[2, 6]" = arange_1 < getitem_11;  arange_1 = getitem_11 = None

        getitem_12: "i64[2]" = index[(slice(None, None, None), 0)]

        getitem_13: "f32[2, 4]" = g_embed_[getitem_12];  getitem_12 = None
        add_3: "f32[2, 4]" = x_1 + getitem_13;  x_1 = getitem_13 = None
        getitem_14: "i64[2, 1]" = position_1[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_14 * g_freq_;  getitem_14 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_3 + cos_1;  add_3 = cos_1 = None

        getitem_15: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_15;  getitem_15 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        mul_4: "f32[2, 6]" = squeeze_1 * mask_1;  squeeze_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_16: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_16 * l_kwargs_keys_;  getitem_16 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(2);  softmax_3 = None
        p_1: "f32[2, 2]" = topk_1[0]
        index_1: "i64[2, 2]" = topk_1[1];  topk_1 = None

        getitem_19: "i64[2]" = index_1[(slice(None, None, None), 0)]

        getitem_20: "f32[2, 4]" = g_embed_[getitem_19];  g_embed_ = getitem_19 = None
        add_6: "f32[2, 4]" = x_3 + getitem_20;  x_3 = getitem_20 = None
        getitem_21: "i64[2, 1]" = position_1[(slice(None, None, None), None)];  position_1 = None
        mul_6: "f32[2, 4]" = getitem_21 * g_freq_;  getitem_21 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_6 + cos_2;  add_6 = cos_2 = None

        getitem_22: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_22;  getitem_22 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        mul_7: "f32[2, 6]" = squeeze_2 * mask_1;  squeeze_2 = mask_1 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * l_kwargs_keys_;  getitem_23 = l_kwargs_keys_ = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(2);  softmax_5 = None
        p_2: "f32[2, 2]" = topk_2[0]
        index_2: "i64[2, 2]" = topk_2[1];  topk_2 = None

        stack: "i64[2, 3, 2]" = torch.stack([index, index_1, index_2], 1);  index = index_1 = index_2 = None
        stack_1: "f32[2, 3, 2]" = torch.stack([p, p_1, p_2], 1);  p = p_1 = p_2 = None
        return (stack, stack_1)
""")
        self.assertIn("write into caller buffer dropped (drop_buffer_writes)", self.rules(report))
        self.assertEqual(report.refusals, [])

    def test_refuses_setup_that_differs_across_the_seam(self):
        before, after, report = self.fold(frozen_seed, differing_loop, frozen_args())
        self.assertExpectedInline(before, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_kwargs_seq_lens_: "i64[2]", G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", G_FREQ_: "f32[4]", L_kwargs_keys_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]"):
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        g_freq_ = G_FREQ_
        l_kwargs_keys_ = L_kwargs_keys_
        g_head_ = G_HEAD_

        position: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange: "i64[6]" = torch.arange(6)
        getitem: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mask: "b8[2, 6]" = arange < getitem;  arange = getitem = None

        getitem_1: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem_1;  l_kwargs_hidden_ = getitem_1 = None
        getitem_2: "i64[2, 1]" = position[(slice(None, None, None), None)];  position = None
        mul: "f32[2, 4]" = getitem_2 * g_freq_;  getitem_2 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        getitem_3: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_3;  getitem_3 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        mul_1: "f32[2, 6]" = squeeze * mask;  squeeze = mask = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * l_kwargs_keys_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(1);  softmax_1 = None
        index: "i64[2, 1]" = topk[1];  topk = None

        seed_output: "i64[2]" = index[(slice(None, None, None), 0)];  index = None

        seam_default = torch.ops.draftfuse.seam.default([seed_output, x_1, l_kwargs_keys_, l_kwargs_seq_lens_], '{"drop_buffer_writes": false, "value_ranges": {}}');  seed_output = x_1 = l_kwargs_keys_ = l_kwargs_seq_lens_ = None
        mark: "i64[2]" = seam_default[0]
        mark_1: "f32[2, 4]" = seam_default[1]
        mark_2: "f32[2, 6, 4]" = seam_default[2]
        mark_3: "i64[2]" = seam_default[3];  seam_default = None

        sub_1: "i64[2]" = mark_3 - 1
        position_1: "i64[2]" = sub_1.clamp(min = 0);  sub_1 = None

        arange_1: "i64[6]" = torch.arange(6)
        add_3: "i64[2]" = mark_3 + 1;  mark_3 = None
        getitem_12: "i64[2, 1]" = add_3[(slice(None, None, None), None)];  add_3 = None
        mask_1: "b8[2, 6]" = arange_1 < getitem_12;  arange_1 = getitem_12 = None

        getitem_13: "f32[2, 4]" = g_embed_[mark]
        add_4: "f32[2, 4]" = mark_1 + getitem_13;  mark_1 = getitem_13 = None
        getitem_14: "i64[2, 1]" = position_1[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_14 * g_freq_;  getitem_14 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_4 + cos_1;  add_4 = cos_1 = None

        getitem_15: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = mark_2 @ getitem_15;  getitem_15 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        mul_4: "f32[2, 6]" = squeeze_1 * mask_1;  squeeze_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_16: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_16 * mark_2;  getitem_16 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(1);  softmax_3 = None
        getitem_18: "i64[2, 1]" = topk_1[1];  topk_1 = None
        getitem_19: "i64[2]" = getitem_18[(slice(None, None, None), 0)];  getitem_18 = None

        getitem_20: "f32[2, 4]" = g_embed_[getitem_19];  g_embed_ = None
        add_7: "f32[2, 4]" = x_3 + getitem_20;  x_3 = getitem_20 = None
        getitem_21: "i64[2, 1]" = position_1[(slice(None, None, None), None)];  position_1 = None
        mul_6: "f32[2, 4]" = getitem_21 * g_freq_;  getitem_21 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_7 + cos_2;  add_7 = cos_2 = None

        getitem_22: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = mark_2 @ getitem_22;  getitem_22 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        mul_7: "f32[2, 6]" = squeeze_2 * mask_1;  squeeze_2 = mask_1 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * mark_2;  getitem_23 = mark_2 = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(1);  softmax_5 = None
        getitem_25: "i64[2, 1]" = topk_2[1];  topk_2 = None
        getitem_26: "i64[2]" = getitem_25[(slice(None, None, None), 0)];  getitem_25 = None

        stack: "i64[2, 3]" = torch.stack([mark, getitem_19, getitem_26], 1);  mark = getitem_19 = getitem_26 = None
        return (stack,)
""")
        self.assertExpectedInline(after, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_kwargs_seq_lens_: "i64[2]", G_EMBED_: "f32[8, 4]", L_kwargs_tokens_: "i64[2]", L_kwargs_hidden_: "f32[2, 4]", G_FREQ_: "f32[4]", L_kwargs_keys_: "f32[2, 6, 4]", G_HEAD_: "f32[4, 8]"):
        l_kwargs_seq_lens_ = L_kwargs_seq_lens_
        g_embed_ = G_EMBED_
        l_kwargs_tokens_ = L_kwargs_tokens_
        l_kwargs_hidden_ = L_kwargs_hidden_
        g_freq_ = G_FREQ_
        l_kwargs_keys_ = L_kwargs_keys_
        g_head_ = G_HEAD_

        position: "i64[2]" = l_kwargs_seq_lens_ - 1

        arange: "i64[6]" = torch.arange(6)
        getitem: "i64[2, 1]" = l_kwargs_seq_lens_[(slice(None, None, None), None)]
        mask: "b8[2, 6]" = arange < getitem;  arange = getitem = None

        getitem_1: "f32[2, 4]" = g_embed_[l_kwargs_tokens_];  l_kwargs_tokens_ = None
        add: "f32[2, 4]" = l_kwargs_hidden_ + getitem_1;  l_kwargs_hidden_ = getitem_1 = None
        getitem_2: "i64[2, 1]" = position[(slice(None, None, None), None)];  position = None
        mul: "f32[2, 4]" = getitem_2 * g_freq_;  getitem_2 = None
        cos: "f32[2, 4]" = torch.cos(mul);  mul = None
        x: "f32[2, 4]" = add + cos;  add = cos = None

        getitem_3: "f32[2, 4, 1]" = x[(slice(None, None, None), slice(None, None, None), None)]
        matmul: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_3;  getitem_3 = None
        squeeze: "f32[2, 6]" = matmul.squeeze(-1);  matmul = None
        mul_1: "f32[2, 6]" = squeeze * mask;  squeeze = mask = None
        attn: "f32[2, 6]" = mul_1.softmax(-1);  mul_1 = None

        getitem_4: "f32[2, 6, 1]" = attn[(slice(None, None, None), slice(None, None, None), None)];  attn = None
        mul_2: "f32[2, 6, 4]" = getitem_4 * l_kwargs_keys_;  getitem_4 = None
        sum_1: "f32[2, 4]" = mul_2.sum(1);  mul_2 = None
        x_1: "f32[2, 4]" = x + sum_1;  x = sum_1 = None

        logits: "f32[2, 8]" = x_1 @ g_head_

        softmax_1: "f32[2, 8]" = logits.softmax(-1);  logits = None
        topk = softmax_1.topk(1);  softmax_1 = None
        index: "i64[2, 1]" = topk[1];  topk = None

        seed_output: "i64[2]" = index[(slice(None, None, None), 0)];  index = None

        sub_1: "i64[2]" = l_kwargs_seq_lens_ - 1
        position_1: "i64[2]" = sub_1.clamp(min = 0);  sub_1 = None

        arange_1: "i64[6]" = torch.arange(6)
        add_3: "i64[2]" = l_kwargs_seq_lens_ + 1;  l_kwargs_seq_lens_ = None
        getitem_12: "i64[2, 1]" = add_3[(slice(None, None, None), None)];  add_3 = None
        mask_1: "b8[2, 6]" = arange_1 < getitem_12;  arange_1 = getitem_12 = None

        getitem_13: "f32[2, 4]" = g_embed_[seed_output]
        add_4: "f32[2, 4]" = x_1 + getitem_13;  x_1 = getitem_13 = None
        getitem_14: "i64[2, 1]" = position_1[(slice(None, None, None), None)]
        mul_3: "f32[2, 4]" = getitem_14 * g_freq_;  getitem_14 = None
        cos_1: "f32[2, 4]" = torch.cos(mul_3);  mul_3 = None
        x_2: "f32[2, 4]" = add_4 + cos_1;  add_4 = cos_1 = None

        getitem_15: "f32[2, 4, 1]" = x_2[(slice(None, None, None), slice(None, None, None), None)]
        matmul_2: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_15;  getitem_15 = None
        squeeze_1: "f32[2, 6]" = matmul_2.squeeze(-1);  matmul_2 = None
        mul_4: "f32[2, 6]" = squeeze_1 * mask_1;  squeeze_1 = None
        attn_1: "f32[2, 6]" = mul_4.softmax(-1);  mul_4 = None

        getitem_16: "f32[2, 6, 1]" = attn_1[(slice(None, None, None), slice(None, None, None), None)];  attn_1 = None
        mul_5: "f32[2, 6, 4]" = getitem_16 * l_kwargs_keys_;  getitem_16 = None
        sum_2: "f32[2, 4]" = mul_5.sum(1);  mul_5 = None
        x_3: "f32[2, 4]" = x_2 + sum_2;  x_2 = sum_2 = None

        logits_1: "f32[2, 8]" = x_3 @ g_head_

        softmax_3: "f32[2, 8]" = logits_1.softmax(-1);  logits_1 = None
        topk_1 = softmax_3.topk(1);  softmax_3 = None
        getitem_18: "i64[2, 1]" = topk_1[1];  topk_1 = None
        getitem_19: "i64[2]" = getitem_18[(slice(None, None, None), 0)];  getitem_18 = None

        getitem_20: "f32[2, 4]" = g_embed_[getitem_19];  g_embed_ = None
        add_7: "f32[2, 4]" = x_3 + getitem_20;  x_3 = getitem_20 = None
        getitem_21: "i64[2, 1]" = position_1[(slice(None, None, None), None)];  position_1 = None
        mul_6: "f32[2, 4]" = getitem_21 * g_freq_;  getitem_21 = g_freq_ = None
        cos_2: "f32[2, 4]" = torch.cos(mul_6);  mul_6 = None
        x_4: "f32[2, 4]" = add_7 + cos_2;  add_7 = cos_2 = None

        getitem_22: "f32[2, 4, 1]" = x_4[(slice(None, None, None), slice(None, None, None), None)]
        matmul_4: "f32[2, 6, 1]" = l_kwargs_keys_ @ getitem_22;  getitem_22 = None
        squeeze_2: "f32[2, 6]" = matmul_4.squeeze(-1);  matmul_4 = None
        mul_7: "f32[2, 6]" = squeeze_2 * mask_1;  squeeze_2 = mask_1 = None
        attn_2: "f32[2, 6]" = mul_7.softmax(-1);  mul_7 = None

        getitem_23: "f32[2, 6, 1]" = attn_2[(slice(None, None, None), slice(None, None, None), None)];  attn_2 = None
        mul_8: "f32[2, 6, 4]" = getitem_23 * l_kwargs_keys_;  getitem_23 = l_kwargs_keys_ = None
        sum_3: "f32[2, 4]" = mul_8.sum(1);  mul_8 = None
        x_5: "f32[2, 4]" = x_4 + sum_3;  x_4 = sum_3 = None

        logits_2: "f32[2, 8]" = x_5 @ g_head_;  x_5 = g_head_ = None

        softmax_5: "f32[2, 8]" = logits_2.softmax(-1);  logits_2 = None
        topk_2 = softmax_5.topk(1);  softmax_5 = None
        getitem_25: "i64[2, 1]" = topk_2[1];  topk_2 = None
        getitem_26: "i64[2]" = getitem_25[(slice(None, None, None), 0)];  getitem_25 = None

        stack: "i64[2, 3]" = torch.stack([seed_output, getitem_19, getitem_26], 1);  seed_output = getitem_19 = getitem_26 = None
        return (stack,)
""")
        merged = self.merged(frozen_seed, differing_loop, frozen_args())
        reasons = [r.reason for r in merged.refusals]
        self.assertEqual(len(reasons), 2, reasons)
        clamp, plus_one = sorted(reasons)
        int64 = "[-9223372036854775808, 9223372036854775807]"
        self.assertIn(f"kept Max(0, seq_lens - 1) beside seq_lens - 1 (from `position = seq_lens - 1`): not proven, its operand may wrap around given seq_lens in {int64}", clamp)
        self.assertIn("value_ranges={'seq_lens': (low, high)}", clamp)
        self.assertIn("kept seq_lens + 1 beside seq_lens - 1 (from `position = seq_lens - 1`): they differ by 2", plus_one)
        # With the range declared, the clamp goes: the loop's position is the seed's.
        proven = self.merged(frozen_seed, differing_loop, frozen_args(), facts={"value_ranges": {"seq_lens": (1, None)}})
        self.assertIn("Max(0, seq_lens - 1) == seq_lens - 1 given seq_lens in [1, 9223372036854775807]",
                      [r.detail for r in proven.rewrites])


class SeedFoldRegions(TestCase):
    def test_parallel_heads_without_marker_are_left_alone(self):
        def medusa(hidden):
            return [(hidden @ HEAD * (i + 1)).softmax(-1).topk(2) for i in range(3)]

        gm, _ = capture(medusa, dict(hidden=torch.randn(B, H)))
        result = fold_seed(gm)
        self.assertEqual(graph_text(result.graph_module), graph_text(gm))
        self.assertEqual(result.report.rewrites, [])
        self.assertIn("no seam", result.report.notes[0])

    def test_chain_without_marker_is_folded_like_a_draft_loop(self):
        def draft(tokens, hidden, keys, seq_lens):
            return frozen_loop(*frozen_seed(tokens, hidden, keys, seq_lens))

        args = frozen_args()
        gm, inputs = capture(draft, args)
        result = fold_seed(gm)
        notes = result.report.notes
        self.assertTrue(notes[0].startswith("seed region: 23 nodes (position .. index)"), notes[0])
        self.assertIn(ITERATIONS, notes)
        torch.testing.assert_close(result.graph_module(*inputs)[0], draft(**args), rtol=0, atol=0)
        merged = [r for r in draft_graphs(draft, **args).reports if r.pass_name == "merge_setup"][0]
        self.assertGreaterEqual(sum(len(r.nodes) for r in merged.rewrites), 10, str(merged))

    def test_item_round_trip_becomes_a_broadcast_on_the_device(self):
        def seed(seq_lens):
            return seq_lens.max().item(), seq_lens

        def loop(longest, seq_lens):
            return torch.full((B, 3), longest) - seq_lens[:, None]

        with torch._dynamo.config.patch(capture_scalar_outputs=True):  # torch 2.11 breaks the graph otherwise
            gm, inputs = capture(composed(seed, loop), dict(seq_lens=torch.tensor([3, 6])))
        result = fold_seed(gm)
        self.assertIn("host round trip removed", [r.rule for r in result.report.rewrites])
        self.assertNotIn(".item()", graph_text(result.graph_module))
        torch.testing.assert_close(result.graph_module(*inputs)[0], loop(*seed(torch.tensor([3, 6]))), rtol=0, atol=0)

    def test_item_round_trip_into_a_narrower_dtype_is_kept(self):
        """full((n,), x.item(), dtype=int16) raises for 40000 where x.to(int16) wraps to -25536: the round
        trip stays (a host read, named as one) unless the result dtype holds every source value."""
        def seed(seq_lens):
            return seq_lens.max().item(), seq_lens

        def narrow(longest, seq_lens):
            return torch.full((B, 3), longest, dtype=torch.int16)

        def wide(longest, seq_lens):
            return torch.full((B, 3), longest, dtype=torch.float64)

        for loop, removed in ((narrow, False), (wide, True)):
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                gm, inputs = capture(composed(seed, loop), dict(seq_lens=torch.tensor([3, 6])))  # int64: 40000 would raise
            result = fold_seed(gm)
            self.assertEqual("host round trip removed" in [r.rule for r in result.report.rewrites], removed)
            if not removed:
                self.assertIn("may not be its cast", result.report.refusals[0].reason)

    def test_outputs_are_never_made_to_share_memory(self):
        def seed(x):
            return x * 2, x

        def loop(doubled, x):
            return doubled, x * 2  # the seed's value, computed again: both are returned, so both stay

        graphs = draft_graphs(composed(seed, loop), x=torch.randn(3))
        (merged,) = [r for r in graphs.reports if r.pass_name == "merge_setup"]
        self.assertNotIn("setup merged (identical)", [r.rule for r in merged.rewrites])
        first, second = graphs.outputs
        self.assertNotEqual(first.data_ptr(), second.data_ptr())

    def test_graph_without_fake_values_comes_back_unchanged(self):
        def draft(logits):
            first = logits.softmax(-1).topk(1)[1]
            return (logits + first).softmax(-1).topk(1)[1]

        gm = torch.fx.symbolic_trace(draft)  # no example values: nothing to prove anything with
        result = fold_seed(gm)
        self.assertEqual(result.graph_module.code, gm.code)
        self.assertFalse(any("internal error" in n for n in result.report.notes), result.report.notes)


_E, _W = torch.randn(16, 8), torch.randn(16, 8)


def _fills_a_buffer_from_its_input(h, tok):
    buf = torch.zeros(2, 1, dtype=torch.long)
    buf.copy_(tok)
    h = torch.tanh(_E[buf.squeeze(-1)] + h)
    i1 = torch.softmax(h @ _W.t(), -1).max(-1, keepdim=True)[1]
    h = torch.tanh(_E[i1.squeeze(-1)] + h)
    i2 = torch.softmax(h @ _W.t(), -1).max(-1, keepdim=True)[1]
    return buf[:, :1], i1, i2


def test_a_kept_buffer_is_named_as_the_user_wrote_it():
    """The refusal named the input by Dynamo's placeholder (l_tok_) and said the buffer is returned when only
    a view of it is (helper-75)."""
    from tests._graphs import dynamo_graph

    gm = dynamo_graph(_fills_a_buffer_from_its_input, torch.randn(2, 8), torch.tensor([[1], [2]]))
    text = fold_seed(gm).report.format()
    assert "buf filled from tok kept: buf (or a view of it) is returned and tok is an input" in text, text
