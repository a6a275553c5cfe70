"""vLLM's EAGLE-3 draft, modeled on vllm-project/vllm:
  * `vllm/model_executor/models/llama_eagle3.py`: `Eagle3LlamaForCausalLM.combine_hidden_states` (`fc`
    over the target's three auxiliary hidden states, concatenated: [T, 3H] -> [T, H]); the first decoder
    layer's `input_layernorm(embeds)` and `hidden_norm(hidden_states)` concatenated into a qkv
    projection of width 2H; vLLM's fused `RMSNorm(x, residual)` (adds the residual first, returns the
    sum as the new residual); `LlamaModel.forward` returning `(norm(h), prenorm)`;
    `compute_logits`: an lm_head over the *draft* vocabulary, `targets = arange(draft_vocab) +
    draft_id_to_target_id` (a long Parameter, requires_grad=False) and the draft logits scattered into
    a target-vocabulary tensor filled with -inf, `logits.new_full((n, vocab), float("-inf"))`,
    `logits_new[:, targets] = logits`; `LogitsProcessor`'s constant logit scale.
  * `vllm/v1/spec_decode/eagle.py`: `EagleProposer.propose` with its persistent buffers
    (`self.input_ids` int32, `self.positions` int64, `self.hidden_states`), the shift of the target's
    token ids by one (`input_ids[: T - 1] = target_token_ids[1:]`, `input_ids[last_token_indices] =
    next_token_ids`), `logits.argmax(dim=-1)` per step, `draft_token_ids_list[-1].int()`, `positions +=
    1`, `exceeds_max_model_len = positions >= max_model_len`, `torch.where(exceeds, 0, positions)`,
    `seq_lens += 1` and `seq_lens.masked_fill_(exceeds, 1)` on the attention metadata,
    `slot_mapping.masked_fill_(exceeds, PADDING_SLOT_ID)`, the buffers refilled by slice assignment
    before every step, and `torch.stack(draft_token_ids_list, dim=1)`; `propose_tree`'s
    `torch.topk(logits, num_children, dim=-1)` over the same scattered logits.
  * The older EAGLE-3 spelling (SafeAILab/EAGLE `cnets.py`, sglang's EAGLE-3 worker): the selection on
    the draft-vocabulary logits and the id mapped afterwards, `ids + d2t[ids]`.

The attention is a small stand-in: one head group over a per-request KV cache laid out as vLLM's slot
mapping addresses it (`slot = request * max_model_len + position`), with one spare slot at the end that
receives the writes of slot -1 (vLLM's kernel skips PADDING_SLOT_ID; plain indexing writes the last row).
Numerics are irrelevant; the spellings are what matter.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

TARGET_VOCAB, DRAFT_VOCAB, HIDDEN, MAX_MODEL_LEN = 256, 96, 32, 16
PADDING_SLOT_ID = -1


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: `forward(x, residual=None)`; with a residual it adds it first and returns both."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)


class Eagle3DecoderLayer(nn.Module):
    """The first (only) EAGLE-3 layer: norms, cat([embeds, hidden]) -> qkv of width 2H, attention, MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.hidden_norm = RMSNorm(hidden)
        self.qkv_proj = nn.Linear(2 * hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.gate_up_proj = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def attention(self, q, k, v, positions, request, slot_mapping, kv_cache):
        # write this step's keys and values at their slots, then attend over the request's positions
        kv_cache[slot_mapping] = torch.stack((k, v), dim=1)
        rows = kv_cache[:-1].view(-1, MAX_MODEL_LEN, 2, k.shape[-1])[request]  # [T, L, 2, H]
        scores = torch.einsum("th,tlh->tl", q, rows[:, :, 0]) / k.shape[-1] ** 0.5
        visible = torch.arange(MAX_MODEL_LEN, device=q.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("tl,tlh->th", scores.softmax(dim=-1), rows[:, :, 1])

    def forward(self, positions, embeds, hidden_states, request, slot_mapping, kv_cache):
        embeds = self.input_layernorm(embeds)
        residual = hidden_states
        hidden_states = self.hidden_norm(hidden_states)
        hidden_states = torch.cat([embeds, hidden_states], dim=-1)
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        hidden_states = self.o_proj(self.attention(q, k, v, positions, request, slot_mapping, kv_cache))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up), residual


class Eagle3Draft(nn.Module):
    """Eagle3LlamaForCausalLM in small: fc, one layer, norm, draft-vocabulary lm_head, d2t."""

    def __init__(self, seed: int = 0, logit_scale: float = 1.0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(TARGET_VOCAB, HIDDEN)
        self.fc = nn.Linear(3 * HIDDEN, HIDDEN, bias=False)
        self.layer = Eagle3DecoderLayer(HIDDEN)
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, DRAFT_VOCAB, bias=False)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        self.logit_scale = logit_scale
        # draft id -> offset to the target id (the checkpoint's `d2t`): a sorted random hot subset
        hot = torch.randperm(TARGET_VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values
        self.draft_id_to_target_id = nn.Parameter(hot - torch.arange(DRAFT_VOCAB), requires_grad=False)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden_states)  # the three aux hidden states, concatenated by the target

    def forward(self, input_ids, positions, hidden_states, request, slot_mapping, kv_cache):
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)
        hidden_states, residual = self.layer(positions, embeds, hidden_states, request, slot_mapping, kv_cache)
        return self.norm(hidden_states, residual)  # (normed, prenorm)

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale  # LogitsProcessor(scale=...)
        return logits

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.draft_logits(hidden_states)
        base = torch.arange(DRAFT_VOCAB, device=logits.device)
        targets = base + self.draft_id_to_target_id
        logits_new = logits.new_full((logits.shape[0], TARGET_VOCAB), float("-inf"))
        logits_new[:, targets] = logits
        return logits_new

    def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.draft_id_to_target_id[ids]  # EAGLE's `ids + d2t[ids]`


@dataclasses.dataclass
class CommonAttentionMetadata:
    seq_lens: torch.Tensor  # [B] int32, written in place by the draft as vLLM does
    request: torch.Tensor  # [T] request index of each target token
    slot_mapping: torch.Tensor  # [T]


class EagleProposer:
    """EagleProposer in small: persistent buffers and the greedy `propose` chain."""

    def __init__(self, model: Eagle3Draft, num_speculative_tokens: int = 3, max_num_tokens: int = 64) -> None:
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = MAX_MODEL_LEN
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64)
        self.hidden_states = torch.zeros(max_num_tokens, HIDDEN)

    # ---- the seed: the draft-extend forward over the target's tokens, and its argmax
    def seed_step(self, target_token_ids, target_positions, target_hidden_states, next_token_ids, last_token_indices, meta, kv_cache):
        num_tokens = target_token_ids.shape[0]
        target_hidden_states = self.model.combine_hidden_states(target_hidden_states)
        self.input_ids[: num_tokens - 1] = target_token_ids[1:]
        self.input_ids[last_token_indices] = next_token_ids
        self.positions[:num_tokens] = target_positions
        self.hidden_states[:num_tokens] = target_hidden_states
        last_hidden_states, hidden_states = self.model(
            self.input_ids[:num_tokens], self.positions[:num_tokens], self.hidden_states[:num_tokens], meta.request, meta.slot_mapping, kv_cache
        )
        logits = self.model.compute_logits(last_hidden_states[last_token_indices])
        draft_token_ids = logits.argmax(dim=-1)
        positions = target_positions[last_token_indices]
        hidden_states = hidden_states[last_token_indices]
        return draft_token_ids, positions, hidden_states, meta, kv_cache

    # ---- the loop: num_speculative_tokens - 1 greedy steps
    def draft_steps(self, draft_token_ids, positions, hidden_states, meta, kv_cache):
        batch_size = draft_token_ids.shape[0]
        requests = torch.arange(batch_size, device=positions.device)
        draft_token_ids_list = [draft_token_ids]
        for _ in range(self.num_speculative_tokens - 1):
            input_ids = draft_token_ids_list[-1].int()
            positions += 1
            exceeds_max_model_len = positions >= self.max_model_len
            clamped_positions = torch.where(exceeds_max_model_len, 0, positions)
            meta.seq_lens += 1
            meta.seq_lens.masked_fill_(exceeds_max_model_len, 1)
            slot_mapping = requests * self.max_model_len + clamped_positions
            slot_mapping.masked_fill_(exceeds_max_model_len, PADDING_SLOT_ID)
            self.input_ids[:batch_size] = input_ids
            self.positions[:batch_size] = clamped_positions
            self.hidden_states[:batch_size] = hidden_states
            last_hidden_states, hidden_states = self.model(
                self.input_ids[:batch_size], self.positions[:batch_size], self.hidden_states[:batch_size], requests, slot_mapping, kv_cache
            )
            logits = self.model.compute_logits(last_hidden_states)
            draft_token_ids = logits.argmax(dim=-1)
            draft_token_ids_list.append(draft_token_ids)
        return torch.stack(draft_token_ids_list, dim=1)

    def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids, last_token_indices, meta, kv_cache):
        return self.draft_steps(
            *self.seed_step(target_token_ids, target_positions, target_hidden_states, next_token_ids, last_token_indices, meta, kv_cache)
        )


def propose_softmax_topk(model: Eagle3Draft, input_ids, positions, hidden_states, kv_cache, steps: int = 3, k: int = 1, temperature=None):
    """A greedy/top-k chain written with softmax + topk over the scattered full-vocabulary logits (the
    spelling a sampler gives the same step), optionally over a per-request temperature tensor."""
    batch = input_ids.shape[0]
    requests = torch.arange(batch, device=positions.device)
    tokens, probs = [], []
    for _ in range(steps):
        slot_mapping = requests * MAX_MODEL_LEN + positions
        last, hidden_states = model(input_ids, positions, hidden_states, requests, slot_mapping, kv_cache)
        logits = model.compute_logits(last)
        if temperature is not None:
            logits = logits / temperature.unsqueeze(-1)
        p, token = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        tokens.append(token)
        probs.append(p)
        input_ids = token[:, 0]
        positions = torch.clamp(positions + 1, max=MAX_MODEL_LEN - 1)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


def propose_draft_vocab(model: Eagle3Draft, input_ids, positions, hidden_states, kv_cache, steps: int = 3):
    """The older EAGLE-3 spelling: select on the draft vocabulary, then map the id with `ids + d2t[ids]`."""
    batch = input_ids.shape[0]
    requests = torch.arange(batch, device=positions.device)
    tokens, probs = [], []
    for _ in range(steps):
        slot_mapping = requests * MAX_MODEL_LEN + positions
        last, hidden_states = model(input_ids, positions, hidden_states, requests, slot_mapping, kv_cache)
        p, draft_ids = torch.softmax(model.draft_logits(last), dim=-1).max(dim=-1)
        input_ids = model.map_ids(draft_ids)
        tokens.append(input_ids)
        probs.append(p)
        positions = positions + 1
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


def make_kv_cache(batch: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(batch * MAX_MODEL_LEN + 1, 2, HIDDEN, dtype=dtype)  # + the slot -1 writes


def make_target_batch(batch: int, query_len: int = 2, seed: int = 0, start: int = 3, dtype: torch.dtype = torch.float32):
    """What the target hands the proposer for `batch` requests of `query_len` new tokens each: token ids,
    positions (request r at `start + r`...), three aux hidden states concatenated, the sampled next
    tokens, the last token index per request, the metadata and a KV cache."""
    generator = torch.Generator().manual_seed(seed)
    tokens = batch * query_len
    request = torch.arange(batch).repeat_interleave(query_len)
    first = start + torch.arange(batch) % (MAX_MODEL_LEN - query_len - start)
    positions = first.repeat_interleave(query_len) + torch.arange(query_len).repeat(batch)
    target_token_ids = torch.randint(0, TARGET_VOCAB, (tokens,), generator=generator)
    target_hidden = (torch.randn(tokens, 3 * HIDDEN, generator=generator)).to(dtype)
    next_token_ids = torch.randint(0, TARGET_VOCAB, (batch,), generator=generator, dtype=torch.int32)
    last_token_indices = torch.arange(1, batch + 1) * query_len - 1
    meta = CommonAttentionMetadata(
        seq_lens=(positions[last_token_indices] + 1).to(torch.int32), request=request, slot_mapping=request * MAX_MODEL_LEN + positions
    )
    return target_token_ids, positions, target_hidden, next_token_ids, last_token_indices, meta, make_kv_cache(batch, dtype)
