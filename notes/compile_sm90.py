"""The selection kernels compiled for an H200 (sm_90) on a machine without a GPU: registers, spills,
16-byte loads, shuffles, and each loop's SASS instructions by opcode, per dtype and scale. No device
time: run it before a GPU call to see what a change does to the code (notes/kernels.md, "Per-lane state
for k = 1", used it so). Needs only Triton: the H200 runs Triton 3.6, whose codegen differs from later
ones (3.9 here gave 16-bit loads and 128 registers for the same source), so compile with 3.6:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python notes/compile_sm90.py [--sass DIR]

Integer arguments get the specialisation a real launch gets (pointers, row stride and chunk divisible
by 16; vocab, splits, scale stride and log not specialised); without it no load is vectorised.
"""

import argparse
import os
import re
import subprocess
import sys
import types
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for name in ("draftfuse", "draftfuse.kernels"):  # the kernels' modules import Triton only: no torch needed
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(REPO, *name.split("."))]
    sys.modules[name] = package
from draftfuse.kernels._triton_argmax import _argmax_kernel  # noqa: E402
from draftfuse.kernels._triton_selection import _selection_kernel  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ARGS = ["logits_ptr", "row_stride", "vocab", "chunk", "splits", "scale_ptr", "scale_stride", "part_ptr",
        "key_ptr", "ws_ptr", "prob_ptr", "index_ptr", "log"]
TYPES = ["*{dt}", "i32", "i32", "i32", "i32", "*fp32", "i32", "*fp32", "*i64", "*i32", "*fp32", "*i64", "i32"]


def compile_sm90(fn, dtype: str, constants: dict, maxnreg: int | None = None) -> tuple[str, str]:
    """(resource usage, SASS) of `fn` for sm_90; `constants` in the kernel's parameter order; `maxnreg` as
    launch_selection's keyword (a register budget, which changes where ptxas puts the loads)."""
    signature = {name: kind.format(dt=dtype) for name, kind in zip(ARGS, TYPES)}
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(ARGS) if n.endswith("ptr") or n in ("row_stride", "chunk")}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs)
    options = {"num_warps": 1, "enable_fp_fusion": False, "launch_pdl": True, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    path = "/tmp/draftfuse_sm90.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    return " ".join(re.findall(r"REG:\d+|STACK:\d+", usage)), sass


def loops(sass: str) -> list[tuple[Counter, list[int]]]:
    """Each loop body (a backward branch to a label): its opcode counts and where in it (the instruction's
    place, from 0) its global loads are. A prefetch issued late in the tile loop hides less of its
    latency: the place moved with code outside the loop once (notes/kernels.md, "Pass 2 in u")."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            ops = [op.group(1) for x in lines[labels[m.group(1)]:i + 1]
                   if (op := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", x))]
            if len(ops) > 1:
                found.append((Counter(ops), [n for n, op in enumerate(ops) if op == "LDG"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", help="write each kernel's SASS into this folder")
    parser.add_argument("--maxnreg", type=int, help="compile with this register budget (launch_selection's maxnreg)")
    args = parser.parse_args()
    print("Triton", triton.__version__)
    for dtype, v in (("bf16", 8), ("fp32", 4)):
        for scaled in (False, True):
            kernels = {"k=1": (_argmax_kernel, dict(BLOCK=512, V=v, HAS_SCALE=scaled, GPU=True, PDL=True, MERGE=256))}
            for k in (4, 16):
                kernels[f"k={k}"] = (_selection_kernel, dict(K=k, BLOCK=512, V=v, CAND=256, HAS_SCALE=scaled, GPU=True,
                                                            PDL=True, SORT=True, MERGE=128, RECORD=32, RESNAP=False))
            for name, (fn, constants) in kernels.items():
                usage, sass = compile_sm90(fn, dtype, constants, args.maxnreg)
                if args.sass:
                    with open(os.path.join(args.sass, f"{name}_{dtype}{'_scaled' * scaled}.sass"), "w") as f:
                        f.write(sass)
                first = loops(sass)[:1]
                hot = ""
                if first:
                    ops, loads = first[0]
                    hot = f"first loop {sum(ops.values())} instructions, LDG at {loads} {dict(ops.most_common(6))}"
                print(f"{name:4} {dtype} {'scaled' if scaled else 'plain ':6} {usage} LDG.128 {sass.count('LDG.E.128')} "
                      f"SHFL {sass.count('SHFL')} | {hot}")


if __name__ == "__main__":
    main()
