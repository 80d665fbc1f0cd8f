"""``python -m benchmarks.forward``: every CPU peer, one process, same inputs.

Methods: swa_tvm tuned (a library exported with the tuning logs), swa_tvm default (the
same specs, default schedules), torch SDPA with a boolean banded mask, FlexAttention
(block mask, under torch.compile) and a pure-torch "sliding chunks" implementation in
Longformer's style. Every method is checked against ours on the same inputs before it
is timed. Times are medians of ``--runs`` runs (more for calls under 0.1 s), the methods
of one shape timed round-robin (``interleaved_medians``), after a warm-up; GFLOP/s counts useful
work only (4*D per visible (query, key) pair); % of peak is against a large
torch.matmul timed in the same run. Peak memory is measured in a fresh subprocess per
(method, config) at the largest T. Writes ``results.json`` and ``scaling.png``.

``--mcpu NAME`` builds for another CPU class than this machine's (LLVM's name, e.g.
``rocketlake`` on an Intel machine with AMX runs the code of an Intel class without it),
with that class's tuning records; results then go to
``benchmarks/results/llvm-<NAME>-on-<this machine's mcpu>``. In a bfloat16 or float16
run, the method "swa_tvm float32" times the float32 tuned library on float32 copies of
the same inputs (copied before the timing), so the two dtypes of our kernels are timed
round-robin in one run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

import swa_tvm
from swa_tvm.compiler.targets import host_target, target_key
from swa_tvm.runtime import library
from swa_tvm.spec import AttentionSpec

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_results(result: dict, name: str, out: str | None) -> str:
    """``result`` as JSON in ``results_dir(out)``/``name``; its path."""
    folder = results_dir(out)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return path


def _foreign(target: dict | None) -> bool:
    """Whether ``target`` is not this machine's own target: another class, or the same
    -mcpu name with other features (a virtual machine LLVM names rocketlake gets AMX in
    its host target, which ``--mcpu rocketlake`` leaves out)."""
    return target is not None and target != host_target()


def results_dir(out: str | None, target: dict | None = None) -> str:
    """``out``, or benchmarks/results/<target-key>: this machine's own target, or, for
    another (``_foreign``), ``<its key>-on-<this machine's mcpu>``."""
    if out:
        return out
    host = host_target()
    key = target_key(host)
    if _foreign(target):
        key = f"{target_key(target)}-on-{host['mcpu']}"
    return os.path.join(_REPO, "benchmarks", "results", key)


def add_mcpu_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mcpu", default=None, help="build for this LLVM CPU class instead of this machine's "
                   "(its tuning records; results in benchmarks/results/llvm-<MCPU>-on-<this mcpu>)")


def parsed_target(p: argparse.ArgumentParser, mcpu: str | None) -> dict:
    """``bench_target(mcpu)``, a bad name a usage error of ``p``."""
    try:
        return bench_target(mcpu)
    except ValueError as e:
        p.error(f"--mcpu: {e}")


def bench_target(mcpu: str | None) -> dict:
    """This machine's target, or the llvm target of CPU class ``mcpu`` on this machine's
    cores (without the AMX features the host target would add)."""
    host = host_target()
    if mcpu is None:
        return host
    from swa_tvm.compiler.targets import normalize_target

    return normalize_target({"kind": "llvm", "mcpu": mcpu, "num-cores": host["num-cores"]})

B, H, D = 1, 8, 64
CONFIGS = {
    "causal W=512": dict(window=(511, 0), dilation=1, G=0),
    "symmetric (256,256)": dict(window=(256, 256), dilation=1, G=0),
    "dilation 2, W=256": dict(window=(255, 0), dilation=2, G=0),
    "W=512 + 16 globals": dict(window=(511, 0), dilation=1, G=16),
}
METHODS = ["swa_tvm tuned", "swa_tvm default", "FlexAttention", "sliding chunks", "SDPA + mask"]
# Our float32 library on float32 copies of a 16-bit run's inputs: not in the default set.
FLOAT32 = "swa_tvm float32"
DTYPES = ("float32", "bfloat16", "float16")
# A peer's output agrees with ours within this relative error (both rounded to the dtype
# once; peers that compute in the input dtype add their own rounding).
AGREE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 1e-2}
DENSE_MAX_T = 16384  # SDPA's T x T boolean mask: 4 GiB at T=65536


def spec_strings(dtype: str = "float32") -> list[str]:
    """The shipped spec set: what the benchmark exports and the committed logs tune
    (float32; ``dtype`` for the benchmark's other dtypes)."""
    out = []
    for cfg in CONFIGS.values():
        left, right = cfg["window"]
        s = f"head_dim={D},window={left}:{right}"
        if cfg["dilation"] > 1:
            s += f",dilation={cfg['dilation']}"
        if cfg["G"]:
            s += ",globals"
        if dtype != "float32":
            s += f",dtype={dtype}"
        out.append(s)
    return out


# --------------------------------------------------------------------------- inputs


def global_positions(T: int, G: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.sort(torch.randperm(T, generator=g)[:G]).values.to(torch.int32).view(1, G)


def visible_pairs(T: int, cfg: dict) -> int:
    """Exact number of (query, key) pairs the pattern allows (the useful work)."""
    left, right = cfg["window"]
    d = cfg["dilation"]
    i = np.arange(T, dtype=np.int64)
    # Steps s with -left <= s <= right and 0 <= i + s*d < T.
    smin = -np.minimum(left if left >= 0 else T, i // d)
    smax = np.minimum(right if right >= 0 else T, (T - 1 - i) // d)
    total = int((smax - smin + 1).sum())
    G = cfg["G"]
    if G:
        gi = global_positions(T, G).numpy()[0].astype(np.int64)
        is_g = np.zeros(T, bool)
        is_g[gi] = True
        # Global rows see every key j <= i (causal) or all keys; they replace their window.
        causal = right == 0
        for r in gi:
            s_lo, s_hi = smin[r], smax[r]
            total -= int(s_hi - s_lo + 1)
            total += int(r + 1) if causal else T
        # Other rows also see the global keys outside their window (and causal).
        rows = np.flatnonzero(~is_g)
        for g in gi:
            diff = g - rows
            in_win = (diff % d == 0) & (diff // d >= smin[rows]) & (diff // d <= smax[rows])
            ok = ~in_win & ((g <= rows) if causal else True)
            total += int(ok.sum())
    return total


# --------------------------------------------------------------------------- methods


def band_mask_mod(cfg: dict, is_global: torch.Tensor | None):
    left, right = cfg["window"]
    d = cfg["dilation"]
    causal = right == 0

    def mask_mod(b, h, qi, kj):
        diff = kj - qi
        ok = (diff % d == 0) & (diff >= -left * d) & (diff <= right * d)
        if is_global is not None:
            extra = is_global[kj] | is_global[qi]
            if causal:
                extra = extra & (kj <= qi)
            ok = ok | extra
        return ok

    return mask_mod


def dense_mask(T: int, cfg: dict, gi: torch.Tensor | None) -> torch.Tensor:
    qi = torch.arange(T).view(T, 1)
    kj = torch.arange(T).view(1, T)
    is_g = None
    if gi is not None:
        is_g = torch.zeros(T, dtype=torch.bool)
        is_g[gi.long().view(-1)] = True
    return band_mask_mod(cfg, is_g)(None, None, qi, kj)


def sliding_chunks(q, k, v, cfg: dict, gi: torch.Tensor | None):
    """Longformer-style banded attention in plain torch: queries in chunks of c rows,
    each against the (left/c + 1 + right/c) key chunks around it, masked to the band.
    Uniform dilation d is exact as d interleaved undilated problems. Global keys are
    extra columns of every row's softmax; global rows are recomputed densely."""
    left, right = cfg["window"]
    d = cfg["dilation"]
    Bq, Hq, T, Dq = q.shape
    scale = 1.0 / math.sqrt(Dq)
    if d > 1:
        out = torch.empty_like(q)
        for r in range(d):
            sub = dict(cfg, dilation=1, G=0)
            out[:, :, r::d] = sliding_chunks(q[:, :, r::d], k[:, :, r::d], v[:, :, r::d], sub, None)
        if gi is None:
            return out
        raise NotImplementedError("sliding chunks with dilation and globals")
    c = max(left, right, 1)
    nl, nr = -(-left // c), -(-right // c)
    n = -(-T // c)
    pad_q = n * c - T
    qp = torch.nn.functional.pad(q, (0, 0, 0, pad_q)).view(Bq, Hq, n, c, Dq)
    kp = torch.nn.functional.pad(k, (0, 0, nl * c, pad_q + nr * c))
    vp = torch.nn.functional.pad(v, (0, 0, nl * c, pad_q + nr * c))
    span = (nl + 1 + nr) * c
    kc = kp.unfold(2, span, c).transpose(-1, -2)  # [B,H,n,span,D]
    vc = vp.unfold(2, span, c).transpose(-1, -2)
    scores = torch.matmul(qp, kc.transpose(-1, -2)) * scale  # [B,H,n,c,span]
    qpos = (torch.arange(n).view(n, 1, 1) * c + torch.arange(c).view(1, c, 1))
    kpos = torch.arange(n).view(n, 1, 1) * c - nl * c + torch.arange(span).view(1, 1, span)
    diff = kpos - qpos
    ok = (diff >= -left) & (diff <= right) & (kpos >= 0) & (kpos < T)
    if gi is not None:
        gl = gi.long().view(-1)
        is_g = torch.zeros(T + 1, dtype=torch.bool)
        is_g[gl] = True
        # Global keys inside the band are already there: count them once.
        in_band = ((gl.view(1, -1) - torch.arange(T).view(-1, 1)) >= -left) & (
            (gl.view(1, -1) - torch.arange(T).view(-1, 1)) <= right
        )
        g_ok = ~in_band & ((gl.view(1, -1) <= torch.arange(T).view(-1, 1)) if right == 0 else True)
        gscores = torch.matmul(q, k[:, :, gl].transpose(-1, -2)) * scale  # [B,H,T,G]
        gscores = gscores.masked_fill(~g_ok, float("-inf"))
        gscores = torch.nn.functional.pad(gscores, (0, 0, 0, pad_q)).view(Bq, Hq, n, c, -1)
        allsc = torch.cat([scores.masked_fill(~ok, float("-inf")), gscores], dim=-1)
        p = torch.softmax(allsc, dim=-1)
        out = torch.matmul(p[..., :span], vc) + torch.matmul(p[..., span:], v[:, :, gl].unsqueeze(2))
        out = out.reshape(Bq, Hq, n * c, Dq)[:, :, :T].contiguous()
        # Global rows see every (causal) key.
        qg = q[:, :, gl]
        full = torch.matmul(qg, k.transpose(-1, -2)) * scale
        if right == 0:
            full = full.masked_fill(torch.arange(T).view(1, -1) > gl.view(-1, 1), float("-inf"))
        out[:, :, gl] = torch.matmul(torch.softmax(full, dim=-1), v)
        return out
    p = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1)
    out = torch.matmul(p, vc)
    return out.reshape(Bq, Hq, n * c, Dq)[:, :, :T].contiguous()


# Each library's kernels, as load_library registered them (by path).
_LIBRARY_KERNELS: dict = {}


def use_library(path: str) -> None:
    """Make ``path``'s kernels the registered ones. The "tuned" and "default" libraries
    hold the same kernel names, and the registry keeps one kernel per name: so each call
    of a method re-registers its library's kernels (a few dictionary entries; the file
    is loaded and checked once). Registered only when a method was made, the library
    made last served both methods' timed calls."""
    if path not in _LIBRARY_KERNELS:
        swa_tvm.load_library(path)
        _LIBRARY_KERNELS[path] = [k for k in library.REGISTRY.kernels() if k.origin == path]
    for kernel in _LIBRARY_KERNELS[path]:
        library.REGISTRY.add(kernel)


def make_method(name: str, T: int, cfg: dict, gi, libs: dict):
    """A no-argument callable computing attention on (q, k, v) for one method, or None
    where it does not apply (dense peers past DENSE_MAX_T)."""
    if name.startswith("swa_tvm"):
        path = libs[{"swa_tvm tuned": "tuned", "swa_tvm default": "default", FLOAT32: "float32"}[name]]
        use_library(path)

        def run(q, k, v):
            use_library(path)
            return swa_tvm.sliding_window_attention(
                q, k, v, window_size=cfg["window"], dilation=cfg["dilation"], global_idx=gi
            )

        return run
    if name == "SDPA + mask":
        if T > DENSE_MAX_T:
            return None
        mask = dense_mask(T, cfg, gi)
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if name == "FlexAttention":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        is_g = None
        if gi is not None:
            is_g = torch.zeros(T, dtype=torch.bool)
            is_g[gi.long().view(-1)] = True
        # _compile=True builds the block mask block by block; the eager path evaluates
        # mask_mod on all T x T pairs at once (32 GiB at T=65536).
        block_mask = create_block_mask(band_mask_mod(cfg, is_g), None, None, T, T, device="cpu", _compile=True)
        # Each (pattern, T) compiles afresh: past dynamo's recompile limit (8),
        # fullgraph=True turns a recompile into an error.
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    if name == "sliding chunks":
        return lambda q, k, v: sliding_chunks(q, k, v, cfg, gi)
    raise ValueError(name)


# --------------------------------------------------------------------------- measuring


# Short calls are repeated until their runs span this long (at most MAX_RUNS runs): five
# 8 ms calls last 40 ms, and one burst of a shared machine's noise then moves the median.
MIN_SECONDS, MAX_RUNS = 0.5, 200
HANDOFF_SECONDS = 0.1


def _wants_more(ts: list, runs: int, min_seconds: float) -> bool:
    """Whether a method timed ``ts`` (seconds) so far needs another timed call."""
    return len(ts) < runs or (sum(ts) < min_seconds and len(ts) < MAX_RUNS)


def median_ms(fn, runs: int = 5, min_seconds: float = MIN_SECONDS) -> float:
    """Median wall time in ms of at least ``runs`` calls, more for short calls until the
    timed calls add up to ``min_seconds`` (at most MAX_RUNS), after one warm-up call
    (which compiles FlexAttention at this shape)."""
    fn()
    ts = []
    while _wants_more(ts, runs, min_seconds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def interleaved_medians(fns: dict, runs: int = 5, min_seconds: float = MIN_SECONDS) -> dict:
    """Median wall time in ms of each callable, timed round-robin: one call of every
    method per round, so a burst of the shared machine's noise lands on all of them
    alike, not on whichever was being timed. Each gets at least ``runs`` timed calls, and
    short ones more, until theirs span ``min_seconds`` (at most MAX_RUNS); one warm-up
    call each first (it compiles FlexAttention at this shape).

    A method's call right after another runtime's finds that runtime's idle threads still
    spinning for work (TVM's pool after swa_tvm, OpenMP's after torch), competing for the
    cores: measured 15.0 against 8.0 ms for the same causal T=1024 kernel timed after
    SDPA and after itself. So a call shorter than HANDOFF_SECONDS is preceded by an untimed
    one each round: the medians compare the kernels, not the handoff."""
    for fn in fns.values():
        fn()
    ts = {name: [] for name in fns}

    while any(_wants_more(ts[name], runs, min_seconds) for name in fns):
        for name, fn in fns.items():
            if _wants_more(ts[name], runs, min_seconds):
                if not ts[name] or ts[name][-1] < HANDOFF_SECONDS:
                    fn()  # untimed: absorbs the other runtime's spinning threads (see above)
                t = time.perf_counter()
                fn()
                ts[name].append(time.perf_counter() - t)
    return {name: 1e3 * statistics.median(v) for name, v in ts.items()}


def matmul_peak_gflops(runs: int = 5, n: int = 4096, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of an n x n torch.matmul in ``dtype`` (bfloat16: oneDNN, on the matrix
    engine where the CPU has one)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    ms = median_ms(lambda: torch.matmul(a, b), runs)
    return 2.0 * n**3 / (ms * 1e-3) / 1e9


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _inputs(T: int, dtype: str = "float32"):
    """Fresh random q, k, v [B, H, T, D] in ``dtype``."""
    return tuple(torch.randn(B, H, T, D).to(getattr(torch, dtype)) for _ in range(3))


def _memory_child(method: str, config: str, T: int, libs: dict, dtype: str = "float32") -> dict:
    """In a fresh process: bytes the call needs beyond the process at rest, inputs and
    output included (peak RSS with the high-water mark reset after a warm-up)."""
    cfg = CONFIGS[config]
    gi = global_positions(T, cfg["G"]) if cfg["G"] else None
    _load_libs(libs)
    fn = make_method(method, T, cfg, gi, libs)
    q, k, v = _inputs(T, dtype)
    fn(q, k, v)  # warm-up: compiles, allocates caches
    del q, k, v
    gc.collect()
    base = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    q, k, v = _inputs(T, dtype)
    out = fn(q, k, v)
    peak = _rss_kb("VmHWM")
    qkvo = 4 * q.numel() * q.element_size()
    del out
    return {"peak_bytes": (peak - base) * 1024, "qkvo_bytes": qkvo, "ratio": (peak - base) * 1024 / qkvo}


def memory_in_subprocess(method: str, config: str, T: int, libs: dict, timeout: int = 900,
                         dtype: str = "float32") -> dict | None:
    code = (
        "import json, sys; from benchmarks import forward; "
        "print('RESULT' + json.dumps(forward._memory_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), "
        "json.loads(sys.argv[4]), sys.argv[5])))"
    )
    try:
        p = subprocess.run(
            [sys.executable, "-c", code, method, config, str(T), json.dumps(libs), dtype],
            capture_output=True,
            text=True,
            timeout=timeout,
            # A fixed mmap threshold: freed large buffers go back to the OS at once, so the
            # resident size before the measured call is not inflated by the warm-up's.
            env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    return {"error": (p.stderr or p.stdout)[-500:]}


def _load_libs(libs: dict) -> None:
    for path in libs.values():
        use_library(path)


def build_libraries(out_dir: str, logs: str | None, reuse: bool = False, dtype: str = "float32",
                    target: dict | None = None, float32: bool = False) -> dict:
    """The "tuned" and "default" libraries of ``dtype`` for ``target`` (default: this
    machine), and with ``float32`` the float32 tuned library beside them; their paths and
    which kernels of the tuned one apply a record."""
    # Lazy: the memory children import this module and run the libraries on the runtime
    # alone; the compiler loads only where libraries are built.
    from swa_tvm.compiler.build import DEFAULT_LOGS, UntunedKernelWarning

    specs = [AttentionSpec.parse(s) for s in spec_strings(dtype)]
    tag = "" if dtype == "float32" else f"_{dtype}"
    libs = {kind: os.path.join(out_dir, f"swa_bench_{kind}{tag}.so") for kind in ("tuned", "default")}
    if float32:
        libs["float32"] = os.path.join(out_dir, "swa_bench_tuned.so")
    if reuse and all(os.path.exists(p) for p in libs.values()):
        try:
            _load_libs(libs)  # checks hashes, TVM version and CPU
            m = swa_tvm.runtime.library.read_manifest(libs["tuned"])
            return libs, {k["name"]: k["tuned"] for k in m["kernels"]}
        except swa_tvm.LibraryError as e:
            print(f"not reusing the libraries in {out_dir}: {e}", file=sys.stderr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntunedKernelWarning)
        m = swa_tvm.export_library(specs, libs["tuned"], target=target, logs=logs or DEFAULT_LOGS)
        if float32:
            swa_tvm.export_library([AttentionSpec.parse(s) for s in spec_strings()], libs["float32"], target=target,
                                   logs=logs or DEFAULT_LOGS)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    swa_tvm.export_library(specs, libs["default"], target=target, logs=None, warn_untuned=False)
    return libs, {k["name"]: k["tuned"] for k in m["kernels"]}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.forward",
        description=__doc__.split("\n\n")[0],
        epilog="python -m benchmarks.training [...] times forward + backward instead.",
    )
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384, 65536], help="sequence lengths")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="CONFIG",
                   help=f"subset of: {'; '.join(CONFIGS)}")
    p.add_argument("--methods", nargs="+", choices=METHODS + [FLOAT32], default=METHODS, metavar="METHOD",
                   help=f"subset of: {'; '.join(METHODS)}; and, in a 16-bit run, {FLOAT32} (our float32 library "
                        "on float32 copies of the inputs)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--out", default=None, help="folder for results.json, scaling.png and the libraries "
                   "(default: benchmarks/results/<target-key>)")
    p.add_argument("--logs", help="tuning log root (default: the committed tuning_logs/)")
    p.add_argument("--memory-T", type=int, default=None, help="T of the peak-memory runs (default: largest T)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    add_mcpu_argument(p)
    p.add_argument("--reuse-libs", action="store_true", help="reuse OUT's libraries from an earlier run if they load")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="input dtype (float16/bfloat16: our kernels accumulate in float32; on a CPU with AMX or "
                        "AVX-512 BF16 the bfloat16 local forwards run on the matrix engine, untuned; only tuning_logs/llvm-rocketlake "
                        "has other records for bfloat16); results go to results_<dtype>.json")
    args = p.parse_args(argv)
    if args.runs < 5:
        print("benchmarks.forward: --runs below 5 gives medians too noisy to quote", file=sys.stderr)


    if FLOAT32 in args.methods and args.dtype == "float32":
        p.error(f"--methods {FLOAT32!r} compares a 16-bit run with float32: give --dtype bfloat16 or float16")
    target = parsed_target(p, args.mcpu)
    args.out = results_dir(args.out, target)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    libs, tuned = build_libraries(args.out, args.logs, args.reuse_libs, args.dtype, target, FLOAT32 in args.methods)
    print(f"libraries built in {time.time() - t0:.0f}s; tuned kernels: {sum(tuned.values())}/{len(tuned)}")
    _load_libs(libs)
    threads = torch.get_num_threads()
    # The peak in the run's dtype: bfloat16 kernels are held to what the CPU does in bfloat16.
    peak = matmul_peak_gflops(dtype=getattr(torch, args.dtype))
    print(f"torch.matmul 4096^2 {args.dtype} on {threads} threads: {peak:.1f} GFLOP/s (the peak below)")
    print(f"swa_tvm kernels on {library.tvm_pool_threads()} threads")

    stem = "results" if args.dtype == "float32" else f"results_{args.dtype}"

    def save(rows, memory, growth=()) -> dict:
        """Write results.json after every step, so an interrupted run keeps what it measured."""
        result = _result(args, argv, tuned, threads, peak, rows, memory, growth, target)
        tmp = os.path.join(args.out, f"{stem}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, os.path.join(args.out, f"{stem}.json"))
        return result

    rows = []
    for config in args.configs:
        cfg = CONFIGS[config]
        for T in args.T:
            gi = global_positions(T, cfg["G"]) if cfg["G"] else None
            torch.manual_seed(T)
            q, k, v = _inputs(T, args.dtype)
            pairs = visible_pairs(T, cfg)
            flop = 4.0 * B * H * pairs * D
            ref = None
            timed = {}  # method -> (callable, rel err against swa_tvm)
            for method in args.methods:
                try:
                    fn = make_method(method, T, cfg, gi, libs)
                    if fn is None:
                        rows.append(dict(config=config, T=T, method=method, skipped="dense T x T mask does not fit"))
                        continue
                    inputs = tuple(x.float() for x in (q, k, v)) if method == FLOAT32 else (q, k, v)
                    out = fn(*inputs)
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    print(f"  {config} T={T} {method}: failed ({msg})")
                    rows.append(dict(config=config, T=T, method=method, skipped=msg))
                    gc.collect()
                    continue
                if ref is None and method.startswith("swa_tvm"):
                    ref = out
                err = None
                if ref is not None:
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    if err > AGREE[args.dtype]:
                        print(f"  {config} T={T} {method}: disagrees with swa_tvm (rel err {err:.2e}); not timed")
                        rows.append(dict(config=config, T=T, method=method, rel_err=err, skipped="wrong result"))
                        continue
                del out
                timed[method] = (lambda fn=fn, inputs=inputs: fn(*inputs), err)
            ref = None
            medians = interleaved_medians({m: fn for m, (fn, _) in timed.items()}, args.runs)
            for method, (_, err) in timed.items():
                ms = medians[method]
                g = flop / (ms * 1e-3) / 1e9
                rows.append(dict(config=config, T=T, method=method, ms=ms, gflops=g, pct_peak=100 * g / peak, rel_err=err))
                print(f"  {config:22s} T={T:6d} {method:16s} {ms:10.1f} ms {g:7.1f} GFLOP/s {100 * g / peak:5.1f}%")
            del timed, medians
            del q, k, v
            gc.collect()
            save(rows, [])
    growth = []
    if len(args.T) >= 2 and "swa_tvm tuned" in args.methods:
        small, large = sorted(args.T)[-2:]
        for config in args.configs:
            growth.append(time_growth(config, small, large, libs, args.runs, args.dtype))
            g = growth[-1]
            print(f"  growth {config:22s} t({large})/t({small}) = {g['ratio']:.2f} "
                  f"({g['ms_large']:.1f} / {g['ms_small']:.1f} ms, the two timed round-robin)")
        save(rows, [], growth)
    memory = []
    if not args.no_memory:
        mT = args.memory_T or max(args.T)
        for config in args.configs:
            for method in args.methods:
                if method == FLOAT32 or (method == "SDPA + mask" and mT > DENSE_MAX_T):
                    continue
                r = memory_in_subprocess(method, config, mT, libs, dtype=args.dtype)
                memory.append(dict(config=config, T=mT, method=method, **(r or {})))
                if r and "ratio" in r:
                    print(f"  memory {config:22s} T={mT} {method:16s} {r['peak_bytes'] / 2**20:8.0f} MiB "
                          f"({r['ratio']:.2f}x q+k+v+out)")
                else:
                    print(f"  memory {config} {method}: {r}")
            save(rows, memory, growth)
    result = save(rows, memory, growth)
    plot(result, os.path.join(args.out, "scaling.png" if args.dtype == "float32" else f"scaling_{args.dtype}.png"))
    print(markdown_table(result))
    if growth:
        print(growth_table(result))
    print(f"wrote {args.out}/{stem}.json and its plot in {time.time() - t0:.0f}s")
    return 0


GROWTH_ROUNDS = 11


def time_growth(config: str, small: int, large: int, libs: dict, runs: int, dtype: str = "float32") -> dict:
    """t(large)/t(small) of the tuned kernel of one pattern, the two lengths timed
    round-robin: the per-shape table times its lengths minutes apart, and this shared
    machine's speed drifts by more than the linearity bar's margin in that time."""
    cfg = CONFIGS[config]
    fns = {}
    for T in (small, large):
        gi = global_positions(T, cfg["G"]) if cfg["G"] else None
        fn = make_method("swa_tvm tuned", T, cfg, gi, libs)
        q, k, v = _inputs(T, dtype)
        fns[T] = lambda fn=fn, q=q, k=k, v=v: fn(q, k, v)
    # At least GROWTH_ROUNDS rounds: one ratio of two medians of 5 moved by 20% between runs.
    rounds = max(runs, GROWTH_ROUNDS)
    ms = interleaved_medians(fns, rounds)
    return dict(config=config, T_small=small, T_large=large, ms_small=ms[small], ms_large=ms[large],
                ratio=ms[large] / ms[small], rounds=rounds)


def _result(args, argv, libs_tuned, threads, peak, rows, memory, growth=(), target=None) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.forward", *argv]),
        "machine": machine_info(threads, target),
        "versions": {"torch": torch.__version__, "tvm": swa_tvm.runtime.library.tvm_version(), "swa_tvm": swa_tvm.__version__},
        "shape": {"B": B, "H": H, "D": D, "dtype": args.dtype},
        "matmul_peak_gflops": peak,
        "matmul_dtype": args.dtype,
        "tuned_kernels": libs_tuned,
        # Which searched records "swa_tvm tuned" applies: those validation kept.
        "record_rule": "validated",
        # Each swa_tvm method's calls run its own library's kernels (use_library).
        "library_per_call": True,
        "rows": rows,
        "growth": list(growth),
        "memory": memory,
    }


def markdown_table(result: dict) -> str:
    """The README's table: median ms per method, and ours against FlexAttention."""
    rows = result["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    Ts = sorted({r["T"] for r in rows})
    methods = [m for m in METHODS + [FLOAT32] if any(r["method"] == m for r in rows)]
    out = ["| pattern | T | " + " | ".join(methods) + " | tuned GFLOP/s (% of matmul) | FlexAttention / tuned |",
           "| --- | --- |" + " --- |" * len(methods) + " --- | --- |"]
    for config in configs:
        for T in Ts:
            cell = {r["method"]: r for r in rows if r["config"] == config and r["T"] == T}
            if not cell:
                continue
            vals = [f"{cell[m]['ms']:.1f}" if m in cell and "ms" in cell[m] else "—" for m in methods]
            ours, flex = cell.get("swa_tvm tuned", {}), cell.get("FlexAttention", {})
            g = f"{ours['gflops']:.1f} ({ours['pct_peak']:.0f}%)" if "ms" in ours else "—"
            ratio = f"{flex['ms'] / ours['ms']:.2f}×" if "ms" in ours and "ms" in flex else "—"
            out.append(f"| {config} | {T} | " + " | ".join(vals) + f" | {g} | {ratio} |")
    return "\n".join(out)


def growth_table(result: dict) -> str:
    """The linearity check: t(large)/t(small) per pattern, the two timed round-robin."""
    out = ["| pattern | T | ms (small T) | ms (large T) | ratio (4.0 = linear) |", "| --- | --- | --- | --- | --- |"]
    for g in result.get("growth", []):
        out.append(f"| {g['config']} | {g['T_small']} → {g['T_large']} | {g['ms_small']:.1f} | {g['ms_large']:.1f} | "
                   f"{g['ratio']:.2f} |")
    return "\n".join(out)


def machine_info(threads: int, target: dict | None = None) -> dict:
    """What a results file says of the machine; ``target_key`` is the class whose code
    and tuning logs (``tuning_logs/<target_key>/``) the libraries were built with, and
    ``host_key`` this machine's class where that differs."""
    host = target_key(host_target())
    key = target_key(target) if target is not None else host
    info = {"cpu": library.host_cpu_name(), "machine": platform.machine(), "target_key": key,
            "threads": threads, "tvm_threads": library.tvm_pool_threads()}
    if _foreign(target):
        info["host_key"] = host
    return info


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        for method in METHODS + [FLOAT32]:
            pts = [(r["T"], r["ms"]) for r in result["rows"] if r["config"] == config and r["method"] == method and "ms" in r]
            if pts:
                xs, ys = zip(*pts)
                ax.loglog(xs, ys, marker="o", label=method)
        ax.set_title(config)
        ax.set_xlabel("T")
        ax.grid(True, which="both", alpha=0.3)
    shape = result["shape"]
    axes[0][0].set_ylabel(f"median ms (B={shape['B']}, H={shape['H']}, D={shape['D']}, {shape.get('dtype', 'float32')})")
    axes[0][-1].legend(fontsize=8)
    m = result["machine"]
    key = f" ({m['target_key']})" if "target_key" in m else ""  # results before 2026-12-05 lack it
    fig.suptitle(f"{m['cpu']}{key}, {m['threads']} threads, {result['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
