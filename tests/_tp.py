"""Multi-process (gloo) checks of the vocab-parallel rewrite, spawned from pytest.

`run_world(world, names)` starts `world` processes once; each runs every named case and writes what
it found to a file; the parent reads them back (one spawn for many cases: starting a process group
costs seconds on a small CPU). A case gathers vocabulary shards of logits that every rank builds
from one seed, selects, and compares with the same selection on the full logits in one process:
tokens exactly, probabilities to float32 rounding, plus that the pass rewrote (or refused) it.

Logits kinds: "random" (float32, no ties), "special" (rows with ties across and within shards, NaN,
+inf, a shard of -inf, a row of -inf; k = 1, where the rule is torch.argmax's: the first maximum, NaN
first), "ties" (small integers: ties everywhere; compared with a stable sort, the kernels' rule).
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

B, S = 7, 16  # rows, vocabulary entries per rank


# ---- reassembly forms: this rank's shard -> the full logits, as servers write it ----


def _world() -> int:
    return dist.get_world_size()


def gather_dim(x):
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_gather_tensor(x, -1, dist.group.WORLD)


def chunk_cat(x):
    from torch.distributed import _functional_collectives as funcol

    stacked = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    return torch.cat(torch.chunk(stacked, _world(), dim=0), dim=-1)


def view_permute(x):
    from torch.distributed import _functional_collectives as funcol

    stacked = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    return stacked.view(_world(), *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


def into_buffer(x):
    out = torch.empty(_world() * x.shape[0], *x.shape[1:], dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)
    return out.view(_world(), *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


def dtensor_full(x):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(x, _mesh(), [Shard(-1)]).full_tensor()


def dtensor_redistribute(x):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(x, _mesh(), [Shard(x.dim() - 1)]).redistribute(_mesh(), [Replicate()]).to_local()


_MESH: list = []


def _mesh():
    if not _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH.append(init_device_mesh("cpu", (_world(),)))
    return _MESH[0]


FORMS: dict[str, Callable] = {f.__name__: f for f in (gather_dim, chunk_cat, view_permute, into_buffer, dtensor_full, dtensor_redistribute)}


# ---- selections: full logits -> what the draft returns ----

SELECTIONS: dict[str, Callable] = {
    "topk4": lambda full: torch.softmax(full.float(), dim=-1).topk(4, dim=-1),
    "argmax": lambda full: torch.argmax(torch.softmax(full, dim=-1), dim=-1),
    "max_temperature": lambda full: torch.softmax(full.float() / 0.7, dim=-1).max(dim=-1),
    "log_topk3_temperature": lambda full: torch.log_softmax(full.float() / 0.7, dim=-1).topk(3, dim=-1),
    "topk1_dtype": lambda full: F.softmax(full, dim=-1, dtype=torch.float32).topk(1, dim=-1),
    "last_row_topk2": lambda full: torch.softmax(full[:, -1].float(), dim=-1).topk(2, dim=-1),
    "padded_topk2": lambda full: torch.softmax(full[..., : full.shape[-1] - 3], dim=-1).topk(2, dim=-1),
    "padded_argmax": lambda full: torch.softmax(full[..., : full.shape[-1] - 3].float(), dim=-1).max(dim=-1, keepdim=True),
    # bare selections of the gathered logits, no softmax (vLLM's greedy draft: logits.argmax(dim=-1))
    "bare_argmax": lambda full: full.argmax(dim=-1),
    "bare_topk4_scaled": lambda full: (full.float() * -0.5).topk(4, dim=-1),
    "bare_padded_max": lambda full: full[..., : full.shape[-1] - 3].max(dim=-1),
    "bare_padded_negated_topk2": lambda full: (full[..., : full.shape[-1] - 3] * -1.0).topk(2, dim=-1),
    "bare_fp8_argmax": lambda full: full.to(torch.float8_e4m3fn).float().argmax(dim=-1),  # ties everywhere
}


def logits(kind: str, world: int, rows: int = B, dtype: torch.dtype = torch.float32, three_d: bool = False) -> torch.Tensor:
    vocab = world * S
    generator = torch.Generator().manual_seed(1234 + world)
    if kind == "ties":
        full = torch.randint(0, 4, (rows, vocab), generator=generator).float()
    else:
        full = torch.randn(rows, vocab, generator=generator)
    if kind == "special":
        last = vocab - S
        full[0, 3] = full[0, last + 5] = full[0].max() + 1  # a tie across shards: the lower id wins
        full[1, 2] = full[1, 9] = full[1].max() + 1  # a tie within a shard
        full[2, S + 1] = float("nan")
        full[3, last + 2] = float("inf")
        full[4, :S] = float("-inf")  # rank 0 holds nothing above -inf
        full[5] = float("-inf")
    full = full.to(dtype)
    return full.view(rows, 1, vocab).expand(rows, 2, vocab).contiguous() if three_d else full


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def compare(got, want, kind: str, full: torch.Tensor, k: int) -> str:
    """'' when they agree (see the module docstring), else what differs."""
    got, want = _leaves(got), _leaves(want)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for g, w in zip(got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"shape/dtype {tuple(g.shape)} {g.dtype} != {tuple(w.shape)} {w.dtype}"
        if not g.dtype.is_floating_point:
            if kind == "special":  # the rule: torch.argmax of the logits
                w = torch.argmax(full.float(), dim=-1).view(w.shape) if k == 1 else w
            if kind == "ties":  # the rule: a stable sort, lower ids first among equals
                w = torch.sort(full.float(), dim=-1, descending=True, stable=True).indices[..., :k].reshape(w.shape)
            if not torch.equal(g, w):
                return f"tokens differ:\n{g}\n{w}"
        elif not torch.allclose(g.float(), w.float(), rtol=2e-5, atol=1e-6, equal_nan=True):
            return f"values differ by {(g.float() - w.float()).abs().nan_to_num(0).max().item():.3g}:\n{g}\n{w}"
    return ""


# ---- running one draft at one level ----


def run_level(fn: Callable, args: tuple, level: str, options: dict) -> tuple[Any, list]:
    """fn compiled with draftfuse's vocab_parallel pass only, at one level, run eagerly:
    "dynamo" (the Dynamo graph after the pass), "aten" (the post-grad graph after it, the Dynamo pass
    skipped), "inductor" (the whole pipeline through draft_loop: Inductor on the CPU)."""
    from draftfuse.options import Options
    from draftfuse.runtime.draft_loop import draft_loop
    from draftfuse.runtime.tracing import own_code
    from draftfuse.runtime.pipeline import prepare
    from draftfuse.testing import _post_grad

    if level == "inductor":
        draft = draft_loop(fn, options=options)
        out = draft(*args)
        return out, [r for record in draft.compiles for r in record.reports]
    parsed = Options.parse(None, {"softmax_topk": False, "seed_fold": False, **options})
    reports: list = []

    def backend(gm, example_inputs):
        if level == "dynamo":
            prepared = prepare(gm, parsed)
            reports.extend(prepared.reports)
            return prepared.graph_module.forward
        found = {"reports": reports}
        return _post_grad(gm, example_inputs, parsed, found)

    with torch.no_grad():
        out = torch.compile(own_code(fn), backend=backend, fullgraph=True)(*args)
    return out, reports


def aten_graphs(fn: Callable, *args: Any, **options: Any) -> tuple[str, str, Any]:
    """The post-grad ATen graph of fn(*args) (Dynamo's graph left as traced, AOT autograd with
    Inductor's decompositions and joint-graph passes, as draftfuse.testing builds it) before and after
    the post-grad vocab_parallel pass, and its report."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.decomposition import select_decomp_table

    from draftfuse.options import Options
    from draftfuse.passes.vocab_parallel import post_grad_pass
    from draftfuse.runtime.tracing import own_code
    from draftfuse.testing import graph_text

    found: dict[str, Any] = {}

    def forward_compiler(gm, inputs):
        gm = _recursive_joint_graph_passes(gm)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        found["before"] = graph_text(gm)
        found["report"] = post_grad_pass(gm.graph, Options.parse(None, options))
        gm.recompile()
        found["after"] = graph_text(gm)
        return gm.forward

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler, decompositions=select_decomp_table())

    with torch.no_grad():
        torch.compile(own_code(fn), backend=backend, fullgraph=True)(*args)
    return found["before"], found["after"], found["report"]


CaseSpec = tuple[str, str, str, str, dict]  # form, selection, logits kind, level, options


def case_specs() -> dict[str, CaseSpec]:
    specs = {
        "gather_dim-topk4": ("gather_dim", "topk4", "random", "dynamo", {}),
        "gather_dim-topk4-aten": ("gather_dim", "topk4", "random", "aten", {}),
        "chunk_cat-argmax-special": ("chunk_cat", "argmax", "special", "dynamo", {}),
        "chunk_cat-argmax-special-aten": ("chunk_cat", "argmax", "special", "aten", {}),
        "view_permute-log_topk3_temperature": ("view_permute", "log_topk3_temperature", "random", "dynamo", {}),
        "view_permute-log_topk3_temperature-aten": ("view_permute", "log_topk3_temperature", "random", "aten", {}),
        "into_buffer-max_temperature-special": ("into_buffer", "max_temperature", "special", "dynamo", {}),
        "into_buffer-max_temperature-aten": ("into_buffer", "max_temperature", "random", "aten", {}),
        "dtensor_full-topk4": ("dtensor_full", "topk4", "random", "dynamo", {}),
        "dtensor_full-topk4-aten": ("dtensor_full", "topk4", "random", "aten", {}),
        "dtensor_redistribute-argmax-special": ("dtensor_redistribute", "argmax", "special", "dynamo", {}),
        "gather_dim-last_row_topk2": ("gather_dim", "last_row_topk2", "random3d", "dynamo", {}),
        "gather_dim-last_row_topk2-aten": ("gather_dim", "last_row_topk2", "random3d", "aten", {}),
        "chunk_cat-padded_topk2": ("chunk_cat", "padded_topk2", "padded", "dynamo", {}),
        "gather_dim-padded_argmax-aten": ("gather_dim", "padded_argmax", "padded", "aten", {}),
        "gather_dim-topk1_dtype-bf16-special": ("gather_dim", "topk1_dtype", "special_bf16", "dynamo", {}),
        "gather_dim-topk1_dtype-probs_ones": ("gather_dim", "topk1_dtype", "random", "dynamo", {"probs": "ones"}),
        "gather_dim-topk4-kernels-ties": ("gather_dim", "topk4", "ties", "dynamo", {"lowering": "kernels"}),
        "chunk_cat-argmax-kernels-special-aten": ("chunk_cat", "argmax", "special", "aten", {"lowering": "kernels"}),
        "gather_dim-bare_argmax-special": ("gather_dim", "bare_argmax", "special", "dynamo", {}),
        "chunk_cat-bare_argmax-special_bf16-aten": ("chunk_cat", "bare_argmax", "special_bf16", "aten", {}),
        "view_permute-bare_topk4_scaled": ("view_permute", "bare_topk4_scaled", "random", "dynamo", {}),
        "dtensor_full-bare_topk4_scaled-aten": ("dtensor_full", "bare_topk4_scaled", "random", "aten", {}),
        "gather_dim-bare_padded_max-aten": ("gather_dim", "bare_padded_max", "padded", "aten", {}),
        "chunk_cat-bare_padded_negated_topk2": ("chunk_cat", "bare_padded_negated_topk2", "padded", "dynamo", {}),
        "gather_dim-bare_fp8_argmax": ("gather_dim", "bare_fp8_argmax", "random", "dynamo", {}),
    }
    return specs


def run_case(name: str, spec: CaseSpec) -> str:
    """'' when the case passes on this rank, else why not."""
    form, selection, kind, level, options = spec
    world, rank = dist.get_world_size(), dist.get_rank()
    base = {"special_bf16": "special", "random3d": "random", "padded": "random"}.get(kind, kind)
    dtype = torch.bfloat16 if kind == "special_bf16" else torch.float32
    full = logits(base, world, dtype=dtype, three_d=kind == "random3d")
    if kind == "padded":
        full[:, -3:] = 100.0  # the padding's logits would win if it were not masked
    shard = full[..., rank * S : (rank + 1) * S].contiguous()
    select, gather = SELECTIONS[selection], FORMS[form]

    def draft(x):
        return select(gather(x))

    out, reports = run_level(draft, (shard,), level, options)
    rewrites = [r for report in reports if report.pass_name.startswith("vocab_parallel") for r in report.rewrites]
    if len(rewrites) != 1:
        return "expected one vocab_parallel rewrite:\n" + "\n".join(str(r) for r in reports)
    want = select(full)
    if options.get("probs") == "ones":
        want = (torch.ones_like(want[0]), want[1])
    k = _leaves(want)[-1].shape[-1] if selection.startswith(("topk", "log_topk", "last_row", "padded_topk", "bare_topk")) else 1
    reference = full[..., : full.shape[-1] - 3] if kind == "padded" else full
    if kind == "random3d":
        reference = full[:, -1]
    return compare(out, want, base, reference, k)


def _child(rank: int, world: int, init: str, names: list[str], out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    _mesh()  # outside any compiled region: Dynamo cannot trace making a mesh
    torch._inductor.config.fx_graph_cache = False
    specs, results = case_specs(), {}
    try:
        for name in names:
            try:
                results[name] = run_case(name, specs[name]) if name in specs else EXTRA_CASES[name]()
            except Exception:
                results[name] = "raised:\n" + traceback.format_exc()
            torch._dynamo.reset()
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _example(drafts: str) -> str:
    """examples/tp_draft.py on this rank, compiled through draft_loop (Inductor on the CPU), fp32:
    tokens equal to the one-process draft on the full logits, every selection localised."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import tp_draft

    results = tp_draft.run_rank(["--rounds", "0", "--steps", "1", "--drafts", drafts])
    wrong = [f"{name}: tokens differ" for name, r in results.items() if not r["tokens_match"]]
    wrong += [f"{name}: {len(r['rewrites'])} localised selections, expected 2" for name, r in results.items() if len(r["rewrites"]) != 2]
    return "; ".join(wrong)


def _fold() -> str:
    """draftfuse.fold(seed_step, draft_steps) of a TP draft (Inductor on the CPU): one region, every
    gathered selection localised, tokens equal to the one-process draft on the full LM head."""
    import draftfuse

    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(7)
    head, embed = torch.randn(world * S, 8, generator=generator), torch.randn(world * S, 8, generator=generator)
    hidden = torch.randn(B, 8, generator=generator)

    def make(weight, gather):
        def pick(h):
            return torch.softmax(gather(h @ weight.T), dim=-1).topk(1, dim=-1).indices

        def seed_step(h):
            return pick(h), h

        def draft_steps(token, h):
            tokens = [token]
            for _ in range(2):
                h = torch.tanh(h + embed[token.squeeze(-1)])
                tokens.append(token := pick(h))
            return torch.cat(tokens, dim=-1)

        return seed_step, draft_steps

    seed_step, draft_steps = make(head.chunk(world)[rank].contiguous(), gather_dim)
    draft = draftfuse.fold(seed_step, draft_steps)
    got = draft(hidden)
    one_process = make(head, lambda logits: logits)
    want = one_process[1](*one_process[0](hidden))
    rewrites = [r for record in draft.draft.compiles for rep in record.reports if rep.pass_name == "vocab_parallel" for r in rep.rewrites]
    if len(rewrites) != 3:
        return f"{len(rewrites)} localised selections, expected 3"
    return "" if torch.equal(got, want) else f"tokens differ:\n{got}\n{want}"


def _vllm_greedy_eagle() -> str:
    """A greedy EAGLE chain as vLLM's proposer writes it, under draft_loop (Inductor on the CPU): each step
    its LogitsProcessor all-gathers the vocab-parallel head's logits and drops the padding
    ([..., :org_vocab_size]), then takes logits.argmax(dim=-1), no softmax; tokens equal the one-process
    draft on the full head, every step localised."""
    import draftfuse

    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(11)
    vocab = world * S - 3  # the head is padded to tp * S rows
    head, embed = torch.randn(world * S, 8, generator=generator), torch.randn(vocab, 8, generator=generator)
    hidden, token = torch.randn(B, 8, generator=generator), torch.randint(0, vocab, (B,), generator=generator)

    def make(weight, gather):
        def propose(hidden, token):
            tokens = []
            for _ in range(3):
                hidden = torch.tanh(hidden + embed[token])
                logits = gather(hidden @ weight.T)[..., :vocab]
                token = logits.argmax(dim=-1)
                tokens.append(token)
            return torch.stack(tokens, dim=1)

        return propose

    draft = draftfuse.draft_loop(make(head.chunk(world)[rank].contiguous(), gather_dim))
    got, want = draft(hidden, token), make(head, lambda logits: logits)(hidden, token)
    reports = [rep for record in draft.compiles for rep in record.reports if rep.pass_name.startswith("vocab_parallel")]
    rewrites = [r for rep in reports if rep.pass_name == "vocab_parallel" for r in rep.rewrites]
    if len(rewrites) != 3:
        return f"{len(rewrites)} localised selections, expected 3"
    if refusals := [r for rep in reports for r in rep.refusals]:  # the post-grad pass read the merges as selections
        return f"refusals of the rewrite's own merges: {refusals}"
    return "" if torch.equal(got, want) else f"tokens differ:\n{got}\n{want}"


def _dtensor_grad() -> str:
    """Logits that require grad (a draft run without no_grad) gathered by DTensor's full_tensor(), whose
    backward takes each rank's slice of the gradient: the localised gather's backward sums over the ranks,
    and every rank got tp times eager's gradient. Refused now, with the reason; the gradient is eager's."""
    from draftfuse.options import Options
    from draftfuse.runtime.pipeline import prepare
    from draftfuse.runtime.tracing import own_code

    rank, full = dist.get_rank(), logits("random", dist.get_world_size())

    def draft(x):
        return torch.softmax(dtensor_full(x), -1).topk(2, -1)

    def shard():
        return full[:, rank * S : (rank + 1) * S].clone().requires_grad_()

    x = shard()
    draft(x)[0].sum().backward()
    parsed, reports = Options.parse(None, {"softmax_topk": False, "seed_fold": False}), []

    def backend(gm, example_inputs):
        prepared = prepare(gm, parsed)
        reports.extend(prepared.reports)
        return prepared.graph_module.forward

    got = shard()
    values, index = torch.compile(own_code(draft), backend=backend, fullgraph=True)(got)
    values.sum().backward()
    report = "\n".join(str(r) for r in reports)
    if "require grad" not in report:
        return "expected the refusal:\n" + report
    return "" if torch.allclose(got.grad, x.grad) else f"gradient {got.grad} vs eager {x.grad}"


def _dtensor_draft_loop() -> str:
    """A DTensor draft (from_local(...).full_tensor(), or .redistribute(...).to_local()) under draft_loop,
    called with a new shard tensor each time: the DeviceMesh input was taken for a tensor that from_local (an
    unknown call) writes, and mark_static_address raised TypeError on it, so no DTensor draft compiled."""
    import draftfuse

    world, rank, wrong = dist.get_world_size(), dist.get_rank(), []
    for form in (dtensor_full, dtensor_redistribute):
        draft = draftfuse.draft_loop(lambda x, form=form: torch.softmax(form(x), -1).topk(2, -1))
        for call in range(3):
            full = logits("random", world).roll(5 * call, dims=-1)  # other tokens on each call
            got, want = draft(full[:, rank * S : (rank + 1) * S].contiguous()), torch.softmax(full, -1).topk(2, -1)
            if not (torch.equal(got.indices, want.indices) and torch.allclose(got.values, want.values)):
                wrong.append(f"{form.__name__} call {call}: {got.indices.tolist()} vs {want.indices.tolist()}")
        rewrites = [r for record in draft.compiles for rep in record.reports if rep.pass_name == "vocab_parallel" for r in rep.rewrites]
        if len(rewrites) != 1 or len(draft.compiles) != 1:
            wrong.append(f"{form.__name__}: {len(rewrites)} localised selections in {len(draft.compiles)} compiles, expected 1 in 1")
    return "; ".join(wrong)


def _gathered_into_a_list() -> str:
    """Megatron's gather (`dist.all_gather(list, x)`, then cat) was left as it was with no word (0 rewrites,
    0 refusals): it is refused with the reason and the spellings that are localised; tokens are eager's."""
    import draftfuse

    world, rank, full = dist.get_world_size(), dist.get_rank(), logits("random", dist.get_world_size())

    def draft(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        return torch.softmax(torch.cat(parts, dim=-1), -1).topk(2, -1)

    compiled = draftfuse.draft_loop(draft)
    got, want = compiled(full[:, rank * S : (rank + 1) * S].contiguous()), torch.softmax(full, -1).topk(2, -1)
    refusals = [r.reason for record in compiled.compiles for rep in record.reports if rep.pass_name == "vocab_parallel" for r in rep.refusals]
    if not any("gathered into a list of buffers" in reason for reason in refusals):
        return f"expected the list-of-buffers refusal, got {refusals}"
    return "" if torch.equal(got.indices, want.indices) else f"tokens {got.indices.tolist()} vs {want.indices.tolist()}"


def _bare_fuzz() -> str:
    """tests/fuzz/vocab_parallel.py's programs, seeds from DRAFTFUSE_BARE_FUZZ ("start:count", default 0:40)."""
    from tests.fuzz.vocab_parallel import run_seeds

    start, count = map(int, os.environ.get("DRAFTFUSE_BARE_FUZZ", "0:40").split(":"))
    return run_seeds(start, count)


EXTRA_CASES: dict[str, Callable[[], str]] = {
    "bare_fuzz": _bare_fuzz,
    "gathered_into_a_list": _gathered_into_a_list,
    "dtensor_full-grad": _dtensor_grad,
    "dtensor-draft_loop": _dtensor_draft_loop,
    "fold-chain": _fold,
    "vllm_greedy_eagle-draft_loop": _vllm_greedy_eagle,
    "example-draft_loop-chain": lambda: _example("chain"),
    "example-draft_loop-tree": lambda: _example("tree"),
    "example-draft_loop-greedy": lambda: _example("greedy"),
}


def run_world(world: int, names: list[str]) -> dict[str, str]:
    """Run the named cases on `world` gloo ranks; per case '' if every rank passed, else the reasons."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_child, args=(world, init, names, tmp), nprocs=world, join=True)
        per_rank = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    return {name: "\n".join(f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res.get(name)) for name in names}
