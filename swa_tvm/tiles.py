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

FORMAT = 1
FILE = "tiles.json"
# The fused kernel each measured kind runs on tensor cores; records apply to these kinds
# only (the global rows and CUDA-core kernels keep their defaults: never swept).
SCHEDULES = {"local": "cuda_flash_tc", "local_dq": "cuda_flash_bwd_tc", "local_dkv": "cuda_flash_bwd_tc"}


def config_class(schedule: str):
    from .schedules import cuda_flash_bwd_tc, cuda_flash_tc

    return {"cuda_flash_tc": cuda_flash_tc.TCConfig, "cuda_flash_bwd_tc": cuda_flash_bwd_tc.TCBwdConfig}[schedule]


def path(root: str, target: dict) -> str:
    from .tuning import log_dir

    return os.path.join(log_dir(root, target), FILE)


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
    from .schedules.cuda_flash_tc import tile_scope

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
    that do not need sm_90a (wgmma). Agreement and speed as ``gpu_check.best_variants``
    judges them."""
    import torch

    from .gpu_check import best_variants

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
        mine = [r for r in rows if r.get("kernel") == SCHEDULES.get(r.get("kind")) and usable(r)]
        recs = []
        for kind, found in best_variants(mine, getattr(torch, spec["dtype"])).items():
            if found is None:
                continue
            best = next(r for r in mine if r["function"] == found["function"])
            schedule = SCHEDULES[kind]
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
