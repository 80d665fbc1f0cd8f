"""Carry the committed tuning records across a change of the math that keeps every
stage's name and loop structure (a select or predicate added inside a stage).

A log's records are keyed by the structural hash of the tuned workload (the TE compute
at the tuning shape), so such a change orphans them although their schedule traces
still apply. Two steps, the first run with the code before the change:

    python -m tools.rekey_records dump  old_keys.json   # before: spec -> old workload key
    python -m tools.rekey_records apply old_keys.json   # after: rewrite those workloads

``apply`` replaces each matched workload row of ``swa_tvm/tuning_logs/<key>/`` with the
new workload (records keep their line index, CUDA baselines follow their key) and
replays every record's trace on it,
refusing to write a folder where a trace no longer applies. Candidates are the shipped
spec set in each dtype and any ``--spec`` given, with all their kernels (forward, global,
backward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from swa_tvm.compiler import records
from swa_tvm.compiler.records import WORKLOAD_FILE, RECORD_FILE, tuning_workload, workload_key
from swa_tvm.spec import AttentionSpec, KernelSpec

DTYPES = ("float32", "bfloat16", "float16", "float64")


def _candidate_specs(root: str, extra: list[str]) -> list[KernelSpec]:
    lines = open(os.path.join(root, "shipped_specs.txt")).read().splitlines() + extra
    specs: dict[str, KernelSpec] = {}
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        for dtype in DTYPES if "dtype=" not in line else ("",):
            for k in AttentionSpec.parse(f"{line},dtype={dtype}" if dtype else line).kernels():
                specs[k.name] = k
    return list(specs.values())


def _folders(root: str):
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if os.path.isfile(os.path.join(folder, WORKLOAD_FILE)):
            yield name, folder, ("cuda" if name.startswith("cuda") else "llvm")


def _rows(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def dump(out: str, root: str, extra: list[str]) -> None:
    specs = _candidate_specs(root, extra)
    found: dict = {}
    for name, folder, kind in _folders(root):
        keys = {row[0] for row in _rows(os.path.join(folder, WORKLOAD_FILE))}
        for spec in specs:
            try:
                key = workload_key(tuning_workload(spec, target_kind=kind))
            except Exception:  # noqa: BLE001 - a spec this target kind cannot express
                continue
            if key in keys:
                found.setdefault(name, {})[key] = spec.to_dict()
        print(f"{name}: {len(found.get(name, {}))} of {len(keys)} workloads matched", file=sys.stderr)
    with open(out, "w") as f:
        json.dump(found, f, indent=1)


def apply(mapping_path: str, root: str, extra: list[str]) -> None:
    from tvm import s_tir
    from tvm.s_tir.meta_schedule.database import TuningRecord, Workload

    mapping = json.load(open(mapping_path))
    for name, folder, kind in _folders(root):
        old = mapping.get(name, {})
        wl_path, rec_path = os.path.join(folder, WORKLOAD_FILE), os.path.join(folder, RECORD_FILE)
        rows = _rows(wl_path)
        new_rows, renamed = [], {}
        for row in rows:
            if row[0] in old:
                spec = KernelSpec.from_dict(old[row[0]])
                new = Workload(tuning_workload(spec, target_kind=kind)).as_json()
                if new[0] != row[0]:  # the same math keeps its row as written
                    renamed[row[0]] = new[0]
                    row = new
            new_rows.append(row)
        changed = len(renamed)
        if not changed:
            print(f"{name}: nothing to re-key", file=sys.stderr)
            continue
        if kind == "cuda":
            records.register_intrinsics()  # tensor-core records name the bfloat16 wmma intrinsics
        # Every record's trace must replay on its (new) workload, or the folder is left as it was.
        workloads = [Workload.from_json(r) for r in new_rows]
        recs = _rows(rec_path) if os.path.exists(rec_path) else []
        for idx, rec in recs:
            record = TuningRecord.from_json(rec, workloads[idx])
            record.trace.apply_to_schedule(s_tir.Schedule(workloads[idx].mod), remove_postproc=True)
        with open(wl_path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in new_rows)
        os.replace(wl_path + ".tmp", wl_path)
        # A CUDA folder's measured fused-kernel baselines are keyed by workload too.
        base_path = os.path.join(folder, records.BASELINE_FILE)
        if os.path.exists(base_path):
            base = json.load(open(base_path))
            with open(base_path + ".tmp", "w") as f:
                json.dump({renamed.get(k, k): v for k, v in base.items()}, f, indent=1)
                f.write("\n")
            os.replace(base_path + ".tmp", base_path)
        print(f"{name}: re-keyed {changed} workloads; {len(recs)} records replay", file=sys.stderr)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("dump", "apply"))
    ap.add_argument("mapping", help="the JSON file of old workload keys (written by dump, read by apply)")
    ap.add_argument("--logs", default=records.default_logs_root(), help="tuning logs root (default: the package's)")
    ap.add_argument("--spec", action="append", default=[], help="another AttentionSpec string to match (repeatable)")
    args = ap.parse_args(argv)
    (dump if args.step == "dump" else apply)(args.mapping, args.logs, args.spec)


if __name__ == "__main__":
    main()
