"""SGLang's multi-step EAGLE draft, modeled on sgl-project/sglang `python/sglang/srt/speculative/`:
`eagle_worker.py` (`EAGLEWorker.draft_forward`, the draft-extend step that seeds it) and
`eagle_utils.py` / `spec_utils.py` (`fast_topk`, `select_top_k_tokens`, `organize_draft_results`).

The patterns kept from there:
  * probabilities are `torch.softmax(next_token_logits, dim=-1)` (no dtype), then `fast_topk`, which is
    `torch.max(values, dim=dim, keepdim=True)` for k = 1 and `torch.topk(values, k, dim=dim)` otherwise;
  * a reduced draft vocabulary: the draft's lm_head covers the "hot" tokens only and the picked indices
    are mapped back to target ids by indexing a buffer, `hot_token_id[topk_index]`;
  * `select_top_k_tokens`: step 0 repeats each request's hidden state `topk` times with
    `repeat_interleave` and starts the parents at `arange(-1, topk)`; later steps multiply the parents'
    scores into the children's probabilities (`scores.unsqueeze(2) * topk_p.reshape(-1, topk, topk)`),
    keep the best `topk` of `topk**2` with `fast_topk`, gather the ids and re-index the hidden states;
  * score / token / parent lists per step, merged at the end with a topk over all scores, a sort of the
    chosen indices and `torch.gather` of the tokens (`organize_draft_results`);
  * the whole loop is a Python `for i in range(num_steps)` over one model, batch of requests first.

The draft model is a small stand-in (embedding over the target vocabulary ⊕ hidden -> fc -> MLP ->
lm_head over the hot vocabulary).
"""

from __future__ import annotations

import torch
from torch import nn

TARGET_VOCAB, DRAFT_VOCAB, HIDDEN, BATCH = 128, 64, 32, 2


class HotVocabDraft(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(TARGET_VOCAB, HIDDEN)
        self.fc = nn.Linear(2 * HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.SiLU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, DRAFT_VOCAB, bias=False)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        # draft id -> target id (a sorted random subset of the target vocabulary)
        hot = torch.randperm(TARGET_VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values
        self.register_buffer("hot_token_id", hot)

    def forward(self, input_ids: torch.Tensor, hidden_states: torch.Tensor):
        x = self.fc(torch.cat((self.embed(input_ids), hidden_states), dim=-1))
        hidden_states = x + self.mlp(x)
        return self.lm_head(hidden_states), hidden_states


def fast_topk(values: torch.Tensor, topk: int, dim: int):
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)  # values and index, k kept as a dim of 1
    return torch.topk(values, topk, dim=dim)


def select_top_k_tokens(i: int, topk_p, topk_index, hidden_states, scores, topk: int):
    if i == 0:
        input_ids = topk_index.flatten()
        hidden_states = hidden_states.repeat_interleave(topk, dim=0)
        scores = topk_p  # [b, topk]
        parents = torch.arange(-1, topk, dtype=torch.long, device=hidden_states.device)
        tree_info = (topk_p.unsqueeze(1), topk_index, parents.unsqueeze(0).repeat(topk_p.shape[0], 1))
    else:
        expand_scores = torch.mul(scores.unsqueeze(2), topk_p.reshape(-1, topk, topk))  # [b, topk, topk]
        topk_cs_p, topk_cs_index = fast_topk(expand_scores.flatten(start_dim=1), topk, dim=-1)
        scores = topk_cs_p
        topk_index = topk_index.reshape(-1, topk**2)
        input_ids = torch.gather(topk_index, index=topk_cs_index, dim=1).flatten()
        rows = torch.arange(0, hidden_states.shape[0], step=topk, device=hidden_states.device)
        selected = topk_cs_index.flatten() // topk + rows.repeat_interleave(topk)
        hidden_states = hidden_states[selected, :]
        tree_info = (expand_scores, topk_index, topk_cs_index + (topk**2 * (i - 1) + topk))
    return input_ids, hidden_states, scores, tree_info


def organize_draft_results(score_list, token_list, parents_list, num_draft_token: int):
    score_list = torch.cat(score_list, dim=1).flatten(1)
    ss_token_list = torch.cat(token_list, dim=1)
    top_scores_index = torch.topk(score_list, num_draft_token - 1, dim=-1).indices
    top_scores_index = torch.sort(top_scores_index).values
    draft_tokens = torch.gather(ss_token_list, index=top_scores_index, dim=1)
    parent_list = torch.cat(parents_list[:-1], dim=1) if len(parents_list) > 1 else None
    return parent_list, top_scores_index, draft_tokens


def draft(model: HotVocabDraft, verified_id, hidden_states, num_steps: int = 3, topk: int = 4, num_draft_tokens: int = 8):
    """The draft-extend step's selection (the seed) followed by draft_forward's steps."""
    logits, hidden_states = model(verified_id, hidden_states)
    probs = torch.softmax(logits, dim=-1)
    topk_p, topk_index = fast_topk(probs, topk, dim=-1)
    topk_index = model.hot_token_id[topk_index]
    score_list, token_list, parents_list = [], [], []
    scores = None
    for i in range(num_steps):
        input_ids, hidden_states, scores, tree_info = select_top_k_tokens(i, topk_p, topk_index, hidden_states, scores, topk)
        score_list.append(tree_info[0])
        token_list.append(tree_info[1])
        parents_list.append(tree_info[2])
        if i == num_steps - 1:
            break
        logits, hidden_states = model(input_ids, hidden_states)
        probs = torch.softmax(logits, dim=-1)
        topk_p, topk_index = fast_topk(probs, topk, dim=-1)
        topk_index = model.hot_token_id[topk_index]
    parent_list, top_scores_index, draft_tokens = organize_draft_results(score_list, token_list, parents_list, num_draft_tokens)
    return parent_list, top_scores_index, draft_tokens, torch.cat(score_list, dim=1).flatten(1)


def make_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed + 1)
    model = HotVocabDraft(seed=seed).eval()
    verified_id = torch.randint(0, TARGET_VOCAB, (BATCH,), generator=generator)
    hidden_states = torch.randn(BATCH, HIDDEN, generator=generator)
    return model, verified_id, hidden_states
