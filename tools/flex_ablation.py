"""FlexAttention's own tile ablation at the bar shape (bf16 B=1 H=32 H_kv=8 D=128
T=32768, causal W=4096): what its 128-row tiles and its pipeline stages are worth on this
GPU, beside the swa_tvm forward's tile variants (the GPU check's ``variants`` stage).

Rows: Flex's own choice for this GPU (no kernel options), then ``BLOCK_M`` 64 and 128
by ``num_stages`` 1 and 3 at one ``BLOCK_N`` and one warp count (``ABLATION_FIXED``:
those of Flex's bf16 D=128 default on sm_90) with TMA off, and SDPA causal without a
window (4x the work: the rate of torch's own flash kernel). Each row's output is checked
against a float32 reference of the last rows. The rows run in one child process, each
under its own timeout (``--row-timeout-s``: a compile that hangs is killed there and the
rows after it go on in a new child); ``<out>/flex_ablation.json`` is written after every
row. Usage (tools/gpu_env.sh sets the environment)::

    python3 -m tools.flex_ablation --out $OUT [--budget-s 100] [--row-timeout-s 60]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

# Flex's forward kernel options (torch/_inductor/kernel/flex/flex_attention.py reads
# them: BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA). Held the same across the
# ablation's rows: BLOCK_N and the warps of Flex's own bf16 D=128 choice on sm_90
# (FlexConfig(128, 64, 3, 8)), TMA off.
ABLATION_FIXED = {"BLOCK_N": 64, "num_warps": 8, "USE_TMA": False}
ABLATION_ROWS: dict[str, dict | None] = {"default": None}
for _m in (64, 128):
    for _s in (1, 3):
        ABLATION_ROWS[f"m{_m}_s{_s}"] = {"BLOCK_M": _m, "num_stages": _s, **ABLATION_FIXED}
ABLATION_ROWS["sdpa_causal_full"] = None  # not Flex: SDPA causal, no window
ROW = "ABLATION_ROW "
# Rows of the reference (the last queries): a float32 product over their window.
CHECK_ROWS = 256


def shape(device: str) -> tuple:
    """B, H, H_kv, D, T, W: the bar shape on the GPU, a tiny one on the CPU (the
    harness only)."""
    return (1, 32, 8, 128, 32768, 4096) if device == "cuda" else (1, 4, 2, 16, 256, 32)


def child(names: list[str], device: str) -> int:
    """Run ``names``' rows in this process, one ``ROW`` line each."""
    import statistics

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = torch.device(device)
    B, H, Hkv, D, T, W = shape(device)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g).to(dev, dt) for h in (H, Hkv, Hkv))
    bm = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W), None, None, T, T, device=dev)
    # The reference of the last CHECK_ROWS queries: float32 over their keys.
    n = min(CHECK_ROWS, T)
    lo = max(0, T - n - W + 1)
    qs = q[:, :, T - n:].float()
    ks, vs = (x[:, :, lo:].float().repeat_interleave(H // Hkv, 1) for x in (k, v))
    qi = torch.arange(T - n, T, device=dev)[:, None]
    ki = torch.arange(lo, T, device=dev)[None, :]
    mask = (qi >= ki) & (qi - ki < W)
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
    useful = 4.0 * B * H * D * (W * T - W * (W - 1) // 2)

    def t_ms(fn, warm=3, reps=10):
        for _ in range(warm):
            fn()
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    for name in names:
        opts = ABLATION_ROWS[name]
        row = {"config": name, "kernel_options": opts}
        t0 = time.monotonic()
        try:
            if name == "sdpa_causal_full":
                kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
                call = lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)  # noqa: E731
                flops = 4.0 * B * H * D * (T * (T + 1) // 2)
            else:
                torch._dynamo.reset()
                f = torch.compile(flex_attention, dynamic=False)
                kw = {} if opts is None else {"kernel_options": dict(opts)}
                call = lambda f=f, kw=kw: f(q, k, v, block_mask=bm, enable_gqa=True, **kw)  # noqa: E731
                flops = useful
            out = call()
            row["compile_s"] = time.monotonic() - t0
            if name != "sdpa_causal_full":
                got = out[:, :, T - n:].float()
                row["rel_err_vs_reference"] = ((got - ref).norm() / ref.norm()).item()
            row["ms"] = t_ms(call)
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - the row says what happened
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(ROW + json.dumps(row), flush=True)
    return 0


def child_command(names: list[str], device: str) -> list[str]:
    return [sys.executable, "-m", "tools.flex_ablation", "--child", ",".join(names), "--device", device]


def run_rows(names: list[str], command, row_timeout_s: float, deadline: float, on_row) -> list[dict]:
    """The rows of ``names``: ``command(names_left)`` runs them in a child that prints a
    ``ROW`` line per row; a row that has not come within ``row_timeout_s`` (or by
    ``deadline``, a time.monotonic()) is killed with its child, recorded as timed out,
    and the rows after it go on in a new child. ``on_row(row)`` after each row."""
    rows: list[dict] = []
    left = list(names)

    def lost(why: str, tail: str) -> None:
        rows.append({"config": left.pop(0), "error": why, "tail": tail[-600:]})
        on_row(rows[-1])

    while left:
        if time.monotonic() >= deadline:
            for name in left:
                rows.append({"config": name, "error": "skipped: the ablation's time budget was spent"})
                on_row(rows[-1])
            break
        proc = subprocess.Popen(command(left), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        fd, buf, tail = proc.stdout.fileno(), b"", ""
        row_start = time.monotonic()
        while left:
            if b"\n" not in buf:
                limit = min(row_start + row_timeout_s, deadline)
                ready, _, _ = select.select([fd], [], [], max(0.0, limit - time.monotonic()))
                if not ready:  # this row's time is up
                    proc.kill()
                    proc.wait()
                    lost(f"no result within {limit - row_start:.0f} s (killed)", tail)
                    break
                chunk = os.read(fd, 65536)
                if not chunk:  # the child ended before this row's line
                    proc.wait()
                    lost(f"child process rc {proc.returncode}", tail + buf.decode(errors="replace"))
                    break
                buf += chunk
                continue
            raw, buf = buf.split(b"\n", 1)
            line = raw.decode(errors="replace")
            if not line.startswith(ROW):
                tail = (tail + line + "\n")[-2000:]
                continue
            row = json.loads(line[len(ROW):])
            row["row_s"] = time.monotonic() - row_start
            left.remove(row["config"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            on_row(row)
            row_start = time.monotonic()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.flex_ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the harness only, tiny shape")
    p.add_argument("--rows", default=",".join(ABLATION_ROWS), help=f"rows to run (default all: {','.join(ABLATION_ROWS)})")
    p.add_argument("--budget-s", type=float, default=100.0, help="seconds after which no row starts")
    p.add_argument("--row-timeout-s", type=float, default=60.0, help="seconds each row (compile and timing) may take")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child.split(","), args.device)
    names = [x for x in args.rows.split(",") if x]
    unknown = [x for x in names if x not in ABLATION_ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)}; the rows are {', '.join(ABLATION_ROWS)}")
    import torch

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "flex_ablation.json")
    result = {"shape": dict(zip(("B", "H", "H_kv", "D", "T", "W"), shape(args.device))), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (harness only)",
              "fixed": ABLATION_FIXED, "row_timeout_s": args.row_timeout_s, "rows": []}

    def save(row):
        result["rows"].append(row)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)

    rows = run_rows(names, lambda left: child_command(left, args.device), args.row_timeout_s,
                    time.monotonic() + args.budget_s, save)
    print(f"wrote {path}: {sum('ms' in r for r in rows)} of {len(rows)} rows timed")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
