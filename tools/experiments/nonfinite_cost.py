"""What the NaN rule costs on the CPU: each kernel of a spec in its plain variant and in
its guarded one (KernelSpec.nonfinite: a select per product, so a key outside a row's
view adds nothing whatever it holds), both from one exported library with the tuning
records, timed on the same inputs with rounds alternated, medians; and the summing pass
over the result by which the eager layer decides whether to run the guarded kernels.

    TVM_NUM_THREADS=2 python -m tools.experiments.nonfinite_cost
    TVM_NUM_THREADS=2 python -m tools.experiments.nonfinite_cost --spec head_dim=64,window=511:0,dtype=bfloat16 --T 8192

Prints one line per kernel: plain ms, guarded ms, guarded / plain."""

import argparse
import os
import statistics
import tempfile
import time

import torch

import swa_tvm
from swa_tvm.runtime import library
from swa_tvm.spec import AttentionSpec


def _args(spec, B, H, T, D):
    dt = getattr(torch, spec.dtype)
    acc = torch.float64 if dt == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g).to(dt) for _ in range(4))
    dil = torch.ones(H, dtype=torch.int32)
    scale = D**-0.5
    if spec.kind == "local":
        return [q, k, v, dil, torch.full((H,), float("-inf"), dtype=acc), scale,
                torch.empty(B, H, T, D, dtype=dt), torch.empty(B, H, T, dtype=acc)]
    lse = torch.randn(B, H, T, generator=g, dtype=acc).abs() + 5
    delta = torch.randn(B, H, T, generator=g, dtype=acc)
    outs = [torch.empty(B, H, T, D, dtype=dt)] if spec.kind == "local_dq" else \
        [torch.empty(B, H, T, D, dtype=acc), torch.empty(B, H, T, D, dtype=acc)]
    return [q, k, v, dil, dout, lse, delta, scale] + outs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="head_dim=64,window=511:0,backward", help="an AttentionSpec (no globals or sinks)")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=11)
    a = ap.parse_args(argv)
    pattern = AttentionSpec.parse(a.spec + ",nonfinite")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "nonfinite_cost.so")
        swa_tvm.export_library([pattern], path, warn_untuned=False)
        swa_tvm.load_library(path)
    by_name = {k.spec.name: k for k in library.REGISTRY.kernels("cpu")}
    for spec in pattern.kernels():
        if spec.nonfinite or spec.kind not in ("local", "local_dq", "local_dkv"):
            continue
        plain, guarded = by_name[spec.name], by_name[spec.name + "_nf"]
        args = _args(spec, a.B, a.H, a.T, spec.head_dim)
        times = {"plain": [], "guarded": []}
        for kern in (plain, guarded):
            kern.func(*args)  # warm
        for _ in range(a.rounds):
            for name, kern in (("plain", plain), ("guarded", guarded)):
                t = time.perf_counter()
                kern.func(*args)
                times[name].append(time.perf_counter() - t)
        p, g = (statistics.median(times[n]) * 1e3 for n in ("plain", "guarded"))
        print(f"{spec.kind:9s} {spec.dtype:8s} plain {p:8.2f} ms  guarded {g:8.2f} ms  guarded/plain {g / p:.2f}")
        if spec.kind == "local":
            out = args[-2]
            acc = torch.float64 if out.dtype == torch.float64 else torch.float32
            ts = []
            for _ in range(a.rounds):
                t = time.perf_counter()
                float(out.sum(dtype=acc))
                ts.append(time.perf_counter() - t)
            s = statistics.median(ts) * 1e3
            print(f"{'check':9s} {spec.dtype:8s} summing out {s:.2f} ms  ({100 * s / p:.1f}% of the plain forward)")


if __name__ == "__main__":
    main()
