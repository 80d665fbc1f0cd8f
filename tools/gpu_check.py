"""The GPU check: run on a machine with an NVIDIA GPU and no TVM compiler.

It loads the CUDA libraries built elsewhere (:mod:`tools.gpu_bundle`) through the TVM
runtime only, then runs its stages (``--stages``, default ``DEFAULT_STAGES``) in the
order of what they decide, writing ``<out>/gpu_results.json`` after every stage and
after every variant row:

1. ``variants``: the fused forward's tile configurations (``lib/variants``) at the bar
   shape (bf16 B=1 H=32 H_kv=8 D=128 T=32768, causal W=4096), each checked against the
   registered library's forward first: the wgmma probes (one instruction against a
   matrix product: which reading of the descriptors the hardware has), then the wgmma
   forwards, each in a child process under its own timeout (``--child-timeout-s``: an
   illegal instruction poisons a CUDA context), then the mma.sync and CUDA-core ones;
2. ``bars``: the bf16 matmul rate and an L2 read rate, then ours against FlexAttention
   (compiled, sliding-window block mask), SDPA with a banded mask and SDPA causal with
   no window at the bar shape (plain, dilation 2, 64 globals); each forward variant
   against the same FlexAttention and matmul rate (``against_the_bars``);
3. ``training``: forward + backward against FlexAttention and SDPA at the bar shape;
4. ``scaling``: our forward at T = 8K ... 128K (as far as memory allows);
5. ``grad_variants``: the dq and dk/dv kernels' tile configurations, where the bundle
   holds them (``gpu_bundle --gradients``);
6. ``correctness``: every pattern (window causal and symmetric, uniform and per-head
   dilation, globals with and without their own projections, sinks, learned sink
   logits, GQA) in float16, bfloat16 and float32 against the float64 dense reference:
   out, lse and the gradients of every float input; a call on a side stream and under
   ``torch.compile(fullgraph=True)``.

Not by default (name them in ``--stages``; the bundle holds their libraries only when
built with ``gpu_bundle --kv-cache`` / ``--tune-trials``): ``kv_cache`` (
``attention_with_kv_cache`` against the reference), ``decode`` (a decode step and a
prefill chunk against peers) and ``tuning`` (``--tune``: the MetaSchedule batch,
measured into ``<out>/measured.json``). ``swa-tvm import-tiles`` turns the variant rows
into tile records (swa_tvm.compiler.tiles).

Usage (tools/gpu_check.sh sets the environment): ``python3 -m tools.gpu_check --libs
build/gpu/lib --out $OUT``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch

# Modules the TVM runtime alone serves: this machine has no TVM compiler.
import swa_tvm
from swa_tvm.compiler.tiles import GRAD_TOLERANCE, TOLERANCE, best_variants
from swa_tvm.reference import sliding_window_attention_ref
from swa_tvm.runtime import library
from swa_tvm.spec import KernelSpec
from swa_tvm.tuning import measure as measure_batch
from swa_tvm.tuning.measure import rel_err, time_calls

# time.monotonic() past which nothing more is timed (main's --budget-s): the device
# tool stops a run at its limit, and what a stage cut short had measured is kept.
_deadline = float("inf")


def _out_of_time() -> bool:
    return time.monotonic() > _deadline


OUT_OF_TIME = "skipped: the run's time budget was spent"
# Seconds a child process (a wgmma variant's or probe's row) may take, at most; main's
# --child-timeout-s. Capped by the time the run has left.
DEFAULT_CHILD_TIMEOUT = 60.0
_child_timeout = DEFAULT_CHILD_TIMEOUT
# Writes gpu_results.json as it stands (main sets it): called after every stage and
# after every variant row, so that a run cut short keeps what it measured.
_saver = None


def _save() -> None:
    if _saver is not None:
        _saver()

VARIANT_SHAPE = (1, 32, 8, 32768)  # B, H, H_kv, T of the variants' timing

# The float inputs of a call that have gradients (besides q, k, v).
GRAD_INPUTS = ("q_global", "k_global", "v_global", "sink_logits")


def sink_grad_err(got, want, sink, out, lse, d_out, d_lse) -> float:
    """The sink logits' gradient error relative to the size of its terms (float64
    reference ``out``, ``lse``): dsink_h = -sum_i p_sink,i (d_out_i . out_i - d_lse_i)
    sums terms of both signs, each carrying out's rounding to the input dtype, so its
    error is bounded by the terms' size, not by the possibly cancelling sum's (against
    which a bf16 case failed about one run in 60)."""
    p_sink = torch.exp(sink.detach().double().view(1, -1, 1) - lse.detach().double())
    terms = (p_sink * ((d_out.double().abs() * out.detach().double().abs()).sum(-1) + d_lse.double().abs())).sum((0, 2))
    return ((got.detach().double().cpu() - want.detach().double().cpu()).abs() / terms.cpu()).max().item()


def _within_tolerance(entry: dict, dtype) -> bool:
    """A case's out, lse and gradient errors against its dtype's tolerances."""
    tol_out, tol_lse = TOLERANCE[dtype]
    return bool(entry["out_rel_err"] < tol_out and entry["lse_max_abs_err"] < tol_lse
                and max(entry["grad_rel_err"].values()) < GRAD_TOLERANCE[dtype])


def _record(rows: list, entry: dict, name: str) -> bool:
    """Keep a case's entry, print its line; whether it passed."""
    rows.append(entry)
    print(f"  {entry['dtype']:9s} {name:48s} {'ok' if entry['ok'] else 'FAIL'} "
          f"{entry.get('out_rel_err', float('nan')):.1e} {entry.get('lse_max_abs_err', float('nan')):.1e} "
          f"grads {max(entry.get('grad_rel_err', {'': float('nan')}).values()):.1e}", flush=True)
    return entry["ok"]


def check_patterns(results: dict, dev: torch.device) -> bool:
    """Every pattern x dtype against the float64 reference, forward and gradients; True
    when all pass."""
    B, H, Hkv, T, D = 2, 4, 2, 300, 64
    cases = [
        ("causal window", dict(window_size=(31, 0))),
        ("causal window, dilation 2", dict(window_size=(31, 0), dilation=2)),
        ("per-head dilation, globals, sinks", dict(window_size=(31, 0), dilation="per_head", globals=5, num_sinks=4)),
        ("globals with own projections, sink logits", dict(window_size=(31, 0), globals=6, projections=True, sink_logits=True)),
        ("symmetric window, dilation 2, globals", dict(window_size=(16, 16), dilation=2, globals=3)),
        ("symmetric, per-head dilation, own projections", dict(window_size=(16, 16), dilation="per_head", globals=4, projections=True)),
    ]
    ok_all = True
    rows = []
    dtypes = (torch.float16, torch.bfloat16, torch.float32) if dev.type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for name, case in cases:
            case = dict(case)
            g = torch.Generator(device="cpu").manual_seed(hash((name, str(dtype))) % 2**31)
            mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
            q, k, v = mk(B, H, T, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D)
            kw = {"window_size": case.pop("window_size")}
            dil = case.pop("dilation", 1)
            kw["dilation"] = torch.tensor([1, 2, 1, 2], dtype=torch.int32) if dil == "per_head" else dil
            G = case.pop("globals", 0)
            if G:
                kw["global_idx"] = torch.stack([torch.randperm(T, generator=g)[:G] for _ in range(B)]).int()
                if case.pop("projections", False):
                    kw["q_global"], kw["k_global"], kw["v_global"] = mk(B, H, G, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D)
            kw["num_sinks"] = case.pop("num_sinks", 0)
            if case.pop("sink_logits", False):
                kw["sink_logits"] = torch.randn(H, generator=g)
            entry = {"case": name, "dtype": str(dtype).replace("torch.", "")}
            try:
                # Gradients of <out, d_out> + <lse, d_lse> with respect to every float
                # input, ours on the device against autograd through the reference.
                inputs = {"q": q, "k": k, "v": v, **{n: kw.pop(n) for n in GRAD_INPUTS if n in kw}}
                ours_in = {n: x.detach().to(dev).requires_grad_() for n, x in inputs.items()}  # own leaves, also
                ref_in = {n: x.detach().double().requires_grad_() for n, x in inputs.items()}  # where .to is a no-op
                to_dev = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
                out, lse = swa_tvm.sliding_window_attention(**ours_in, **to_dev, return_lse=True)
                ref_out, ref_lse = sliding_window_attention_ref(**ref_in, **kw)
                entry["out_rel_err"] = rel_err(out.detach().cpu(), ref_out.detach())
                entry["lse_max_abs_err"] = (lse.detach().cpu().double() - ref_lse.detach()).abs().max().item()
                d_out = torch.randn(ref_out.shape, generator=g).to(dtype)
                d_lse = torch.randn(ref_lse.shape, generator=g)
                got = torch.autograd.grad((out * d_out.to(dev)).float().sum() + (lse * d_lse.to(dev)).sum(),
                                          list(ours_in.values()))
                want = torch.autograd.grad((ref_out * d_out.double()).sum() + (ref_lse * d_lse.double()).sum(),
                                           list(ref_in.values()))
                # (The sink logits' entry is relative to its terms: sink_grad_err.)
                entry["grad_rel_err"] = {
                    n: sink_grad_err(a, b, inputs[n], ref_out, ref_lse, d_out, d_lse) if n == "sink_logits"
                    else rel_err(a.cpu(), b) for n, a, b in zip(inputs, got, want)
                }
                entry["ok"] = _within_tolerance(entry, dtype)
            except Exception as e:  # noqa: BLE001 - record and go on to the next case
                entry.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
            ok_all &= _record(rows, entry, name)
    results["correctness"] = rows

    # Stream and compile: the same call on a side stream, and under torch.compile.
    q = torch.randn(1, 4, 256, 64, device=dev, dtype=dtypes[0])
    base = swa_tvm.sliding_window_attention(q, q, q, window_size=(31, 0))
    extra = {}
    if dev.type == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            side = swa_tvm.sliding_window_attention(q, q, q, window_size=(31, 0))
        torch.cuda.current_stream().wait_stream(s)
        extra["side_stream_equal"] = bool(torch.equal(side, base))
    compiled = torch.compile(lambda a: swa_tvm.sliding_window_attention(a, a, a, window_size=(31, 0)), fullgraph=True)
    try:
        extra["compile_fullgraph_equal"] = bool(torch.equal(compiled(q), base))
    except Exception as e:  # noqa: BLE001
        extra["compile_fullgraph_equal"] = False
        extra["compile_error"] = f"{type(e).__name__}: {e}"
    results["stream_and_compile"] = extra
    print(f"  stream and compile: {extra}")
    return ok_all and all(v for k, v in extra.items() if k.endswith("_equal"))


# The KV-cache cases: (name, pattern, T_q, layout). Batch row 0's queries are the last
# T_q positions of the cache, row 1's sit 23 positions earlier, its later slots unwritten
# (NaN: never attended, whatever they hold). "lengths" passes q_offset and kv_len,
# "rolling" the slots' positions in a ring's order (kv_positions) with no slot
# unwritten. Their kernels are tools.gpu_bundle.KV_CHECK_SPECS'.
KV_CASES = (
    ("decode, dilation 2, softcap", dict(window_size=(31, 0), dilation=2, softcap=20.0), 1, "lengths"),
    ("chunk, per-head dilation, sinks, sink logits",
     dict(window_size=(31, 0), dilation="per_head", num_sinks=4, sink_logits=True), 37, "lengths"),
    ("decode, rolling buffer, softcap", dict(window_size=(31, 0), softcap=20.0), 1, "rolling"),
    ("chunk of 16, full layer", dict(window_size=(-1, 0)), 16, "lengths"),
)


def check_kv_cache(results: dict, dev: torch.device) -> bool:
    """``attention_with_kv_cache`` against the float64 dense reference of the full
    sequence (its rows at the queries' positions), out, lse and the gradients of q, k, v
    and the sink logits, in every dtype; True when all pass."""
    B, H, Hkv, N, D = 2, 4, 2, 300, 64
    back = 23  # batch row 1's queries are this many positions before row 0's
    rows, ok_all = [], True
    dtypes = (torch.float16, torch.bfloat16, torch.float32) if dev.type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for name, pattern, Tq, layout in KV_CASES:
            entry = {"case": name, "dtype": str(dtype).replace("torch.", "")}
            try:
                g = torch.Generator().manual_seed(hash((name, str(dtype))) % 2**31)
                mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
                q, k, v = mk(B, H, N, D), mk(B, Hkv, N, D), mk(B, Hkv, N, D)
                kw = dict(pattern)
                if kw.get("dilation") == "per_head":
                    kw["dilation"] = torch.tensor([1, 2, 1, 2], dtype=torch.int32)
                leaves = {"q": q, "k": k, "v": v}
                if kw.pop("sink_logits", False):
                    leaves["sink_logits"] = torch.randn(H, generator=g)
                ref_in = {n: x.detach().double().requires_grad_() for n, x in leaves.items()}
                ref_out, ref_lse = sliding_window_attention_ref(
                    ref_in["q"], ref_in["k"], ref_in["v"], sink_logits=ref_in.get("sink_logits"), **kw)
                q0 = torch.tensor([N - Tq, N - Tq - back])
                # The rows the cached calls compute, per batch row.
                pick = lambda x: torch.stack([x[b, :, int(q0[b]):int(q0[b]) + Tq] for b in range(B)])  # noqa: E731
                if layout == "rolling":  # the window's slots in a ring's order, per row
                    span = 64
                    slot_pos = torch.stack([(int(q0[b]) + Tq - span + torch.randperm(span, generator=g)) for b in range(B)])
                    ck, cv = (torch.stack([x[b, :, slot_pos[b]] for b in range(B)]) for x in (k, v))
                    call = dict(q_offset=q0.int(), kv_positions=slot_pos.int())
                else:  # every position up to row 0's last query; row 1's tail unwritten
                    ck, cv = k.clone(), v.clone()
                    lengths = (q0 + Tq).int()
                    ck[1, :, int(lengths[1]):] = float("nan")
                    cv[1, :, int(lengths[1]):] = float("nan")
                    call = dict(q_offset=q0.int(), kv_len=lengths)
                ours_in = {"q": pick(q), "k": ck, "v": cv, **({"sink_logits": leaves["sink_logits"]}
                                                                if "sink_logits" in leaves else {})}
                ours_in = {n: x.detach().to(dev).requires_grad_() for n, x in ours_in.items()}
                dev_kw = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in {**kw, **call}.items()}
                out, lse = swa_tvm.attention_with_kv_cache(**ours_in, **dev_kw, return_lse=True)
                want_out, want_lse = pick(ref_out), pick(ref_lse)
                entry["out_rel_err"] = rel_err(out.detach().cpu(), want_out.detach())
                entry["lse_max_abs_err"] = (lse.detach().cpu().double() - want_lse.detach()).abs().max().item()
                d_out, d_lse = torch.randn(want_out.shape, generator=g).to(dtype), torch.randn(want_lse.shape, generator=g)
                got = torch.autograd.grad((out * d_out.to(dev)).float().sum() + (lse * d_lse.to(dev)).sum(),
                                          list(ours_in.values()))
                want = torch.autograd.grad((want_out * d_out.double()).sum() + (want_lse * d_lse.double()).sum(),
                                           list(ref_in.values()))
                want = dict(zip(ref_in, want))
                # Reference gradients by position, ours by slot: the same tensors once
                # gathered (q: the picked rows; k, v: the slots' positions; slots
                # never written get zero in both).
                want["q"] = pick(want["q"])
                for n in ("k", "v"):
                    if layout == "rolling":
                        want[n] = torch.stack([want[n][b, :, slot_pos[b]] for b in range(B)])
                grads = dict(zip(ours_in, got))
                entry["grad_rel_err"] = {
                    n: sink_grad_err(grads[n], want[n], leaves[n], want_out, want_lse, d_out, d_lse)
                    if n == "sink_logits" else rel_err(grads[n].cpu(), want[n]) for n in ours_in
                }
                entry["ok"] = _within_tolerance(entry, dtype)
            except Exception as e:  # noqa: BLE001 - record and go on to the next case
                entry.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
            ok_all &= _record(rows, entry, name)
    results["kv_cache"] = rows
    return ok_all


def dram_read_rate(dev: torch.device, mib: int = 1024) -> float:
    """GB/s of torch's sum over a ``mib`` MiB bf16 tensor (far past L2): the memory read
    rate a decode step, bound by reading K and V, is held against."""
    x = torch.randn(mib << 19, device=dev, dtype=torch.bfloat16)
    return x.numel() * 2 / (_time_ms(lambda: x.sum(dtype=torch.float32), warmup=3, reps=10) * 1e-3) / 1e9


def bench_decode(results: dict, dev: torch.device, quick: bool) -> None:
    """One decode step (and a prefill chunk of 512) against a KV cache, ours against
    SDPA on the whole cache with a boolean mask, SDPA on exactly the window's keys and
    FlexAttention, as benchmarks.decode does on the CPU: bf16, H=32 over H_kv=8, D=128,
    a sliding layer (W=4096) and a full one, context 32K, B=1 and 8."""
    from benchmarks.decode import check_agreement, decode_methods

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ctx, window, heads = 32768, 4096, (32, 8, 128)
    if quick:
        ctx = 8192
    if dev.type != "cuda":  # the CPU smoke run: the harness, not the numbers
        ctx, window, heads = 96, 32, (4, 2, 16)
    rate = dram_read_rate(dev, 1024 if dev.type == "cuda" else 64)
    results["decode_read_gb_s"] = rate
    print(f"  memory read (torch sum of 1 GiB): {rate:.0f} GB/s", flush=True)
    cases = [(layer, B, 1) for layer in ("sliding", "full") for B in (1, 8)] + [("sliding", 1, 512 if dev.type == "cuda" else 8)]
    rows = []
    for layer, B, Tq in cases:
        row = {"layer": layer, "B": B, "Tq": Tq, "context": ctx, "window": window if layer == "sliding" else None}
        if _out_of_time():
            rows.append(dict(row, error=OUT_OF_TIME))
            continue
        try:
            methods, nbytes, failed = decode_methods(layer, B, Tq, dtype, ctx, window, heads, device=dev)
            row["max_abs_diff"] = check_agreement(methods, dtype)
            row["ms"] = {n: _time_ms(fn, warmup=3, reps=20) for n, fn in methods.items()}
            row["failed"] = failed
            ours = min(t for n, t in row["ms"].items() if n.startswith("swa_tvm"))
            whole = min(row["ms"][n] for n in ("SDPA + mask", "FlexAttention") if n in row["ms"])
            row["vs_whole_cache_peers"] = whole / ours
            if "SDPA window" in row["ms"]:
                row["vs_window_peer"] = row["ms"]["SDPA window"] / ours
            if Tq <= 16:
                row["kv_gb_s"] = nbytes / ours / 1e6
                row["share_of_read_rate"] = row["kv_gb_s"] / rate
        except Exception as e:  # noqa: BLE001 - keep the other rows
            row.update(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        rows.append(row)
        print(f"  decode {json.dumps({k: v for k, v in row.items() if k != 'trace'})}", flush=True)
        _empty_cache()
    results["decode"] = rows


def _time_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of single calls: CUDA events on the GPU, ``perf_counter`` in
    the CPU smoke run of this script."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return statistics.median(time_calls(fn, device, 1, reps, warmup)) * 1e3


def matmul_rate(dev: torch.device, dtype) -> float:
    """TFLOP/s of an 8192^3 torch.matmul on random data (bf16 on the GPU): the ceiling."""
    n = 8192 if dev.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (_time_ms(lambda: a @ b) * 1e-3) / 1e12


def l2_read_rate(dev: torch.device, mib: int = 16) -> float:
    """TB/s of torch's sum over a ``mib`` MiB bf16 tensor read again and again, so that
    it stays in L2 (H100/H200: 50 MiB): what L2 feeds the SMs at least (a reduction
    need not reach L2's peak), beside which ``staged_bytes`` per second says how near
    a variant runs to it."""
    x = torch.randn(mib << 19, device=dev, dtype=torch.bfloat16)
    return x.numel() * 2 / (_time_ms(lambda: x.sum(dtype=torch.float32), warmup=5, reps=20) * 1e-3) / 1e12


def staged_bytes(entry: dict, spec: dict, shape) -> int | None:
    """Bytes a tensor-core variant (``entry``: kind, warps, chunk, m_tiles) copies into
    shared memory chunk by chunk at ``shape`` = B, H, H_kv, T under ``spec``'s window
    with dilation 1: per block of 16 * warps * m_tiles rows, every chunk of the band
    (aligned to its index 0, as ``cuda_flash.band_positions``) that holds a partner of
    the rows' union (``compute.item_key_span``), a chunk being K's and V's rows for the
    forward and dq (rows: queries), Q's and dO's with their lse and delta for dk/dv
    (rows: keys, partners the queries that see them: the transposed band). Every block
    loads its own, from L2 in the main: blocks of one head's consecutive rows share
    most of their partners but seldom an SM at once. None for a CUDA-core kernel."""
    kind = entry.get("kind", "local")
    if kind not in ("local", "local_dq", "local_dkv") or "warps" not in entry:
        return None
    (B, H, _, T), D = shape, spec["head_dim"]
    lo, hi = (spec["right"], spec["left"]) if kind == "local_dkv" else (spec["left"], spec["right"])
    rows, chunk = 16 * entry["warps"] * entry.get("m_tiles", 1), entry["chunk"]
    chunks = 0
    for m0 in range(0, T, rows):
        first = max(0, lo - m0) if lo >= 0 else 0
        last = T - m0 + lo - 1 if lo >= 0 else T - 1
        if hi >= 0:
            last = min(last, rows - 1 + lo + hi if lo >= 0 else m0 + rows - 1 + hi)
        chunks += last // chunk - first // chunk + 1 if last >= first else 0
    column = 2 * D * getattr(torch, spec["dtype"]).itemsize + (2 * 4 if kind == "local_dkv" else 0)
    return B * H * chunks * chunk * column


# The kinds of lib/variants' entries each variant stage runs.
FORWARD_KINDS = ("wgmma_probe", "local")
GRAD_KINDS = ("local_dq", "local_dkv")


def variant_order(entries: list[dict], kinds=FORWARD_KINDS) -> list[dict]:
    """The entries of ``kinds`` in the order they run: the wgmma probes (which reading of
    the descriptors the hardware has), then the other wgmma kernels, then the rest;
    otherwise as listed."""
    mine = [e for e in entries if e.get("kind", "local") in kinds]
    return sorted(mine, key=lambda e: (e.get("kind") != "wgmma_probe", not e.get("wgmma")))


def time_variants(results: dict, dev: torch.device, libs: str, kinds=FORWARD_KINDS, stage: str = "variants",
                  shape=VARIANT_SHAPE) -> None:
    """Time the fused kernels' tile configurations of ``kinds`` (``lib/variants``,
    built by gpu_bundle.build_variants) against each other at the bar shape, each
    checked first against the registered library's default (the forward's output;
    autograd's dq, dk, dv): which configuration the default should be is a GPU
    measurement. The rows go to ``results["variants"]`` in ``variant_order``, the
    results file written after each."""
    if not os.path.exists(os.path.join(libs, "variants", "variants.json")):
        results[stage] = "none built"
        return
    if dev.type != "cuda":
        results[stage] = "skipped: CUDA functions need a GPU"
        return
    meta, module = load_variants(libs)
    # What ``swa-tvm import-tiles`` needs to turn the rows into tile records (swa_tvm.compiler.tiles).
    commit = os.path.join(libs, os.pardir, "COMMIT")  # git describe, then the checkout's root
    built = open(commit).read().split("\n") if os.path.exists(commit) else [None]
    results["variants_meta"] = {
        "spec": meta["spec"], "arch": meta["arch"], "shape": list(shape), "bundle": built[0],
        "bundle_root": built[1] if len(built) > 1 and built[1] else None,
    }
    run_variants(results, meta, module, libs, dev, kinds, stage, shape)


def run_variants(results: dict, meta: dict, module, libs: str, dev: torch.device, kinds=FORWARD_KINDS,
                 stage: str = "variants", shape=VARIANT_SHAPE) -> None:
    """``time_variants``' rows of the entries of ``meta`` of ``kinds``, appended to
    ``results["variants"]`` as each completes (the results file written after each).
    Those never run on a GPU before (wgmma) run first, each in a process of its own
    (``isolated_variant_row``): an illegal instruction or address poisons the process's
    CUDA context, which would take every later row (and the other reading of wgmma's
    layout) with it."""
    order = variant_order(meta["variants"], kinds)
    if not order:
        results[stage] = "none built"
        return
    rows = results["variants"] if isinstance(results.get("variants"), list) else []
    results["variants"] = rows

    def keep(row: dict) -> None:
        rows.append(row)
        _save()

    hung = 0  # children in a row that ran out of their time (a hang, likely shared by the wgmma code)
    for entry in (e for e in order if e.get("wgmma")):
        if hung >= MAX_CONSECUTIVE_TIMEOUTS and entry.get("kind") != "wgmma_probe":
            keep(dict(entry, error=f"skipped: {hung} children in a row ran out of their time (a hang?); "
                                   "run these with --stages variants and a longer --child-timeout-s"))
            continue
        row = isolated_variant_row(entry, libs, dev.type, shape)
        hung = hung + 1 if str(row.get("error", "")).startswith(CHILD_TIMED_OUT) else 0
        keep(row)
    rest = [e for e in order if not e.get("wgmma")]
    if rest:
        variant_rows(module, dict(meta, variants=rest), dev, shape, on_row=keep)
    if stage != "variants":
        results[stage] = f"{len(order)} rows in variants"
    results["variant_best"] = best_variants(rows, getattr(torch, meta["spec"]["dtype"]))
    against_the_bars(results)


def against_the_bars(results: dict) -> None:
    """Each forward variant's time against the bench stage's FlexAttention at the same
    shape (the causal row: the variants' shape and window) and its TFLOP/s against the
    measured matmul rate: the issue's first two bars, per tile configuration, which
    the default's numbers alone would not show for a variant that should become it."""
    causal = next((t for t in results.get("timing") or [] if isinstance(t, dict) and t.get("config") == "causal"), None)
    flex_ms, rate = (causal or {}).get("flex_attention_ms"), results.get("matmul_tflops")
    for row in results.get("variants") or []:
        if row.get("kind") == "local" and "ms" in row:
            if flex_ms:
                row["speedup_vs_flex_attention"] = flex_ms / row["ms"]
            if rate:
                row["fraction_of_matmul"] = row["tflops"] / rate
    best = (results.get("variant_best") or {}).get("local")
    if best and flex_ms:
        best["speedup_vs_flex_attention"] = flex_ms / best["ms"]


VARIANT_ROW = "VARIANT_ROW "


CHILD_TIMED_OUT = "child process: no result within"
# After this many wgmma children in a row ran out of their time, the wgmma kernels left
# are skipped (their rows say so): the stages after the variants keep their time.
MAX_CONSECUTIVE_TIMEOUTS = 3


def child_command(entry: dict, libs: str, device: str, shape, budget_s: float) -> list[str]:
    """The command of ``isolated_variant_row``'s child: this module's ``--variant``."""
    return [sys.executable, "-m", "tools.gpu_check", "--libs", libs, "--variant", entry["function"],
            "--device", device, "--variant-shape", ",".join(map(str, shape)), "--budget-s", f"{budget_s:.0f}"]


def isolated_variant_row(entry: dict, libs: str, device: str = "cuda", shape=VARIANT_SHAPE) -> dict:
    """``variant_rows``' row of one variant, from a child process (``main --variant``)
    under its own timeout (``--child-timeout-s``, at most the time the run has left);
    the child's failure (crash, CUDA error, time) is the row's error."""
    left = _deadline - time.monotonic()
    if left < 1.0:
        return dict(entry, error=OUT_OF_TIME)
    limit = min(_child_timeout, left)
    cmd = child_command(entry, libs, device, shape, limit)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        tail = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        print(f"  variant {entry['function']}: child killed after {limit:.0f} s\n{tail[-600:]}", flush=True)
        return dict(entry, error=f"{CHILD_TIMED_OUT} its timeout of {limit:.0f} s", child_s=limit,
                    child_tail=tail[-600:])
    for line in proc.stdout.splitlines():
        if line.startswith(VARIANT_ROW):
            row = json.loads(line[len(VARIANT_ROW):])
            row["child_s"] = time.monotonic() - t0
            print(f"  variant {json.dumps(row)}", flush=True)
            return row
    tail = (proc.stdout + proc.stderr)[-600:]
    print(f"  variant {entry['function']}: child rc {proc.returncode}\n{tail}", flush=True)
    return dict(entry, error=f"child process rc {proc.returncode}: {tail}", child_s=time.monotonic() - t0)


def libraries_for(libs: list[str], name: str) -> list[str]:
    """The libraries among ``libs`` whose manifest lists kernel ``name`` (all of them
    where none does or a manifest cannot be read): what a variant's child registers
    for its reference, not every library."""
    found = []
    for lib in libs:
        try:
            with open(lib + ".json") as f:
                if any(k.get("name") == name for k in json.load(f)["kernels"]):
                    found.append(lib)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return list(libs)
    return found or list(libs)


def load_variants(libs: str):
    """(variants.json's contents, the variants' module) of ``<libs>/variants``, loaded
    through the TVM runtime alone (its CUDA part included)."""
    import tvm_ffi

    folder = os.path.join(libs, "variants")
    with open(os.path.join(folder, "variants.json")) as f:
        meta = json.load(f)
    library._load_tvm_runtime()
    library.cuda_unavailable_reason()  # also loads libtvm_runtime_cuda, which CUDA modules need
    return meta, tvm_ffi.load_module(os.path.join(folder, meta["library"]))


def probe_row(module, entry: dict, dev: torch.device) -> dict:
    """One wgmma alone (gpu_bundle.WGMMA_PROBES, ``cuda_wgmma.probe``) against torch's
    product of the same bf16 operands in fp32: ``agrees`` says whether the hardware
    reads the tile as the descriptor is meant to."""
    row = dict(entry)
    try:
        rows, cols, ks = entry["rows"], entry["cols"], entry["ks"]
        a = torch.randn(64, 16, device=dev).to(torch.bfloat16)
        m = torch.randn(rows, cols, device=dev).to(torch.bfloat16)
        b = m[:, 16 * ks:16 * ks + 16].T if entry["operand"] == "nk" else m[16 * ks:16 * ks + 16, :]
        d = torch.full((64, b.shape[1]), float("nan"), device=dev)
        module[entry["function"]](a, m, d)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        row["rel_err"] = rel_err(d.double(), a.double() @ b.double())
        row["agrees"] = row["rel_err"] < 1e-5
    except Exception as e:  # noqa: BLE001 - the row says what happened
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"  probe {json.dumps(row)}", flush=True)
    return row




def variant_rows(module, meta: dict, dev: torch.device, shape=VARIANT_SHAPE, on_row=None) -> list[dict]:
    """One row per entry of ``meta["variants"]`` (function ``module[entry["function"]]``
    computing the kernel kind ``entry["kind"]`` of ``meta["spec"]``'s window): its
    largest relative error against the registered library (forward output, or
    autograd's dq, or dk and dv summed over the GQA groups), median ms and useful
    TFLOP/s at ``shape`` = B, H, H_kv, T; ``on_row(row)`` after each (the results file
    written). The gradients' reference only where a gradient variant is among them."""
    import tvm_ffi

    spec = KernelSpec.from_dict(meta["spec"])
    (B, H, Hkv, T), D, W = shape, spec.head_dim, spec.left + 1
    dtype = getattr(torch, spec.dtype)
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    dil = torch.ones(H, dtype=torch.int32, device=dev)
    sink = torch.full((H,), float("-inf"), device=dev)
    out, lse = swa_tvm.sliding_window_attention(q, k, v, window_size=(spec.left, spec.right), return_lse=True)
    ref = {"local": (out.detach(),)}
    if any(e.get("kind", "local") != "local" for e in meta["variants"]):
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        ref.update(local_dq=(dq,), local_dkv=(dk, dv))
    q, k, v, lse = q.detach(), k.detach(), v.detach(), lse.detach().float()
    delta = (dout.float() * out.detach().float()).sum(-1)  # dout . out (no lse gradient)
    # Useful FLOPs: 2 per multiply-add of each product over the band (causal: row i sees
    # min(i + 1, W) keys): forward S and P V; dq S, dP, dS K; dk/dv S, dP, P^T dO, dS^T Q.
    band = B * H * D * (W * T - W * (W - 1) // 2)
    products = {"local": 2, "local_dq": 3, "local_dkv": 4}
    per_head = lambda x: x.view(B, Hkv, H // Hkv, T, D).sum(2)  # noqa: E731 - dk/dv per query head -> GQA sum
    # Looked up once, outside the timed calls (as before the gradient variants).
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else None
    rows = []
    for entry in meta["variants"]:
        row = dict(entry)
        kind = entry.get("kind", "local")
        if _out_of_time():
            rows.append(dict(row, error=OUT_OF_TIME))
            if on_row is not None:
                on_row(rows[-1])
            continue
        try:
            fn = module[entry["function"]]
            if kind == "local":
                outs = (torch.empty_like(q), torch.empty(B, H, T, device=dev))
                args = (q, k, v, dil, sink, D**-0.5) + outs
            else:
                n = 1 if kind == "local_dq" else 2
                outs = (torch.empty_like(q),) if n == 1 else tuple(torch.empty(B, H, T, D, device=dev) for _ in range(2))
                args = (q, k, v, dil, dout, lse, delta, D**-0.5) + outs

            def call(fn=fn, args=args):
                if stream is None:
                    fn(*args)
                    return
                with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", dev.index or 0), stream):
                    fn(*args)

            call()
            got = tuple(per_head(x) for x in outs) if kind == "local_dkv" else outs[:1]
            row["rel_err_vs_default"] = max(rel_err(a.float(), b.float()) for a, b in zip(got, ref[kind]))
            row["ms"] = _time_ms(call)
            row["tflops"] = 2.0 * products[kind] * band / (row["ms"] * 1e-3) / 1e12
            staged = staged_bytes(entry, meta["spec"], shape)
            if staged:
                row["staged_gb"], row["staged_tb_s"] = staged / 1e9, staged / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(f"  variant {json.dumps(row)}", flush=True)
        if on_row is not None:
            on_row(row)
        _empty_cache()
    return rows


def measure_tune_batch(results: dict, dev: torch.device, batch: str, out: str) -> None:
    """Measure the tuning batch (if one was built) into ``<out>/measured.json``."""
    if not os.path.exists(os.path.join(batch, "batch.json")):
        results["tuning"] = "no batch built"
        return
    with open(os.path.join(batch, "batch.json")) as f:
        built_for = json.load(f)["device"]
    if built_for != dev.type:
        results["tuning"] = f"skipped: the batch is for {built_for}, this run is on {dev.type}"
        return
    measured = measure_batch.measure(batch, dev.type, deadline=_deadline)
    with open(os.path.join(out, measure_batch.MEASURED_FILE), "w") as f:
        json.dump(measured, f, indent=1)
    rows = measured["results"]
    base = [r for r in rows if r["id"].endswith("-base")]
    cands = [r for r in rows if not r["id"].endswith("-base")]
    times = sorted(statistics.median(r["run_secs"]) * 1e3 for r in cands if "run_secs" in r)
    results["tuning"] = {
        "candidates": len(cands),
        "measured": len(times),
        "best_candidate_ms": times[0] if times else None,
        "baseline_ms": [statistics.median(r["run_secs"]) * 1e3 for r in base if "run_secs" in r],
        "errors": sorted({r["error"][:120] for r in rows if "error" in r}),
    }
    print(f"  tuning batch: {results['tuning']}", flush=True)


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _visible_mask(T, W, dilation, gidx, device):
    """[T, T] bool: what a row sees (window of W dilated causal steps, plus globals)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    off = i - j
    m = (off >= 0) & (off % dilation == 0) & (off // dilation < W)
    if gidx is not None:
        g = torch.zeros(T, dtype=torch.bool, device=device)
        g[gidx.long()] = True
        m |= (g[None, :] | g[:, None]) & (off >= 0)
    return m


def bar_shape(dev: torch.device, quick: bool = False) -> tuple:
    """(B, H, H_kv, D, T, W, dtype) of the bars: bf16 B=1 H=32 H_kv=8 D=128 T=32768
    causal W=4096 on the GPU; smaller with ``quick``; tiny float32 on the CPU (the
    smoke run: the harness, not the numbers)."""
    B, H, Hkv, D, T, W = 1, 32, 8, 128, 32768, 4096
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if quick:
        T, W = 8192, 1024
    if dev.type != "cuda":
        H, Hkv, D, T, W = 4, 2, 64, 1024, 128
    return B, H, Hkv, D, T, W, dtype


def compiled_flex(results: dict):
    """FlexAttention under torch.compile, or None (the reason in results["flex_error"])."""
    try:
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001
        results["flex_error"] = f"{type(e).__name__}: {e}"
        return None


def bars(results: dict, dev: torch.device, quick: bool) -> None:
    """The bars: the matmul rate (the ceiling), an L2 read rate, and ours against
    FlexAttention and SDPA at the bar shape (causal, dilation 2, 64 globals); then each
    forward variant measured so far against the same (``against_the_bars``)."""
    B, H, Hkv, D, T, W, dtype = bar_shape(dev, quick)
    peak = matmul_rate(dev, dtype)
    results["matmul_tflops"] = peak
    if dev.type == "cuda":
        results["l2_read_tb_s"] = l2_read_rate(dev)
        print(f"  L2-resident read (torch sum of 16 MiB): {results['l2_read_tb_s']:.2f} TB/s", flush=True)
    results["bench_dtype"] = str(dtype).replace("torch.", "")
    print(f"  {results['bench_dtype']} matmul: {peak:.1f} TFLOP/s", flush=True)
    flex = compiled_flex(results)
    configs = [("causal", 1, 0), ("dilation 2", 2, 0), ("64 globals", 1, 64)]
    rows = results["timing"] = []  # saved as it grows
    for name, d, G in configs:
        if _out_of_time():
            rows.append({"config": name, "error": OUT_OF_TIME})
            continue
        q = torch.randn(B, H, T, D, device=dev, dtype=dtype)
        k = torch.randn(B, Hkv, T, D, device=dev, dtype=dtype)
        v = torch.randn(B, Hkv, T, D, device=dev, dtype=dtype)
        gidx = torch.randperm(T, device=dev)[:G].sort().values.int() if G else None
        mask = _visible_mask(T, W, d, gidx, dev)
        visible = int(mask.sum())
        flops = 4.0 * B * H * D * visible
        row = {"config": name, "T": T, "W": W, "dilation": d, "globals": G, "useful_gflop": flops / 1e9}
        kw = dict(window_size=(W - 1, 0), dilation=d)
        if G:
            kw["global_idx"] = gidx[None]
        ours = lambda: swa_tvm.sliding_window_attention(q, k, v, **kw)  # noqa: E731, F821
        try:
            out = ours()
            row["ours_ms"] = _time_ms(ours)
        except Exception as e:  # noqa: BLE001
            row["ours_error"] = f"{type(e).__name__}: {e}"
        peers = {}
        if flex is not None:
            gmask = None
            if G:
                gmask = torch.zeros(T, dtype=torch.bool, device=dev)
                gmask[gidx.long()] = True

            def mask_mod(b, h, qi, ki):
                off = qi - ki
                m = (off >= 0) & (off % d == 0) & (off // d < W)
                if gmask is not None:
                    m = m | ((gmask[ki] | gmask[qi]) & (off >= 0))
                return m

            try:
                from torch.nn.attention.flex_attention import create_block_mask

                bm = create_block_mask(mask_mod, None, None, T, T, device=dev)
                peers["flex_attention"] = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731, F821
            except Exception as e:  # noqa: BLE001
                row["flex_attention_error"] = f"{type(e).__name__}: {e}"
        kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        peers["sdpa_banded_mask"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)  # noqa: E731, F821
        peers["sdpa_causal_full"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)  # noqa: E731, F821
        for pname, fn in peers.items():
            if _out_of_time():
                row[f"{pname}_error"] = OUT_OF_TIME
                continue
            try:
                po = fn()
                if pname != "sdpa_causal_full" and "ours_ms" in row:
                    row[f"{pname}_vs_ours_rel_err"] = rel_err(po.float(), out.float())
                row[f"{pname}_ms"] = _time_ms(fn)
                if "ours_ms" in row:
                    row[f"speedup_vs_{pname}"] = row[f"{pname}_ms"] / row["ours_ms"]
            except Exception as e:  # noqa: BLE001
                row[f"{pname}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            _empty_cache()
        if "ours_ms" in row:
            row["ours_tflops"] = flops / (row["ours_ms"] * 1e-3) / 1e12
            row["ours_fraction_of_matmul"] = row["ours_tflops"] / peak
        rows.append(row)
        print(f"  {json.dumps(row)}", flush=True)
        _save()
        # The lambdas above have run (ruff reads their names as the ones deleted here: F821).
        del q, k, v, kr, vr, mask, peers
        _empty_cache()
    against_the_bars(results)


def scaling(results: dict, dev: torch.device, quick: bool) -> None:
    """Our causal forward at T = 8K ... 128K, as far as memory allows."""
    B, H, Hkv, D, _, W, dtype = bar_shape(dev, quick)
    rows = []
    for T2 in (8192, 16384, 32768, 65536, 131072):
        if (quick or dev.type != "cuda") and T2 > 16384:
            break
        if _out_of_time():
            rows.append({"T": T2, "error": OUT_OF_TIME})
            break
        try:
            q = torch.randn(B, H, T2, D, device=dev, dtype=dtype)
            k = torch.randn(B, Hkv, T2, D, device=dev, dtype=dtype)
            ms = _time_ms(lambda: swa_tvm.sliding_window_attention(q, k, k, window_size=(W - 1, 0)), warmup=1, reps=5)
            rows.append({"T": T2, "ours_ms": ms})
        except Exception as e:  # noqa: BLE001 - out of memory ends the sweep
            rows.append({"T": T2, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            break
        finally:
            q = k = None
            _empty_cache()
        print(f"  scaling {rows[-1]}", flush=True)
    results["scaling"] = rows


def training(results: dict, dev: torch.device, quick: bool) -> None:
    """``time_training`` at the bar shape (causal), against FlexAttention and SDPA."""
    B, H, Hkv, D, T, W, dtype = bar_shape(dev, quick)
    flex = compiled_flex(results) if dev.type == "cuda" else None  # the CPU smoke run: ours and SDPA
    time_training(results, dev, flex, T, W, shape=(B, H, Hkv, D), dtype=dtype)


def time_training(results: dict, dev: torch.device, flex, T: int, W: int, shape=(1, 32, 8, 128),
                  dtype=torch.bfloat16) -> None:
    """Forward + backward (gradients of q, k, v) at the timing shape (causal window W;
    ``shape`` = B, H, H_kv, D), ours against FlexAttention and SDPA with the banded
    mask; dq/dk/dv compared with each peer's."""
    B, H, Hkv, D = shape
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    mask = _visible_mask(T, W, 1, None, dev)
    row = {"T": T, "W": W, "H": H, "H_kv": Hkv, "D": D, "dtype": str(dtype).replace("torch.", ""),
           "useful_gflop_fwd_bwd": 4.0 * 3.5 * B * H * D * int(mask.sum()) / 1e9}  # bwd ~ 2.5x fwd FLOPs

    def grads(fn):
        return torch.autograd.grad(fn(), (q, k, v), dout)

    runs = {"ours": lambda: swa_tvm.sliding_window_attention(q, k, v, window_size=(W - 1, 0))}
    if flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W), None, None, T, T, device=dev)
        runs["flex_attention"] = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)
    kr = lambda x: x.repeat_interleave(H // Hkv, 1)  # noqa: E731
    runs["sdpa_banded_mask"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, kr(k), kr(v), attn_mask=mask)
    ours_grads = None
    for name, fn in runs.items():
        if _out_of_time():
            row[f"{name}_error"] = OUT_OF_TIME
            continue
        try:
            g = grads(fn)
            if name == "ours":
                ours_grads = g
            elif ours_grads is not None:
                row[f"{name}_grads_vs_ours_rel_err"] = max(rel_err(a.float(), b.float()) for a, b in zip(g, ours_grads))
            row[f"{name}_fwd_ms"] = _time_ms(lambda: fn())
            row[f"{name}_fwd_bwd_ms"] = _time_ms(lambda: grads(fn))
        except Exception as e:  # noqa: BLE001 - out of memory or a peer's failure: keep the rest
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        _empty_cache()
    for name in runs:
        if name != "ours" and f"{name}_fwd_bwd_ms" in row and "ours_fwd_bwd_ms" in row:
            row[f"speedup_vs_{name}"] = row[f"{name}_fwd_bwd_ms"] / row["ours_fwd_bwd_ms"]
    results["training"] = row
    print(f"  training {json.dumps(row)}", flush=True)


# Every stage, and those run without --stages: what decides the Hopper forward's design
# first (the forward variants, the wgmma probes and kernels first; the bars; training and
# scaling), then the gradients' variants and the correctness of every pattern. The
# KV-cache check, the decode timing and the tuning batch only when named (or --tune).
STAGES = ("variants", "bars", "training", "scaling", "grad_variants", "correctness", "kv_cache", "decode", "tuning")
DEFAULT_STAGES = ("variants", "bars", "training", "scaling", "grad_variants", "correctness")
BENCH_STAGES = ("bars", "training", "scaling", "decode")  # what --skip-bench drops (not the variants)


def parse_stages(text: str | None, tune: bool = False, skip_bench: bool = False) -> list[str]:
    """The stages to run, in order: ``text``'s comma-separated names (default
    DEFAULT_STAGES), ``tuning`` added with ``tune``, the bench ones (BENCH_STAGES)
    dropped with ``skip_bench``."""
    stages = [x.strip() for x in text.split(",") if x.strip()] if text else list(DEFAULT_STAGES)
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        raise SystemExit(f"--stages: unknown {', '.join(unknown)}; the stages are {', '.join(STAGES)}")
    if tune and "tuning" not in stages:
        stages.append("tuning")
    if skip_bench:
        stages = [x for x in stages if x not in BENCH_STAGES]
    return list(dict.fromkeys(stages))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default=os.path.join("build", "gpu", "lib"), help="folder of CUDA libraries to load")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_results.json")
    p.add_argument("--stages", help=f"comma-separated stages, run in that order (default {','.join(DEFAULT_STAGES)}; "
                                    f"all: {','.join(STAGES)})")
    p.add_argument("--quick", action="store_true", help="small timing shapes (a smoke run)")
    p.add_argument("--skip-bench", action="store_true", help=f"leave out the bench stages ({','.join(BENCH_STAGES)})")
    p.add_argument("--tune", action="store_true", help="also measure the MetaSchedule batch (stage tuning, last)")
    p.add_argument("--batch", default=os.path.join("build", "gpu", "tune_batch"),
                   help="the tuning batch the tuning stage measures (skipped when absent)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke run of this harness with the CPU kernels (float32, tiny shapes)")
    p.add_argument("--variant", help="only this function of lib/variants, its row printed (time_variants' child)")
    p.add_argument("--variant-shape", default=",".join(map(str, VARIANT_SHAPE)), help="--variant's B,H,H_kv,T")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="seconds after which nothing more is timed (the stages left write what they skipped), "
                        "so that the run ends inside the device tool's limit with its results written")
    p.add_argument("--child-timeout-s", type=float, default=DEFAULT_CHILD_TIMEOUT,
                   help=f"seconds each child process (a wgmma variant or probe) may take, at most the time left "
                        f"(default {DEFAULT_CHILD_TIMEOUT:.0f})")
    args = p.parse_args(argv)
    args.stage_list = parse_stages(args.stages, args.tune, args.skip_bench)
    global _deadline, _child_timeout, _saver
    _deadline = time.monotonic() + args.budget_s
    _child_timeout = args.child_timeout_s
    try:
        return _run(args)
    finally:
        # The budget is this run's, not the next caller's of these functions.
        _deadline, _child_timeout, _saver = float("inf"), DEFAULT_CHILD_TIMEOUT, None


def _stage_functions(args, results: dict, dev: torch.device) -> dict:
    """Each stage's call (looked up when it runs: the module's functions)."""
    return {
        "variants": lambda: time_variants(results, dev, args.libs, FORWARD_KINDS, "variants"),
        "bars": lambda: bars(results, dev, args.quick),
        "training": lambda: training(results, dev, args.quick),
        "scaling": lambda: scaling(results, dev, args.quick),
        "grad_variants": lambda: time_variants(results, dev, args.libs, GRAD_KINDS, "grad_variants"),
        "correctness": lambda: check_patterns(results, dev),
        "kv_cache": lambda: check_kv_cache(results, dev),
        "decode": lambda: bench_decode(results, dev, args.quick),
        "tuning": lambda: measure_tune_batch(results, dev, args.batch, args.out),
    }


def _run(args) -> int:
    global _saver
    dev = torch.device(args.device)
    libs = sorted(glob.glob(os.path.join(args.libs, "*.so")))
    if args.variant:  # time_variants' child: one row (a kernel's: its library for the reference)
        meta, module = load_variants(args.libs)
        entries = [e for e in meta["variants"] if e["function"] == args.variant]
        if not entries:
            raise SystemExit(f"--variant {args.variant}: not in {args.libs}/variants/variants.json")
        shape = tuple(int(x) for x in args.variant_shape.split(","))
        if entries[0]["kind"] == "wgmma_probe":
            row = probe_row(module, entries[0], dev)
        else:
            for lib in libraries_for(libs, KernelSpec.from_dict(meta["spec"]).name):
                swa_tvm.load_library(lib)
            (row,) = variant_rows(module, dict(meta, variants=entries), dev, shape)
        print(VARIANT_ROW + json.dumps(row), flush=True)
        return 0 if "error" not in row else 1
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (smoke run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "stages": args.stage_list,
        "child_timeout_s": args.child_timeout_s,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_results.json")

    def save():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=2)
        os.replace(tmp, path)  # a run killed mid-write keeps the last whole file

    _saver = save
    results["libraries"] = []
    ok = True
    for lib in libs:
        t0 = time.time()
        try:
            specs = swa_tvm.load_library(lib)
        except Exception as e:  # noqa: BLE001 - the stages that need no library (variants, tuning) still run
            ok = False
            results["libraries"].append({"path": lib, "error": f"{type(e).__name__}: {e}"})
            print(traceback.format_exc(), flush=True)
            continue
        entry = {"path": lib, "kernels": len(specs), "load_s": time.time() - t0}
        try:  # which kernel each spec got (tensor-core flash, CUDA-core flash, TE default, tuned), which tiles
            with open(lib + ".json") as f:
                manifest_kernels = json.load(f)["kernels"]
            entry["schedules"] = {k["name"]: k.get("schedule") for k in manifest_kernels}
            entry["tiles"] = {k["name"]: k["tiles"] for k in manifest_kernels if "tiles" in k}
        except (OSError, ValueError, KeyError):
            pass
        results["libraries"].append(entry)
    print(f"loaded {sum('error' not in e for e in results['libraries'])} of {len(libs)} libraries", flush=True)
    save()
    functions = _stage_functions(args, results, dev)
    for stage in args.stage_list:
        print(f"== {stage}", flush=True)
        t0 = time.time()
        if _out_of_time():
            results[stage] = OUT_OF_TIME
            ok = False
            save()
            continue
        try:
            r = functions[stage]()
            if r is False:
                ok = False
        except Exception as e:  # noqa: BLE001 - keep what was measured
            ok = False
            results[f"{stage}_error"] = f"{type(e).__name__}: {e}"
            results[f"{stage}_trace"] = traceback.format_exc()[-3000:]
            print(traceback.format_exc(), flush=True)
        results[f"{stage}_seconds"] = time.time() - t0
        save()
    results["ok"] = ok
    save()
    print(f"wrote {path}; {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
