"""Validation of CPU tuning records: a searched record is applied only where it beats
the default schedule at every shape users run, not only at the tuning shape.

A search measures its candidates at one shape (``records.TUNE_SHAPES``: B=1, T=2048),
each minutes apart from the default schedule's own measurement. Both differ from use:
the exported kernel is the symbolic-T one, and users run long sequences and batches.
Of the rocketlake class's records chosen that way, those of the four float32 forward
window kernels ran up to 1.23x the default's time at one of the shapes below.

``validate`` therefore builds, for each kernel, the symbolic-T kernel exactly as export
does, once with the default schedule and once with each of the fastest searched records,
and times them in this process back to back (round-robin, order rotated each round,
median of the rounds) at ``validation_shapes``: the tuning shape, T=16384 and B=4, the
shapes in turn and all of them twice over (two passes). A candidate whose outputs differ
from the default's beyond the dtype's tolerance is rejected. A record is kept only if its
median is at least ``WIN_MARGIN`` below the default's at every shape in every pass (one
pass let records within the noise through: of two one-pass runs over the same logs, six
verdicts of sixteen flipped); of several such records, the one with the smallest worst
ratio. The verdicts go to ``records.VALIDATION_FILE`` beside the records, with the
default schedule they were weighed against, and ``records.best_records`` applies a
searched record only where a verdict for today's default kept it.

The KV-cache kernels are not validated: their inputs (positions, each block's first key
slot) would have to be a real decode step's for the outputs to mean anything, and the
tuning fills do not make one. Their searched records are therefore not applied.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import tvm
from tvm import te

from swa_tvm.compiler.build import compile_specs
from swa_tvm.compiler.records import (
    TUNE_SCALARS,
    VALIDATION_FILE,
    VALIDATION_FORMAT,
    _same_target_class,
    default_trace,
    log_dir,
    open_log,
    read_validation,
    trace_digest,
    tune_shapes,
    tuning_workload,
    workload_key,
)
from swa_tvm.compiler.targets import host_target, matrix_form, normalize_target, target_key
from swa_tvm.compute import COMPUTES
from swa_tvm.runtime.library import default_tvm_threads, host_cpu_name, tvm_pool_threads
from swa_tvm.spec import KernelSpec
from swa_tvm.tuning.candidates import tuning_inputs

log = logging.getLogger("swa_tvm.tuning")

# A kept record is at least this much faster than the default at every shape: the
# medians of back-to-back rounds on a shared 2-core machine still move by ~1-2%.
WIN_MARGIN = 0.02
# Outputs of a candidate against the default schedule's on the same inputs.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
# The kernels validated: those whose tuning inputs are a meaningful call.
VALIDATED_KINDS = ("local", "global", "local_dq", "local_dkv", "local_dx", "global_bwd")


def validation_shapes(spec: KernelSpec) -> list[dict]:
    """The shapes a record must win at: the tuning shape, a long sequence and a batch."""
    base = tune_shapes(spec)
    return [base, tune_shapes(spec, {"T": max(16384, base["T"])}), tune_shapes(spec, {"B": 4})]


@dataclass
class Verdict:
    spec: KernelSpec
    kept: str | None  # trace_digest of the kept record, None: the default schedule stays
    entry: dict  # what VALIDATION_FILE holds for the kernel


class _Candidate:
    """A kernel built as export builds it: the default schedule (``trace`` None) or a
    record's trace replayed on the symbolic-T kernel."""

    def __init__(self, spec, target, trace, name):
        self.name = name
        record = None if trace is None else _Trace(trace)
        module, _ = compile_specs([spec], target, records={spec.name: record})
        self.func = module[spec.name]


@dataclass
class _Trace:  # what compile_specs reads of a record
    trace: object


def _arguments(spec: KernelSpec, shapes: dict) -> tuple[list, list[int]]:
    """The kernel's arguments at ``shapes`` (tensors filled as tuning fills them, the
    scale and TUNE_SCALARS as a tuning measurement fixes them) and the positions of its
    outputs among them."""
    params = COMPUTES[spec.kind](spec, shapes, native_exp=False)
    tensors = [a for a in params if isinstance(a, te.Tensor)]
    filled = iter(tuning_inputs([("TENSOR", str(a.dtype), [int(x) for x in a.shape]) for a in tensors]))
    args, outputs = [], []
    for i, a in enumerate(params):
        if isinstance(a, te.Tensor):
            args.append(tvm.runtime.tensor(next(filled)))
            if not isinstance(a.op, te.PlaceholderOp):
                outputs.append(i)
        elif a.name == "scale":
            args.append(1.0 / spec.head_dim**0.5)
        elif a.name in TUNE_SCALARS:
            args.append(TUNE_SCALARS[a.name][0])
        else:
            raise ValueError(f"kernel {spec.name}: no validation value for its argument {a.name!r}")
    return args, outputs


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Largest difference over the largest magnitude; equal entries (infinities of one
    sign included) differ by 0, a NaN where the other has none by inf."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    diff = np.where(a == b, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(a) != np.isnan(b), np.inf, np.nan_to_num(diff, nan=0.0))
    finite = np.abs(b[np.isfinite(b)])
    return float(diff.max() / max(finite.max() if finite.size else 0.0, 1e-30))


def _outputs_of(cand: _Candidate, args: list, outputs: list[int]) -> list[np.ndarray]:
    """``cand``'s outputs on ``args``, written into tensors first filled with NaN (an
    entry a schedule leaves unwritten shows)."""
    for i in outputs:
        args[i].copyfrom(np.full(args[i].shape, np.nan, dtype=args[i].numpy().dtype))
    cand.func(*args)
    return [args[i].numpy().copy() for i in outputs]


def _time_round_robin(candidates: list[_Candidate], args: list, rounds: int) -> list[float]:
    """Median ms of each candidate on ``args``: one warm-up call each, then ``rounds``
    rounds calling every candidate once, the order rotated each round."""
    for c in candidates:
        c.func(*args)
    times = [[] for _ in candidates]
    for r in range(rounds):
        order = list(range(len(candidates)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            t0 = time.perf_counter()
            candidates[i].func(*args)
            times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def _searched_traces(db, mod, spec: KernelSpec, target: dict, count: int) -> list:
    """The ``count`` fastest searched traces of ``spec`` (tuning workload ``mod``) in
    ``db`` (distinct, the default point's left out)."""
    mine = [r for r in db.records_for(mod) if _same_target_class(r.target, target)]
    seen, searched = {str(default_trace(spec, target))}, []
    for r in mine:
        text = str(r.trace)
        if text not in seen:
            seen.add(text)
            searched.append(r.trace)
        if len(searched) == count:
            break
    return searched


def validate_spec(spec: KernelSpec, target: dict, traces: list, rounds: int = 7, passes: int = 2,
                  shapes: list[dict] | None = None, progress=None) -> Verdict:
    """Time the default schedule and each searched trace of ``traces`` at ``shapes``
    (default ``validation_shapes``), the shapes in turn, ``passes`` times over; keep
    the best record that wins at every shape in every pass."""
    shapes = shapes if shapes is not None else validation_shapes(spec)
    cands, rejected = [_Candidate(spec, target, None, "default")], {}
    for t in traces:
        try:
            cands.append(_Candidate(spec, target, t, trace_digest(t)))
        except Exception as e:  # noqa: BLE001 - the schedule code changed since the record was made
            rejected[trace_digest(t)] = f"no longer replays ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    timings = []  # one entry per (pass, shape)
    calls = [_arguments(spec, shape) for shape in shapes]  # the same inputs in every pass
    for p in range(passes):
        for shape, (args, outputs) in zip(shapes, calls):
            ms = _time_round_robin(cands, args, rounds)
            if p == 0:
                want = _outputs_of(cands[0], args, outputs)
                for c in cands[1:]:
                    err = max(_rel_err(got, w) for got, w in zip(_outputs_of(c, args, outputs), want))
                    if not err <= TOLERANCE.get(spec.dtype, 1e-4) and c.name not in rejected:
                        rejected[c.name] = f"outputs differ from the default's by {err:.2e} at {_shape_text(shape)}"
            timings.append({"pass": p + 1, "shape": shape, "default_ms": round(ms[0], 4),
                            "record_ms": {c.name: round(t, 4) for c, t in zip(cands[1:], ms[1:])}})
            if progress:
                ratios = ", ".join(f"{t / ms[0]:.2f}" for t in ms[1:])
                progress(f"{spec.name} at {_shape_text(shape)} (pass {p + 1} of {passes}): default {ms[0]:.2f} ms, "
                         f"records x{ratios}")
    worst = {}
    for c in cands[1:]:
        if c.name not in rejected:
            worst[c.name] = max(t["record_ms"][c.name] / t["default_ms"] for t in timings)
    winners = {n: w for n, w in worst.items() if w <= 1 - WIN_MARGIN}
    kept = min(winners, key=winners.get) if winners else None
    entry = {
        "spec": spec.name,
        "kept": kept,
        # The default schedule weighed against: a verdict is void once it changes.
        "default": trace_digest(default_trace(spec, target)),
        "rule": f"median at least {WIN_MARGIN:.0%} below the default's at every shape, in each of {passes} passes",
        "worst_ratio": {n: round(w, 4) for n, w in worst.items()},
        "rejected": rejected,
        "timings": timings,
        "rounds": rounds,
        "threads": tvm_pool_threads(),
        "target_key": target_key(target),
        "measured_on": target_key(host_target()),
        "processor": host_cpu_name() or platform.machine(),
        "date": datetime.date.today().isoformat(),
    }
    return Verdict(spec, kept, entry)


def _shape_text(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items() if k in ("B", "T", "Tk"))


def write_verdicts(folder: str, verdicts: Iterable[Verdict], tuning_workloads: dict) -> str:
    """Merge ``verdicts`` into the folder's VALIDATION_FILE (replacing each kernel's
    earlier verdict); written to a temporary file and renamed, never torn."""
    table = read_validation(folder)
    for v in verdicts:
        table[workload_key(tuning_workloads[v.spec.name])] = v.entry
    path = os.path.join(folder, VALIDATION_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": VALIDATION_FORMAT, "verdicts": table}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def check_runs_here(target: dict) -> None:
    """Validation times the target's code on this CPU: refuse a target whose -mcpu
    implies features this CPU lacks (its code could fault here; timings of a class
    unlike this one say nothing of it)."""
    want = set(tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target(target)))
    have = set(tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target(host_target())))
    missing = sorted(f for f in want - have if not f.startswith("amx"))  # AMX: per kernel (uses_amx)
    if missing:
        raise ValueError(f"target {target_key(target)}: this CPU ({target_key(host_target())}) lacks "
                         f"{', '.join(missing[:8])}; validate on a machine of that class")


def validate(specs: Iterable[KernelSpec], target: dict | str | None, logs_root: str, *, candidates: int = 3,
             rounds: int = 7, passes: int = 2, shapes: list[dict] | None = None, progress=None) -> list[Verdict]:
    """Validate the ``candidates`` fastest searched records of each CPU kernel of
    ``specs`` in ``logs_root``'s folder for ``target`` against the default schedule, and
    write the verdicts (VALIDATION_FILE). ``shapes``: overrides of the tuning shape
    (``{"T": 512}``) instead of ``validation_shapes``, for tests. Kernels without
    searched records get no verdict."""
    target = normalize_target(target)
    if target.get("kind") != "llvm":
        raise ValueError("validation times CPU kernels; CUDA records are weighed against the fused kernels' "
                         "GPU baselines (baselines.json)")
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    check_runs_here(target)
    # The matrix-engine form (AMX, AVX-512 BF16) is built with its own schedule: no record applies.
    specs = [s for s in dict.fromkeys(specs) if matrix_form(s, target) is None]
    for s in specs:
        if s.kind not in VALIDATED_KINDS:
            log.info("%s: the KV-cache kernels are not validated, so their searched records are not applied", s.name)
    specs = [s for s in specs if s.kind in VALIDATED_KINDS]
    folder = log_dir(logs_root, target)
    mods = {s.name: tuning_workload(s) for s in specs}
    db = open_log(folder, only={workload_key(m) for m in mods.values()})
    default_tvm_threads(int(target.get("num-cores", len(os.sched_getaffinity(0)) or 1)))
    verdicts = []
    for spec in specs:
        traces = _searched_traces(db, mods[spec.name], spec, target, candidates)
        if not traces:
            continue
        log.info("validating %d record(s) of %s against its default schedule", len(traces), spec.name)
        full = [tune_shapes(spec, s) for s in shapes] if shapes is not None else None
        v = validate_spec(spec, target, traces, rounds, passes, full, progress)
        verdicts.append(v)
        write_verdicts(folder, [v], mods)  # each kernel's verdict as soon as it is known
    return verdicts


__all__ = ["validate", "validate_spec", "validation_shapes", "Verdict", "WIN_MARGIN"]
