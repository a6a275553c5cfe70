"""draftfuse on two more public draft designs: vLLM's EAGLE-3 (combine_hidden_states, a draft vocabulary
scattered into the target vocabulary through `d2t`, the `propose` chain over persistent buffers) and
DeepSeek-V3 MTP as vLLM and SGLang run it (enorm/hnorm + eh_proj, a Python int `spec_step_idx` picking
the layer, a shared head). tests/real_code/vllm_eagle3.py and deepseek_mtp.py have the models; each
module names the project, file and function it is modeled on.

As in test_real_code.py, these tests are the specification of correct behaviour: in fp32 every draft
gives eager's tokens exactly (probabilities close), a rewrite never changes a pick (writes to the
probabilities, the logits, the scattered buffer or the temperature between the softmax and the
selection included), bf16 drafts are compared with the unrewritten compiled draft, and what the passes
did is checked in their reports (rewrites, refusals with reasons).

Cost on a 2-core CPU: each test compiles one to four tiny drafts (two to ten seconds each).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import draftfuse
from tests.real_code import deepseek_mtp, vllm_eagle3

pytestmark = [pytest.mark.filterwarnings("ignore:draftfuse. draft .* runs on the CPU"), pytest.mark.usefixtures("fresh_dynamo")]

E3 = vllm_eagle3
MTP = deepseek_mtp


# ---- helpers -------------------------------------------------------------------------------------


def _reports(draft, name: str) -> list:
    return [r for record in draft.compiles for r in record.reports if r.pass_name.startswith(name)]


def _selection_reports(draft) -> list:
    return [r for record in draft.compiles for r in record.reports if "softmax" in r.pass_name or "selection" in r.pass_name]


def _rewrites(draft) -> list:
    return [rewrite for report in _selection_reports(draft) for rewrite in report.rewrites]


def _refusals(draft) -> list:
    return [refusal for report in _selection_reports(draft) for refusal in report.refusals]


def _eager(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _refill(dst: tuple, src: tuple) -> None:
    """Copy a new target batch into the tensors of the first one (a server's persistent buffers)."""
    for d, s in zip(dst, src):
        if isinstance(s, torch.Tensor):
            d.copy_(s)
    for field in ("seq_lens", "request", "slot_mapping"):
        getattr(dst[5], field).copy_(getattr(src[5], field))


def _assert_proposer_state_equal(want_proposer, got_proposer, want_batch, got_batch) -> None:
    """Everything propose writes: the persistent buffers, seq_lens and the KV cache."""
    assert torch.equal(got_proposer.input_ids, want_proposer.input_ids)
    assert torch.equal(got_proposer.positions, want_proposer.positions)
    _close(got_proposer.hidden_states, want_proposer.hidden_states)
    assert torch.equal(got_batch[5].seq_lens, want_batch[5].seq_lens)
    _close(got_batch[6], want_batch[6])


def _scatter(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Eagle3LlamaForCausalLM.compute_logits: draft logits into a -inf target-vocabulary tensor."""
    logits_new = logits.new_full((logits.shape[0], vocab), float("-inf"))
    logits_new[:, targets] = logits
    return logits_new


def _selection_inputs(batch: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, 24, generator=generator) * 3
    targets = torch.randperm(80, generator=generator)[:24]
    return logits, targets


# ---- a. vLLM EAGLE-3: propose over persistent buffers (fold, draft_loop on a method alias) ---------


def test_eagle3_propose_folded_equals_eager_on_refilled_buffers():
    # vllm v1/spec_decode/eagle.py propose: combine_hidden_states, the shifted input ids, the buffers
    # refilled by slice assignment, d2t scatter into -inf, argmax, positions += 1, where(exceeds, 0, ..),
    # seq_lens += 1 / masked_fill_; the seed (draft-extend) folded into the loop with draftfuse.fold.
    model = E3.Eagle3Draft().eval()
    eager, compiled = E3.EagleProposer(model), E3.EagleProposer(model)
    draft = draftfuse.fold(compiled.seed_step, compiled.draft_steps)
    want_batch = E3.make_target_batch(3, seed=1)
    got_batch = copy.deepcopy(want_batch)
    for call in range(3):  # new contents in the same tensors on every call, as a server's runner does
        fresh = E3.make_target_batch(3, seed=1 + call, start=3 + 4 * call)  # the third call passes max_model_len
        _refill(want_batch, fresh)
        _refill(got_batch, fresh)
        want = _eager(eager.propose, *want_batch)
        got = draft(*got_batch)
        assert torch.equal(got, want), f"call {call}"
        _assert_proposer_state_equal(eager, compiled, want_batch, got_batch)
    assert (want_batch[1] + E3.EagleProposer(model).num_speculative_tokens - 1 >= E3.MAX_MODEL_LEN).any(), "no position was clamped"
    assert len(draft.draft.compiles) == 1
    (seed_fold,) = _reports(draft.draft, "seed_fold")
    assert any("seam marker removed" in r.rule for r in seed_fold.rewrites), seed_fold.format()
    assert not _rewrites(draft.draft), "argmax alone has no softmax to rewrite"


def test_eagle3_propose_method_alias_equals_eager_and_keeps_the_eager_method():
    # the eager `propose` and a compiled alias on the class, as servers keep both
    class Proposer(E3.EagleProposer):
        pass

    Proposer.fast_propose = draftfuse.draft_loop(Proposer.propose)
    model = E3.Eagle3Draft().eval()
    eager, compiled = Proposer(model), Proposer(model)
    want_batch = E3.make_target_batch(3, seed=4)
    got_batch = copy.deepcopy(want_batch)
    want = _eager(eager.propose, *want_batch)
    got = compiled.fast_propose(*got_batch)
    assert torch.equal(got, want)
    _assert_proposer_state_equal(eager, compiled, want_batch, got_batch)
    assert "propose" not in vars(compiled)
    assert compiled.propose.__func__ is E3.EagleProposer.propose
    frames = counters["frames"]["total"]
    compiled.propose(*copy.deepcopy(want_batch))
    assert counters["frames"]["total"] == frames, "the eager method went through Dynamo"


# ---- b. EAGLE-3 selections on the scattered logits -----------------------------------------------


@pytest.mark.parametrize("k", [1, 4])
def test_eagle3_softmax_topk_on_scattered_logits_equals_eager(k):
    # the same chain with softmax(logits_new.float()).topk(k) over the -inf-filled target vocabulary:
    # the rewrite must select from the buffer as the softmax read it (after the scatter)
    model = E3.Eagle3Draft().eval()
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, E3.TARGET_VOCAB, (5,), generator=generator)
    positions = torch.arange(5) + 2
    hidden = torch.randn(5, E3.HIDDEN, generator=generator)
    want = _eager(E3.propose_softmax_topk, model, ids, positions, hidden, E3.make_kv_cache(5), steps=2, k=k)
    draft = draftfuse.draft_loop(E3.propose_softmax_topk)
    got = draft(model, ids, positions, hidden, E3.make_kv_cache(5), steps=2, k=k)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    assert torch.isin(got[0], model.draft_id_to_target_id + torch.arange(E3.DRAFT_VOCAB)).all(), "a token outside the draft vocabulary"
    rewrites = _rewrites(draft)
    assert len(rewrites) == 2, _selection_reports(draft)
    assert all("as the softmax reads it" in r.detail for r in rewrites), rewrites


def test_eagle3_temperature_tensor_on_scattered_logits_equals_eager():
    # per-request temperatures (vLLM's sampling metadata) dividing the scattered -inf logits
    model = E3.Eagle3Draft(logit_scale=0.5).eval()
    generator = torch.Generator().manual_seed(8)
    ids = torch.randint(0, E3.TARGET_VOCAB, (4,), generator=generator)
    positions = torch.arange(4) + 1
    hidden = torch.randn(4, E3.HIDDEN, generator=generator)
    temperature = torch.tensor([0.25, 1.0, 3.0, 0.7])
    want = _eager(E3.propose_softmax_topk, model, ids, positions, hidden, E3.make_kv_cache(4), steps=2, k=3, temperature=temperature)
    draft = draftfuse.draft_loop(E3.propose_softmax_topk)
    got = draft(model, ids, positions, hidden, E3.make_kv_cache(4), steps=2, k=3, temperature=temperature)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    rewrites = _rewrites(draft)
    assert len(rewrites) == 2 and all("temperature" in r.detail for r in rewrites), _selection_reports(draft)


def test_eagle3_draft_vocab_then_d2t_under_the_backend_equals_eager():
    # the older spelling (EAGLE cnets.py / sglang): max over the draft vocabulary, then ids + d2t[ids];
    # torch.compile(backend="draftfuse")
    model = E3.Eagle3Draft().eval()
    generator = torch.Generator().manual_seed(9)
    ids = torch.randint(0, E3.TARGET_VOCAB, (3,), generator=generator)
    positions = torch.arange(3) + 4
    hidden = torch.randn(3, E3.HIDDEN, generator=generator)
    want = _eager(E3.propose_draft_vocab, model, ids, positions, hidden, E3.make_kv_cache(3), steps=2)
    compiled = torch.compile(E3.propose_draft_vocab, backend="draftfuse", fullgraph=True)
    with torch.no_grad():
        got = compiled(model, ids, positions, hidden, E3.make_kv_cache(3), steps=2)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    hot = model.draft_id_to_target_id + torch.arange(E3.DRAFT_VOCAB)
    assert torch.isin(got[0], hot).all()


def _bf16_head_step(model, hidden):
    """The head of an EAGLE-3 step in bf16: final norm, draft lm_head, d2t scatter into -inf, softmax in
    the model dtype (bf16 probabilities, as sglang's fast_topk takes them) and topk(4)."""
    return torch.softmax(model.compute_logits(model.norm(hidden)), dim=-1).topk(4, dim=-1)


def test_eagle3_bf16_matches_unrewritten_compile_except_ties_and_says_bf16():
    model = E3.Eagle3Draft().to(torch.bfloat16).eval()
    hidden = torch.randn(32, E3.HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    reference = draftfuse.draft_loop(_bf16_head_step, options={"softmax_topk": False})
    want = reference(model, hidden)
    torch._dynamo.reset()
    draft = draftfuse.draft_loop(_bf16_head_step)
    got = draft(model, hidden)
    assert got.values.dtype == torch.bfloat16
    # picks may differ only at bf16 probabilities that tie: the values (the rewrite computes them at its
    # own indices) must equal the reference's, position by position
    assert torch.equal(got.values, want.values)
    differ = got.indices != want.indices
    probs = _eager(lambda: torch.softmax(model.compute_logits(model.norm(hidden)), dim=-1))
    assert torch.equal(probs.gather(1, got.indices)[differ], probs.gather(1, want.indices)[differ]), "indices differ without a tie"
    hot = model.draft_id_to_target_id + torch.arange(E3.DRAFT_VOCAB)
    assert torch.isin(got.indices, hot).all()
    (rewrite,) = _rewrites(draft)
    assert "bfloat16" in rewrite.detail, rewrite


# ---- c. EAGLE-3 hazards: writes around the selection, -inf rows, batch sizes ----------------------


def _scatter_then_ban_probs(logits, targets, banned):
    probs = torch.softmax(_scatter(logits, targets, 80), dim=-1)
    probs[:, banned] = 0  # a logits processor banning target ids, written into the probabilities
    return probs.topk(2, dim=-1)


def _scatter_then_write_buffer(logits, targets, other):
    logits_new = _scatter(logits, targets, 80)
    probs = torch.softmax(logits_new, dim=-1)
    logits_new[:, targets] = other  # the buffer reused for the next request group before the selection
    return probs.max(dim=-1), torch.softmax(logits_new, dim=-1).argmax(dim=-1)


def _scatter_then_write_temperature(logits, targets, temperature):
    probs = torch.softmax(_scatter(logits, targets, 80) / temperature[:, None], dim=-1)
    temperature.mul_(-1.0)  # the sampling metadata updated in place before the selection reads
    return probs.topk(3, dim=-1)


def _scatter_masked_rows(logits, targets, allowed):
    # vLLM's allowed-token mask (structured output): a request with no allowed token is a row of -inf
    logits_new = _scatter(logits, targets, 80).masked_fill(~allowed, float("-inf"))
    k1 = torch.softmax(logits_new, dim=-1).topk(1, dim=-1)
    return k1.indices, torch.softmax(logits_new, dim=-1).argmax(dim=-1)


def test_eagle3_write_to_probabilities_after_softmax_is_refused_and_exact():
    logits, targets = _selection_inputs()
    best = targets[logits.argmax(dim=-1)]
    want = _eager(_scatter_then_ban_probs, logits, targets, best)
    draft = draftfuse.draft_loop(_scatter_then_ban_probs)
    got = draft(logits, targets, best)
    assert not torch.isin(want.indices, best).any()
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)
    assert not _rewrites(draft) and any("written in place" in r.reason for r in _refusals(draft)), _selection_reports(draft)


def test_eagle3_buffer_and_temperature_written_after_softmax_leave_tokens_exact():
    logits, targets = _selection_inputs()
    other = torch.randn(4, 24, generator=torch.Generator().manual_seed(2)) * 3
    want = _eager(_scatter_then_write_buffer, logits, targets, other)
    draft = draftfuse.draft_loop(_scatter_then_write_buffer)
    got = draft(logits, targets, other)
    assert not torch.equal(want[0].indices, want[1]), "the second group must pick other tokens"
    assert torch.equal(got[0].indices, want[0].indices) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].values, want[0].values, rtol=1e-5, atol=1e-7)
    temperature = torch.tensor([0.5, 1.0, 2.0, 0.8])
    want = _eager(_scatter_then_write_temperature, logits, targets, temperature.clone())
    draft = draftfuse.draft_loop(_scatter_then_write_temperature)
    written = temperature.clone()
    got = draft(logits, targets, written)
    assert torch.equal(written, -temperature)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)


def test_eagle3_fully_masked_row_picks_what_eager_picks():
    # a row of -inf only: eager's probabilities are NaN there; the other rows must be untouched and the
    # masked row's token must be eager's (index 0), not an index the rewrite makes up
    logits, targets = _selection_inputs()
    allowed = torch.ones(4, 80, dtype=torch.bool)
    allowed[2] = False
    want = _eager(_scatter_masked_rows, logits, targets, allowed)
    draft = draftfuse.draft_loop(_scatter_masked_rows)
    got = draft(logits, targets, allowed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(_rewrites(draft)) == 2, _selection_reports(draft)


def _scatter_topk_values(logits, targets):
    return torch.softmax(_scatter(logits, targets, 80), dim=-1).topk(3, dim=-1)


def test_eagle3_nan_logit_row_is_the_documented_case_only():
    # a NaN in one request's draft logits (README Semantics: rows holding NaN may pick another index,
    # their probabilities are NaN in both); every other row must be exact
    logits, targets = _selection_inputs()
    logits[1, 5] = float("nan")
    want = _eager(_scatter_topk_values, logits, targets)
    draft = draftfuse.draft_loop(_scatter_topk_values)
    got = draft(logits, targets)
    rows = torch.tensor([0, 2, 3])
    assert torch.equal(got.indices[rows], want.indices[rows])
    torch.testing.assert_close(got.values[rows], want.values[rows], rtol=1e-5, atol=1e-7)
    assert got.values[1].isnan().all() and want.values[1].isnan().all()
    assert len(_rewrites(draft)) == 1, _selection_reports(draft)


def _compute_logits_step(model, hidden):
    probs = torch.softmax(model.compute_logits(hidden), dim=-1)
    return probs.topk(2, dim=-1)


def test_eagle3_server_batch_sizes_each_compile_once_and_equal_eager():
    model = E3.Eagle3Draft().eval()
    draft = draftfuse.draft_loop(_compute_logits_step, max_compiles=4)
    for batch in (1, 3, 8, 17, 3, 1):
        hidden = torch.randn(batch, E3.HIDDEN, generator=torch.Generator().manual_seed(batch))
        want = _eager(_compute_logits_step, model, hidden)
        got = draft(model, hidden)
        assert torch.equal(got.indices, want.indices), batch
        torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-7)
    assert len(draft.compiles) == 4
    with pytest.raises(draftfuse.RecompileError) as info:
        draft(model, torch.randn(5, E3.HIDDEN))
    assert "hidden" in str(info.value) and f"5, {E3.HIDDEN}" in str(info.value)


# ---- d. DeepSeek-V3 MTP (vLLM deepseek_mtp.py, sglang deepseek_nextn.py) ---------------------------


@pytest.mark.parametrize("topk", [1, 4])
def test_mtp_chain_equals_eager_one_region(topk):
    # enorm/hnorm, eh_proj(cat), inputs_embeds[positions == 0] = 0, layers[str(start + step % n)],
    # shared head through the logits processor, softmax + fast_topk per step
    model, input_ids, positions, hidden = MTP.make_inputs(batch=3)
    want = _eager(MTP.mtp_chain, model, input_ids, positions, hidden, topk=topk)
    draft = draftfuse.draft_loop(MTP.mtp_chain)
    got = draft(model, input_ids, positions, hidden, topk=topk)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    _close(got[2], want[2])
    assert len(draft.compiles) == 1
    assert len(_rewrites(draft)) == 3, _selection_reports(draft)


def test_mtp_spec_step_idx_python_int_picks_the_right_layer_on_every_call():
    # a worker calling one MTP step with the step number: each int is a compile (Dynamo specialises),
    # and replays of earlier ints must run their own layer (0 and 2 -> layer 4, 1 and 3 -> layer 5)
    model, input_ids, positions, hidden = MTP.make_inputs(batch=2)
    draft = draftfuse.draft_loop(MTP.mtp_step, max_compiles=4)
    outputs = {}
    for step in (0, 1, 2, 3, 1, 0, 3, 2, 1):
        want = _eager(MTP.mtp_step, model, input_ids, positions, hidden, spec_step_idx=step)
        got = draft(model, input_ids, positions, hidden, spec_step_idx=step) if step % 2 else draft(model, input_ids, positions, hidden, step)
        assert torch.equal(got[0], want[0]), step
        _close(got[2], want[2])
        outputs[step % 2] = got[2]
    assert not torch.allclose(outputs[0], outputs[1]), "the two MTP layers must differ"
    assert len(draft.compiles) == 4
    with pytest.raises(draftfuse.RecompileError) as info:
        draft(model, input_ids, positions, hidden, spec_step_idx=4)
    assert "spec_step_idx: 4" in str(info.value), str(info.value)


def test_mtp_worker_seed_folded_equals_eager_with_new_positions_each_call():
    # the worker's seed (first MTP step) folded into its loop; each call passes a positions tensor of its
    # own (the caller's positions + an offset): the draft only reads positions (the masked embedding
    # writes the embedding), so a new tensor must be no error (seen on an H100 with torch 2.11: a
    # CudagraphSkipError naming 'positions' as written at `inputs_embeds[positions == 0] = 0`)
    model, input_ids, positions, hidden = MTP.make_inputs(batch=3, seed=1)
    eager, compiled = MTP.MTPWorker(model), MTP.MTPWorker(model)
    draft = draftfuse.fold(compiled.seed_step, compiled.draft_steps, value_ranges={"positions": (0, None)})
    for call in range(3):
        moved = positions + call
        want = _eager(lambda *a: eager.draft_steps(*eager.seed_step(*a)), input_ids, moved, hidden)
        got = draft(input_ids, moved, hidden)
        assert torch.equal(got, want), call
    assert len(draft.draft.compiles) == 1
    (seed_fold,) = _reports(draft.draft, "seed_fold")
    assert any("seam marker removed" in r.rule for r in seed_fold.rewrites), seed_fold.format()
    assert len(_rewrites(draft.draft)) == 3, _selection_reports(draft.draft)


def test_mtp_greedy_argmax_writing_positions_under_the_backend_equals_eager():
    # vLLM's greedy logits.argmax(-1) with `positions += 1` on the caller's tensor, under
    # torch.compile(backend="draftfuse"), called again on the advanced positions
    model, input_ids, positions, hidden = MTP.make_inputs(batch=3, seed=2)
    compiled = torch.compile(MTP.mtp_greedy_argmax, backend="draftfuse", fullgraph=True)
    want_positions, got_positions = positions.clone(), positions.clone()
    for _ in range(3):
        want = _eager(MTP.mtp_greedy_argmax, model, input_ids, want_positions, hidden)
        with torch.no_grad():
            got = compiled(model, input_ids, got_positions, hidden)
        assert torch.equal(got, want)
        assert torch.equal(got_positions, want_positions)


def test_mtp_bf16_matches_unrewritten_compile():
    model, input_ids, positions, hidden = MTP.make_inputs(batch=4, seed=3, dtype=torch.bfloat16)
    reference = draftfuse.draft_loop(MTP.mtp_chain, options={"softmax_topk": False})
    want = reference(model, input_ids, positions, hidden, num_steps=2, topk=1)
    torch._dynamo.reset()
    draft = draftfuse.draft_loop(MTP.mtp_chain)
    got = draft(model, input_ids, positions, hidden, num_steps=2, topk=1)
    assert torch.equal(got[1], want[1]), "values of the picked tokens"
    # the picks agree, or tie in the bf16 probabilities (equal values returned, above)
    assert torch.equal(got[0][:, 0], want[0][:, 0]) or torch.equal(got[1][:, 0], want[1][:, 0])
    assert len(_rewrites(draft)) == 2 and all("bfloat16" in r.detail for r in _rewrites(draft)), _selection_reports(draft)
