"""Tune one kernel with MetaSchedule's LocalBuilder, then with swa_tvm's pooled builder
(swa_tvm/tuning/builder.py), and print each run's wall time; then the pooled builder's
worker memory over repeated batches. Usage:

    python -m tools.experiments.compare_builders local     # tune with LocalBuilder
    python -m tools.experiments.compare_builders pooled    # tune with the pooled builder
    python -m tools.experiments.compare_builders memory 8  # 8 batches of 16 builds, worker RSS after each
"""

import sys
import tempfile
import time

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from swa_tvm.compiler import records
from swa_tvm.compiler.targets import _vector_lanes, host_target
from swa_tvm.schedules import cpu
from swa_tvm.spec import AttentionSpec, KernelSpec
from swa_tvm.tuning import tune
from swa_tvm.tuning.builder import PooledBuilder


def tune_with(kind: str) -> None:
    if kind == "local":
        def make_builder(target, cores, shared_library=False):
            b = ms.builder.LocalBuilder(max_workers=cores, timeout_sec=300, initializer=records.preload_tensor_intrin)
            b.close = lambda: None
            return b

        tune.make_builder = make_builder
    specs = AttentionSpec.parse("head_dim=64,window=511:0").kernels()
    d = tempfile.mkdtemp()
    t = time.time()
    r = tune.tune(specs, host_target(), 32, d + "/logs", d + "/work", num_trials_per_iter=16, seed=0, progress=False)
    print(kind, "wall", round(time.time() - t, 1), "s", [(x.trials, x.records, x.best_gflops) for x in r], flush=True)


def worker_rss_mib() -> list[int]:
    """Resident memory of this process's builder workers (TVM's popen_worker children)."""
    import psutil

    out = []
    for child in psutil.Process().children():
        try:
            if any("popen_worker" in arg for arg in child.cmdline()):
                out.append(child.memory_info().rss // 2**20)
        except psutil.NoSuchProcess:
            pass
    return sorted(out)


def memory(batches: int) -> None:
    spec = KernelSpec("local", 64, "float32", 255, 0)
    target = tvm.target.Target(host_target())
    mods = []
    for seed in range(1, 17):
        sch = s_tir.Schedule(records.tuning_workload(spec), seed=seed)
        cpu.schedule(sch, spec, _vector_lanes(target), cpu.Sampled())
        mods.append(sch.mod)
    builder = PooledBuilder(max_workers=2, timeout_sec=300, max_uses=10**6)  # no recycling
    t = time.time()
    try:
        for i in range(batches):
            res = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
            assert all(r.error_msg is None for r in res)
            print(i, f"{time.time() - t:.0f}s", "worker RSS MiB", worker_rss_mib(), flush=True)
    finally:
        builder.close()


if __name__ == "__main__":
    if sys.argv[1] == "memory":
        memory(int(sys.argv[2]))
    else:
        tune_with(sys.argv[1])
