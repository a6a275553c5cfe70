"""Tiny drafts modeled on public speculative-decoding code that no one on this team wrote.

Each module reproduces the *patterns* of one public code base (the spellings, dtypes, in-place writes,
index bookkeeping and host reads that its draft loop really uses), written from scratch for these
tests: random seeded weights, small sizes, CPU. The module docstrings name the project, file and
function each piece is modeled on. Nothing here is copied from those projects.

    eagle_tree    SafeAILab/EAGLE  eagle/model/cnets.py  Model.topK_genrate
    sglang_eagle  sgl-project/sglang  srt/speculative/eagle_worker.py (draft, draft_forward),
                  eagle_utils.py / spec_utils.py (fast_topk, select_top_k_tokens, organize_draft_results)
    vllm_sampling vllm-project/vllm  v1/sample/ops/topk_topp_sampler.py (random_sample),
                  v1/spec_decode/eagle.py (compute_probs_and_sample_next_token), v1/sample/sampler.py
    medusa        FasterDecoding/Medusa  medusa/model/medusa_model.py (ResBlock, MedusaModel.medusa_head)
    hf_draft      huggingface/transformers  LlamaForCausalLM / Qwen2ForCausalLM with StaticCache
    vllm_eagle3   vllm-project/vllm  model_executor/models/llama_eagle3.py, v1/spec_decode/eagle.py (propose)
    deepseek_mtp  vllm-project/vllm  model_executor/models/deepseek_mtp.py; sgl-project/sglang deepseek_nextn.py
    hazards       capture hazards seen in the code above (RMSNorm's float eps, servers' batch sizes,
                  a worker method re-assigned under another name)
"""

from __future__ import annotations

import pathlib
from types import ModuleType


def marker_line(module: ModuleType, marker: str) -> str:
    """"file:line" of the statement marked `# <- marker` in `module`'s source file."""
    path = pathlib.Path(module.__file__).resolve()
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# <- {marker}"):
            return f"{path}:{number}"
    raise AssertionError(f"no line marked {marker!r} in {path}")
