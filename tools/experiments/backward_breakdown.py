"""Where a training step's backward goes: torch's profiler over the backward of
``sliding_window_attention`` (after warm-up steps), self CPU time per op, summed over
``--steps`` steps and divided by them. The gradient kernels show as their custom op
(``swa_tvm::...``); the rest is the eager layer's torch work (row statistics,
conversions, group sums).

    TVM_NUM_THREADS=2 python -m tools.experiments.backward_breakdown
    TVM_NUM_THREADS=2 python -m tools.experiments.backward_breakdown --dtype float32 --T 4096
    TVM_NUM_THREADS=2 python -m tools.experiments.backward_breakdown --dtype float32 --globals 16 --te-gradients
    TVM_NUM_THREADS=2 python -m tools.experiments.backward_breakdown --window 255 0 --dilation 2
    TVM_NUM_THREADS=2 python -m tools.experiments.backward_breakdown --dtype float32 --T 4096 --window 255 0 --softcap 30

Prints the forward's median ms, the backward's, each kernel's median ms per step (the
forward's kernels included), and the ops that take at least 0.5% of the backward,
largest first. ``--globals G`` adds G global tokens (benchmarks.forward's positions);
``--te-gradients`` keeps the TE gradient kernels where the five-product kernel would
run; ``--softcap CAP`` caps the scores, which runs the KV-cache kernels and their
gradients (``cache``, ``cache_dq``, ``cache_dkv``)."""

import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import swa_tvm
from benchmarks.forward import global_positions
from swa_tvm import eager


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--window", type=int, nargs=2, default=(511, 0), metavar=("LEFT", "RIGHT"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--globals", type=int, default=0, metavar="G", help="global tokens")
    ap.add_argument("--dilation", type=int, default=1)
    ap.add_argument("--te-gradients", action="store_true", help="no five-product backward kernel")
    ap.add_argument("--softcap", type=float, default=None, help="score cap (the KV-cache kernels)")
    a = ap.parse_args(argv)
    if a.te_gradients:
        eager._fused_backward_kernel = lambda *args: None
    # Each kernel call timed on its own (the eager layer's one entry to the kernels).
    kernel_ms, launch = collections.defaultdict(list), eager._launch

    def timed_launch(kern, *args):
        t0 = time.perf_counter()
        launch(kern, *args)
        kernel_ms[kern.spec.kind].append((time.perf_counter() - t0) * 1e3)

    eager._launch = timed_launch
    gi = global_positions(a.T, a.globals) if a.globals else None
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.B, a.H, a.T, a.D, generator=g).to(dt).requires_grad_() for _ in range(3))
    grad = torch.randn(a.B, a.H, a.T, a.D, generator=g).to(dt)
    window = tuple(a.window)

    def forward():
        return swa_tvm.sliding_window_attention(q, k, v, window_size=window, dilation=a.dilation, global_idx=gi,
                                               softcap=a.softcap)

    def backward(out):
        # Gradients replace, not accumulate (as benchmarks.training and an optimizer's
        # zero_grad(set_to_none=True) have it): no add into existing .grad tensors.
        for x in (q, k, v):
            x.grad = None
        torch.autograd.backward(out, grad)

    for _ in range(2):  # compiles or loads the kernels, warms the caches
        backward(forward())
    kernel_ms.clear()
    fwd, bwd = [], []
    for _ in range(a.steps):
        with torch.no_grad():
            t0 = time.perf_counter()
            forward()
            fwd.append(time.perf_counter() - t0)
        out = forward()
        t0 = time.perf_counter()
        backward(out)
        bwd.append(time.perf_counter() - t0)
    print(f"{a.dtype} B={a.B} H={a.H} T={a.T} D={a.D} window={window} dilation={a.dilation}: forward {statistics.median(fwd) * 1e3:.1f} ms, "
          f"backward {statistics.median(bwd) * 1e3:.1f} ms (medians of {a.steps}), {a.globals} global tokens, "
          f"softcap {a.softcap}")
    for kind, ms in kernel_ms.items():  # the forward ran twice per step (timed, then for the backward)
        print(f"  kernel {kind:12s} {statistics.median(ms):8.1f} ms, {len(ms) / a.steps:.0f} call(s) per step")

    outs = [forward() for _ in range(a.steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for out in outs:
            backward(out)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows)
    print(f"profiled backward: {total / 1e3 / a.steps:.1f} ms per step of self CPU time")
    for e in rows:
        share = e.self_cpu_time_total / total
        if share >= 0.005:
            print(f"  {e.self_cpu_time_total / 1e3 / a.steps:8.1f} ms  {share:6.1%}  {e.key}")


if __name__ == "__main__":
    main()
