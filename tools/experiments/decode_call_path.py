"""Where a KV-cache decode step's time goes: the op's own time against the torch ops of
``attention_with_kv_cache``'s call path (positions, checks, the block plan), from
torch's profiler over ``--profile-steps`` steps (per step), and the step's median time,
for the decode benchmark's shape (``benchmarks.decode``: H=32 over H_kv=8, D=128, a
W=4096 layer against a 32K cache).

Run it twice, the second time with ``OMP_WAIT_POLICY=PASSIVE`` set before torch starts,
to compare torch's OpenMP threads spinning after each op (the default) with sleeping.
TVM's own workers spin after each kernel unless ``TVM_THREAD_POOL_SPIN_COUNT`` is 0
(as ``swa_tvm.integrations.transformers.register()`` sets it); both settings are
printed.

    python -m tools.experiments.decode_call_path
    OMP_WAIT_POLICY=PASSIVE python -m tools.experiments.decode_call_path
    TVM_THREAD_POOL_SPIN_COUNT=0 python -m tools.experiments.decode_call_path --dtype float32 --batch 1
"""

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import swa_tvm
from benchmarks.decode import CONTEXT, D, H, HKV, WINDOW


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--runs", type=int, default=40, help="timed steps")
    ap.add_argument("--profile-steps", type=int, default=10, help="profiled steps, reported per step")
    ap.add_argument("--rows", type=int, default=12, help="ops listed, by total time")
    a = ap.parse_args(argv)
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(a.batch, H, 1, D, generator=g).to(dt)
    k = torch.randn(a.batch, HKV, a.context, D, generator=g).to(dt)
    v = torch.randn(a.batch, HKV, a.context, D, generator=g).to(dt)

    def step():
        return swa_tvm.attention_with_kv_cache(q, k, v, q_offset=a.context - 1, window_size=(a.window - 1, 0))

    step()
    times = []
    for _ in range(a.runs):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    settings = ", ".join(f"{name}={os.environ.get(name, '(unset)')}"
                         for name in ("OMP_WAIT_POLICY", "TVM_THREAD_POOL_SPIN_COUNT"))
    print(f"B={a.batch} {a.dtype} context {a.context} window {a.window}, {settings}, "
          f"{torch.get_num_threads()} torch threads: step median {1e3 * statistics.median(times):.1f} ms, "
          f"min {1e3 * min(times):.1f} ms over {a.runs} runs")
    n = a.profile_steps
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(n):
            step()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events) / n
    own = sum(e.self_cpu_time_total for e in events if e.key.startswith("swa_tvm::")) / n
    calls = sum(e.count for e in events if not e.key.startswith("swa_tvm::")) / n
    print(f"profiled, per step over {n} steps: {total / 1e3:.1f} ms of self CPU time; the op's own time "
          f"outside torch ops (kernel, launch, its Python) {own / 1e3:.1f} ms; torch ops {(total - own) / 1e3:.1f} ms "
          f"over {calls:.0f} profiler events (nested ones counted)")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: a.rows]:
        print(f"  {e.self_cpu_time_total / n / 1e3:7.2f} ms  {e.count / n:4.1f}x  {e.key:28s} {str(e.input_shapes)[:70]}")


if __name__ == "__main__":
    main()
