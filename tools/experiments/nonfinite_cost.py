"""What the NaN rule costs on the CPU: each kernel of a spec in its plain variant and in
its guarded one (KernelSpec.nonfinite: a select per product, so a key outside a row's
view adds nothing whatever it holds), both from one exported library with the tuning
records, timed on the same inputs with rounds alternated, medians; and what the check
costs by which the eager layer decides whether to run the guarded kernels (one pass
over the result: a sum, or a 16-bit result's min and max).

    TVM_NUM_THREADS=2 python -m tools.experiments.nonfinite_cost
    TVM_NUM_THREADS=2 python -m tools.experiments.nonfinite_cost --spec head_dim=64,window=511:0,dtype=bfloat16 --T 8192

Prints one line per kernel: plain ms, guarded ms, guarded / plain; and the whole
forward op with and without that check."""

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
            _check_cost(spec, a, p)


def _check_cost(spec, a, plain_ms: float) -> None:
    """The whole op, forward only, as users call it, with and without the check of its
    result (swa_tvm.eager._redo_nonfinite), rounds alternated: what finite data pays."""
    from swa_tvm import eager

    dt = getattr(torch, spec.dtype)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(a.B, a.H, a.T, spec.head_dim, generator=g).to(dt) for _ in range(3))
    window = (spec.left, spec.right)
    checked = eager._redo_nonfinite
    times = {True: [], False: []}
    try:
        for _ in range(a.rounds + 1):
            for on in (True, False):
                eager._redo_nonfinite = checked if on else (lambda *_: False)
                t = time.perf_counter()
                swa_tvm.sliding_window_attention(q, k, v, window_size=window)
                times[on].append(time.perf_counter() - t)
    finally:
        eager._redo_nonfinite = checked
    with_check, without = (statistics.median(times[on][1:]) * 1e3 for on in (True, False))
    print(f"{'op':9s} {spec.dtype:8s} with the check {with_check:8.2f} ms  without {without:8.2f} ms  "
          f"with/without {with_check / without:.3f}")

if __name__ == "__main__":
    main()
