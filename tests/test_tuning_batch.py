"""Tuning with the builder here and the runner elsewhere (swa_tvm.tuning.batch and
swa_tvm.tuning.measure): a CPU batch goes the whole way (built by the CLI, measured by
the runtime alone in another process, imported as records that export then applies);
the import refuses what it cannot vouch for; the measuring side refuses a candidate
whose outputs differ from the baseline's; and for CUDA, records replace the fused
kernel only when measured faster than it.

Batches stay tiny (a D=16 kernel, 2 candidates): building one CPU candidate takes
seconds, a CUDA one about ten."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from swa_tvm.compiler import records
from swa_tvm.tuning import batch as tuning_batch
from swa_tvm.tuning import tune
from swa_tvm.compiler.targets import host_target, target_key
from swa_tvm.spec import AttentionSpec

from conftest import rel_err, run_cli

SPEC_STR = "head_dim=16,window=7:0"
KSPEC = AttentionSpec.parse(SPEC_STR).kernels()[0]
CLI = [sys.executable, "-m", "swa_tvm.cli"]

# Tuning batches built and measured in subprocesses: `make test`, not `make check`.
pytestmark = pytest.mark.slow

# Measures a batch in a process that never imports the TVM compiler, as on a GPU
# machine that has only torch, tvm-ffi and libtvm_runtime.
MEASURE_RUNTIME_ONLY = r"""
import sys
from swa_tvm.tuning import measure as measure_batch
assert measure_batch.main([sys.argv[1], "--out", sys.argv[2], "--device", "cpu", "--repeat", "3", "--number", "1"]) == 0
assert "tvm" not in sys.modules, "measuring must not import the TVM compiler"
"""


def _run(args, **kw):
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def cpu_batch(tmp_path_factory):
    """A CPU batch built by the CLI and measured by the runtime alone: (batch, measured.json)."""
    root = tmp_path_factory.mktemp("cpu_batch")
    batch, out = root / "batch", root / "out"
    r = _run(CLI + ["tune", "--spec", SPEC_STR, "--trials", "2", "--seed", "3", "--logs", str(root / "unused"),
                    "--batch-out", str(batch)])
    assert "swa_tvm.tuning.measure" in r.stdout
    _run([sys.executable, "-c", MEASURE_RUNTIME_ONLY, str(batch), str(out)])
    return batch, out / "measured.json"


def test_cpu_batch_round_trip(cpu_batch, tmp_path, capsys):
    from tvm.s_tir.meta_schedule.database import JSONDatabase

    batch, measured_path = cpu_batch
    meta = json.loads((batch / "batch.json").read_text())
    measured = json.loads(measured_path.read_text())
    assert meta["device"] == "cpu" and measured["batch_id"] == meta["batch_id"]
    (task,) = meta["tasks"]
    assert task["name"] == KSPEC.name and len(task["candidates"]) == 2
    assert task["baseline"]["schedule"] == "default"
    rows = {r["id"]: r for r in measured["results"]}
    assert set(rows) == {task["baseline"]["id"]} | {c["id"] for c in task["candidates"]}
    for row in rows.values():
        assert "error" not in row, row
        assert len(row["run_secs"]) == 3 and min(row["run_secs"]) > 0
        assert row["max_rel_err"] < 1e-4  # every candidate computes what the baseline does

    logs = tmp_path / "logs"
    rc, out, err = run_cli(capsys, "import-measurements", measured_path, "--batch", batch, "--logs", logs)
    assert rc == 0 and "imported 2 records and 1 baselines" in out, err
    folder = logs / target_key(host_target())
    # MetaSchedule's own database reads the records, with the times measured there.
    db = JSONDatabase(str(folder / records.WORKLOAD_FILE), str(folder / records.RECORD_FILE))
    recs = db.get_all_tuning_records()
    assert len(recs) == 2
    got = sorted(tuple(float(s) for s in rec.run_secs) for rec in recs)
    want = sorted(tuple(rows[c["id"]]["run_secs"]) for c in task["candidates"])
    assert [t for row in got for t in row] == pytest.approx([t for row in want for t in row], rel=1e-6)
    base = json.loads((folder / records.BASELINE_FILE).read_text())
    assert list(base.values())[0]["run_secs"] == pytest.approx(rows[task["baseline"]["id"]]["run_secs"])
    # A CPU record applies once validated on the class's machine (the batch's baseline
    # is the default schedule, not a record of it).
    assert records.best_record(KSPEC, host_target(), str(logs)) is None
    from swa_tvm.tuning import validate

    (verdict,) = validate.validate([KSPEC], host_target(), str(logs), shapes=[{}, {"T": 4096}], rounds=3)
    assert set(verdict.entry["worst_ratio"]) == {records.trace_digest(r.trace) for r in recs}
    best = records.best_record(KSPEC, host_target(), str(logs))
    assert (best is not None) == (verdict.kept is not None)

    # Export applies what validation kept; the library computes the right answer.
    import torch

    import swa_tvm
    from swa_tvm.reference import sliding_window_attention_ref

    lib = tmp_path / "tuned.so"
    manifest = swa_tvm.export_library([KSPEC], lib, logs=str(logs))
    assert manifest["kernels"][0]["tuned"] is (verdict.kept is not None)
    swa_tvm.load_library(lib)
    q, k, v = (torch.randn(2, 3, 70, 16) for _ in range(3))
    ref, _ = sliding_window_attention_ref(q, k, v, window_size=(7, 0))
    out = swa_tvm.sliding_window_attention(q, k, v, window_size=(7, 0))
    assert rel_err(out, ref) < 1e-5

    # A batch is imported once.
    with pytest.raises(ValueError, match="already imported"):
        tuning_batch.import_measurements(str(batch), str(measured_path), str(logs))


def _edited(measured_path, tmp_path, edit):
    data = json.loads(measured_path.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: d.update(batch_id="0" * 32), "measured batch"),
        (lambda d: d.update(device="cuda"), "measured on cuda"),
        (lambda d: d["results"][1].update(sha256="0" * 64), "ran a file other than the one built"),
        (lambda d: d["results"][1].update(id="99-000"), "not a candidate"),
        (lambda d: d["results"][1].update(run_secs=[0.0]), "no positive run time"),
    ],
)
def test_import_refuses_what_it_cannot_vouch_for(cpu_batch, tmp_path, edit, message):
    batch, measured_path = cpu_batch
    logs = tmp_path / "logs"
    with pytest.raises(ValueError, match=message):
        tuning_batch.import_measurements(str(batch), _edited(measured_path, tmp_path, edit), str(logs))
    record_file = logs / target_key(host_target()) / records.RECORD_FILE
    assert not record_file.exists() or record_file.read_text() == ""  # nothing half-imported


def test_a_record_that_cannot_be_read_writes_nothing(cpu_batch, tmp_path):
    """Every record is decoded before the log is touched (the first GPU batch's import,
    2026-12-04, failed on a bfloat16 tensor intrinsic nobody had registered after it had
    written the workloads)."""
    batch, measured_path = cpu_batch
    copy = tmp_path / "batch"
    shutil.copytree(batch, copy)
    saved = json.loads((copy / "records.json").read_text())
    victim = sorted(saved["records"])[-1]
    saved["records"][victim] = [[["NoSuchInstruction", [], [], []]], []]
    (copy / "records.json").write_text(json.dumps(saved))
    logs = tmp_path / "logs"
    with pytest.raises(Exception):
        tuning_batch.import_measurements(str(copy), str(measured_path), str(logs))
    assert not any((logs / target_key(host_target())).glob("database_*.json"))


def test_measure_rejects_a_candidate_that_computes_something_else(cpu_batch, tmp_path):
    """A candidate whose outputs differ from the baseline's (here: a kernel of another
    window, same arguments) is reported as an error with no time, so it never becomes a
    record."""
    import tvm

    from swa_tvm.schedules import cpu
    from swa_tvm.compiler.targets import _vector_lanes
    from swa_tvm.tuning.measure import measure
    from tvm import s_tir

    batch, _ = cpu_batch
    copy = tmp_path / "batch"
    shutil.copytree(batch, copy)
    meta = json.loads((copy / "batch.json").read_text())
    wrong = AttentionSpec.parse("head_dim=16,window=3:0").kernels()[0]
    sch = s_tir.Schedule(records.tuning_workload(wrong))
    target = tvm.target.Target(host_target())
    cpu.schedule(sch, wrong, _vector_lanes(target))
    victim = meta["tasks"][0]["candidates"][0]
    tvm.compile(sch.mod, target=target).export_library(str(copy / victim["artifact"]))
    rows = {r["id"]: r for r in measure(str(copy), "cpu", number=1, repeat=1, progress=lambda m: None)["results"]}
    assert "run_secs" not in rows[victim["id"]]
    assert "differs from the baseline" in rows[victim["id"]]["error"]
    assert rows[victim["id"]]["max_rel_err"] > 0.01
    other = meta["tasks"][0]["candidates"][1]["id"]
    assert "run_secs" in rows[other]
    # Past the deadline (the GPU check's time budget) nothing more is loaded or timed.
    late = measure(str(copy), "cpu", number=1, repeat=1, progress=lambda m: None, deadline=0.0)["results"]
    assert len(late) == 3 and all("run_secs" not in r and "time budget" in r["error"] for r in late)


@pytest.fixture(scope="module")
def cuda_batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_batch")
    spec = AttentionSpec.parse("head_dim=16,window=7:0,dtype=float16").kernels()[0]
    batch = tuning_batch.build_batch([spec], "cuda -arch=sm_80", 1, str(root / "logs"), str(root / "batch"), seed=1,
                                     progress=lambda m: None)
    return spec, root / "batch", batch


def _simulated_measurement(batch, path, base_ms, cand_ms):
    """A measured.json as the GPU would write it, with chosen times: a test of how
    export chooses between records and the fused kernel, not a measurement."""
    (task,) = batch["tasks"]
    rows = [{"id": task["baseline"]["id"], "sha256": task["baseline"]["sha256"], "run_secs": [base_ms * 1e-3] * 3}]
    rows += [{"id": c["id"], "sha256": c["sha256"], "run_secs": [cand_ms * 1e-3] * 3} for c in task["candidates"]]
    path.write_text(json.dumps({"format": 1, "batch_id": batch["batch_id"], "device": "cuda",
                                "device_name": "simulated", "results": rows}))
    return str(path)


def test_cuda_batch_builds_the_search_space_and_the_fused_baseline(cuda_batch):
    spec, folder, batch = cuda_batch
    (task,) = batch["tasks"]
    assert batch["device"] == "cuda" and batch["target"] == {"kind": "cuda", "arch": "sm_80"}
    assert task["baseline"]["schedule"] == "cuda_flash_tc"
    assert len(task["candidates"]) == 1
    names = [a[3]["name"] for a in task["args"]]
    assert names == ["q", "k", "v", "dilation", "sink_logit", "out", "lse"]
    # The GPU fills the arguments by the rule MetaSchedule's runner follows here.
    from swa_tvm.tuning.candidates import input_fills

    fills = [{k: v for k, v in a[3].items() if k not in ("name", "output")} for a in task["args"]]
    assert fills == input_fills([a[:3] for a in task["args"]]) and fills[3] == {"fill": "ones"}
    assert [bool(a[3].get("output")) for a in task["args"]] == [False] * 5 + [True] * 2
    # Each artifact carries its device code compiled (a fatbin), which the runtime alone
    # loads there: TVM by itself would leave the source for a compiler at load.
    from swa_tvm.compiler import cuda_pack

    for entry in [task["baseline"]] + task["candidates"]:
        [(fmt, data)] = cuda_pack.read_cuda_modules(cuda_pack.library_blob(str(folder / entry["artifact"])))
        assert fmt == "fatbin" and data[:4] == bytes.fromhex("50ed55ba"), (entry["artifact"], fmt)
    # The candidate is a point of schedules/cuda.py's space (its samples in the trace).
    records = json.loads((folder / "records.json").read_text())["records"]
    trace = json.dumps(records[task["candidates"][0]["id"]])
    assert "SamplePerfectTile" in trace and "SampleCategorical" in trace


@pytest.mark.parametrize("faster", [False, True])
def test_cuda_records_replace_the_fused_kernel_only_when_measured_faster(cuda_batch, tmp_path, faster):
    import swa_tvm

    spec, folder, batch = cuda_batch
    logs = tmp_path / "logs"
    target = {"kind": "cuda", "arch": "sm_80"}
    measured = _simulated_measurement(batch, tmp_path / "m.json", 1.0, 0.5 if faster else 2.0)
    # Without a measured baseline a CUDA record is never applied.
    counts = tuning_batch.import_measurements(str(folder), measured, str(logs))
    assert counts == {"records": 1, "baselines": 1, "failed": 0}
    best = records.best_record(spec, target, str(logs))
    manifest = swa_tvm.export_library([spec], tmp_path / "x.so", "cuda -arch=sm_80", logs=str(logs))
    entry = manifest["kernels"][0]
    if faster:
        assert best.trace is not None and best.run_ms == pytest.approx(0.5)
        assert entry["schedule"] == "tuned"
    else:
        from swa_tvm.cli import _tuned_text

        assert best.trace is None and best.default_point and best.run_ms == pytest.approx(1.0)
        assert entry["schedule"] == "cuda_flash_tc" and entry["tuning"]["default_point"]
        assert "tensor cores" in _tuned_text(entry) and "faster than its 1 tuning records" in _tuned_text(entry)
    os.remove(logs / target_key(target) / records.BASELINE_FILE)
    assert records.best_record(spec, target, str(logs)) is None


def test_cuda_tune_without_a_gpu_says_how_to_measure(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "tune", "--spec", "head_dim=16,window=7:0,dtype=float16", "--target", "cuda -arch=sm_90",
                         "--trials", "1", "--logs", tmp_path)  # fmt: skip
    assert rc == 1
    assert "has none" in err and "--batch-out" in err


def test_baselines_measured_by_metaschedules_runner(tmp_path):
    """Where MetaSchedule's runner reaches the device (tune on the GPU's machine, or over
    RPC) the baseline is measured by that runner: here the CPU's local runner."""
    target = host_target()
    folder = str(tmp_path / target_key(target))
    builder = tune.make_builder(target, 2)
    try:
        tuning_batch.measure_baselines([KSPEC], target, folder, builder, tune.make_runner(threads=2))
    finally:
        builder.close()
    (entry,) = records.read_baselines(folder).values()
    assert entry["spec"] == KSPEC.name and entry["schedule"] == "default"
    assert len(entry["run_secs"]) == 3 and min(entry["run_secs"]) > 0


def test_measuring_a_cuda_batch_without_a_gpu_says_so(cuda_batch):
    from swa_tvm.tuning.measure import measure

    _, folder, _ = cuda_batch
    with pytest.raises(RuntimeError, match="no CUDA device is present"):
        measure(str(folder), "cuda", progress=lambda m: None)
    with pytest.raises(ValueError, match="is for cuda"):
        measure(str(folder), "cpu", progress=lambda m: None)


def test_committed_bf16_cuda_records_read_in_a_fresh_process():
    """tuning_logs/cuda-sm_90 holds the H200 batch's bf16 records, tensor-core ones among
    them, which name this package's bfloat16 wmma intrinsics: looking them up (what every
    bf16 CUDA export does first) works in a process that registered nothing. It failed
    there (`make gpu-bundle` stopped at its bf16 library); pytest's own process has them
    registered by other tests, hence a subprocess."""
    from swa_tvm.compiler.records import default_logs_root

    assert os.path.exists(os.path.join(default_logs_root(), "cuda-sm_90"))
    code = (
        "from swa_tvm.compiler import build, targets\n"
        "from swa_tvm.spec import AttentionSpec\n"
        "specs = [k for k in AttentionSpec.parse('head_dim=128,window=4095:0,dtype=bfloat16').kernels() if k.kind == 'local']\n"
        "found = build.find_records(specs, targets.normalize_target('cuda -arch=sm_90'))\n"
        "print(sorted(k for k, v in found.items() if v is not None))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "['swa_local_d128_bf16_l4095_r0_md1_x0_bq32']", run.stdout
