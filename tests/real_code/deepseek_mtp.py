"""DeepSeek-V3 multi-token prediction (MTP) as servers run it, modeled on vllm-project/vllm
`vllm/model_executor/models/deepseek_mtp.py` (`DeepSeekMultiTokenPredictorLayer.forward`,
`DeepSeekMultiTokenPredictor.forward` / `compute_logits`, `SharedHead`) and sgl-project/sglang
`python/sglang/srt/models/deepseek_nextn.py` (`DeepseekModelNextN.forward`), with the draft chain of
vllm `v1/spec_decode/eagle.py` (`propose`, method "deepseek_mtp").

The patterns kept from there:
  * `inputs_embeds[positions == 0] = 0` (masking the embedding at position 0, an index_put with a
    boolean mask of the same shape as the rows), then `enorm(inputs_embeds)` and
    `hnorm(previous_hidden_states)`, `eh_proj(torch.cat([...], dim=-1))`, the MTP block returning
    `(hidden_states, residual)` and `hidden_states = residual + hidden_states`;
  * a `nn.ModuleDict` keyed by the *target's* layer numbers, `str(mtp_start_layer_idx + idx)`, and a Python
    int `spec_step_idx` selecting `self.layers[str(self.mtp_start_layer_idx + spec_step_idx %
    self.num_mtp_layers)]` in both `forward` and `compute_logits` (a different module per step);
  * `SharedHead`: `forward` is the norm only, the head is applied by the logits processor:
    `logits_processor(mtp_layer.shared_head.head, mtp_layer.shared_head(hidden_states))`;
  * the chain feeds each step's hidden state to the next and picks greedily (`argmax`) or, in SGLang's
    EAGLE-style MTP worker, `softmax` + `fast_topk` (`max(keepdim=True)` for k = 1, `topk` otherwise).

The MTP block is a small stand-in (RMSNorm -> MLP with a residual, no attention). Numerics are
irrelevant; the spellings are what matter.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.real_code.vllm_eagle3 import RMSNorm  # vLLM's RMSNorm (a residual added first), which its MTP layers use too

VOCAB, HIDDEN = 160, 32
NUM_HIDDEN_LAYERS, NUM_MTP_LAYERS = 4, 2  # the MTP layers are numbered 4 and 5, after the target's


class MTPBlock(nn.Module):
    """Stand-in for DeepseekV2DecoderLayer: returns (hidden_states, residual) like vLLM's layers."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.gate_up_proj = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up), residual


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)


class DeepSeekMultiTokenPredictorLayer(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden)
        self.hnorm = RMSNorm(hidden)
        self.eh_proj = nn.Linear(hidden * 2, hidden, bias=False)
        self.shared_head = SharedHead(hidden, vocab)
        self.mtp_block = MTPBlock(hidden)

    def forward(self, input_ids, positions, previous_hidden_states, inputs_embeds, spec_step_index: int = 0):
        assert inputs_embeds is not None
        inputs_embeds[positions == 0] = 0  # masking inputs at position 0, as not needed by MTP
        inputs_embeds = self.enorm(inputs_embeds)
        previous_hidden_states = self.hnorm(previous_hidden_states)
        hidden_states = self.eh_proj(torch.cat([inputs_embeds, previous_hidden_states], dim=-1))
        hidden_states, residual = self.mtp_block(positions=positions, hidden_states=hidden_states, residual=None)
        return residual + hidden_states


class LogitsProcessor(nn.Module):
    def __init__(self, vocab: int, scale: float = 1.0) -> None:
        super().__init__()
        self.vocab, self.scale = vocab, scale

    def forward(self, lm_head: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden_states)
        if self.scale != 1.0:
            logits *= self.scale
        return logits[..., : self.vocab]


class DeepSeekMultiTokenPredictor(nn.Module):
    def __init__(self, seed: int = 0, vocab: int = VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.mtp_start_layer_idx = NUM_HIDDEN_LAYERS
        self.num_mtp_layers = NUM_MTP_LAYERS
        self.layers = nn.ModuleDict(
            {str(idx): DeepSeekMultiTokenPredictorLayer(hidden, vocab) for idx in range(self.mtp_start_layer_idx, self.mtp_start_layer_idx + self.num_mtp_layers)}
        )
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.logits_processor = LogitsProcessor(vocab)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def forward(self, input_ids, positions, previous_hidden_states, inputs_embeds=None, spec_step_idx: int = 0):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        current_step_idx = spec_step_idx % self.num_mtp_layers
        return self.layers[str(self.mtp_start_layer_idx + current_step_idx)](
            input_ids, positions, previous_hidden_states, inputs_embeds, current_step_idx
        )

    def compute_logits(self, hidden_states, spec_step_idx: int = 0):
        current_step_idx = spec_step_idx % self.num_mtp_layers
        mtp_layer = self.layers[str(self.mtp_start_layer_idx + current_step_idx)]
        return self.logits_processor(mtp_layer.shared_head.head, mtp_layer.shared_head(hidden_states))


def mtp_step(model: DeepSeekMultiTokenPredictor, input_ids, positions, hidden_states, spec_step_idx: int = 0):
    """One MTP step as a worker calls it with the step number (a Python int): greedy token and hidden."""
    hidden_states = model(input_ids, positions, hidden_states, spec_step_idx=spec_step_idx)
    logits = model.compute_logits(hidden_states, spec_step_idx)
    probs = torch.softmax(logits, dim=-1)
    p, token = torch.max(probs, dim=-1, keepdim=True)  # sglang's fast_topk for k = 1
    return token, p, hidden_states


def mtp_chain(model: DeepSeekMultiTokenPredictor, input_ids, positions, hidden_states, num_steps: int = 3, topk: int = 1):
    """vLLM's propose for method "deepseek_mtp" (seed included as step 0), with sglang's fast_topk."""
    tokens, scores = [], []
    for step in range(num_steps):
        hidden_states = model(input_ids, positions, hidden_states, spec_step_idx=step)
        logits = model.compute_logits(hidden_states, step)
        probs = torch.softmax(logits, dim=-1)
        if topk == 1:
            p, index = torch.max(probs, dim=-1, keepdim=True)
        else:
            p, index = torch.topk(probs, topk, dim=-1)
        tokens.append(index)
        scores.append(p)
        input_ids = index[:, 0]
        positions = positions + 1
    return torch.stack(tokens, dim=1), torch.stack(scores, dim=1), hidden_states


def mtp_greedy_argmax(model: DeepSeekMultiTokenPredictor, input_ids, positions, hidden_states, num_steps: int = 3):
    """vLLM's greedy spelling: `logits.argmax(dim=-1)` per step, no softmax."""
    tokens = []
    for step in range(num_steps):
        hidden_states = model(input_ids, positions, hidden_states, spec_step_idx=step)
        input_ids = model.compute_logits(hidden_states, step).argmax(dim=-1)
        tokens.append(input_ids)
        positions += 1
    return torch.stack(tokens, dim=1)


class MTPWorker:
    """A server-style worker: the seed (the first MTP step, run eagerly today) and the remaining steps."""

    def __init__(self, model: DeepSeekMultiTokenPredictor, num_steps: int = 3) -> None:
        self.model = model
        self.num_steps = num_steps

    def seed_step(self, input_ids, positions, hidden_states):
        hidden_states = self.model(input_ids, positions, hidden_states, spec_step_idx=0)
        logits = self.model.compute_logits(hidden_states, 0)
        _, token = torch.softmax(logits.float(), dim=-1).topk(1, dim=-1)
        return token, positions + 1, hidden_states

    def draft_steps(self, token, positions, hidden_states):
        tokens = [token]
        for step in range(1, self.num_steps):
            hidden_states = self.model(token[:, 0], positions, hidden_states, spec_step_idx=step)
            logits = self.model.compute_logits(hidden_states, step)
            _, token = torch.softmax(logits.float(), dim=-1).topk(1, dim=-1)
            tokens.append(token)
            positions = positions + 1
        return torch.cat(tokens, dim=1)


def make_inputs(batch: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32):
    """(model, input_ids [B], positions [B] with request 0 at position 0, hidden [B, H])."""
    generator = torch.Generator().manual_seed(seed + 1)
    model = DeepSeekMultiTokenPredictor(seed=seed).to(dtype).eval()
    input_ids = torch.randint(0, VOCAB, (batch,), generator=generator)
    positions = torch.arange(batch) * 2  # request 0 at position 0: its embedding is masked
    hidden = torch.randn(batch, HIDDEN, generator=generator).to(dtype)
    return model, input_ids, positions, hidden
