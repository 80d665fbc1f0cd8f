"""Measure a batch of tuning candidates built elsewhere, with the TVM runtime alone.

The other half of :mod:`swa_tvm.tuning.batch`: it runs on the machine with the GPU, which
has torch and tvm-ffi but no TVM compiler (``tools/gpu_check.sh`` sets that up), and
imports neither ``tvm`` nor the compiler. For each task of the batch it makes one set of
inputs (fresh random floats; dilation 1; extra and global positions distinct and sorted),
runs the task's baseline (the kernel the library uses without a record) and then every
candidate on them, and for each one writes:

- ``run_secs``: one entry per timed repeat (CUDA events around ``number`` calls, after
  warm-up; on the CPU, ``perf_counter``), as MetaSchedule's runner reports them;
- ``sha256`` of the file it loaded, so the import can tell the measured code is the code
  that was built;
- ``max_rel_err``: the largest relative difference of the outputs from the baseline's.
  A candidate off by more than the dtype's tolerance gets an ``error`` and no time: a
  fast wrong kernel must never become a record.

Usage: ``python -m swa_tvm.tuning.measure BATCH_DIR --out OUT`` writes ``OUT/measured.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback

import torch

from swa_tvm.runtime.library import (
    _load_tvm_runtime,
    cuda_unavailable_reason,
    sha256_file,
)

MEASURED_FILE = "measured.json"
# Largest relative output difference from the baseline a candidate may have.
TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-4, "float64": 1e-9}


def make_inputs(args: list, device: torch.device, seed: int) -> list:
    """Tensors for one call, from the batch's argument list (MetaSchedule's ArgInfo JSON
    plus how to fill each)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for arg in args:
        _, dtype, shape = arg[:3]
        fill = arg[3] if len(arg) > 3 else {"fill": "normal"}
        if fill["fill"] == "ones":
            t = torch.ones(shape, dtype=getattr(torch, dtype))
        elif fill["fill"] == "positions":  # distinct sorted positions < high, per row
            count = 1
            for n in shape[:-1]:
                count *= n
            rows = torch.stack([torch.randperm(fill["high"], generator=g)[: shape[-1]].sort().values
                                for _ in range(count)])
            t = rows.reshape(shape).to(getattr(torch, dtype))
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(getattr(torch, dtype))
        out.append(t.to(device))
    return out


def time_calls(fn, device: torch.device, number: int, repeat: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn``, one entry per repeat of ``number`` calls, after
    ``warmup`` calls: CUDA events on a CUDA device, ``perf_counter`` on the CPU."""
    for _ in range(warmup):
        fn()
    secs = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(number):
                fn()
            b.record()
            b.synchronize()
            secs.append(a.elapsed_time(b) * 1e-3 / number)
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            secs.append((time.perf_counter() - t0) / number)
    return secs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf when ``a`` has a non-finite value."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def measure(batch_dir: str, device: str = "cuda", number: int = 3, repeat: int = 5, warmup: int = 2,
            progress=print, deadline: float | None = None) -> dict:
    """Measure every candidate of the batch in ``batch_dir`` (the baseline of each task
    first, candidates checked against it); past ``deadline`` (a ``time.monotonic()``
    value) the rest are rows with an error, never timed."""
    import tvm_ffi

    with open(os.path.join(batch_dir, "batch.json")) as f:
        batch = json.load(f)
    dev = torch.device(device)
    if (dev.type == "cuda") != (batch["device"] == "cuda"):
        raise ValueError(f"batch {batch['batch_id']} is for {batch['device']}, this run measures on {device}")
    _load_tvm_runtime()
    if dev.type == "cuda":
        reason = cuda_unavailable_reason()  # also loads libtvm_runtime_cuda, which CUDA modules need
        if reason:
            raise RuntimeError(f"cannot measure batch {batch['batch_id']} on CUDA: {reason}")
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else None
    results = []
    for n_task, task in enumerate(batch["tasks"]):
        inputs = make_inputs(task["args"], dev, seed=n_task)
        outputs = [i for i, a in enumerate(task["args"]) if len(a) > 3 and a[3].get("output")]
        tol = TOLERANCE[task["dtype"]]
        reference = None
        for entry in [task["baseline"]] + task["candidates"]:
            row = {"id": entry["id"], "task": task["name"]}
            path = os.path.join(batch_dir, entry["artifact"])
            try:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("not measured: the run's time budget was spent")
                if entry is not task["baseline"] and reference is None:
                    raise RuntimeError("the baseline failed: nothing to check this candidate against")
                row["sha256"] = sha256_file(path)
                fn = tvm_ffi.load_module(path)[entry["function"]]
                for i in outputs:
                    inputs[i].fill_(float("nan"))

                def call(fn=fn):
                    if stream is None:
                        fn(*inputs)
                    else:
                        with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", dev.index or 0), stream):
                            fn(*inputs)

                call()
                got = [inputs[i].clone() for i in outputs]
                if reference is None:
                    reference = got  # the baseline comes first
                row["max_rel_err"] = max(rel_err(a, b) for a, b in zip(got, reference))
                if not row["max_rel_err"] <= tol:
                    raise ValueError(f"output differs from the baseline's by {row['max_rel_err']:.2e} (tolerance {tol:.0e})")
                row["run_secs"] = time_calls(call, dev, number, repeat, warmup)
            except Exception as e:  # noqa: BLE001 - one broken candidate must not stop the batch
                row.pop("run_secs", None)
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                if entry is task["baseline"]:
                    row["trace"] = traceback.format_exc()[-1500:]
            results.append(row)
            ms = f"{statistics.median(row['run_secs']) * 1e3:.3f} ms" if "run_secs" in row else row["error"][:100]
            progress(f"  {task['name']} {entry['id']}: {ms}")
    return {
        "format": batch["format"],
        "batch_id": batch["batch_id"],
        "device": dev.type,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "number": number,
        "repeat": repeat,
        "results": results,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m swa_tvm.tuning.measure", description=__doc__.split("\n\n")[0])
    p.add_argument("batch", help="the batch folder (swa-tvm tune --batch-out)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help=f"folder for {MEASURED_FILE}")
    p.add_argument("--device", default="cuda", help="torch device to measure on (default cuda)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--number", type=int, default=3, help="calls per timed repeat")
    args = p.parse_args(argv)
    measured = measure(args.batch, args.device, args.number, args.repeat)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, MEASURED_FILE)
    with open(path, "w") as f:
        json.dump(measured, f, indent=1)
    ok = sum("run_secs" in r for r in measured["results"])
    print(f"wrote {path}: {ok} of {len(measured['results'])} measured")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
