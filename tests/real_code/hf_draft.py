"""A Hugging Face causal LM used as a small draft model, the way servers and HF's own assisted
generation run one: huggingface/transformers `LlamaForCausalLM` / `Qwen2ForCausalLM` (their
`modeling_llama.py` / `modeling_qwen2.py`, unmodified, from the installed package) with a
`StaticCache` (`cache_utils.py`), prefilled eagerly with the prompt, then a few greedy decode steps
each picking the next token with softmax -> topk(1) on the last position's logits.

Tiny configs built from config objects (2 layers, hidden 32, vocab 128): nothing is downloaded.
Verified with transformers 5.24.0, whose forward takes the cache as `cache=` (older releases call it
`past_key_values=`; `CACHE_KWARG` picks whichever the installed version has).
"""

from __future__ import annotations

import inspect

import torch

VOCAB, HIDDEN, PROMPT, BATCH, MAX_CACHE = 128, 32, 5, 2, 16


def _config(kind: str):
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    return config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def build(kind: str, seed: int = 0):
    """A tiny LlamaForCausalLM ("llama") or Qwen2ForCausalLM ("qwen2") with seeded random weights."""
    import transformers

    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    torch.manual_seed(seed)
    model = model_class(_config(kind)).eval()
    model.draft_cache_kwarg = cache_kwarg(model_class)  # looked up once, outside any compiled region
    return model


def cache_kwarg(model_class) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def prefilled_cache(model, seed: int = 1):
    """A StaticCache holding a random prompt, and the target's token that seeds the draft [B, 1]."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True, **{model.draft_cache_kwarg: cache})
    return cache, out.logits[:, -1:].argmax(dim=-1)


def greedy_draft(model, cache, token, steps: int = 3):
    """`steps` decode steps of the draft model, each token from softmax -> topk(1); tokens [B, steps]."""
    key = model.draft_cache_kwarg
    tokens, probs = [], []
    for _ in range(steps):
        logits = model(input_ids=token, use_cache=True, **{key: cache}).logits[:, -1, :]
        prob, token = torch.softmax(logits.float(), dim=-1).topk(1, dim=-1)
        tokens.append(token)
        probs.append(prob)
    return torch.cat(tokens, dim=1), torch.cat(probs, dim=1)
