"""The five-product CPU backward (kind "local_bwd", swa_tvm/schedules/cpu_flash_bwd.py)
against the two TE gradient kernels it replaces (dq: 3 products, dk/dv: 4), called
directly from one exported library: round-robin on the same inputs in one process,
medians; then each path's largest difference from the other.

    python -m tools.experiments.fused_backward_probe            # T=16384, causal W=512
    python -m tools.experiments.fused_backward_probe --T 4096 --window 256 256 --H 32

Float32, B=1, H heads (H_kv = H). The kernel runs one task per (batch, head), so H
below the thread count leaves threads idle (swa_tvm.eager then runs the TE kernels)."""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import tvm

import swa_tvm
from swa_tvm.schedules.cpu_flash_bwd import BK, BQ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--window", type=int, nargs=2, default=[511, 0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    B, H, Tn, D = 1, args.H, args.T, args.D
    left, right = args.window
    torch.set_num_threads(2)

    lib = tempfile.mkdtemp() + "/bwd.so"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "swa_tvm.cli", "export", "--no-tuning", "-o", lib, "--spec",
                    f"head_dim={D},window={left}:{right},backward"], check=True, capture_output=True)
    print(f"library built in {time.perf_counter() - t0:.1f}s")
    mod = tvm.runtime.load_module(lib)
    name = f"swa_local_%s_d{D}_f32_l{left}_r{right}_md1_x0_bq32"
    dq_fn, dkv_fn, fused_fn = mod[name % "dq"], mod[name % "dkv"], mod[name % "bwd"]

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, Tn, D, generator=g) for _ in range(4))
    out, lse = swa_tvm.sliding_window_attention(q, k, v, window_size=(left, right), return_lse=True)
    delta = (do * out).sum(-1)
    scale = D ** -0.5
    dil = torch.ones(H, dtype=torch.int32)
    res = {n: torch.empty(B, H, Tn, D) for n in ("dq", "dk", "dv", "dq2", "dk2", "dv2")}
    tv = lambda x: tvm.runtime.from_dlpack(x.contiguous())  # noqa: E731
    te_in = [tv(q), tv(k), tv(v), tv(dil), tv(do), tv(lse.float()), tv(delta)]

    def run_fused():
        fused_fn(*te_in, scale, *(tv(res[n]) for n in ("dq", "dk", "dv")))

    def run_te():
        dq_fn(*te_in, scale, tv(res["dq2"]))
        dkv_fn(*te_in, scale, tv(res["dk2"]), tv(res["dv2"]))

    times = {"fused": [], "te": []}
    for r in range(args.rounds):
        for n, fn in ((("fused", run_fused), ("te", run_te)) if r % 2 == 0 else (("te", run_te), ("fused", run_fused))):
            t = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - t)
    f, t_ = statistics.median(times["fused"]), statistics.median(times["te"])
    print(f"B={B} H={H} T={Tn} D={D} window=({left}, {right}): five-product fused {1e3 * f:.1f} ms, "
          f"TE dq + dk/dv {1e3 * t_:.1f} ms, fused / TE {f / t_:.3f}")
    # The products the fused kernel computes: 5 per (key block, query sub-block) pair.
    blocks = -(-Tn // BK) * -(-(BK + left + right) // BQ)
    a = torch.randn(4096, 4096)
    mm = []
    for _ in range(5):
        t = time.perf_counter()
        a @ a
        mm.append(time.perf_counter() - t)
    print(f"  fused: {2 * 5 * B * H * blocks * BK * BQ * D / f / 1e9:.0f} GFLOP/s computed; "
          f"a 4096^2 float32 torch.matmul: {2 * 4096 ** 3 / statistics.median(mm) / 1e9:.0f} GFLOP/s")
    for n in ("dq", "dk", "dv"):
        diff = float((res[n] - res[n + "2"]).abs().max())
        print(f"  max |{n} fused - {n} TE| = {diff:.2e} (largest |{n}|: {float(res[n + '2'].abs().max()):.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
