"""Seconds TVM takes to compile TE CUDA kernels (schedules/cuda.py) for sm_90, and how
many of them its buffer compaction pass takes: the kernels a library gets where no fused
kernel fits, and every candidate of `swa-tvm tune --target cuda`. No GPU needed.

    python -m tools.experiments.te_cuda_compile_time              # the cases below
    python -m tools.experiments.te_cuda_compile_time --records 3  # and the first 3 committed records

Cases: a sampled point of the search space (the seed-1 point of tests/test_cuda_emulated.py),
and the default schedule of a float32 forward with a window unbounded on the right and
of a bfloat16 dq kernel. ``--records N`` also replays the first N records of
tuning_logs/cuda-sm_90 (the issue's bf16 D=128 causal W=4096 kernel, measured on an
H200) as export would: records are traces, so they keep the grid they were measured with
whatever schedules/cuda.py now does."""

import argparse
import re
import time

import tvm
from tvm import s_tir

from swa_tvm.tuning import tune
from swa_tvm.compiler import records
from swa_tvm.schedules import cpu, cuda
from swa_tvm.spec import KernelSpec

CASES = [
    ("forward f16 D=16 (8, 9), dilation, extras: sampled point, seed 1",
     KernelSpec("local", 16, "float16", 8, 9, max_dilation=2, extras=True), 1),
    ("forward f32 D=32 (5, -1), dilation: default", KernelSpec("local", 32, "float32", 5, -1, max_dilation=2), None),
    ("dq bf16 D=32 (15, 0), dilation, extras: default",
     KernelSpec("local_dq", 32, "bfloat16", 15, 0, max_dilation=2, extras=True), None),
]


def scheduled(spec: KernelSpec, seed):
    if seed is None:
        sch = s_tir.Schedule(tvm.IRModule({"main": tune.prim_func(spec, target_kind="cuda")}))
        cuda.schedule(sch, spec)
        return sch.mod["main"].with_attr("global_symbol", spec.name)
    sch = s_tir.Schedule(records.tuning_workload(spec, target_kind="cuda"), seed=seed)
    cuda.schedule(sch, spec, cpu.Sampled())
    return records.apply_record(spec, sch.trace, "cuda")  # as export replays a record


def committed_records(n: int):
    cuda.register_intrinsics()  # tensor-core records name the bfloat16 wmma intrinsics
    spec = KernelSpec("local", 128, "bfloat16", 4095, 0)
    db = records.open_log("tuning_logs/cuda-sm_90", readonly=True)
    for i, rec in enumerate(db.get_all_tuning_records()[:n]):
        func = records.apply_record(spec, rec.trace, "cuda")
        axes = "".join(sorted(set(re.findall(r'thread="blockIdx\.([xyz])"', func.script()))))
        yield f"committed record {i} (grid axes {axes})", spec, func


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=0, help="also replay the first N committed cuda-sm_90 records")
    args = parser.parse_args()
    records.preload_tensor_intrin()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    kernels = [(label, spec, scheduled(spec, seed)) for label, spec, seed in CASES]
    for label, spec, func in kernels + list(committed_records(args.records)):
        timing = tvm.ir.instrument.PassTimingInstrument()
        with tvm.transform.PassContext(instruments=[timing]):
            t0 = time.perf_counter()
            tvm.compile(tvm.IRModule({spec.name: func}), target=target)
            total = time.perf_counter() - t0
            profile = timing.render()
        compact = sum(float(line.split(":")[1].split("us")[0]) for line in profile.splitlines()
                      if "CompactBufferAllocation" in line and "us" in line) / 1e6
        print(f"{label}: {total:.1f} s, of which CompactBufferAllocation {compact:.1f} s", flush=True)


if __name__ == "__main__":
    main()
