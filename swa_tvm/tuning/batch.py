"""Tuning for a device the compiler cannot reach: MetaSchedule's builder here, its runner there.

A GPU machine without TVM (or one whose only link is a file carried over) still tunes:

1. here: ``swa-tvm tune --target "cuda -arch=sm_90" --spec ... --trials 32 --batch-out DIR``
   (``build_batch``). MetaSchedule's evolutionary search proposes candidates from the
   target's search space, seeded by the log's records and ranked by an XGBoost cost model
   trained on them; each is built here (nvcc) into a shared library. Each task also gets
   its *baseline*: the kernel a library uses without a record (for CUDA the fused kernel).
   ``DIR/batch.json`` lists what to run and with which arguments; ``DIR/records.json``
   keeps the traces here.
2. there: ``python -m swa_tvm.tuning.measure DIR --out OUT`` (torch and tvm-ffi only).
3. here: ``swa-tvm tune --import OUT/measured.json --batch DIR`` (``import_measurements``):
   each measured candidate becomes an ordinary MetaSchedule tuning record in
   ``tuning_logs/<target-key>/`` with the run times measured there; baselines go to
   ``baselines.json``, which export compares records against.

Then again from 1: the new records seed the next batch and train its cost model.

Keeping it honest: a record's time is only ever one the measuring machine reported for
the very file built here (sha256), of a batch imported once (its id is remembered), on
the device kind the batch was built for, for a candidate whose outputs matched the
baseline's on the same inputs. Nothing is timed here.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
from typing import Iterable

import tvm
from tvm import s_tir
from tvm.runtime import convert
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.database import TuningRecord, Workload

from swa_tvm.compiler.build import default_schedule, schedule_spec
from swa_tvm.compiler.records import (
    BASELINE_FILE,
    fold_scale,
    log_dir,
    open_log,
    read_baselines,
    tuning_workload,
    tvm_target_of,
    workload_key,
)
from swa_tvm.compiler.targets import normalize_target, target_key
from swa_tvm.compute import prim_func
from swa_tvm.runtime.library import sha256_file, tvm_version
from swa_tvm.schedules.cuda import register_intrinsics
from swa_tvm.schedules.intrinsics import preload_tensor_intrin
from swa_tvm.spec import KernelSpec
from swa_tvm.tuning.candidates import (
    check_cuda_specs,
    check_no_amx_specs,
    input_fills,
    make_builder,
    space_generator,
)

BATCH_FORMAT = 1
IMPORTED_FILE = "imported_batches.json"


def _fills(spec: KernelSpec, target_kind: str, args: list) -> list:
    """Annotate call arguments with how the measuring side fills them
    (``tuning.input_fills``: the rule MetaSchedule's runner here follows too), their
    names, and which are outputs (compared against the baseline)."""
    names = [p.name for p in prim_func(spec, target_kind=target_kind).params if p.name != "scale"]
    tensors = [arg for arg in args if arg[0] == "TENSOR"]
    fills = iter(input_fills(tensors))
    outputs = {"out", "lse"}
    annotated = []
    for name, arg in zip(names, args):
        if arg[0] != "TENSOR":
            annotated.append(arg)
            continue
        fill = next(fills)
        if name in outputs:
            fill["output"] = True
        annotated.append([*arg[:3], dict(fill, name=name)])
    return annotated


def baseline_module(spec: KernelSpec, target: dict):
    """The kernel a library uses for ``spec`` without a record, as an IRModule whose
    "main" takes a tuning candidate's arguments (scale folded; T stays symbolic and
    binds to the tensors passed)."""
    func = fold_scale(schedule_spec(spec, tvm.target.Target(target), record=None), spec)
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def _candidates(ctx, db, cost_model, trials: int):
    """Up to ``trials`` new candidates of one task from MetaSchedule's evolutionary search
    (population seeded by ``db``'s best records, ranked by ``cost_model``)."""
    ctx.pre_tuning(max_trials=trials, num_trials_per_iter=trials, design_spaces=ctx.generate_design_space(),
                   database=db, cost_model=cost_model)
    try:
        return list(ctx.generate_measure_candidates() or [])
    finally:
        ctx.post_tuning()


def _memory_copy(folder: str, mods: list):
    """A MemoryDatabase holding the log's records of these workloads (the search reads
    and may add workloads; the log itself is only written by an import)."""
    mem = ms.database.MemoryDatabase(module_equality="structural")
    if not os.path.exists(folder):
        return mem
    log = open_log(folder, only={workload_key(m) for m in mods})
    for rec in log.get_all_tuning_records():
        wl = mem.commit_workload(rec.workload.mod)
        mem.commit_tuning_record(ms.database.TuningRecord(rec.trace, wl, rec.run_secs, rec.target, rec.args_info))
    return mem


def _trained_cost_model(ctx, db, mod, cores: int):
    """XGBoost cost model trained on the measured records of ``mod`` (untrained without)."""
    model = ms.cost_model.XGBModel(num_tuning_cores=cores)
    if not db.has_workload(mod):
        return model
    records = [r for r in db.get_top_k(db.commit_workload(mod), 1 << 20) if r.run_secs]
    cands, results = [], []
    for rec in records:
        sch = s_tir.Schedule(mod)
        try:
            rec.trace.apply_to_schedule(sch, remove_postproc=False)
        except Exception:  # noqa: BLE001 - a record of an older space: leave it out
            continue
        cands.append(ms.MeasureCandidate(sch, rec.args_info))
        results.append(ms.runner.RunnerResult(rec.run_secs, None))
    if cands:
        model.update(ctx, cands, results)
    return model


def build_batch(
    specs: Iterable[KernelSpec],
    target: dict,
    trials: int,
    logs_root: str,
    out_dir: str,
    *,
    seed: int | None = None,
    cores: int | None = None,
    progress=print,
    baselines_only: bool = False,
) -> dict:
    """Build ``trials`` candidates per kernel (fewer where the space has fewer new points)
    plus each kernel's baseline into ``out_dir``; returns the batch description."""
    preload_tensor_intrin()
    target = normalize_target(target)
    kind = target["kind"]
    specs = list(dict.fromkeys(specs))
    if trials < 1 and not baselines_only:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if kind == "cuda":
        check_cuda_specs(specs)
    check_no_amx_specs(specs, target)
    if os.path.exists(os.path.join(out_dir, "batch.json")):
        raise FileExistsError(f"{out_dir} already holds a batch: give an empty or new folder")
    os.makedirs(out_dir, exist_ok=True)
    cores = cores or len(os.sched_getaffinity(0))
    tvm_target = tvm_target_of(target)
    mods = [tuning_workload(s, target_kind=kind) for s in specs]
    db = _memory_copy(log_dir(logs_root, target), mods)
    builder = make_builder(target, cores, shared_library=True)
    batch_id = uuid.uuid4().hex
    tasks, records = [], {}
    try:
        for n, (spec, mod) in enumerate(zip(specs, mods)):
            ctx = ms.TuneContext(mod=mod, target=tvm_target, space_generator=space_generator(spec, tvm_target),
                                 search_strategy=ms.search_strategy.EvolutionarySearch(
                                     population_size=max(64, 2 * trials), init_min_unmeasured=trials, genetic_num_iters=2),
                                 task_name=spec.name, rand_state=-1 if seed is None else seed + n,
                                 num_threads=cores).clone()
            cands = [] if baselines_only else _candidates(ctx, db, _trained_cost_model(ctx, db, mod, cores), trials)
            inputs = [ms.builder.BuilderInput(c.sch.mod, tvm_target) for c in cands]
            inputs.append(ms.builder.BuilderInput(baseline_module(spec, target), tvm_target))
            built = builder.build(inputs)
            args = _fills(spec, kind, [a.as_json() for a in ArgInfo.from_prim_func(mod["main"])])
            task = {"name": spec.name, "spec": spec.to_dict(), "dtype": spec.dtype, "args": args, "candidates": []}
            for i, b in enumerate(built):
                is_base = i == len(cands)
                cid = f"{n:02d}-base" if is_base else f"{n:02d}-{i:03d}"
                if b.error_msg:
                    if is_base:
                        raise RuntimeError(f"the baseline of {spec.name} failed to build: {b.error_msg[:500]}")
                    progress(f"  {spec.name} candidate {i}: build failed ({b.error_msg.splitlines()[0][:120]})")
                    continue
                artifact = f"{cid}.so"
                shutil.copyfile(b.artifact_path, os.path.join(out_dir, artifact))
                shutil.rmtree(os.path.dirname(b.artifact_path), ignore_errors=True)
                entry = {"id": cid, "artifact": artifact, "sha256": sha256_file(os.path.join(out_dir, artifact)),
                         "function": "main"}
                if is_base:
                    task["baseline"] = dict(entry, schedule=default_schedule(spec, kind))
                else:
                    if [a.as_json() for a in cands[i].args_info] != [a[:3] for a in args]:
                        raise RuntimeError(f"{spec.name}: candidate arguments differ from the kernel's")
                    task["candidates"].append(entry)
                    rec = TuningRecord(cands[i].sch.trace, ms.database.Workload(mod), None, tvm_target, cands[i].args_info)
                    records[cid] = rec.as_json()
            tasks.append(task)
            progress(f"{spec.name}: {len(task['candidates'])} candidates + baseline built")
    finally:
        builder.close()
    workloads = {t["name"]: ms.database.Workload(m).as_json() for t, m in zip(tasks, mods)}
    batch = {
        "format": BATCH_FORMAT,
        "batch_id": batch_id,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": target,
        "target_key": target_key(target),
        "tvm_version": tvm_version(),
        "device": "cuda" if kind == "cuda" else "cpu",
        "tasks": tasks,
    }
    with open(os.path.join(out_dir, "records.json"), "w") as f:
        json.dump({"batch_id": batch_id, "workloads": workloads, "records": records}, f)
    with open(os.path.join(out_dir, "batch.json"), "w") as f:
        json.dump(batch, f, indent=1)
    return batch


def import_measurements(batch_dir: str, measured_path: str, logs_root: str, progress=print) -> dict:
    """Commit the measured candidates of a batch as tuning records (and its baselines to
    ``baselines.json``) in ``logs_root``'s folder for the batch's target. Refuses a
    measurement of another batch, of another device kind, of a file that is not the one
    built, or of a batch already imported. Returns counts."""
    with open(os.path.join(batch_dir, "batch.json")) as f:
        batch = json.load(f)
    with open(os.path.join(batch_dir, "records.json")) as f:
        saved = json.load(f)
    with open(measured_path) as f:
        measured = json.load(f)
    if measured.get("batch_id") != batch["batch_id"] or saved.get("batch_id") != batch["batch_id"]:
        raise ValueError(f"{measured_path} measured batch {measured.get('batch_id')}, not {batch['batch_id']} ({batch_dir})")
    if measured.get("device") != batch["device"]:
        raise ValueError(f"{measured_path}: measured on {measured.get('device')}, the batch was built for {batch['device']}")
    folder = log_dir(logs_root, batch["target"])
    os.makedirs(folder, exist_ok=True)
    imported_path = os.path.join(folder, IMPORTED_FILE)
    imported = []
    if os.path.exists(imported_path):
        with open(imported_path) as f:
            imported = json.load(f)
    if any(i["batch_id"] == batch["batch_id"] for i in imported):
        raise ValueError(f"batch {batch['batch_id']} was already imported into {folder}")
    entries = {}
    for task in batch["tasks"]:
        entries[task["baseline"]["id"]] = (task, task["baseline"])
        entries.update({c["id"]: (task, c) for c in task["candidates"]})
    # Check every row before writing anything: a refused import leaves the log as it was.
    measured_rows = []
    for row in measured["results"]:
        if row["id"] not in entries:
            raise ValueError(f"{measured_path}: result {row['id']!r} is not a candidate of batch {batch['batch_id']}")
        task, entry = entries[row["id"]]
        if "run_secs" not in row:
            progress(f"  {task['name']} {row['id']}: not measured ({row.get('error', '?')[:120]})")
            continue
        if row.get("sha256") != entry["sha256"]:
            raise ValueError(f"{measured_path}: {row['id']} ran a file other than the one built (sha256 differs)")
        run_secs = [float(s) for s in row["run_secs"]]
        if not run_secs or min(run_secs) <= 0:
            raise ValueError(f"{measured_path}: {row['id']} has no positive run time")
        measured_rows.append((task, entry, run_secs))
    counts = {"records": 0, "baselines": 0, "failed": len(measured["results"]) - len(measured_rows)}
    if batch["device"] == "cuda":
        register_intrinsics()  # a tensor-core record names the bfloat16 wmma intrinsics
    # Every record is decoded before anything is written: one that cannot be read leaves
    # the log as it was.
    parsed = {name: Workload.from_json(wl) for name, wl in saved["workloads"].items()}
    decoded = {entry["id"]: TuningRecord.from_json(saved["records"][entry["id"]], parsed[task["name"]])
               for task, entry, _ in measured_rows if entry is not task["baseline"]}
    db = open_log(folder)
    workloads = {name: db.commit_workload(wl.mod) for name, wl in parsed.items()}
    baselines = {}
    for task, entry, run_secs in measured_rows:
        if entry is task["baseline"]:
            baselines[saved["workloads"][task["name"]][0]] = {
                "spec": task["name"], "schedule": entry["schedule"], "run_secs": run_secs,
                "device": measured.get("device_name"), "measured": measured.get("measured"), "batch_id": batch["batch_id"],
            }
            counts["baselines"] += 1
            continue
        rec = decoded[entry["id"]]
        db.commit_tuning_record(TuningRecord(rec.trace, workloads[task["name"]], convert(run_secs), rec.target, rec.args_info))
        counts["records"] += 1
    update_baselines(folder, baselines)
    imported.append({"batch_id": batch["batch_id"], "device": measured.get("device_name"),
                     "measured": measured.get("measured"), **counts})
    with open(imported_path + ".tmp", "w") as f:
        json.dump(imported, f, indent=1)
    os.replace(imported_path + ".tmp", imported_path)
    return counts


def measure_baselines(specs, target: dict, folder: str, builder, runner) -> None:
    """Where MetaSchedule's runner reaches the device (``swa-tvm tune --target cuda`` on
    the GPU's machine or through an RPC tracker): build each kernel's baseline and
    measure it with that runner, into ``baselines.json``."""
    tvm_target = tvm_target_of(target)
    kind = target["kind"]
    specs = list(specs)
    built = builder.build([ms.builder.BuilderInput(baseline_module(s, target), tvm_target) for s in specs])
    inputs = []
    for spec, b in zip(specs, built):
        if b.error_msg:
            raise RuntimeError(f"the baseline of {spec.name} failed to build: {b.error_msg[:500]}")
        args = ArgInfo.from_prim_func(tuning_workload(spec, target_kind=kind)["main"])
        inputs.append(ms.runner.RunnerInput(b.artifact_path, "cuda" if kind == "cuda" else "cpu", args))
    entries = {}
    for spec, fut in zip(specs, runner.run(inputs)):
        res = fut.result()
        if res.error_msg:
            raise RuntimeError(f"the baseline of {spec.name} failed to run: {res.error_msg[:500]}")
        entries[workload_key(tuning_workload(spec, target_kind=kind))] = {
            "spec": spec.name, "schedule": default_schedule(spec, kind), "run_secs": [float(x) for x in res.run_secs],
            "device": "MetaSchedule runner",
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
    update_baselines(folder, entries)


def update_baselines(folder: str, entries: dict) -> None:
    """Merge measured baselines into ``baselines.json``, keeping each kernel's fastest."""
    def mean(e):
        return sum(e["run_secs"]) / len(e["run_secs"])

    baselines = read_baselines(folder)
    for key, entry in entries.items():
        if key not in baselines or mean(entry) < mean(baselines[key]):
            baselines[key] = entry
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, BASELINE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(baselines, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
