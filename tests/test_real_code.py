"""draftfuse on drafts modeled on public code: EAGLE, SGLang's EAGLE worker, vLLM's sampling, Medusa
heads, and Hugging Face Llama/Qwen2 with a StaticCache as a draft model (tests/real_code/ has the
models; each module names the project, file and function it is modeled on).

These tests are the specification of correct behaviour on real code, not a record of today's: in
fp32 every draft must give eager's tokens exactly (probabilities close), a rewrite must never change
what a draft picks (in-place writes to the probabilities included), bf16 drafts are compared with the
unrewritten compiled draft and the report must say when a selection read bf16 probabilities, and every
capture hazard must come back as the right DraftCaptureError naming the user's line (`# <- marker`).

Cost on a 2-core CPU: each test compiles one to a few tiny drafts (one to five seconds each). Marked
slow: the two Hugging Face drafts (20-60 s each with cold Inductor caches) and the twelve-batch-size test.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import draftfuse
from tests._oracle import ulp
from tests.real_code import eagle_tree, hazards, hf_draft, marker_line, medusa, sglang_eagle, vllm_sampling

# draft_loop warns once per draft that CUDA graphs need CUDA: expected on this CPU suite.
pytestmark = [pytest.mark.filterwarnings("ignore:draftfuse. draft .* runs on the CPU"), pytest.mark.usefixtures("fresh_dynamo")]


# ---- helpers -------------------------------------------------------------------------------------


def _selection_reports(draft) -> list:
    """The softmax -> topk pass reports of every compile of a draft_loop draft."""
    names = ("softmax", "topk", "selection")
    return [r for record in draft.compiles for r in record.reports if any(n in r.pass_name for n in names)]


def _rewrites(draft) -> list:
    """Every rewrite the selection pass made in a draft_loop draft's compiles."""
    return [rewrite for report in _selection_reports(draft) for rewrite in report.rewrites]


def _eager(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def _assert_rounding_ties_only(log_probs: torch.Tensor, want: torch.Tensor, got: torch.Tensor) -> None:
    """Indices differ only where the two tokens' (bf16) log-probabilities are within one ulp: a tie
    that rounding made, the documented case where a rewrite may pick the other token."""
    differ = want != got
    if not differ.any():
        return
    rows = torch.arange(log_probs.shape[0]).unsqueeze(-1).expand_as(want)[differ]
    a, b = log_probs[rows, want[differ]].double(), log_probs[rows, got[differ]].double()
    assert torch.all((a - b).abs() <= ulp(log_probs[rows, want[differ]])), "indices differ without a rounding tie"


# ---- a. EAGLE tree levels (SafeAILab/EAGLE cnets.py Model.topK_genrate) -------------------------


@pytest.mark.parametrize("top_k", [4, 10])
def test_eagle_tree_fp32_equals_eager(top_k):
    # Models topK_genrate: log_softmax module in the model dtype, topk, cumulative scores, parents,
    # searchsorted tree mask indices (eagle_tree.tree_draft).
    head, hidden, token = eagle_tree.make_inputs(torch.float32)
    kwargs = dict(top_k=top_k, depth=2, total_tokens=top_k + 4)
    want_tokens, want_scores, want_mask = _eager(eagle_tree.tree_draft, head, hidden, token, **kwargs)
    draft = draftfuse.draft_loop(eagle_tree.tree_draft)
    got_tokens, got_scores, got_mask = draft(head, hidden, token, **kwargs)
    assert torch.equal(got_tokens, want_tokens)
    assert torch.equal(got_mask, want_mask)
    torch.testing.assert_close(got_scores, want_scores, rtol=1e-5, atol=1e-5)
    assert len(draft.compiles) == 1
    # the seed's and each level's log_softmax -> topk, all rewritten
    assert len(_rewrites(draft)) == 1 + kwargs["depth"], _selection_reports(draft)


def _bf16_level_inputs(top_k: int):
    head, hidden, token = eagle_tree.make_inputs(torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    input_hidden = torch.randn(1, top_k, eagle_tree.HIDDEN, generator=generator).to(torch.bfloat16)
    input_ids = torch.randint(0, eagle_tree.VOCAB, (1, top_k), generator=generator)
    scores = (-torch.rand(top_k, generator=generator) * 4).to(torch.bfloat16)
    return head, input_hidden, input_ids, scores


BF16_TOP_K = 8


@pytest.fixture(scope="module")
def eagle_bf16():
    """One bf16 EAGLE tree level compiled twice: unrewritten (softmax_topk off) and by default."""
    torch._dynamo.reset()
    head, input_hidden, input_ids, scores = _bf16_level_inputs(BF16_TOP_K)
    reference = draftfuse.draft_loop(eagle_tree.tree_level, options={"softmax_topk": False})
    rewritten = draftfuse.draft_loop(eagle_tree.tree_level)
    want = reference(head, input_hidden, input_ids, scores, BF16_TOP_K)
    torch._dynamo.reset()
    got = rewritten(head, input_hidden, input_ids, scores, BF16_TOP_K)
    with torch.no_grad():  # the log-probabilities the selection read, for the tie oracle
        log_probs = head.log_probs(head(input_hidden, input_ids)[0])
    torch._dynamo.reset()
    return dict(want=want, got=got, rewritten=rewritten, log_probs=log_probs)


def test_eagle_tree_level_bf16_matches_unrewritten_compile(eagle_bf16):
    # bf16 log_softmax + topk(8): the reference is the same draft compiled without the rewrite.
    want_index, want_p, want_cu, want_best, want_flat, want_ids, _ = eagle_bf16["want"]
    got_index, got_p, got_cu, got_best, got_flat, got_ids, _ = eagle_bf16["got"]
    assert got_p.dtype == torch.bfloat16 and got_index.shape == want_index.shape
    _assert_rounding_ties_only(eagle_bf16["log_probs"], want_index, got_index)
    # values: the rewrite computes log-probs in float32 and rounds once, like Inductor's log_softmax
    torch.testing.assert_close(got_p.float(), want_p.float(), rtol=0, atol=float(ulp(want_p).max()))
    torch.testing.assert_close(got_cu.float(), want_cu.float(), rtol=0, atol=2 * float(ulp(want_cu).max()))
    if torch.equal(got_index, want_index) and torch.equal(got_cu, want_cu):
        assert torch.equal(got_flat, want_flat) and torch.equal(got_ids, want_ids)
        assert torch.equal(got_best, want_best)


def test_eagle_bf16_cumulative_scores_add_the_returned_log_probs(eagle_bf16):
    # EAGLE adds the parents' scores to the bf16 log-probs topk returned: cu_scores must be exactly
    # bf16(topk_p + scores), as in eager and in the unrewritten compile. A rewrite that computes the
    # values in float32 must round them to bf16 before anything else reads them, or the tree's
    # cumulative scores (and so the parents the next topk keeps) drift from the returned values.
    scores = _bf16_level_inputs(BF16_TOP_K)[3]
    want_p, want_cu = eagle_bf16["want"][1:3]
    assert torch.equal(want_cu, want_p + scores[:, None])  # the reference is self-consistent
    got_p, got_cu = eagle_bf16["got"][1:3]
    assert torch.equal(got_cu, got_p + scores[:, None])


def test_eagle_bf16_report_says_the_selection_read_bf16_probabilities(eagle_bf16):
    # A rewrite of a selection over bf16 (log-)probabilities can pick another token at a rounding
    # tie: the report must say that this selection read bf16 probabilities (not only which kernel ran).
    reports = _selection_reports(eagle_bf16["rewritten"])
    assert any(report.rewrites for report in reports), reports
    text = "\n".join([n for report in reports for n in report.notes] + [r.detail for report in reports for r in report.rewrites])
    text = re.sub(r"no kernel for [^;)\n]*", "", text)  # the kernel-choice clause names the dtype anyway
    assert re.search(r"bf16|bfloat16", text), f"no word on bf16 probabilities in:\n{text}"


def test_eagle_bf16_half_probs_keep_leaves_the_selection(eagle_bf16):
    # options={"half_probs": "keep"}: selections over half-precision probabilities stay as written,
    # so the draft is the unrewritten one, bit for bit.
    head, input_hidden, input_ids, scores = _bf16_level_inputs(BF16_TOP_K)
    draft = draftfuse.draft_loop(eagle_tree.tree_level, options={"half_probs": "keep"})
    got = draft(head, input_hidden, input_ids, scores, BF16_TOP_K)
    assert not _rewrites(draft), _selection_reports(draft)
    for got_part, want_part in zip(got, eagle_bf16["want"]):
        assert torch.equal(got_part, want_part)


# ---- b. SGLang multi-step EAGLE (sglang eagle_worker.py draft_forward, eagle_utils.py) ------------


@pytest.mark.parametrize("topk", [1, 4])
def test_sglang_multi_step_draft_equals_eager_one_region(topk):
    # fast_topk (max for k = 1, topk otherwise), hot_token_id[topk_index], select_top_k_tokens,
    # score/token/parent lists, organize_draft_results; seed + 2 steps.
    model, verified_id, hidden = sglang_eagle.make_inputs()
    kwargs = dict(num_steps=3, topk=topk, num_draft_tokens=4 if topk == 1 else 8)
    want = _eager(sglang_eagle.draft, model, verified_id, hidden, **kwargs)
    explanation = draftfuse.explain(sglang_eagle.draft, model, verified_id, hidden, **kwargs)
    assert explanation.one_region, str(explanation)
    torch._dynamo.reset()
    draft = draftfuse.draft_loop(sglang_eagle.draft)
    got = draft(model, verified_id, hidden, **kwargs)
    parents, top_index, tokens, scores = got
    assert torch.equal(parents, want[0])
    assert torch.equal(top_index, want[1])
    assert torch.equal(tokens, want[2])
    torch.testing.assert_close(scores, want[3], rtol=1e-5, atol=1e-6)
    assert len(draft.compiles) == 1
    assert len(_rewrites(draft)) == kwargs["num_steps"], _selection_reports(draft)
    # mapped through the hot-token table: every proposed id is a target id of the hot vocabulary
    assert torch.isin(tokens, model.hot_token_id).all()


# ---- c. vLLM sampling (topk_topp_sampler.py random_sample, spec_decode/eagle.py) ------------------


def _compile_and_compare(fn, *args):
    want = _eager(fn, *[a.clone() for a in args])
    draft = draftfuse.draft_loop(fn)
    got = draft(*[a.clone() for a in args])
    return want, got, draft


def _ban_inputs():
    logits, _, _ = vllm_sampling.make_inputs()
    top2 = logits.topk(2, dim=-1).indices
    banned = torch.unique(top2[:, 0])  # every row's best token, and some rows' second best
    banned = torch.cat([banned, top2[:2, 1]]).unique()
    return logits, banned


def test_vllm_temperature_tensor_and_exponential_sampling_equal_eager():
    # compute_probs_and_sample_next_token: where(is_greedy, 1, t), div_ by t.view(-1, 1),
    # softmax(dtype=float32), probs.div(q).argmax(-1), greedy probs.argmax(-1), where(is_greedy, ...)
    logits, temperature, q = vllm_sampling.make_inputs()
    (want_tokens, want_probs), (got_tokens, got_probs), draft = _compile_and_compare(
        vllm_sampling.temperature_sample, logits, temperature, q
    )
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_probs, want_probs, rtol=1e-5, atol=1e-7)


def test_vllm_temperature_tensor_then_topk_equal_eager():
    # vLLM's per-request temperature tensor (spec_decode/eagle.py compute_probs_and_sample_next_token),
    # as an out-of-place `logits / t.unsqueeze(-1)`, then softmax -> topk(4). A tensor temperature's
    # sign is unknown to the pass: rewritten (if it proves t > 0) or refused, never silently wrong.
    logits, temperature, _ = vllm_sampling.make_inputs()
    want, got, draft = _compile_and_compare(vllm_sampling.temperature_topk, logits, temperature)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)
    reports = _selection_reports(draft)
    assert any(report.rewrites or report.refusals for report in reports), "the selection went unreported"


def test_vllm_in_place_temperature_on_an_upcast_copy_is_rewritten_and_equals_eager():
    # `logits = logits.to(float32); logits.div_(t.unsqueeze(1))` on bf16 logits, temperatures of both
    # signs: refused before (the walk looked through the cast to the bf16 logits, which the division
    # does not change); now the selection reads the divided copy, as the softmax does
    logits, temperature, _ = vllm_sampling.make_inputs()
    logits = logits.bfloat16()
    want, got, draft = _compile_and_compare(vllm_sampling.temperature_in_place_topk, logits, temperature)
    assert not torch.equal(want.indices, logits.float().topk(4, dim=-1).indices), "the temperatures must change tokens"
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)
    (rewrite,) = _rewrites(draft)
    assert "as the softmax reads it: div_" in rewrite.detail, rewrite


def test_vllm_top_p_filter_sorting_the_logits_argument_takes_new_logits_every_call():
    # apply_top_k_top_p sorts the logits it is given: the sort was taken for a write of that argument
    # (aten.sort's list overloads write their list), so the second call's new logits raised
    # CudagraphSkipError ("written in place by the draft but a different tensor") and the Dynamo-level
    # rewrite was refused as "written in place ... by sort"
    draft = draftfuse.draft_loop(vllm_sampling.top_p_then_topk)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.2])
    for seed in range(3):
        logits, _, _ = vllm_sampling.make_inputs(seed)
        before = logits.clone()
        want, got = _eager(vllm_sampling.top_p_then_topk, logits.clone(), top_p), draft(logits, top_p)
        assert torch.equal(got.indices, want.indices) and torch.equal(logits, before)
        torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)
    assert len(draft.compiles) == 1
    assert len(_rewrites(draft)) == 1 and not any(report.refusals for report in _selection_reports(draft))


def test_vllm_exponential_division_in_place_chained_equals_eager():
    # vllm v1/sample/ops/topk_topp_sampler.py random_sample: probs.div_(q).argmax(dim=-1).view(-1)
    logits, _, q = vllm_sampling.make_inputs()
    want, got, _ = _compile_and_compare(vllm_sampling.gumbel_inplace_chained, logits, q)
    assert not torch.equal(want, logits.argmax(-1)), "the draw must change some tokens for this test to mean anything"
    assert torch.equal(got, want)


def test_vllm_exponential_division_in_place_statement_equals_eager():
    # random_sample with the in-place division as a statement, then probs.argmax(-1): the argmax
    # reads the divided probabilities, so it must not become argmax(logits)
    logits, _, q = vllm_sampling.make_inputs()
    want, got, _ = _compile_and_compare(vllm_sampling.gumbel_inplace, logits, q)
    assert not torch.equal(want, logits.argmax(-1)), "the draw must change some tokens for this test to mean anything"
    assert torch.equal(got, want)


def test_vllm_ban_by_index_assignment_equals_eager():
    # vllm v1/sample/ops/bad_words.py / logits processors ban ids by writing into the scores:
    # probs[:, banned] = 0 then topk(2) (banned holds every row's best token)
    logits, banned = _ban_inputs()
    want, got, _ = _compile_and_compare(vllm_sampling.ban_setitem, logits, banned)
    assert not torch.isin(want.indices, banned).any()
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)


def test_vllm_ban_by_masked_fill_equals_eager():
    # the same ban as a mask (vllm v1/sample/sampler.py allowed-token mask, masked_fill_), topk(1)
    logits, banned = _ban_inputs()
    mask = torch.zeros_like(logits, dtype=torch.bool)
    mask[:, banned] = True
    want, got, _ = _compile_and_compare(vllm_sampling.ban_masked_fill, logits, mask)
    assert not torch.equal(want.indices.squeeze(-1), logits.argmax(-1))
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)


def test_vllm_reweight_in_place_equals_eager():
    # a multiplicative in-place reweighting of the probabilities (probs.mul_(w)), then max(dim)
    logits, banned = _ban_inputs()
    weight = torch.ones(logits.shape[-1])
    weight[banned] = 0.01
    want, got, _ = _compile_and_compare(vllm_sampling.reweight_mul, logits, weight)
    assert not torch.equal(want.indices, logits.argmax(-1))
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)


def test_vllm_write_to_a_clone_keeps_the_rewrite():
    # vLLM keeps the unfiltered probabilities for rejection sampling and filters a copy: the write
    # goes to probs.clone(), so the selection of probs itself must still be rewritten
    logits, banned = _ban_inputs()
    want, got, draft = _compile_and_compare(vllm_sampling.ban_in_a_clone, logits, banned)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert _rewrites(draft), _selection_reports(draft)


# ---- d. Medusa heads (Medusa medusa_model.py ResBlock, MedusaModel.medusa_head) -------------------


def test_medusa_heads_per_head_equal_eager_and_rewritten():
    # MedusaModel.medusa_head: Sequential([ResBlock] * 2 (one shared module), Linear), 4 heads over
    # a clone of the last hidden state; softmax -> topk(4) per head
    heads, last_hidden = medusa.make_inputs()
    want = _eager(medusa.propose_per_head, heads, last_hidden)
    draft = draftfuse.draft_loop(medusa.propose_per_head)
    got = draft(heads, last_hidden)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    assert len(_rewrites(draft)) == medusa.HEADS, _selection_reports(draft)


def test_medusa_stacked_heads_equal_eager_and_rewritten():
    # MedusaModel.forward's torch.stack(medusa_logits, dim=0), then one softmax -> topk(4) over it
    heads, last_hidden = medusa.make_inputs()
    want = _eager(medusa.propose_stacked, heads, last_hidden)
    draft = draftfuse.draft_loop(medusa.propose_stacked)
    got = draft(heads, last_hidden)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)
    assert len(_rewrites(draft)) == 1, _selection_reports(draft)


# ---- e. Hugging Face Llama / Qwen2 with StaticCache as a draft model ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_static_cache_draft_equals_eager_one_region(kind):
    # transformers LlamaForCausalLM / Qwen2ForCausalLM + cache_utils.StaticCache (prefilled eagerly),
    # three greedy decode steps with softmax -> topk(1) under draft_loop, called twice
    pytest.importorskip("transformers")
    model = hf_draft.build(kind)
    eager_cache, token = hf_draft.prefilled_cache(model)
    draft_cache, same_token = hf_draft.prefilled_cache(model)
    assert torch.equal(token, same_token)
    draft = draftfuse.draft_loop(hf_draft.greedy_draft)
    for _ in range(2):  # the second call continues from the advanced cache, without a recompile
        want_tokens, want_probs = _eager(hf_draft.greedy_draft, model, eager_cache, token)
        got_tokens, got_probs = draft(model, draft_cache, token)
        assert torch.equal(got_tokens, want_tokens)
        torch.testing.assert_close(got_probs, want_probs, rtol=1e-5, atol=1e-6)
        token = want_tokens[:, -1:].contiguous()  # a slice's strides would be a new guard: a recompile
    assert len(draft.compiles) == 1
    assert len(_rewrites(draft)) == 3, _selection_reports(draft)
    for eager_layer, draft_layer in zip(eager_cache.layers, draft_cache.layers):
        torch.testing.assert_close(draft_layer.keys, eager_layer.keys, rtol=1e-5, atol=1e-5)
        assert torch.equal(draft_layer.cumulative_length, eager_layer.cumulative_length)


# ---- f. capture hazards --------------------------------------------------------------------------


def test_eagle_host_reads_raise_host_sync_error_at_the_first_read():
    # topK_genrate's torch.unique(mask_index).tolist() (then max_depth.item()) inside the draft
    head, hidden, token = eagle_tree.make_inputs()
    draft = draftfuse.draft_loop(eagle_tree.tree_draft_with_host_reads)
    with pytest.raises(draftfuse.HostSyncError) as info:
        draft(head, hidden, token)
    assert info.value.where == marker_line(eagle_tree, "first host read")
    assert info.value.fix


def test_explain_eagle_host_reads_names_the_line_without_dynamos_advice():
    # the same topK_genrate host reads through draftfuse.explain
    head, hidden, token = eagle_tree.make_inputs()
    explanation = draftfuse.explain(eagle_tree.tree_draft_with_host_reads, head, hidden, token)
    text = str(explanation)
    assert not explanation.one_region
    first = explanation.obstacles[0]
    assert isinstance(first, draftfuse.HostSyncError), [f"{type(o).__name__}: {o}" for o in explanation.obstacles]
    assert first.where == marker_line(eagle_tree, "first host read")
    # Dynamo's advice (trace the read into the graph) would still sync: it must not be repeated
    assert "capture_scalar_outputs" not in text
    assert "capture_dynamic_output_shape_ops" not in text


def test_rmsnorm_float_eps_under_dynamic_shapes_is_no_host_sync():
    # LlamaRMSNorm's `self.variance_epsilon` (a Python float) under draft_loop(dynamic=True)
    head = hazards.NormedHead()
    draft = draftfuse.draft_loop(hazards.normed_greedy, dynamic=True)
    for batch in (2, 3):
        hidden = torch.randn(batch, hazards.HIDDEN, generator=torch.Generator().manual_seed(batch))
        want = _eager(hazards.normed_greedy, head, hidden)
        got = draft(head, hidden)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert 1 <= len(draft.compiles) <= 2


@pytest.mark.slow
def test_server_batch_sizes_compile_once_each_within_max_compiles():
    # a server's CUDA-graph batch-size list: 12 sizes, max_compiles=20
    head = torch.nn.Linear(hazards.HIDDEN, hazards.VOCAB)
    limit = torch._dynamo.config.recompile_limit
    draft = draftfuse.draft_loop(hazards.batch_step, max_compiles=20)
    sizes = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32]
    for batch in sizes:
        hidden = torch.randn(batch, hazards.HIDDEN, generator=torch.Generator().manual_seed(batch))
        want = _eager(hazards.batch_step, head, hidden)
        got = draft(head, hidden)
        assert torch.equal(got.indices, want.indices)
    assert len(draft.compiles) == len(sizes)
    assert torch._dynamo.config.recompile_limit == limit


def test_max_compiles_error_names_the_argument_and_both_shapes():
    # the same batch-size list with max_compiles=4: the fifth size is the error, naming what changed
    head = torch.nn.Linear(hazards.HIDDEN, hazards.VOCAB)
    draft = draftfuse.draft_loop(hazards.batch_step, max_compiles=4)
    for batch in (1, 2, 3, 4):
        draft(head, torch.randn(batch, hazards.HIDDEN))
    with pytest.raises(draftfuse.RecompileError) as info:
        draft(head, torch.randn(5, hazards.HIDDEN))
    message = str(info.value)
    assert "hidden" in message
    assert f"4, {hazards.HIDDEN}" in message and f"5, {hazards.HIDDEN}" in message  # the last shape and the new one


def test_recompile_for_a_token_slice_names_the_argument_and_its_strides():
    # the next token passed as a view of the token buffer (tokens[:, -1:], as HF generation and EAGLE
    # feed it): same shape and dtype as the contiguous token of the first call, other strides
    embedding, lm_head = torch.nn.Embedding(hazards.VOCAB, hazards.HIDDEN), torch.nn.Linear(hazards.HIDDEN, hazards.VOCAB)
    tokens = torch.randint(0, hazards.VOCAB, (2, 3), generator=torch.Generator().manual_seed(0))
    draft = draftfuse.draft_loop(hazards.token_step, max_compiles=1)
    draft(embedding, lm_head, tokens[:, -1:].contiguous())
    with pytest.raises(draftfuse.RecompileError) as info:
        draft(embedding, lm_head, tokens[:, -1:])
    message = str(info.value)
    assert "token" in message and "stride" in message, message


def test_vllm_per_request_generators_are_a_graph_break_at_their_line():
    # random_sample's `q[i].exponential_(generator=generator)` for seeded requests: a torch.Generator
    # cannot be an input of a captured graph
    probs = torch.softmax(vllm_sampling.make_inputs()[0], dim=-1)
    draft = draftfuse.draft_loop(vllm_sampling.sample_with_generators)
    with pytest.raises(draftfuse.GraphBreakError) as info:
        draft(probs, {1: torch.Generator().manual_seed(0)})
    assert info.value.where == marker_line(vllm_sampling, "per-request generator")
    assert info.value.fix


def test_method_compiled_under_another_name_leaves_the_original():
    # Worker.fast = draftfuse.draft_loop(Worker.step): the eager method and its compiled alias
    class Worker(hazards.Worker):
        pass

    Worker.fast = draftfuse.draft_loop(Worker.step)
    worker = Worker()
    hidden = torch.randn(2, hazards.HIDDEN, generator=torch.Generator().manual_seed(0))
    want = _eager(worker.step, hidden)
    got = worker.fast(hidden)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert "step" not in vars(worker), "the compiled alias was stored under 'step', shadowing the eager method"
    assert worker.step.__func__ is hazards.Worker.step  # still the eager method
    assert any(v is worker.fast for k, v in vars(worker).items() if k.startswith("_draftfuse_"))  # kept under a private name
    frames = counters["frames"]["total"]
    again = worker.step(hidden)
    assert counters["frames"]["total"] == frames, "the eager method went through Dynamo"
    assert torch.equal(again[0], want[0])
