"""The benchmark's draft workloads, each built at one batch size, and the four ways each draft is run.

Workloads (the models of examples/, random seeded weights, nothing downloaded), each seed + 3 steps:
  mtp          frozen-KV MTP drafter (examples/mtp_frozen_kv.py): tokens and their probabilities
  eagle        EAGLE-style head, greedy chain (examples/eagle_head.py): tokens; writes its KV cache
  draft_model  independent two-layer draft model (examples/draft_model.py): tokens and their
               probabilities at temperature 0.7; writes its KV cache, positions advance

Variants: the same draft on the same inputs, five ways.
  eager                     the draft as written, run eagerly.
  eager_seed+captured_loop  today's server layout: the seed iteration eager, the recurrent steps compiled
                            with torch.compile(mode="reduce-overhead") (Inductor, CUDA graph trees).
                            MTP: the worker's own draft_server_layout. EAGLE and the draft model: the
                            split written here, whose seed outputs reach the steps' CUDA graph through the
                            copies into static inputs that graph trees make for every non-static input.
  hand_fold+hand_argmax     the edit servers make by hand: seed and steps in one function, argmax instead
                            of softmax + topk(1), and where the draft returns probabilities the max
                            probability 1 / sum(exp(x - max)) in float32; torch.compile(mode=
                            "reduce-overhead", fullgraph=True), default backend.
  raw_cuda_graph            the hand edit as server runners run it: the same hand_fold function compiled
                            by Inductor without CUDA graphs (torch.compile(fullgraph=True), default
                            mode), warmed up on a side stream and captured once in a torch.cuda.CUDAGraph
                            over static input buffers (the first call does this). Per call: copy the
                            draft's inputs (tokens, hidden states, positions / sequence lengths; not the
                            weights or KV caches, which stay where they are) into the static buffers,
                            graph.replay(), and clone the static output tensors (draft_loop's outputs
                            are the caller's too: handed out from a spare recording, or copied when
                            the spares' outputs are all held; unless zero_copy_outputs=True).
                            On a CPU (no CUDA graphs) the same copies and clones around a plain call of
                            the compiled function.
  draftfuse                 the unedited softmax + topk draft through draftfuse (default options):
                            draft_loop for the one-function drafts, fold(seed_step, draft_steps) for the
                            MTP worker, told that seq_lens >= 1 as the MTP example tells it.

Each variant is a factory: calling it makes a fresh compile (nothing runs yet) and returns a call of no
arguments that runs one draft and returns output tensors no later call writes (compiled variants
clone the graph's outputs, which the next replay overwrites; draft_loop sees to its own). Calling a factory again after
torch._dynamo.reset() gives the warm compile. Compiles are static-shaped (dynamic=False, draft_loop's
default): one graph per batch size, as CUDA graphs want.

Every variant reads the same per-call input tensors: the eager and compiled ones take them as arguments,
raw_cuda_graph copies them into its static buffers on each call, draftfuse reads them where they are.
Workload.vary() writes a second set of values into those tensors, in place (the same values whenever it
is called): the input tokens shifted by half the vocabulary, so every drafted token changes; the hidden
states negated; the position (eagle, draft_model) or the sequence lengths (mtp) one less. An eagle or
draft_model draft then writes the cache slots pos - 1 .. pos + 2, inside the cache, and each slot it reads
is either written earlier in the same call or part of the prefix no call writes, so its outputs depend on
its inputs alone, whichever variant ran before it; mtp's sequence lengths stay in [kv_len / 2 - 1,
kv_len - 1], >= 1 as the fold is told. A variant that does not read its call's inputs (a stale replay)
then drafts other tokens.

Weights: the LM head is the embedding shifted by one token, and the EAGLE head's input projection passes
the token's embedding through almost unchanged, as in the MTP example, so each step's best token (the
input token plus one, then plus two, ...) leads by a margin far wider than bf16 rounding: equal tokens
across variants then test the layouts, not luck. The draft model's and the MTP drafter's LM heads are
scaled so that t + 1 gets the logit temperature * ln(vocab) from a hidden state equal to token t's
embedding (temperature 0.7 and 1): the drafted tokens' probabilities are then 0.04 to 0.76 at the tiny
size (batches 1 to 64) and 0.13 to 0.55 at the reference size (batch 8), not saturated. With the MTP
example's own scale, 2 * sqrt(dim), they were 0.93 to 1 at the tiny size (batch 2) and exactly 1 at the
reference size, where a wrong temperature or a constant 1 would pass the comparison of probabilities. Speed does
not depend on weight values.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# The examples are scripts that import their siblings (_layers, _common) by plain name.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import draft_model  # noqa: E402
import eagle_head  # noqa: E402
import mtp_frozen_kv  # noqa: E402
from _layers import SIZES as LAYER_SIZES  # noqa: E402
from _layers import causal_mask  # noqa: E402

from draftfuse.runtime.draft_loop import draft_loop  # noqa: E402
from draftfuse.runtime.fold import fold  # noqa: E402

STEPS = 3  # recurrent steps after the seed
TEMPERATURE = 0.7  # the draft model's sampling temperature (its example's default)
MODE = "reduce-overhead"

Outputs = tuple[torch.Tensor, ...]
Factory = Callable[[], Callable[[], Outputs]]


@dataclasses.dataclass
class Workload:
    """One draft at one batch size: its vocabulary, a factory per variant, and vary(), which writes the
    second set of per-call inputs into the tensors every variant reads (see the module doc)."""

    vocab: int
    variants: dict[str, Factory]
    vary: Callable[[], None]


def _vary(*changes: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    """A workload's vary(): copy each (input, value) pair's value into the input tensor, in place. The
    values are made when the workload is built, so a second vary() writes the same values again."""

    def vary() -> None:
        for tensor, value in changes:
            tensor.copy_(value)

    return vary


def _other_tokens(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The tokens shifted by half the vocabulary: each step's best token (the input token plus the step's
    number) changes."""
    return (tokens + vocab // 2) % vocab


def _as_tuple(out) -> Outputs:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _cloned(out) -> Outputs:
    return tuple(t.clone() for t in _as_tuple(out))


def _eager(fn: Callable, *args, **kwargs) -> Factory:
    return lambda: lambda: _cloned(fn(*args, **kwargs))


def _compiled(fn: Callable, *args, **kwargs) -> Factory:
    def make() -> Callable[[], Outputs]:
        compiled = torch.compile(fn, mode=MODE, fullgraph=True, dynamic=False)
        return lambda: _cloned(compiled(*args, **kwargs))

    return make


def _draftfuse(fn: Callable, *args, **kwargs) -> Factory:
    def make() -> Callable[[], Outputs]:
        compiled = draft_loop(fn)  # its outputs are the caller's already
        return lambda: _as_tuple(compiled(*args, **kwargs))

    return make


def _raw_cuda_graph(fn: Callable, args: tuple, inputs: tuple[int, ...], **kwargs) -> Factory:
    """The raw_cuda_graph variant of `fn(*args, **kwargs)` (see the module doc); `inputs`: the positions in
    `args` of the per-call inputs, which get static buffers."""

    def make() -> Callable[[], Outputs]:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)  # Inductor's kernels, no graph trees
        sources = [args[i] for i in inputs]
        static = [a.clone() for a in sources]
        call_args = list(args)
        for i, buffer in zip(inputs, static):
            call_args[i] = buffer
        state: dict = {}

        def copy_inputs() -> None:
            for buffer, source in zip(static, sources):
                buffer.copy_(source)

        def capture() -> None:
            device = static[0].device
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # compile, autotune and warm up off the capture
                for _ in range(3):
                    compiled(*call_args, **kwargs)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                state["outputs"] = _as_tuple(compiled(*call_args, **kwargs))
            state["graph"] = graph

        def call() -> Outputs:
            copy_inputs()
            if static[0].device.type != "cuda":
                return _cloned(compiled(*call_args, **kwargs))
            if "graph" not in state:
                capture()  # the first call: compile, warm up, capture (its outputs: the replay's below)
            state["graph"].replay()
            return _cloned(state["outputs"])

        return call

    return make


def _argmax_and_prob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax over the last dim [..., 1] and softmax(logits).max(-1) [..., 1] without the softmax."""
    logits = logits.float()
    prob = 1 / torch.exp(logits - logits.amax(-1, keepdim=True)).sum(-1, keepdim=True)
    return logits.argmax(-1, keepdim=True), prob


@torch.no_grad()
def _favour_next_token(embed: nn.Embedding, lm_head: nn.Linear, next_logit: float | None = None) -> None:
    """LM head row j := embedding row j - 1, scaled: a hidden state near token t's embedding (entries of
    variance 1, as the final norm leaves it) scores t + 1 highest, at about `next_logit` (default
    2 * sqrt(dim), the MTP example's scale), and the other tokens about 0."""
    vocab, dim = embed.weight.shape
    next_logit = 2.0 * math.sqrt(dim) if next_logit is None else next_logit
    lm_head.weight.copy_(embed.weight.roll(1, dims=0) * (next_logit / dim))


def _build(make: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """make() with seeded random weights, built on the device (float32: the caller casts)."""
    torch.manual_seed(0)
    with device:
        return make()


# ---- frozen-KV MTP: the worker of examples/mtp_frozen_kv.py ----


def mtp_hand_fold(model, bonus_tokens, hidden_states, keys, values, seq_lens, steps: int = STEPS):
    """The MTP draft edited by hand: the setup once (position seq_lens - 1, the mask), seed and steps in
    one loop, argmax and the max probability instead of softmax + topk(1). Same outputs as the worker's."""
    cos, sin = model.rope(seq_lens - 1)
    kv_mask = torch.arange(keys.shape[2], device=keys.device)[None, :] < seq_lens[:, None]
    token, hidden, tokens, probs = bonus_tokens, hidden_states, [], []
    for _ in range(steps + 1):
        hidden, logits = model(token, hidden, cos, sin, keys, values, kv_mask)
        index, prob = _argmax_and_prob(logits)
        token = index[:, 0]
        tokens.append(token)
        probs.append(prob[:, 0])
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


def build_mtp(size: str, batch: int, device: torch.device, dtype: torch.dtype) -> Workload:
    mtp_size = mtp_frozen_kv.SIZES[size]
    model = _build(lambda: mtp_frozen_kv.MTPDrafter(mtp_size), device)
    _favour_next_token(model.embed, model.lm_head, math.log(mtp_size.vocab))  # unsaturated probabilities
    model = model.to(dtype).requires_grad_(False)
    inputs = mtp_frozen_kv.make_inputs(mtp_size, batch, device, dtype)
    bonus_tokens, hidden_states, _, _, seq_lens = inputs
    worker = mtp_frozen_kv.FrozenKVMTPWorker(model, batch)

    def server_layout() -> Callable[[], Outputs]:
        # A new worker holds a new torch.compile of its steps: a fresh compile on its first draft.
        layout = mtp_frozen_kv.FrozenKVMTPWorker(model, batch).draft_server_layout
        return lambda: _as_tuple(layout(*inputs))

    def folded() -> Callable[[], Outputs]:
        draft = fold(worker.seed_step, worker.draft_steps, value_ranges={"seq_lens": (1, None)})
        return lambda: _as_tuple(draft(*inputs))

    return Workload(
        vocab=mtp_size.vocab,
        variants={
            "eager": _eager(lambda: worker.draft_steps(*worker.seed_step(*inputs))),
            "eager_seed+captured_loop": server_layout,
            "hand_fold+hand_argmax": _compiled(mtp_hand_fold, model, *inputs, steps=mtp_size.steps),
            # Per call: bonus tokens, hidden states, sequence lengths; the target's KV cache stays put.
            "raw_cuda_graph": _raw_cuda_graph(mtp_hand_fold, (model, *inputs), (1, 2, 5), steps=mtp_size.steps),
            "draftfuse": folded,
        },
        vary=_vary(
            (bonus_tokens, _other_tokens(bonus_tokens, mtp_size.vocab)),
            (hidden_states, -hidden_states),
            (seq_lens, seq_lens - 1),
        ),
    )


# ---- EAGLE-style chain: examples/eagle_head.py's head and draft_chain ----


def eagle_seed(head, token, hidden, pos):
    """The server layout's eager seed: iteration 0 of draft_chain, softmax + topk(1) as written there."""
    cache_len = head.layer.attn.k_cache.shape[2]
    logits, hidden = head(token, hidden, pos, pos, causal_mask(cache_len, pos))
    _, token = torch.softmax(logits[:, -1].float(), dim=-1).topk(1, dim=-1)
    return token, hidden


def eagle_steps(head, token, hidden, pos, steps: int = STEPS):
    """The server layout's captured steps: iterations 1..steps of draft_chain, fed by the seed."""
    cache_len = head.layer.attn.k_cache.shape[2]
    tokens = [token]
    for _ in range(steps):
        pos = pos + 1
        logits, hidden = head(token, hidden, pos, pos, causal_mask(cache_len, pos))
        _, token = torch.softmax(logits[:, -1].float(), dim=-1).topk(1, dim=-1)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


def eagle_hand_fold(head, token, hidden, pos, steps: int = STEPS):
    """draft_chain edited by hand: argmax instead of softmax + topk(1)."""
    cache_len = head.layer.attn.k_cache.shape[2]
    tokens = []
    for _ in range(steps + 1):
        logits, hidden = head(token, hidden, pos, pos, causal_mask(cache_len, pos))
        token = logits[:, -1].float().argmax(-1, keepdim=True)
        tokens.append(token)
        pos = pos + 1
    return torch.cat(tokens, dim=1)


def build_eagle(size: str, batch: int, device: torch.device, dtype: torch.dtype) -> Workload:
    cfg = LAYER_SIZES[size]
    head = _build(lambda: eagle_head.EagleHead(cfg, batch), device)
    with torch.no_grad():
        _favour_next_token(head.embed, head.lm_head)
        head.fc.weight.mul_(0.1)[:, : cfg.dim] += torch.eye(cfg.dim, device=device)  # x ~ the token's embedding
    head = head.to(dtype).requires_grad_(False)
    generator = torch.Generator(device).manual_seed(0)
    token = torch.randint(cfg.vocab, (batch, 1), device=device, generator=generator)
    hidden = torch.randn(batch, 1, cfg.dim, device=device, generator=generator).to(dtype)
    pos = torch.tensor([cfg.cache_len // 2], device=device)  # half the head's cache is the prefix

    def server_layout() -> Callable[[], Outputs]:
        compiled_steps = torch.compile(eagle_steps, mode=MODE, fullgraph=True, dynamic=False)
        return lambda: _cloned(compiled_steps(head, *eagle_seed(head, token, hidden, pos), pos))

    return Workload(
        vocab=cfg.vocab,
        variants={
            "eager": _eager(eagle_head.draft_chain, head, token, hidden, pos, steps=STEPS),
            "eager_seed+captured_loop": server_layout,
            "hand_fold+hand_argmax": _compiled(eagle_hand_fold, head, token, hidden, pos),
            "raw_cuda_graph": _raw_cuda_graph(eagle_hand_fold, (head, token, hidden, pos), (1, 2, 3)),
            "draftfuse": _draftfuse(eagle_head.draft_chain, head, token, hidden, pos, steps=STEPS),
        },
        vary=_vary((token, _other_tokens(token, cfg.vocab)), (hidden, -hidden), (pos, pos - 1)),
    )


# ---- independent draft model: examples/draft_model.py's model and draft ----


def draft_model_seed(model, token, pos, temperature: float = TEMPERATURE):
    """The server layout's eager seed: iteration 0 of draft_model.draft."""
    logits = model(token, pos)
    prob, token = torch.softmax(logits[:, -1].float() / temperature, dim=-1).topk(1, dim=-1)
    return token, prob


def draft_model_steps(model, token, prob, pos, steps: int = STEPS, temperature: float = TEMPERATURE):
    """The server layout's captured steps: iterations 1..steps of draft_model.draft, fed by the seed."""
    tokens, token_probs = [token], [prob]
    for _ in range(steps):
        pos = pos + 1
        logits = model(token, pos)
        prob, token = torch.softmax(logits[:, -1].float() / temperature, dim=-1).topk(1, dim=-1)
        tokens.append(token)
        token_probs.append(prob)
    return torch.cat(tokens, dim=1), torch.cat(token_probs, dim=1)


def draft_model_hand_fold(model, token, pos, steps: int = STEPS, temperature: float = TEMPERATURE):
    """draft_model.draft edited by hand: argmax and the max probability at the temperature."""
    tokens, token_probs = [], []
    for _ in range(steps + 1):
        logits = model(token, pos)
        token, prob = _argmax_and_prob(logits[:, -1].float() / temperature)
        tokens.append(token)
        token_probs.append(prob)
        pos = pos + 1
    return torch.cat(tokens, dim=1), torch.cat(token_probs, dim=1)


def build_draft_model(size: str, batch: int, device: torch.device, dtype: torch.dtype) -> Workload:
    cfg = LAYER_SIZES[size]
    model = _build(lambda: draft_model.DraftModel(cfg, batch), device)
    _favour_next_token(model.embed, model.lm_head, TEMPERATURE * math.log(cfg.vocab))  # unsaturated probabilities
    model = model.to(dtype).requires_grad_(False)
    generator = torch.Generator(device).manual_seed(0)
    token = torch.randint(cfg.vocab, (batch, 1), device=device, generator=generator)
    pos = torch.tensor([cfg.cache_len // 2], device=device)

    def server_layout() -> Callable[[], Outputs]:
        compiled_steps = torch.compile(draft_model_steps, mode=MODE, fullgraph=True, dynamic=False)
        return lambda: _cloned(compiled_steps(model, *draft_model_seed(model, token, pos), pos))

    return Workload(
        vocab=cfg.vocab,
        variants={
            "eager": _eager(draft_model.draft, model, token, pos, steps=STEPS, temperature=TEMPERATURE),
            "eager_seed+captured_loop": server_layout,
            "hand_fold+hand_argmax": _compiled(draft_model_hand_fold, model, token, pos),
            "raw_cuda_graph": _raw_cuda_graph(draft_model_hand_fold, (model, token, pos), (1, 2)),
            "draftfuse": _draftfuse(draft_model.draft, model, token, pos, steps=STEPS, temperature=TEMPERATURE),
        },
        vary=_vary((token, _other_tokens(token, cfg.vocab)), (pos, pos - 1)),
    )


WORKLOADS: dict[str, Callable[[str, int, torch.device, torch.dtype], Workload]] = {
    "mtp": build_mtp,
    "eagle": build_eagle,
    "draft_model": build_draft_model,
}
