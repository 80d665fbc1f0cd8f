"""Measured tile configurations of the fused CUDA kernels, per GPU class:
``tuning_logs/cuda-<arch>/tiles.json``.

The fused kernels (``cuda_flash_tc``, ``cuda_flash_bwd_tc``) take their tiles (warps,
keys per chunk, loads, wgmma...) from a config (TCConfig, TCBwdConfig) that no
MetaSchedule space covers: MetaSchedule tunes the unfused TE, which the fused kernels
beat. So their tuning is a sweep: the GPU check times the bundle's variants module
(every configuration of ``gpu_bundle.TC_VARIANTS`` / ``TC_BWD_VARIANTS``, each checked
against the default kernels) on the GPU, ``swa-tvm import-tiles gpu_results.json``
turns those rows into records here, and export builds each fused kernel with the record
of its schedule, kind, dtype and head dim for its arch, else with the default config.

A record is only ever a GPU measurement: the fastest configuration whose result agreed
with the default's, with its time, the default's, the device, the date and the bundle's
commit. Configurations that only run on sm_90a (wgmma) are recorded for sm_90a alone.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from swa_tvm.compiler import kernels
from swa_tvm.compiler.targets import target_key

FORMAT = 1
FILE = "tiles.json"


def config_class(schedule: str):
    return kernels.fused_kernel(schedule).config_type()


def swept_schedule(kind: str) -> str | None:
    """The fused kernel whose tiles are measured for ``kind``; records apply to those
    kinds only (the global rows and CUDA-core kernels keep their defaults: never swept)."""
    fused = kernels.swept(kind)
    return fused.name if fused is not None else None


def path(root: str, target: dict) -> str:
    return os.path.join(root, target_key(target), FILE)


def read(root: str | None, target: dict) -> list[dict]:
    """The records for ``target``'s class under ``root`` ([] when none)."""
    if root is None or target.get("kind") != "cuda":
        return []
    p = path(root, target)
    if not os.path.exists(p):
        return []
    with open(p, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{p}: tile records of format {data.get('format')!r}; this swa_tvm reads format {FORMAT}")
    return data["records"]


def find(spec, schedule: str, records: list[dict], arch: str | None = None):
    """The config of the record for ``spec`` under ``schedule`` (None: no record, or one
    whose config this spec or ``arch`` cannot take: shared memory past the block's
    limit, wgmma off sm_90a)."""
    # Lazy: the schedules import tvm, and tools/gpu_check.py imports this module without it.
    from swa_tvm.schedules.cuda_flash_tc import tile_scope

    for rec in records:
        if (rec["schedule"], rec["kind"], rec["dtype"], rec["head_dim"]) == (schedule, spec.kind, spec.dtype,
                                                                             spec.head_dim):
            cfg = config_class(schedule)(**rec["tiles"])
            if getattr(cfg, "wgmma", False) and arch != "sm_90a":
                return None
            try:
                tile_scope(spec, cfg)
            except ValueError:
                return None
            return cfg
    return None


def records_from_results(results: dict) -> dict[str, list[dict]]:
    """{arch: records} from the GPU check's results (``gpu_results.json``: its variant
    rows and ``variants_meta``): per kind, the fastest tensor-core configuration that
    agreed with the default kernels; for the sm_90a module also for sm_90 from the rows
    that do not need sm_90a (wgmma). Agreement and speed as ``best_variants``
    judges them."""
    meta = results.get("variants_meta")
    rows = results.get("variants")
    if not meta or not isinstance(rows, list):
        raise ValueError("the results hold no variant rows with their variants_meta (a GPU check since 2026-12-04)")
    spec, arch = meta["spec"], meta["arch"]
    archs = {arch: lambda r: True}
    if arch == "sm_90a":
        archs["sm_90"] = lambda r: not r.get("wgmma")
    out = {}
    for a, usable in archs.items():
        mine = [r for r in rows if r.get("kernel") == swept_schedule(r.get("kind")) and usable(r)]
        recs = []
        for kind, found in best_variants(mine, getattr(torch, spec["dtype"])).items():
            if found is None:
                continue
            best = next(r for r in mine if r["function"] == found["function"])
            schedule = swept_schedule(kind)
            fields = {f.name for f in dataclasses.fields(config_class(schedule))}
            recs.append({
                "schedule": schedule, "kind": kind, "dtype": spec["dtype"], "head_dim": spec["head_dim"],
                "tiles": {k: best[k] for k in fields if k in best},
                "function": best["function"], "ms": best["ms"], "tflops": best.get("tflops"),
                "default_ms": found["default_ms"],
                "window": [spec["left"], spec["right"]], "shape": meta.get("shape"),
                "device": results.get("device"), "date": results.get("date"), "bundle": meta.get("bundle"),
            })
        out[a] = recs
    return out


def import_results(results_path: str, root: str) -> list[str]:
    """Merge ``records_from_results`` of a results file into ``root``'s tiles.json files
    (a record replaces the one of the same schedule, kind, dtype and head dim). Returns
    the paths written."""
    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)
    written = []
    for arch, recs in records_from_results(results).items():
        p = path(root, {"kind": "cuda", "arch": arch})
        old = read(root, {"kind": "cuda", "arch": arch})
        keys = {(r["schedule"], r["kind"], r["dtype"], r["head_dim"]) for r in recs}
        merged = [r for r in old if (r["schedule"], r["kind"], r["dtype"], r["head_dim"]) not in keys] + recs
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "records": merged}, f, indent=2)
            f.write("\n")
        written.append(p)
    return written


TOLERANCE = {torch.float16: (3e-3, 2e-3), torch.bfloat16: (2e-2, 2e-3), torch.float32: (1e-4, 1e-4)}



# Relative error of every gradient (dq, dk, dv, the global projections', the sink logits').
GRAD_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}



def best_variants(rows: list[dict], dtype) -> dict:
    """Per kernel kind, the fastest variant whose result agreed with the default's
    (forward within the output tolerance, gradients within the gradient tolerance of
    ``dtype``), with its time against the default configuration's: what the defaults
    should become."""
    best = {}
    for kind in dict.fromkeys(r.get("kind", "local") for r in rows):
        if kind == "wgmma_probe":
            continue
        tol = TOLERANCE[dtype][0] if kind == "local" else GRAD_TOLERANCE[dtype]
        ok = [r for r in rows if r.get("kind", "local") == kind and "ms" in r and r["rel_err_vs_default"] < tol]
        if not ok:
            best[kind] = None
            continue
        fastest = min(ok, key=lambda r: r["ms"])
        default = next((r for r in ok if r.get("default")), None)
        best[kind] = {"function": fastest["function"], "ms": fastest["ms"], "tflops": fastest["tflops"],
                      "default_ms": default["ms"] if default else None,
                      "speedup_vs_default": default["ms"] / fastest["ms"] if default else None}
    return best
