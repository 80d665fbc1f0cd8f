"""Where a KV-cache decode step's time goes outside the kernel: the torch ops of
``attention_with_kv_cache``'s call path (positions, the block plan), profiled with
torch's profiler over one call, and the step's median time, for the benchmark's decode
shape (H=32 over H_kv=8, D=128, a W=4096 layer against a 32K cache).

Run it twice, the second time with ``OMP_WAIT_POLICY=PASSIVE`` set before torch starts,
to see what torch's OpenMP threads spinning after those ops cost the kernel that follows.

    python -m tools.experiments.decode_call_path
    OMP_WAIT_POLICY=PASSIVE python -m tools.experiments.decode_call_path --batch 8 --dtype bfloat16
"""

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import swa_tvm


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--rows", type=int, default=12, help="ops listed, by total time")
    a = ap.parse_args(argv)
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(a.batch, 32, 1, 128, generator=g).to(dt)
    k = torch.randn(a.batch, 8, a.context, 128, generator=g).to(dt)
    v = torch.randn(a.batch, 8, a.context, 128, generator=g).to(dt)

    def step():
        return swa_tvm.attention_with_kv_cache(q, k, v, q_offset=a.context - 1, window_size=(a.window - 1, 0))

    step()
    times = []
    for _ in range(a.runs):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    print(f"B={a.batch} {a.dtype} context {a.context} window {a.window}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}: step median {1e3 * statistics.median(times):.1f} ms, "
          f"min {1e3 * min(times):.1f} ms over {a.runs} runs")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    kernel = sum(e.self_cpu_time_total for e in events if e.key.startswith("swa_tvm::"))
    print(f"profiled step: {total / 1e3:.1f} ms of self CPU time, {kernel / 1e3:.1f} ms in the op itself "
          f"(kernel and launch), {(total - kernel) / 1e3:.1f} ms in torch ops")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: a.rows]:
        print(f"  {e.self_cpu_time_total / 1e3:7.2f} ms  {e.count:3d}x  {e.key:28s} {str(e.input_shapes)[:70]}")


if __name__ == "__main__":
    main()
