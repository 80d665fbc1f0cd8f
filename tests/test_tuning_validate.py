"""Validation of CPU tuning records: a searched record is applied only where it beat the
default schedule at every validation shape, timed back to back; a record faster at the
tuning shape alone, or with outputs that differ from the default's, is not applied.

Timings are replaced by fixed numbers where a verdict is asserted (the machine is shared
and noisy); one real run checks what is timed and written."""

import json

import pytest
import torch

import swa_tvm
from swa_tvm.compiler import records
from swa_tvm.compiler.targets import host_target
from swa_tvm.spec import CPU_ONLY_KINDS, AttentionSpec
from swa_tvm.tuning import validate as V

from conftest import check_against_reference, run_cli

SPEC_STR = "head_dim=16,window=7:0"
KSPEC = AttentionSpec.parse(SPEC_STR).kernels()[0]
SMALL = [{}, {"T": 4096}, {"B": 3}]  # the tuning shape, a longer T, a batch (small kernels keep it quick)


def _log_with_searched_records(root, searched_secs=(0.5e-3, 0.6e-3)):
    """A log of KSPEC: the default point at 1 ms, and searched points that measured
    faster at the tuning shape. Returns (default trace, [searched traces])."""
    import tvm
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from swa_tvm.compiler.targets import _vector_lanes
    from swa_tvm.schedules import cpu

    here = host_target()
    tvm_target = tvm.target.Target(here)
    lanes = _vector_lanes(tvm_target)
    default = records.default_point(KSPEC, lanes)
    db = records.open_log(records.log_dir(str(root), here))
    wl = db.commit_workload(records.tuning_workload(KSPEC))
    args = ArgInfo.from_prim_func(default.mod["main"])
    db.commit_tuning_record(ms.database.TuningRecord(default.trace, wl, [1.0e-3], tvm_target, args))
    searched = []
    for seed, secs in zip((5, 7), searched_secs):
        sch = s_tir.Schedule(records.tuning_workload(KSPEC), seed=seed)
        cpu.schedule(sch, KSPEC, lanes, cpu.Sampled())
        assert str(sch.trace) != str(default.trace)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wl, [secs], tvm_target, args))
        searched.append(sch.trace)
    return default.trace, searched


def test_unvalidated_records_are_not_applied(tmp_path):
    """A searched record twice as fast at the tuning shape is not applied until a
    verdict keeps it: the default schedule's own record is."""
    default, searched = _log_with_searched_records(tmp_path)
    best = records.best_record(KSPEC, host_target(), str(tmp_path))
    assert best.default_point and str(best.trace) == str(default)
    assert best.run_ms == pytest.approx(1.0) and best.records == 3


def _fixed_times(monkeypatch, per_shape):
    """Replace the timing with ``per_shape[i]`` (ms of the default, then each record)."""
    calls = iter(per_shape)
    monkeypatch.setattr(V, "_time_round_robin", lambda cands, args, rounds: list(next(calls)))


@pytest.mark.slow  # builds kernels: `make test`
@pytest.mark.parametrize(
    "per_shape,kept",
    [
        # The first record wins everywhere; the second loses at the batch shape.
        ([(10, 8, 7), (40, 36, 30), (20, 19, 21)], 0),
        # Both win everywhere: the smaller worst-shape ratio (the second's 0.95) is kept.
        ([(10, 9.7, 9.5), (40, 36, 38), (20, 19, 19)], 1),
        # Faster at the tuning shape, slower at T=16384: nothing is kept.
        ([(10, 5, 6), (40, 41, 44), (20, 15, 16)], None),
        # Within the 2% margin everywhere: not a win.
        ([(10, 9.9, 9.85), (40, 39.5, 39.9), (20, 19.7, 19.9)], None),
    ],
)
def test_a_record_is_kept_only_if_it_wins_at_every_shape(tmp_path, monkeypatch, per_shape, kept):
    default, searched = _log_with_searched_records(tmp_path)
    _fixed_times(monkeypatch, per_shape)
    (v,) = V.validate([KSPEC], host_target(), str(tmp_path), shapes=SMALL, rounds=1, passes=1)
    digests = [records.trace_digest(t) for t in searched]
    assert v.kept == (None if kept is None else digests[kept])
    for d, j in zip(digests, (1, 2)):
        assert v.entry["worst_ratio"][d] == pytest.approx(max(s[j] / s[0] for s in per_shape), abs=1e-4)
    best = records.best_record(KSPEC, host_target(), str(tmp_path))
    assert best.default_point is (kept is None)
    assert str(best.trace) == str(default if kept is None else searched[kept])


@pytest.mark.slow  # builds kernels: `make test`
def test_a_record_with_other_outputs_is_rejected(tmp_path, monkeypatch):
    """A candidate faster everywhere whose outputs differ from the default schedule's is
    rejected, never kept."""
    _, searched = _log_with_searched_records(tmp_path)
    wrong = records.trace_digest(searched[0])
    real_init = V._Candidate.__init__

    def init(self, spec, target, trace, name):
        real_init(self, spec, target, trace, name)
        if name == wrong:
            f = self.func

            def skewed(*args):
                f(*args)
                out = args[-2]  # ..., out, lse
                out.copyfrom(out.numpy() * 1.01)

            self.func = skewed

    monkeypatch.setattr(V._Candidate, "__init__", init)
    _fixed_times(monkeypatch, [(10, 5, 9), (40, 20, 36), (20, 10, 18)])
    (v,) = V.validate([KSPEC], host_target(), str(tmp_path), shapes=SMALL, rounds=1, passes=1)
    assert wrong in v.entry["rejected"] and "differ" in v.entry["rejected"][wrong]
    assert v.kept == records.trace_digest(searched[1])  # the other one, 0.9x everywhere


@pytest.mark.slow  # builds kernels: `make test`
def test_validation_times_the_exported_kernels_and_export_applies_the_verdict(tmp_path, fresh_registry, capsys):
    """A real validation run: every shape is timed for the default and each record, the
    verdict file says what was measured, and export applies exactly the kept record (or
    the default schedule), whose library computes the right answer."""
    _log_with_searched_records(tmp_path)
    rc, out, err = run_cli(capsys, "validate", "--spec", SPEC_STR, "--logs", tmp_path, "--rounds", "3",
                           "--candidates", "2")  # fmt: skip
    assert rc == 0, err
    assert err.count(f"{KSPEC.name} at ") == 6  # one progress line per validation shape and pass
    folder = records.log_dir(str(tmp_path), host_target())
    with open(f"{folder}/{records.VALIDATION_FILE}") as f:
        (entry,) = json.load(f)["verdicts"].values()
    assert [t["shape"]["T"] for t in entry["timings"]] == [2048, 16384, 2048] * 2
    assert [t["shape"]["B"] for t in entry["timings"]] == [1, 1, 4] * 2
    assert [t["pass"] for t in entry["timings"]] == [1, 1, 1, 2, 2, 2]
    for t in entry["timings"]:
        assert t["default_ms"] > 0 and len(t["record_ms"]) == 2 and all(x > 0 for x in t["record_ms"].values())
    assert entry["rejected"] == {}  # the sampled schedules compute what the default does
    assert entry["default"] == records.trace_digest(records.default_trace(KSPEC, host_target()))
    worst = {d: max(t["record_ms"][d] / t["default_ms"] for t in entry["timings"]) for d in entry["worst_ratio"]}
    assert worst == pytest.approx(entry["worst_ratio"], abs=1e-3)
    assert (entry["kept"] is not None) == (min(worst.values()) <= 1 - V.WIN_MARGIN)

    lib = tmp_path / "validated.so"
    rc, _, err = run_cli(capsys, "export", "--spec", SPEC_STR, "--logs", tmp_path, "-o", lib)
    assert rc == 0, err
    (k,) = swa_tvm.runtime.library.read_manifest(lib)["kernels"]
    assert k["tuned"] and k["tuning"]["default_point"] is (entry["kept"] is None)
    assert k["tuning"]["validation"] == ("default" if entry["kept"] is None else "kept")
    swa_tvm.load_library(lib)
    check_against_reference(*(torch.randn(2, 2, 333, 16) for _ in range(3)), window_size=(7, 0))


def test_validate_refuses_bad_arguments(tmp_path, capsys):
    for flag, value, word in (("--candidates", "0", "candidates"), ("--rounds", "0", "rounds"),
                              ("--passes", "0", "passes")):
        rc, _, err = run_cli(capsys, "validate", "--spec", SPEC_STR, "--logs", tmp_path, flag, value)
        assert rc == 1 and word in err
    rc, _, err = run_cli(capsys, "validate", "--spec", SPEC_STR, "--logs", tmp_path, "--target", "cuda -arch=sm_90")
    assert rc == 1 and "CUDA" in err


@pytest.mark.slow  # builds kernels: `make test`
def test_a_record_must_win_in_every_pass(tmp_path, monkeypatch):
    """A record ahead everywhere in the first pass and behind at one shape in the second
    is not kept: one pass let records within the noise through."""
    _, searched = _log_with_searched_records(tmp_path, searched_secs=(0.5e-3,))
    _fixed_times(monkeypatch, [(10, 9), (40, 36), (20, 18), (10, 9), (40, 41), (20, 18)])
    (v,) = V.validate([KSPEC], host_target(), str(tmp_path), shapes=SMALL, rounds=1, passes=2)
    assert v.kept is None and v.entry["worst_ratio"] == {records.trace_digest(searched[0]): pytest.approx(41 / 40)}


@pytest.mark.slow  # builds kernels: `make test`
def test_kept_record_in_the_manifest_and_info(tmp_path, monkeypatch, capsys):
    """A kept record is exported with its validation (worst ratio, date), and `info`
    says so; the library computes the right answer."""
    _, searched = _log_with_searched_records(tmp_path)
    _fixed_times(monkeypatch, [(10, 8, 7), (40, 36, 30), (20, 19, 21)])
    (v,) = V.validate([KSPEC], host_target(), str(tmp_path), shapes=SMALL, rounds=1, passes=1)
    lib = tmp_path / "kept.so"
    rc, _, err = run_cli(capsys, "export", "--spec", SPEC_STR, "--logs", tmp_path, "-o", lib)
    assert rc == 0, err
    (k,) = swa_tvm.runtime.library.read_manifest(lib)["kernels"]
    assert k["schedule"] == "tuned" and k["tuning"]["validation"] == "kept"
    assert k["tuning"]["worst_ratio"] == pytest.approx(0.95)
    rc, out, _ = run_cli(capsys, "info", lib)
    assert rc == 0 and "validated at most 0.95x the default's time" in out


@pytest.mark.slow  # builds kernels: `make test`
def test_stale_or_damaged_verdicts_apply_no_record(tmp_path, monkeypatch):
    """A verdict weighed against another default schedule (the code changed since) is
    void, and a damaged verdict file warns and applies no searched record."""
    default, searched = _log_with_searched_records(tmp_path)
    _fixed_times(monkeypatch, [(10, 8, 7), (40, 36, 30), (20, 19, 21)])
    V.validate([KSPEC], host_target(), str(tmp_path), shapes=SMALL, rounds=1, passes=1)
    assert not records.best_record(KSPEC, host_target(), str(tmp_path)).default_point
    path = tmp_path / records.target_key(host_target()) / records.VALIDATION_FILE
    data = json.loads(path.read_text())
    (entry,) = data["verdicts"].values()
    entry["default"] = "0" * 16
    path.write_text(json.dumps(data))
    best = records.best_record(KSPEC, host_target(), str(tmp_path))
    assert best.default_point and str(best.trace) == str(default)
    path.write_text('{"format": 1, "verdicts": [')
    with pytest.warns(UserWarning, match="unreadable"):
        best = records.best_record(KSPEC, host_target(), str(tmp_path))
    assert best.default_point


def test_every_validated_kind_gets_its_arguments():
    """Every validated kernel kind gets a tensor for each buffer and a value for each
    scalar at every validation shape, outputs last; the KV-cache kinds are left out."""
    spec = AttentionSpec.parse("head_dim=16,window=7:0,sinks,globals,kvcache,softcap,backward")
    kinds = set()
    for k in spec.kernels():
        if k.kind not in V.VALIDATED_KINDS:
            assert k.kind.startswith("cache") or k.kind in CPU_ONLY_KINDS  # not validated; hand-written: no records
            continue
        kinds.add(k.kind)
        for shape in V.validation_shapes(k):
            args, outputs = V._arguments(k, shape)
            assert outputs and outputs == list(range(len(args) - len(outputs), len(args)))
            assert all(not isinstance(args[i], float) for i in outputs)
    assert kinds == set(V.VALIDATED_KINDS)


def test_validation_refuses_a_class_this_cpu_cannot_run(tmp_path, monkeypatch):
    """Timing a target's code needs a CPU with the features its -mcpu implies: a
    baseline x86-64 host refuses an AVX-512 class, naming the features it lacks."""
    monkeypatch.setattr(V, "host_target", lambda: {"kind": "llvm", "mcpu": "x86-64", "num-cores": 2})
    with pytest.raises(ValueError, match="lacks .*avx2"):
        V.validate([KSPEC], {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}, str(tmp_path))
    V.check_runs_here({"kind": "llvm", "mcpu": "x86-64", "num-cores": 2})  # its own class passes


@pytest.mark.slow  # builds kernels: `make test`
def test_a_record_that_no_longer_replays_is_rejected(tmp_path, monkeypatch):
    """A record whose trace fails to replay on today's schedule code is rejected, named,
    and the others are still weighed."""
    _, searched = _log_with_searched_records(tmp_path)
    stale = records.trace_digest(searched[0])
    real_init = V._Candidate.__init__

    def init(self, spec, target, trace, name):
        if name == stale:
            raise ValueError("instruction 3: no such block")
        real_init(self, spec, target, trace, name)

    monkeypatch.setattr(V._Candidate, "__init__", init)
    _fixed_times(monkeypatch, [(10, 9), (40, 36), (20, 18)])  # the default, then the one record built
    (v,) = V.validate([KSPEC], host_target(), str(tmp_path), shapes=SMALL, rounds=1, passes=1)
    assert "no longer replays" in v.entry["rejected"][stale] and stale not in v.entry["worst_ratio"]
    assert v.kept == records.trace_digest(searched[1])


@pytest.mark.slow  # builds kernels: `make test`
def test_verdicts_export_cannot_use_are_ignored(tmp_path, monkeypatch):
    """A verdict keeping a record the log lacks applies the default and says so (no
    "kept" in what export reads); malformed verdict entries are warned about and
    ignored, never a crash."""
    default, searched = _log_with_searched_records(tmp_path)
    _fixed_times(monkeypatch, [(10, 8, 7), (40, 36, 30), (20, 19, 21)])
    V.validate([KSPEC], host_target(), str(tmp_path), shapes=SMALL, rounds=1, passes=1)
    path = tmp_path / records.target_key(host_target()) / records.VALIDATION_FILE
    data = json.loads(path.read_text())
    (key,) = data["verdicts"]
    entry = data["verdicts"][key]
    entry["worst_ratio"]["f" * 16] = 0.5
    entry["kept"] = "f" * 16  # no such record
    path.write_text(json.dumps(data))
    best = records.best_record(KSPEC, host_target(), str(tmp_path))
    assert best.default_point and str(best.trace) == str(default) and best.validation["kept"] is None
    for damaged in ("not a dict", {"kept": None}, dict(entry, kept="e" * 16)):
        data["verdicts"][key] = damaged
        path.write_text(json.dumps(data))
        with pytest.warns(UserWarning, match="damaged verdict"):
            best = records.best_record(KSPEC, host_target(), str(tmp_path))
        assert best.default_point and best.validation is None
