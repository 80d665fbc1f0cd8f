"""The machine code of the CUDA kernels, read without a GPU: each kernel's registers and
spills, and the instruction mix of its hot loop (the loop holding the most tensor-core
products), from the cubin nvcc makes of the generated source (``cuda_pack``'s command)
disassembled by nvdisasm (pip: nvidia-cuda-nvdisasm).

    python -m tools.sass --spec head_dim=128,window=4095:0,dtype=bfloat16,backward
    python -m tools.sass --spec head_dim=128,window=4095:0,dtype=bfloat16 --forward-tiles 4,32,1,1,2
    python -m tools.sass --spec head_dim=128,window=4095:0,dtype=bfloat16,backward --backward-tiles 4,32,1,0,2

Why: the H200 profile (bench/gpu/ncu_details_*.txt) found the forward issue-bound, one
mma per eleven other instructions, most of them integer index work. What a kernel asks
of the instruction issue is fixed by its machine code, so the static count of the hot
loop's instructions per mma is a measure this machine can take between GPU runs (the
times themselves need the GPU). Static: each instruction counted once, branches both
ways (a loop's masked and unmasked paths both count).
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import tvm

from swa_tvm.compiler.build import schedule_spec
from swa_tvm.compiler.cuda_pack import nvcc_compile, ptxas_resources
from swa_tvm.schedules import cuda_flash_bwd_tc, cuda_flash_tc
from swa_tvm.spec import CPU_ONLY_KINDS, AttentionSpec
from tools.cuda_races import generated_source

# A tensor-core product: HMMA on sm_80/sm_90 (mma.sync m16n8k16), HGMMA on sm_90a (wgmma
# m64nNk16, which each of the warpgroup's 4 warps issues: a warp's share, 16 rows, is the
# work of N/8 of them; the counts are in those units, per warp as the code is).
MMA = "HMMA"
GMMA = "HGMMA"
GMMA_SHAPE = re.compile(r"HGMMA\.64x(\d+)x16")


def mma_units(op: str, line: str) -> float:
    """A warp's m16n8k16 products in one instruction: 1 per HMMA, N/8 per HGMMA.64xNx16."""
    if op == MMA:
        return 1
    if op == GMMA:
        m = GMMA_SHAPE.search(line)
        return int(m.group(1)) // 8 if m else 0
    return 0


def nvdisasm() -> str | None:
    """The nvdisasm binary: on PATH, else the nvidia-cuda-nvdisasm wheel's; None if neither."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))):
            if os.access(path, os.X_OK):
                return path
    return None


def disassemble(cubin: bytes) -> str:
    tool = nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or put CUDA's bin on PATH)")
    with tempfile.TemporaryDirectory(prefix="swa_tvm_sass_") as tmp:
        path = os.path.join(tmp, "kernels.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout


SECTION = re.compile(r"^//-+ \.text\.(\w+) +-+$", re.M)  # short names are padded
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
# A branch that may fall through: predicated (@P0 BRA, @!P0 BRA !P1, ...).
CONDITIONAL = re.compile(r"@!?U?P\w+\s+BRA|BRA\S*\s+!?U?P\d")


def kernel_instructions(sass: str) -> dict[str, list[tuple[str, str]]]:
    """{kernel: [(opcode without modifiers, line)]} and each kernel's labels, in order."""
    parts = SECTION.split(sass)
    kernels = {}
    for name, text in zip(parts[1::2], parts[2::2]):
        insts, labels = [], {}
        for line in text.splitlines():
            m = LABEL.match(line)
            if m:
                labels[m.group(1)] = len(insts)
                continue
            m = INSTRUCTION.match(line)
            if m:
                insts.append((m.group(1).split(".")[0], line))
        kernels[name] = (insts, labels)
    return kernels


def hot_loop(insts, labels) -> tuple[int, int]:
    """[start, end) of the innermost loop (a backward branch's range holding no other)
    with the most tensor-core work (``mma_units``), the first of equals (the band loop, before the extra keys' loop);
    the whole kernel when no loop holds one. Innermost: nvcc's layout also makes
    branches back across two loops, whose range would count both."""
    loops = []
    for i, (op, line) in enumerate(insts):
        m = BRANCH_TARGET.search(line) if op == "BRA" else None
        if m and labels.get(m.group(1), i + 1) <= i:
            loops.append((labels[m.group(1)], i + 1))
    inner = [a for a in loops if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in loops)]
    best, best_count = (0, len(insts)), 0
    for start, end in inner:
        count = sum(mma_units(o, line) for o, line in insts[start:end])
        if count > best_count:
            best, best_count = (start, end), count
    return best


def shortest_pass(insts, labels, start: int, end: int) -> tuple[int, float]:
    """(instructions, mma units) of the shortest way through the loop [start, end), from
    its first instruction to its back branch, that issues the most products: each
    forward branch inside taken or not as is shorter, unless skipping it would skip
    products. A chunk that skips every step it can (the masked chunks' mask, the
    outputs' rescale; but also, with cp.async, the next chunk's copies, which all but
    the last chunk issue), and every chunk of a loop that holds two (TCConfig.stages =
    2, whose second is conditional for odd counts). A lower bound of the dynamic count;
    the static count (``loop_instructions``) counts both ways of every branch."""

    def better(a, b):  # more products, then fewer instructions; None: not reached
        if a is None or b is None:
            return a or b
        return a if (-a[1], a[0]) < (-b[1], b[0]) else b

    best: list = [None] * (end - start + 1)
    best[0] = (0, 0.0)
    for i in range(start, end):
        if best[i - start] is None:
            continue
        n, mma = best[i - start]
        op, line = insts[i]
        here = (n + 1, mma + mma_units(op, line))
        if i == end - 1:  # the back branch: one pass done
            best[-1] = better(best[-1], here)
            break
        m = BRANCH_TARGET.search(line) if op == "BRA" else None
        target = labels.get(m.group(1)) if m else None
        if target is not None and i < target < end:
            best[target - start] = better(best[target - start], here)
        if target is None or CONDITIONAL.search(line):  # falls through too
            best[i + 1 - start] = better(best[i + 1 - start], here)
    if best[-1] is None:
        return end - start, 0.0
    n, mma = best[-1]
    return int(n), mma


def summarize(insts, labels) -> dict:
    """Instruction counts of a kernel and of its hot loop (per mma, and the top opcodes),
    and of the loop's shortest pass (``shortest_pass``)."""
    start, end = hot_loop(insts, labels)
    loop = collections.Counter(op for op, _ in insts[start:end])
    mma, n = sum(mma_units(op, line) for op, line in insts[start:end]), sum(loop.values())
    short, short_mma = shortest_pass(insts, labels, start, end)
    return {
        "instructions": len(insts),
        "loop_instructions": n,
        "loop_mma": mma,  # in m16n8k16 products (an HGMMA counts its share)
        "loop_per_mma": round(n / mma, 2) if mma else None,
        "loop_opcodes": dict(loop.most_common(12)),
        "shortest_pass": short,
        "shortest_pass_per_mma": round(short / short_mma, 2) if short_mma else None,
    }


def analyze(funcs: dict, arch: str = "sm_90") -> dict[str, dict]:
    """{kernel: ptxas's registers/spills + ``summarize``} for PrimFuncs ``funcs`` ({name:
    func}) built for ``arch``."""
    return analyze_source(generated_source(funcs, arch), arch)


def analyze_source(code: str, arch: str = "sm_90") -> dict[str, dict]:
    """``analyze`` of CUDA source TVM generated (``build.cuda_source`` of a compiled
    module: lowering it again would cost what its first lowering did)."""
    cubin, report = nvcc_compile(code, arch, "cubin")
    return analyze_cubin(cubin, ptxas_resources(report))


def analyze_cubin(cubin: bytes, resources: dict) -> dict[str, dict]:
    """``analyze`` of machine code already compiled (``cuda_pack.fatbin_cubin`` of an
    exported library's fatbin) with ptxas's report of it (``export_module``'s)."""
    return {
        name: {**resources.get(name, {}), **summarize(*parts)}
        for name, parts in kernel_instructions(disassemble(cubin)).items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.sass", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", action="append", required=True, help="an AttentionSpec (as swa-tvm export takes); repeatable")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--forward-tiles", help="the tensor-core forward's TCConfig fields instead of its default, e.g. 4,32,1,1,2 "
                   "(4,64,1,0,1,1: wgmma, with --arch sm_90a; 4,64,1,0,1,1,0,none,1: overlapped; "
                   "4,64,1,1,1,0,0,none,0,2: two K/V stages; none: the field's None)")
    p.add_argument("--backward-tiles", help="the tensor-core gradient kernels' TCBwdConfig fields, e.g. 4,32 "
                   "(4,32,1,1: wgmma, with --arch sm_90a; 4,32,1,0,2: two chunk stages)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)

    def fields(text):
        return (None if x == "none" else int(x) for x in text.split(","))

    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    funcs = {}
    for text in args.spec:
        for k in AttentionSpec.parse(text).kernels():
            if k.kind in CPU_ONLY_KINDS:  # the five-product CPU backward: no CUDA build
                continue
            if args.forward_tiles and cuda_flash_tc.supports(k):
                funcs[k.name] = cuda_flash_tc.flash_tc(k, cuda_flash_tc.TCConfig(*fields(args.forward_tiles)))
            elif args.backward_tiles and cuda_flash_bwd_tc.supports(k):
                funcs[k.name] = cuda_flash_bwd_tc.flash_bwd_tc(k, cuda_flash_bwd_tc.TCBwdConfig(*fields(args.backward_tiles)))
            else:
                funcs[k.name] = schedule_spec(k, target)
    result = analyze(funcs, args.arch)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for name, r in result.items():
        print(f"{name}: {r.get('registers')} registers, {r.get('spill_stores', 0)} bytes spilled; "
              f"hot loop {r['loop_instructions']} instructions, {r['loop_mma']} mma, {r['loop_per_mma']} per mma; "
              f"shortest pass {r['shortest_pass']}, {r['shortest_pass_per_mma']} per mma")
        print("    " + ", ".join(f"{op} {n}" for op, n in r["loop_opcodes"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
