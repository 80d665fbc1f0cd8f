"""make demo: build CPU kernels, export a library, load it, call torch.ops.swa_tvm on
B=1, H=8, T=4096, D=64 with causal windows (512 tokens, 256 with dilation 2, 512 plus 16 globals),
and print the error against the float64 reference and the time next to torch SDPA with
a boolean banded mask."""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

import swa_tvm
from swa_tvm.reference import attention_mask, sliding_window_attention_ref

B, H, T, D, W, G = 1, 8, 4096, 64, 512, 16
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo_out")


def median_ms(fn, runs: int = 5, min_seconds: float = 0.5) -> float:
    """Median wall time in ms after a warm-up call: at least ``runs`` calls, more for
    short ones until they span ``min_seconds`` (as benchmarks/forward.py times)."""
    fn()
    ts = []
    while len(ts) < runs or (sum(ts) < min_seconds and len(ts) < 200):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main():
    t0 = time.time()
    lib = os.path.join(OUT, "swa_demo.so")
    specs = [
        swa_tvm.AttentionSpec(head_dim=D, window=(W - 1, 0)),
        swa_tvm.AttentionSpec(head_dim=D, window=(W // 2 - 1, 0), max_dilation=2),
        swa_tvm.AttentionSpec(head_dim=D, window=(W - 1, 0), globals=True),
    ]
    manifest = swa_tvm.export_library(specs, lib)  # applies tuning_logs/<this CPU class>/ records
    tuned = sum(k["tuned"] for k in manifest["kernels"])
    print(
        f"exported {lib} ({len(manifest['kernels'])} kernels, {tuned} tuned, {manifest['target_key']}) "
        f"in {time.time() - t0:.0f}s"
    )
    swa_tvm.load_library(lib)

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    gi = torch.sort(torch.randperm(T)[:G]).values.to(torch.int32).view(1, G)
    qg, kg, vg = torch.randn(B, H, G, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    cases = {
        f"causal W={W}": dict(window_size=(W - 1, 0)),
        f"causal W={W // 2}, dilation 2": dict(window_size=(W // 2 - 1, 0), dilation=2),
        f"causal W={W} + {G} globals (own projections)": dict(
            window_size=(W - 1, 0), global_idx=gi, q_global=qg, k_global=kg, v_global=vg
        ),
    }
    print(f"\nB={B} H={H} T={T} D={D} fp32, {torch.get_num_threads()} torch threads")
    print(f"{'pattern':45s} {'rel err':>9s} {'swa_tvm ms':>11s} {'SDPA+mask ms':>13s} {'speed-up':>9s}")
    for name, kw in cases.items():
        dil = torch.full((H,), kw.get("dilation", 1), dtype=torch.int32)
        args = (q, k, v, dil, kw.get("global_idx"), kw.get("q_global"), kw.get("k_global"), kw.get("v_global"),
                0, None, 1 / math.sqrt(D), kw["window_size"][0], 0)  # fmt: skip
        out = torch.ops.swa_tvm.attention(*args)[0]
        ref, _ = sliding_window_attention_ref(q, k, v, **kw)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ours = median_ms(lambda args=args: torch.ops.swa_tvm.attention(*args))
        # SDPA peer: same visible set as a boolean mask. Its global rows use the shared
        # projections (SDPA has no notion of separate ones), so only its time is compared.
        mask, _ = attention_mask(T, H, kw["window_size"], kw.get("dilation", 1), kw.get("global_idx"))
        sdpa = median_ms(lambda m=mask: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m))
        print(f"{name:45s} {err:9.1e} {ours:11.1f} {sdpa:13.1f} {sdpa / ours:8.1f}x")
        assert err < 1e-5, f"{name}: relative error {err}"
    print(f"\ndone in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
