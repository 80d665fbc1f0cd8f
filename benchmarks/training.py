"""``python -m benchmarks.training``: forward + backward against the CPU peers that train.

For each pattern and T it times, in one process on the same inputs, the forward alone
(under no_grad) and forward + backward (``torch.autograd.backward`` with a fixed random
output gradient) of: swa_tvm (a library exported with the backward kernels, tuned where
the logs have records), FlexAttention (compiled), Longformer-style sliding chunks and
SDPA with a dense mask (pure torch autograd). Every peer's gradients are checked against
ours before it is timed. Writes ``training.json``. ``--mcpu`` builds for another CPU
class on this machine, as ``benchmarks.forward --mcpu`` does.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import warnings

import torch

import swa_tvm
from benchmarks import forward as bench
from swa_tvm.compiler.build import DEFAULT_LOGS, UntunedKernelWarning
from swa_tvm.spec import AttentionSpec

CONFIGS = ["causal W=512", "dilation 2, W=256", "W=512 + 16 globals"]
METHODS = ["swa_tvm", "FlexAttention", "sliding chunks", "SDPA + mask"]
DENSE_MAX_T = 4096  # SDPA's backward keeps T x T probabilities and their gradient per head


def spec_strings(configs=CONFIGS, dtype: str = "float32") -> list[str]:
    """The training spec set (forward + backward kernels); the committed logs tune it
    (float32)."""
    strings = dict(zip(bench.CONFIGS, bench.spec_strings(dtype)))
    return [strings[c] + ",backward" for c in configs]


def build_library(out_dir: str, configs, logs: str | None, dtype: str = "float32", target: dict | None = None) -> str:
    specs = [AttentionSpec.parse(s) for s in spec_strings(configs, dtype)]
    path = os.path.join(out_dir, "swa_bench_training.so" if dtype == "float32" else f"swa_bench_training_{dtype}.so")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntunedKernelWarning)
        swa_tvm.export_library(specs, path, target=target, logs=logs or DEFAULT_LOGS)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return path


def make_method(name: str, T: int, cfg: dict, gi):
    if name == "swa_tvm":
        return lambda q, k, v: swa_tvm.sliding_window_attention(
            q, k, v, window_size=cfg["window"], dilation=cfg["dilation"], global_idx=gi
        )
    if name == "SDPA + mask" and T > DENSE_MAX_T:
        return None
    return bench.make_method(name, T, cfg, gi, libs={})


def _grads(fn, q, k, v, dout):
    for x in (q, k, v):
        x.grad = None
    torch.autograd.backward(fn(q, k, v), dout)
    return [x.grad for x in (q, k, v)]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)  # recorded in the results as the command
    p = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384], help="sequence lengths")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS, metavar="CONFIG",
                   help=f"subset of: {'; '.join(CONFIGS)}")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, metavar="METHOD",
                   help=f"subset of: {'; '.join(METHODS)}")
    p.add_argument("--runs", type=int, default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--out", default=None, help="folder for training.json and the library "
                   "(default: benchmarks/results/<target-key>)")
    p.add_argument("--logs", help="tuning log root (default: the committed tuning_logs/)")
    p.add_argument("--dtype", choices=bench.DTYPES, default="float32",
                   help="input dtype (as swa-tvm bench --dtype); results go to training_<dtype>.json")
    bench.add_mcpu_argument(p)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    target = bench.parsed_target(p, args.mcpu)
    args.out = bench.results_dir(args.out, target)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    swa_tvm.load_library(build_library(args.out, args.configs, args.logs, args.dtype, target))
    print(f"library built in {time.time() - t0:.0f}s")
    rows = []
    path = os.path.join(args.out, "training.json" if args.dtype == "float32" else f"training_{args.dtype}.json")
    for config in args.configs:
        cfg = bench.CONFIGS[config]
        for T in args.T:
            gi = bench.global_positions(T, cfg["G"]) if cfg["G"] else None
            torch.manual_seed(T)
            q, k, v = (torch.randn(bench.B, bench.H, T, bench.D).to(dtype).requires_grad_() for _ in range(3))
            dout = torch.randn(bench.B, bench.H, T, bench.D).to(dtype)
            ref = None
            timed = {}  # method -> (forward, forward + backward, gradients' rel err)
            for method in args.methods:
                row = dict(config=config, T=T, method=method)
                try:
                    fn = make_method(method, T, cfg, gi)
                    if fn is None:
                        rows.append(dict(row, skipped="dense T x T backward does not fit"))
                        continue
                    grads = _grads(fn, q, k, v, dout)
                except Exception as e:  # noqa: BLE001 - a peer that cannot train is reported, not fatal
                    # torch.compile wraps the peer's own error ("Unsupported: Observed
                    # exception"); report the innermost one, which says why.
                    while e.__cause__ is not None or e.__context__ is not None:
                        e = e.__cause__ or e.__context__
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    print(f"  {config} T={T} {method}: failed ({msg})")
                    rows.append(dict(row, skipped=msg))
                    gc.collect()
                    continue
                if ref is None:
                    ref = grads
                err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(grads, ref))
                if err > bench.AGREE[args.dtype]:
                    print(f"  {config} T={T} {method}: gradients disagree with swa_tvm (rel err {err:.2e}); not timed")
                    rows.append(dict(row, rel_err=err, skipped="wrong gradients"))
                    continue
                del grads

                def forward(fn=fn, q=q, k=k, v=v):
                    with torch.no_grad():
                        fn(q, k, v)

                timed[method] = (forward, lambda fn=fn, q=q, k=k, v=v, d=dout: _grads(fn, q, k, v, d), err)
            # Every method's forward and forward+backward timed round-robin (see
            # bench.interleaved_medians: a slow spell of the machine lands on all alike).
            fns = {(m, part): f for m, (fwd_fn, train_fn, _) in timed.items()
                   for part, f in (("fwd", fwd_fn), ("train", train_fn))}
            medians = bench.interleaved_medians(fns, args.runs)
            for method, (_, _, err) in timed.items():
                fwd, train = medians[(method, "fwd")], medians[(method, "train")]
                rows.append(dict(config=config, T=T, method=method, forward_ms=fwd, train_ms=train,
                                 ratio=train / fwd, rel_err=err))
                print(f"  {config:20s} T={T:6d} {method:15s} fwd {fwd:9.1f} ms  fwd+bwd {train:9.1f} ms  "
                      f"({train / fwd:.2f}x)")
            result = _result(argv, rows, args.dtype, target)
            with open(path + ".tmp", "w") as f:
                json.dump(result, f, indent=2)
            os.replace(path + ".tmp", path)
            del q, k, v, dout, timed, fns
            gc.collect()
    result = _result(argv, rows, args.dtype, target)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown_table(result))
    print(f"wrote {path} in {time.time() - t0:.0f}s")
    return 0


def _result(argv, rows, dtype: str = "float32", target: dict | None = None) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.training", *(argv or [])]),
        "machine": bench.machine_info(torch.get_num_threads(), target),
        "versions": {"torch": torch.__version__, "tvm": swa_tvm.runtime.library.tvm_version(), "swa_tvm": swa_tvm.__version__},
        "shape": {"B": bench.B, "H": bench.H, "D": bench.D, "dtype": dtype},
        "rows": rows,
    }


def markdown_table(result: dict) -> str:
    out = ["| pattern | T | method | forward ms | forward + backward ms | (fwd + bwd) / fwd | swa_tvm fwd + bwd speedup |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = result["rows"]
    for r in rows:
        ours = next((x for x in rows if x["config"] == r["config"] and x["T"] == r["T"] and x["method"] == "swa_tvm"), {})
        if "train_ms" in r:
            speed = f"{r['train_ms'] / ours['train_ms']:.2f}×" if "train_ms" in ours and r is not ours else "—"
            out.append(f"| {r['config']} | {r['T']} | {r['method']} | {r['forward_ms']:.1f} | {r['train_ms']:.1f} | "
                       f"{r['ratio']:.2f} | {speed} |")
        else:
            out.append(f"| {r['config']} | {r['T']} | {r['method']} | — | — | — | {r.get('skipped', '')} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
