"""``python -m benchmarks.decode``: one decode step (and a prefill chunk) against a KV
cache, every CPU peer in one process on the same inputs.

Shapes: H=32 query heads over H_kv=8, D=128, B=1 and B=8, float32 and bfloat16, a
context of 32K positions. Layers:

* sliding: window W=4096 (transformers' ``sliding_window=4096``: the query and the
  4095 positions before it);
* full: every position.

Methods (each checked against swa_tvm's output before it is timed):

* ``swa_tvm`` on the whole cache (32K slots; the kernel scans only the window's);
* ``swa_tvm rolling`` on a rolling buffer of the window's slots, written out of order
  as ``RollingKVCache`` writes them (sliding layer only);
* ``SDPA + mask``: torch SDPA on the whole cache with a boolean mask, as transformers'
  static cache does;
* ``SDPA window``: torch SDPA on exactly the window's keys, as its sliding cache does;
* ``FlexAttention`` (compiled) on the whole cache with the same mask.

A peer that fails to compile at a shape is reported as failed, with its error. Reports
the median time of each, the ratios the bars ask for, and the read bandwidth
on the K/V bytes a step must read, against this machine's read bandwidth measured in
the same run (a 256 MB ``torch.dot``). ``--prefill`` adds chunked prefill: a chunk of
512 queries against the window. Writes ``decode.json`` under
benchmarks/results/<target-key>/.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

import swa_tvm
from benchmarks.forward import interleaved_medians, machine_info, write_results

H, HKV, D = 32, 8, 128
CONTEXT, WINDOW = 32768, 4096


def read_bandwidth_gbs(runs: int = 7, nbytes: int = 256 << 20) -> float:
    """GB/s of a dot product over two float32 vectors of nbytes together."""
    x = torch.randn(nbytes // 8)
    y = torch.randn(nbytes // 8)
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        torch.dot(x, y)
        ts.append(time.perf_counter() - t)
    return nbytes / statistics.median(ts) / 1e9


def decode_methods(layer: str, B: int, Tq: int, dtype, ctx: int, window: int = WINDOW, heads=(H, HKV, D),
                   device="cpu"):
    """(name -> callable(), the K/V bytes one call must read, peers that failed): the
    methods above on the same inputs, on ``device`` (tools.gpu_check times them there)."""
    nh, nkv, hd = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, nh, Tq, hd, generator=g).to(device, dtype)
    k = torch.randn(B, nkv, ctx, hd, generator=g).to(device, dtype)
    v = torch.randn(B, nkv, ctx, hd, generator=g).to(device, dtype)
    left = window - 1 if layer == "sliding" else -1
    q0 = ctx - Tq
    pos = torch.arange(ctx, device=device)
    qpos = torch.arange(q0, ctx, device=device)
    allowed = (pos[None, :] <= qpos[:, None]) & ((qpos[:, None] - pos[None, :] <= left) if left >= 0 else True)
    keys_read = min(ctx, window + Tq - 1) if left >= 0 else ctx
    nbytes = 2 * B * nkv * keys_read * hd * q.element_size()
    methods = {
        "swa_tvm": lambda: swa_tvm.attention_with_kv_cache(q, k, v, window_size=(left, 0)),
        "SDPA + mask": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, enable_gqa=True
        ),
    }
    if left >= 0:
        lo = ctx - keys_read
        kw, vw = k[:, :, lo:].contiguous(), v[:, :, lo:].contiguous()
        win_mask = allowed[:, lo:]
        methods["SDPA window"] = lambda: torch.nn.functional.scaled_dot_product_attention(
            q, kw, vw, attn_mask=win_mask if Tq > 1 else None, enable_gqa=True
        )
        # A rolling buffer of exactly the slots a step needs, in ring order.
        slots = keys_read
        ring_pos = torch.arange(lo, ctx, device=device)
        order = ring_pos % slots
        kr = torch.empty_like(kw)
        vr = torch.empty_like(vw)
        kr[:, :, order] = kw
        vr[:, :, order] = vw
        slot_pos = torch.empty(slots, dtype=torch.int32, device=device)
        slot_pos[order] = ring_pos.to(torch.int32)
        methods["swa_tvm rolling"] = lambda: swa_tvm.attention_with_kv_cache(
            q, kr, vr, q_offset=q0, kv_positions=slot_pos, window_size=(left, 0)
        )
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, qi, kj):
        ok = kj <= qi + q0
        return ok & (qi + q0 - kj <= left) if left >= 0 else ok

    failed = {}
    try:  # a peer that does not compile at a shape is reported, not fatal
        # The eager block mask: inductor's C++ for the compiled one fails at T_q = 1.
        block_mask = create_block_mask(mask_mod, None, None, Tq, ctx, device=str(device), _compile=False)
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        methods["FlexAttention"] = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
        methods["FlexAttention"]()
    except Exception as e:  # noqa: BLE001
        failed["FlexAttention"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        methods.pop("FlexAttention", None)
    return methods, nbytes, failed


def check_agreement(methods: dict, dtype) -> dict:
    """Each method's max |difference| from swa_tvm's output; AssertionError past the
    dtype's tolerance."""
    want = methods["swa_tvm"]().float()
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    agree = {}
    for name, fn in methods.items():
        err = (fn().float() - want).abs().max().item()
        agree[name] = err
        if not err <= tol * max(1.0, want.abs().max().item()):
            raise AssertionError(f"{name} disagrees with swa_tvm: max |difference| {err}")
    return agree


def run_case(layer: str, B: int, Tq: int, dtype, runs: int, ctx: int) -> dict:
    methods, nbytes, failed = decode_methods(layer, B, Tq, dtype, ctx)
    try:
        agree = check_agreement(methods, dtype)
    except AssertionError as e:
        raise AssertionError(f"{layer} B={B} Tq={Tq} {dtype}: {e}") from None
    ms = interleaved_medians(methods, runs=runs)
    return {"layer": layer, "B": B, "Tq": Tq, "dtype": str(dtype).replace("torch.", ""), "kv_bytes": nbytes,
            "ms": ms, "max_abs_diff": agree, "failed": failed}


def summarize(row: dict, bandwidth: float) -> dict:
    ms = row["ms"]
    ours = min(v for n, v in ms.items() if n.startswith("swa_tvm"))
    whole = min(ms[n] for n in ("SDPA + mask", "FlexAttention") if n in ms)
    out = {"vs whole-cache peers": whole / ours}
    if row["Tq"] <= 16:  # a decode step is bound by reading K and V; a prefill chunk by its products
        out["GB/s"] = row["kv_bytes"] / ours / 1e6
        out["share of read bandwidth"] = out["GB/s"] / bandwidth
    if "SDPA window" in ms:
        out["vs window peer"] = ms["SDPA window"] / ours
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layer", nargs="+", default=["sliding", "full"])
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--prefill", action="store_true", help="also a 512-query chunk against the window")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<target-key>)")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth (256 MB torch.dot): {bandwidth:.1f} GB/s", flush=True)
    rows = []
    cases = [(layer, B, 1, dt) for dt in args.dtype for layer in args.layer for B in args.batch]
    if args.prefill:
        cases += [("sliding", 1, 512, dt) for dt in args.dtype]
    for layer, B, Tq, dt in cases:
        row = run_case(layer, B, Tq, getattr(torch, dt), args.runs, args.context)
        row["summary"] = summarize(row, bandwidth)
        rows.append(row)
        times = ", ".join([f"{n} {v:.2f} ms" for n, v in row["ms"].items()] + [f"{n} failed" for n in row["failed"]])
        s = row["summary"]
        print(f"{layer:7s} B={B} Tq={Tq:<3d} {dt:8s}: {times} | {s['vs whole-cache peers']:.2f}x whole-cache peers"
              + (f", {s['vs window peer']:.2f}x window peer" if "vs window peer" in s else "")
              + (f", {s['GB/s']:.1f} GB/s ({100 * s['share of read bandwidth']:.0f}% of read bandwidth)"
                 if "GB/s" in s else ""), flush=True)
    result = {
        "command": "python -m benchmarks.decode " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(threads),
        "versions": {"torch": torch.__version__, "tvm": swa_tvm.runtime.library.tvm_version(), "swa_tvm": swa_tvm.__version__},
        "read_bandwidth_gbs": bandwidth,
        "shape": {"H": H, "H_kv": HKV, "D": D, "context": args.context, "window": WINDOW},
        "rows": rows,
    }
    write_results(result, "decode.json", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
