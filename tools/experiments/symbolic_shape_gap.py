"""How much slower each CPU kernel of a spec runs as shipped (symbolic B, H, T, ...)
than the same default schedule compiled for the tuning shape (what `swa-tvm tune`
measures), and what the batch-predicate pass (schedules.cpu.drop_fused_bound_predicates)
is worth: all three timed with TVM's time_evaluator on the same inputs at the tuning
shape, rounds alternated, medians. A gap here is speed the tuner cannot see.

    TVM_NUM_THREADS=2 python -m tools.experiments.symbolic_shape_gap
    TVM_NUM_THREADS=2 python -m tools.experiments.symbolic_shape_gap --spec head_dim=64,window=511:0,globals,backward

Set TVM_NUM_THREADS (TVM's own pool default is half the logical CPUs on x86)."""

import argparse
import statistics

import numpy as np
import tvm
from tvm import s_tir
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from swa_tvm.compiler import build
from swa_tvm.compiler import targets
from swa_tvm.compiler import records
from swa_tvm.tuning import tune
from swa_tvm.compute import prim_func
from swa_tvm.schedules import cpu as cpu_schedules
from swa_tvm.spec import CPU_ONLY_KINDS, AttentionSpec


def compiled(spec, shapes, target, lanes, drop_predicates: bool):
    sch = s_tir.Schedule(tvm.IRModule({spec.name: prim_func(spec, shapes, target_kind="llvm")}))
    sch.work_on(spec.name)
    cpu_schedules.schedule(sch, spec, vector_lanes=lanes)
    func = sch.mod[spec.name]
    if drop_predicates:
        func = build._postprocess(spec, "llvm", func)  # what export does after scheduling
    elif spec.kind == "local":
        func = cpu_schedules.skip_dead_keys(func, spec)  # the same, less the predicate pass
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default="head_dim=64,window=511:0,backward")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    target = tvm.target.Target(targets.host_target())
    lanes = targets._vector_lanes(target)
    dev = tvm.cpu()
    for spec in AttentionSpec.parse(args.spec).kernels():
        if spec.kind in CPU_ONLY_KINDS:  # hand-written: no TE compute to compare
            continue
        shapes = records.tune_shapes(spec)
        variants = {
            "as shipped": compiled(spec, None, target, lanes, True),
            "without the pass": compiled(spec, None, target, lanes, False),
            "tuning shape": compiled(spec, shapes, target, lanes, True),
        }
        # Inputs as the tuner fills them; the kernels take scale where the tuned
        # workload has it folded in.
        infos = [a.as_json() for a in ArgInfo.from_prim_func(records.tuning_workload(spec)["main"])]
        arrays = iter(tune.tuning_inputs(infos))
        params = prim_func(spec, shapes, target_kind="llvm").params
        scale = 1.0 / spec.head_dim**0.5
        call_args = [scale if p.name == "scale" else tvm.runtime.tensor(next(arrays), device=dev) for p in params]
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, lib in variants.items():
                ev = lib.mod.time_evaluator("main", dev, number=1, repeat=5)
                times[name].append(float(np.median(ev(*call_args).results)) * 1e3)
        shape = ", ".join(f"{k}={v}" for k, v in shapes.items())
        row = "  ".join(f"{name} {statistics.median(t):7.2f} ms" for name, t in times.items())
        print(f"{spec.name:45s} ({shape})  {row}")


if __name__ == "__main__":
    main()
