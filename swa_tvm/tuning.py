"""MetaSchedule tuning: the search space, the tuning logs, and applying their records.

What is tuned. A record is measured on a *tuning workload*: the kernel's PrimFunc at a
concrete shape (``TUNE_SHAPES``) with the scale folded to a constant, because
MetaSchedule's runner needs concrete tensors. The search space is the target's schedule
(``schedules/cpu.py``, ``schedules/cuda.py``) run with ``Sampled`` knobs; it samples only
loops whose extent the spec fixes, so a record's trace replays unchanged on the
symbolic-T kernel that is exported (``apply_record``).

CUDA. A CUDA kernel without a record is a fused kernel (``build.default_schedule``), not
the TE this space schedules, so a CUDA record applies only where it measured faster than
that fused kernel at the tuning shape, on the same GPU: ``baselines.json`` beside the
records holds the fused kernels' measured times (written by ``swa_tvm.tuning_batch``).

Where records live. ``<logs>/<target-key>/`` (for instance ``tuning_logs/llvm-znver3/``)
holds MetaSchedule's own JSON database files, ``database_workload.json`` and
``database_tuning_record.json``, readable by ``ms.database.JSONDatabase``. Records of one
target class are never applied to another: export looks only in its own class's folder
and also checks each record's target.

Why a custom writer. ``TuningLog`` appends every line with a single ``write(2)`` on an
O_APPEND descriptor and fsyncs it, so killing a tune (Ctrl-C, SIGKILL) loses at most the
candidates in flight and never leaves a torn line; a torn last line from a power loss is
skipped with a warning when loading.
"""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .compute import flops, prim_func
from .spec import KernelSpec, accum_dtype

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"

# The shape records are measured at. T=2048 keeps one measurement near 50-100 ms on two
# cores while giving every core hundreds of work items, as long sequences do.
TUNE_SHAPES = {
    "local": {"B": 1, "H": 8, "Hkv": 8, "T": 2048, "E": 16},
    "global": {"B": 1, "H": 8, "Hkv": 8, "T": 2048, "G": 16},
}


def tune_shapes(spec: KernelSpec, shapes: dict | None = None) -> dict:
    """The tuning shape of ``spec``: TUNE_SHAPES, with T raised for windows that reach
    past T/2 (a multiple of 2048 at least twice the reach), so that most rows see their
    whole window, as at the lengths such windows serve (W=4096: T=8192)."""
    base = dict(TUNE_SHAPES["global" if spec.is_global else "local"])
    if not spec.is_global and spec.left >= 0 and spec.right >= 0:
        reach = (spec.left + spec.right) * spec.max_dilation + 1
        base["T"] = max(base["T"], -(-2 * reach // 2048) * 2048)
    base.update(shapes or {})
    return base


def tuning_workload(spec: KernelSpec, shapes: dict | None = None, target_kind: str = "llvm"):
    """The IRModule MetaSchedule tunes for ``spec``: concrete shapes, constant scale."""
    import tvm

    func = fold_scale(prim_func(spec, tune_shapes(spec, shapes), target_kind=target_kind), spec)
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def fold_scale(func, spec: KernelSpec):
    """``func`` (a kernel of ``spec``) with its ``scale`` parameter fixed to 1/sqrt(D), as
    a tuning measurement calls it."""
    from tvm import tirx

    scale = next(p for p in func.params if p.name == "scale")
    return func.specialize({scale: tirx.const(1.0 / spec.head_dim**0.5, accum_dtype(spec.dtype))})


def tvm_target_of(target: dict):
    """The TVM Target tuning builds for. CUDA targets get the limits of an sm_80/sm_90
    class GPU that MetaSchedule's GPU checks read (1024 threads and 64K registers per
    block, 48 KiB of static shared memory); the code is the same as without them."""
    import tvm

    if target.get("kind") == "cuda":
        target = dict(target, **{"max_threads_per_block": 1024, "max_num_threads": 1024, "thread_warp_size": 32,
                                 "max_shared_memory_per_block": 48 * 1024, "registers_per_block": 65536})
    return tvm.target.Target(target)


def workload_flops(spec: KernelSpec, shapes: dict | None = None) -> float:
    s = tune_shapes(spec, shapes)
    if spec.is_global:
        return flops(spec, s["B"], s["H"], s["T"], G=s["G"])
    if spec.kind == "local_dx":
        return flops(spec, s["B"], s["H"], s["T"], window_entries=s["E"])
    # Bounded windows: the full band per row (edges ignored); unbounded: half or all of T.
    if spec.left >= 0 and spec.right >= 0:
        w = spec.left + spec.right + 1
    else:
        w = s["T"] // 2 if (spec.left < 0) != (spec.right < 0) else s["T"]
    return flops(spec, s["B"], s["H"], s["T"], window_entries=w + (s["E"] if spec.extras else 0))


# --------------------------------------------------------------------------- startup


def preload_tensor_intrin() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` quickly.

    MetaSchedule imports it in every process that tunes or builds. It parses hundreds
    of TVMScript functions, and the parser calls ``inspect.stack()``, which resolves a
    source file for every frame of the (deep, import-machinery) stack by scanning
    ``sys.modules``: 80 s per process on this 2-core machine. The parser only reads the
    source line of the third frame (``is_defined_in_class``), so while importing, every
    frame gets its file name from the code object, and the first three their source
    line from ``linecache`` (``inspect.getframeinfo`` scanned ``sys.modules`` for each:
    the import took about 10 s with it, 7 s without, 2026-12-05).
    """
    import inspect
    import linecache
    import sys

    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    original = inspect.stack

    def stack(context: int = 1):
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            code, lines, index = frame.f_code, None, None
            if len(frames) < 3:
                lines, index = [linecache.getline(code.co_filename, frame.f_lineno, frame.f_globals)], 0
            frames.append(
                inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, lines, index, positions=None)
            )
            frame = frame.f_back
        return frames

    inspect.stack = stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = original


# --------------------------------------------------------------------------- logs


def default_logs_root() -> str | None:
    """$SWA_TVM_TUNING_LOGS, else the repository's committed ``tuning_logs/`` when the
    package runs from a source checkout, else None."""
    env = os.environ.get("SWA_TVM_TUNING_LOGS")
    if env:
        return env
    repo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning_logs")
    return repo if os.path.isdir(repo) else None


def log_dir(logs_root: str, target: dict) -> str:
    from .build import target_key

    return os.path.join(logs_root, target_key(target))


def _read_lines(path: str) -> list:
    """Parse a JSON-lines table, skipping (with a warning) a torn last line only."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().split("\n") if ln.strip()]
    rows = []
    for n, ln in enumerate(lines):
        try:
            rows.append(json.loads(ln))
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                warnings.warn(f"{path}: skipping a torn last line (an interrupted write)", stacklevel=3)
            else:
                raise ValueError(f"{path}: line {n + 1} is not JSON; the tuning log is damaged") from None
    return rows


def _make_tuning_log_class():
    from tvm.s_tir.meta_schedule.database import MemoryDatabase, PyDatabase, TuningRecord, Workload
    from tvm.ir.utils import derived_object

    @derived_object
    class TuningLog(PyDatabase):
        """A MetaSchedule database over the two JSON files of one target-class folder.

        Queries go to an in-memory database; commits are appended to the files, one
        fsynced ``write(2)`` per line. ``readonly`` opens without ever writing.
        """

        def __init__(self, folder: str, readonly: bool = False, only: set | None = None):
            super().__init__()
            self.folder = folder
            self.readonly = readonly or only is not None
            self._mem = MemoryDatabase(module_equality="structural")
            self._index: dict[str, int] = {}  # workload structural hash -> line number
            self._records = 0
            wl_path, rec_path = self.paths
            if os.path.basename(os.path.normpath(folder)).startswith("cuda"):
                # A tensor-core bf16 record names our wmma intrinsics, which decoding it
                # looks up: without them any bf16 CUDA export failed in a fresh process.
                from .schedules.cuda import register_intrinsics

                register_intrinsics()
            # Decoding a record into TVM objects costs ~15 ms (its trace), so a lookup
            # (``only``: the workload keys wanted) decodes just those workloads' records;
            # the whole committed log took ~8 s to decode.
            workloads = []
            for row in _read_lines(wl_path):
                wanted = only is None or row[0] in only
                self._index[row[0]] = len(workloads)
                workloads.append(self._mem.commit_workload(Workload.from_json(row).mod) if wanted else None)
            for idx, rec in _read_lines(rec_path):
                if workloads[idx] is not None:
                    self._mem.commit_tuning_record(TuningRecord.from_json(rec, workloads[idx]))
                self._records += 1

        @property
        def paths(self) -> tuple[str, str]:
            return os.path.join(self.folder, WORKLOAD_FILE), os.path.join(self.folder, RECORD_FILE)

        def _append(self, path: str, row) -> None:
            if self.readonly:
                raise RuntimeError(f"{self.folder} was opened read-only")
            os.makedirs(self.folder, exist_ok=True)
            data = (json.dumps(row) + "\n").encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)
                if written != len(data):  # only on a full disk; never leave half a line
                    os.ftruncate(fd, os.fstat(fd).st_size - written)
                    raise OSError(f"{path}: short write ({written} of {len(data)} bytes)")
                os.fsync(fd)
            finally:
                os.close(fd)

        def _key(self, workload) -> str:
            return workload.as_json()[0]

        def has_workload(self, mod) -> bool:
            return self._mem.has_workload(mod)

        def commit_workload(self, mod):
            known = self._mem.has_workload(mod)
            wl = self._mem.commit_workload(mod)
            if not known:
                row = wl.as_json()
                if row[0] not in self._index:
                    self._append(self.paths[0], row)
                    self._index[row[0]] = len(self._index)
            return wl

        def commit_tuning_record(self, record) -> None:
            idx = self._index[self._key(record.workload)]
            self._append(self.paths[1], [idx, record.as_json()])
            self._mem.commit_tuning_record(record)
            self._records += 1

        def get_top_k(self, workload, top_k: int):
            return self._mem.get_top_k(workload, top_k)

        def records_for(self, mod) -> list:
            """Every valid record of the workload ``mod``, fastest first (a lookup: the
            workload is committed to the in-memory table only)."""
            if not self._mem.has_workload(mod):
                return []
            return list(self._mem.get_top_k(self._mem.commit_workload(mod), 1 << 20))

        def get_all_tuning_records(self):
            return self._mem.get_all_tuning_records()

        def __len__(self) -> int:
            return self._records

    return TuningLog


_TUNING_LOG_CLS = None


def open_log(folder: str, readonly: bool = False, only: set | None = None):
    """The ``TuningLog`` database of one target-class folder. ``only``: the workload
    keys (``workload_key``) to load, read-only; None loads every workload."""
    global _TUNING_LOG_CLS
    if _TUNING_LOG_CLS is None:
        _TUNING_LOG_CLS = _make_tuning_log_class()
    return _TUNING_LOG_CLS(folder, readonly, only)


def workload_key(mod) -> str:
    """The key a log's workload table stores for ``mod`` (its structural hash)."""
    from tvm.s_tir.meta_schedule.database import Workload

    return Workload(mod).as_json()[0]


@dataclass
class BestRecord:
    trace: object
    run_ms: float
    gflops: float
    records: int  # how many records this workload has
    default_point: bool = False  # the default schedule's own record (nothing beat it)


# A searched record replaces the default schedule only if it measured at least this much
# faster than the default's own record. Smaller wins are within this shared machine's
# noise and did not survive the replay on the symbolic-T kernel: the committed dk/dv
# record of 2026-12-03 measured 2% ahead of the default at the tuning shape and ran ~20%
# behind it in use.
DEFAULT_MARGIN = 0.05


def _same_target_class(record_target, target: dict) -> bool:
    from .build import target_key

    if record_target is None:
        return True  # the folder already names the class
    attrs = dict(record_target.export())
    rec = {"kind": attrs.get("kind"), "mcpu": attrs.get("mcpu"), "arch": attrs.get("arch")}
    return target_key({k: v for k, v in rec.items() if v is not None}) == target_key(target)


BASELINE_FILE = "baselines.json"


def read_baselines(folder: str) -> dict:
    """The fused kernels' measured times in a CUDA log folder: workload key -> entry
    with ``run_secs`` (the fastest measurement), ``spec``, ``schedule``, ``device``."""
    path = os.path.join(folder, BASELINE_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _secs(run_secs) -> float:
    return float(np.mean([float(s) for s in run_secs]))


def _best_in(db, spec: KernelSpec, target: dict, baselines: dict | None = None, mod=None) -> BestRecord | None:
    kind = target.get("kind")
    mod = mod if mod is not None else tuning_workload(spec, target_kind=kind)
    recs = db.records_for(mod)
    mine = [r for r in recs if _same_target_class(r.target, target)]
    if not mine:
        return None
    best, is_default = mine[0], False
    if kind == "llvm":
        import tvm

        from .build import _vector_lanes

        trace = str(default_point(spec, _vector_lanes(tvm.target.Target(target))).trace)
        default = next((r for r in mine if str(r.trace) == trace), None)
        if default is not None and (default is best or _secs(best.run_secs) > (1 - DEFAULT_MARGIN) * _secs(default.run_secs)):
            best, is_default = default, True
    elif kind == "cuda":
        # The default is the fused kernel: a record replaces it only when measured faster
        # on the GPU; without a measurement of the fused kernel, the fused kernel stays.
        base = (baselines or {}).get(workload_key(mod))
        if base is None:
            return None
        if _secs(best.run_secs) > (1 - DEFAULT_MARGIN) * _secs(base["run_secs"]):
            t = _secs(base["run_secs"])
            return BestRecord(None, t * 1e3, workload_flops(spec) / t / 1e9, len(recs), True)
    t = _secs(best.run_secs)
    return BestRecord(best.trace, t * 1e3, workload_flops(spec) / t / 1e9, len(recs), is_default)


def best_records(specs: Iterable[KernelSpec], target: dict, logs_root: str | None) -> dict:
    """The fastest valid record of each spec in ``logs_root``'s folder for ``target``
    (None where there is none), reading that folder once. A record whose ``trace`` is
    None stands for the default kernel, measured faster than every record."""
    specs = list(specs)
    folder = log_dir(logs_root, target) if logs_root else None
    if folder is None or not os.path.exists(os.path.join(folder, RECORD_FILE)):
        return {s.name: None for s in specs}
    kind = target.get("kind")
    mods = {s.name: tuning_workload(s, target_kind=kind) for s in specs}
    db = open_log(folder, only={workload_key(m) for m in mods.values()})
    baselines = read_baselines(folder)
    return {s.name: _best_in(db, s, target, baselines, mods[s.name]) for s in specs}


def best_record(spec: KernelSpec, target: dict, logs_root: str | None) -> BestRecord | None:
    """The fastest valid record for ``spec`` in ``logs_root``'s folder for ``target``."""
    return best_records([spec], target, logs_root)[spec.name]


def apply_record(spec: KernelSpec, trace, target_kind: str = "llvm"):
    """Replay a tuned trace on the symbolic-T kernel; returns the scheduled PrimFunc."""
    import tvm
    from tvm import s_tir

    if target_kind == "cuda":
        from .schedules.cuda import register_intrinsics

        register_intrinsics()  # a tensor-core record names the bfloat16 wmma intrinsics
    sch = s_tir.Schedule(tvm.IRModule({"main": prim_func(spec, target_kind=target_kind)}))
    trace.apply_to_schedule(sch, remove_postproc=True)
    return sch.mod["main"].with_attr("global_symbol", spec.name)


# --------------------------------------------------------------------------- measuring


def input_fills(args_info) -> list[dict]:
    """How each tensor argument ``("TENSOR", dtype, shape)`` of a kernel is filled to
    measure it, the one rule for MetaSchedule's runner here (``tuning_inputs``) and the
    GPU batch runner (``measure_batch``, from ``tuning_batch``'s annotations): floats
    random normal; the [H] int table (dilation) ones; the [B, E] int tables (extra and
    global positions) distinct and sorted below T, the longest third dim of the 4-D
    tensors (q_global's is G), so every index is in range and global rows see the
    sequence."""
    T = max(shape[2] for _, _, shape in args_info if len(shape) == 4)
    fills = []
    for _, dtype, shape in args_info:
        if not dtype.startswith("int"):
            fills.append({"fill": "normal"})
        elif len(shape) == 2:
            fills.append({"fill": "positions", "high": T})
        else:
            fills.append({"fill": "ones"})
    return fills


def tuning_inputs(args_info) -> list[np.ndarray]:
    """A kernel's tuning inputs, filled by ``input_fills``."""
    rng = np.random.default_rng(0)
    out = []
    for (_, dtype, shape), fill in zip(args_info, input_fills(args_info)):
        if fill["fill"] == "positions":
            rows = [np.sort(rng.permutation(fill["high"])[: shape[1]]) for _ in range(shape[0])]
            out.append(np.stack(rows).astype(dtype))
        elif fill["fill"] == "ones":
            out.append(np.ones(shape, dtype=dtype))
        else:
            out.append(rng.standard_normal(shape).astype(dtype))
    return out


def alloc_args_local(device, args_info, alloc_repeat):
    import tvm

    return [[tvm.runtime.tensor(a, device=device) for a in tuning_inputs(args_info)] for _ in range(alloc_repeat)]


def alloc_args_local_threads(threads, device, args_info, alloc_repeat):
    """``alloc_args_local`` that first sizes the runner worker's TVM thread pool like the
    op's (library.configure_cpu_threads). It runs in the worker process before the
    worker's first kernel call creates the pool, so the setting stays in the worker: the
    tuner's own process (and a caller of ``tune``) keeps its environment."""
    from .library import default_tvm_threads

    default_tvm_threads(threads)
    return alloc_args_local(device, args_info, alloc_repeat)


def alloc_args_rpc(session, device, args_info, alloc_repeat):
    return alloc_args_local(device, args_info, alloc_repeat)


def _evaluator():
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig

    # Each candidate runs tens of ms at the tuning shape: three timed runs are enough.
    return EvaluatorConfig(number=1, repeat=3, min_repeat_ms=0, enable_cpu_cache_flush=False)


def parse_rpc_tracker(rpc_tracker: str, rpc_key: str | None) -> tuple[str, int]:
    """HOST:PORT of an RPC tracker, which needs a device key."""
    host, _, port = rpc_tracker.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rpc_tracker {rpc_tracker!r}: expected HOST:PORT")
    if not rpc_key:
        raise ValueError("rpc_key is required with rpc_tracker")
    return host, int(port)


def check_tune_arguments(trials: int, rpc_tracker: str | None, rpc_key: str | None) -> None:
    """The checks of ``tune``'s own arguments, before anything costs time (importing the
    tensor intrinsics, the logs, the search): a mistyped command fails at once."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if rpc_tracker:
        parse_rpc_tracker(rpc_tracker, rpc_key)


def make_runner(
    rpc_tracker: str | None = None, rpc_key: str | None = None, timeout_s: float = 120.0, threads: int | None = None
):
    """MetaSchedule's runner: local (candidates measured on ``threads`` threads, default
    the usable cores), or the devices of an RPC tracker (which use their own setting)."""
    from tvm.s_tir.meta_schedule.runner import LocalRunner, RPCConfig, RPCRunner

    if not rpc_tracker:
        threads = threads or len(os.sched_getaffinity(0))
        alloc = functools.partial(alloc_args_local_threads, threads)
        return LocalRunner(timeout_sec=timeout_s, evaluator_config=_evaluator(), f_alloc_argument=alloc)
    host, port = parse_rpc_tracker(rpc_tracker, rpc_key)
    config = RPCConfig(tracker_host=host, tracker_port=port, tracker_key=rpc_key, session_timeout_sec=int(timeout_s))
    servers = config.count_num_servers(allow_missing=False)
    return RPCRunner(
        rpc_config=config,
        evaluator_config=_evaluator(),
        f_alloc_argument=alloc_args_rpc,
        max_workers=servers,
    )


# --------------------------------------------------------------------------- tuning


@dataclass
class TuneResult:
    spec: KernelSpec
    trials: int  # measured this run
    records: int  # in the log for this kernel after the run
    best_ms: float | None
    best_gflops: float | None


def _progress_callback(specs, bar):
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
    from tvm.ir.utils import derived_object

    @derived_object
    class Progress(PyMeasureCallback):
        def __init__(self):
            super().__init__()
            self.done = 0
            self.best = {}
            self.start = time.time()

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            spec = specs[task_id]
            for res in runner_results:
                self.done += 1
                if res.run_secs:
                    secs = float(np.mean([float(s) for s in res.run_secs]))
                    if secs > 0:
                        g = workload_flops(spec) / secs / 1e9
                        self.best[spec.name] = max(self.best.get(spec.name, 0.0), g)
            if bar is not None:
                bar.update(len(runner_results))
                bar.set_postfix_str(f"{spec.name}: best {self.best.get(spec.name, 0.0):.1f} GFLOP/s")

    return Progress()


def default_point(spec: KernelSpec, lanes: int):
    """The schedule of the default knobs, as a point of the search space (its trace has
    the space's sampling instructions with the defaults as decisions)."""
    from tvm import s_tir

    from .schedules import cpu as cpu_schedules

    sch = s_tir.Schedule(tuning_workload(spec))
    cpu_schedules.schedule(sch, spec, lanes, cpu_schedules.DefaultPoint())
    return sch


def _measure_default_points(specs, db, builder, runner, tvm_target, lanes) -> None:
    """Measure each kernel's default point, unless its log already holds it, and commit
    it as an ordinary record. The evolutionary search seeds its population from the
    best records, so it starts at the default instead of random points only (32 random
    trials of the backward kernels' spaces all lost to the default)."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    todo = []
    for spec in specs:
        sch = default_point(spec, lanes)
        mod = tuning_workload(spec)
        if any(str(r.trace) == str(sch.trace) for r in db.records_for(mod)):
            continue
        todo.append((spec, sch, mod))
    if not todo:
        return
    built = builder.build([ms.builder.BuilderInput(sch.mod, tvm_target) for _, sch, _ in todo])
    inputs, kept = [], []
    for (spec, sch, mod), b in zip(todo, built):
        if b.error_msg:
            raise RuntimeError(f"the default schedule of {spec.name} failed to build: {b.error_msg[:500]}")
        args = ArgInfo.from_prim_func(sch.mod["main"])
        device = "cpu" if tvm_target.kind.name == "llvm" else tvm_target.kind.name
        inputs.append(ms.runner.RunnerInput(b.artifact_path, device, args))
        kept.append((spec, sch, mod, args))
    for (spec, sch, mod, args), fut in zip(kept, runner.run(inputs)):
        res = fut.result()
        if res.error_msg:
            raise RuntimeError(f"the default schedule of {spec.name} failed to run: {res.error_msg[:500]}")
        db.commit_tuning_record(
            ms.database.TuningRecord(sch.trace, db.commit_workload(mod), res.run_secs, tvm_target, args)
        )


def space_generator(spec: KernelSpec, tvm_target):
    """MetaSchedule's design space for ``spec``: the target's schedule with Sampled knobs.
    CUDA candidates that exceed the GPU's limits (threads, shared memory) are dropped
    before building."""
    from tvm.s_tir import meta_schedule as ms

    from .schedules import cpu as cpu_schedules
    from .schedules import cuda as cuda_schedules

    if tvm_target.kind.name == "cuda":

        def fn(sch):
            # Two design spaces where tensor cores apply: the score product on tensor
            # cores, and everything on CUDA cores.
            spaces = []
            if cuda_schedules.tensor_cores_apply(spec):
                tc = sch.copy()
                cuda_schedules.schedule(tc, spec, cpu_schedules.Sampled(), tensor_cores=True)
                spaces.append(tc)
            cuda_schedules.schedule(sch, spec, cpu_schedules.Sampled())
            return spaces + [sch]

        postprocs = [ms.postproc.VerifyGPUCode()]
    else:
        from .build import _vector_lanes

        lanes = _vector_lanes(tvm_target)

        def fn(sch):
            cpu_schedules.schedule(sch, spec, lanes, cpu_schedules.Sampled())
            return sch

        postprocs = []
    return ms.space_generator.ScheduleFn(fn, sch_rules=[], postprocs=postprocs, mutator_probs="from-target")


def export_shared_library(mod, target: dict | None = None) -> str:
    """MetaSchedule builder export: a shared library (which the TVM runtime alone loads,
    unlike the default tar, which needs a compiler to link on the measuring machine),
    for CUDA with the device code compiled in (``cuda_pack.export_module``)."""
    import tempfile

    from .cuda_pack import export_module

    path = os.path.join(tempfile.mkdtemp(prefix="swa_tvm_candidate_"), "candidate.so")
    export_module(mod, path, target or {"kind": "llvm"})
    return path


def make_builder(target: dict, cores: int, shared_library: bool = False):
    """A MetaSchedule builder for ``target`` whose workers persist across batches
    (``tuning_builder.PooledBuilder``; ``close()`` it when done). ``shared_library``:
    export .so files (for measuring with the runtime alone) instead of MetaSchedule's
    tar; CUDA candidates always are."""
    from .tuning_builder import PooledBuilder

    export = shared_library or target.get("kind") == "cuda"
    return PooledBuilder(
        max_workers=cores,
        timeout_sec=300,
        f_export=functools.partial(export_shared_library, target=dict(target)) if export else None,
    )


def check_cuda_specs(specs) -> None:
    """CUDA tuning covers the forward kernels only: the gradient kernels are fused TIR
    kernels (schedules/cuda_flash_bwd.py) with no search space, and the batch runner
    compares forward outputs."""
    from .spec import BACKWARD_KINDS

    if any(s.kind in BACKWARD_KINDS for s in specs):
        raise ValueError("CUDA tuning covers the forward kernels only (the gradient kernels are fused, "
                         "with no search space); tune with --kernels forward")


def check_cuda_tuning(specs, rpc_tracker: str | None) -> None:
    """CUDA tuning measures on a GPU: this machine's, or an RPC tracker's."""
    check_cuda_specs(specs)
    if rpc_tracker is None:
        from .build import local_cuda_arch

        if local_cuda_arch() is None:
            raise RuntimeError(
                "tuning for CUDA measures candidates on a GPU and this machine has none: use "
                "--rpc-tracker, or build a batch here and measure it on a GPU machine "
                "(swa-tvm tune --batch-out DIR; see python -m swa_tvm.measure_batch)"
            )


def tune(
    specs: Iterable[KernelSpec],
    target: dict,
    trials: int,
    logs_root: str,
    work_dir: str,
    *,
    rpc_tracker: str | None = None,
    rpc_key: str | None = None,
    num_trials_per_iter: int = 32,
    seed: int | None = None,
    progress: bool = True,
) -> list[TuneResult]:
    """Tune every kernel of ``specs`` for ``trials`` more measured candidates each,
    appending records to ``<logs_root>/<target-key>/``. The default schedule's point is
    measured first (once per log); existing records seed the search, so a second run
    continues where the first stopped."""
    import logging

    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.logging import get_loggers_from_work_dir

    from .build import _vector_lanes

    check_tune_arguments(trials, rpc_tracker, rpc_key)
    specs = list(dict.fromkeys(specs))
    kind = target.get("kind")
    if kind not in ("llvm", "cuda"):
        raise NotImplementedError(f"tuning for target kind {kind!r} is not supported")
    if kind == "cuda":
        check_cuda_tuning(specs, rpc_tracker)
    cores = int(target.get("num-cores", len(os.sched_getaffinity(0)) or 1))
    # The builder's workers start now, beside this process's tensor_intrin import.
    builder = make_builder(target, cores)
    try:
        preload_tensor_intrin()
        tvm_target = tvm_target_of(target)
        folder = log_dir(logs_root, target)
        db = open_log(folder)
        os.makedirs(work_dir, exist_ok=True)

        names = [s.name for s in specs]
        loggers = get_loggers_from_work_dir(work_dir, names)
        # MetaSchedule's console handler would print its tables through the progress bar;
        # its full log still goes to <work_dir>/logs/.
        ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
        for h in list(ms_logger.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                ms_logger.removeHandler(h)

        before = {s.name: len(db.records_for(tuning_workload(s, target_kind=kind))) for s in specs}
        # Candidates are measured on as many threads as the target's cores, as the op runs
        # them (library.configure_cpu_threads): TVM's own default is half the logical CPUs.
        runner = make_runner(rpc_tracker, rpc_key, threads=cores)
        if kind == "llvm":
            _measure_default_points(specs, db, builder, runner, tvm_target, _vector_lanes(tvm_target))
        else:
            from .tuning_batch import measure_baselines

            measure_baselines(specs, target, folder, builder, runner)

        per_iter = max(1, min(num_trials_per_iter, trials))
        strategy = ms.search_strategy.EvolutionarySearch(
            population_size=max(64, 2 * per_iter), init_min_unmeasured=per_iter, genetic_num_iters=2
        )
        tasks = [
            ms.TuneContext(
                mod=tuning_workload(spec, target_kind=kind),
                target=tvm_target,
                space_generator=space_generator(spec, tvm_target),
                search_strategy=strategy,
                task_name=spec.name,
                rand_state=-1 if seed is None else seed + i,
                num_threads=cores,
                logger=logger,
            ).clone()
            for i, (spec, logger) in enumerate(zip(specs, loggers))
        ]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=trials * len(specs), unit="trial", desc="tune", dynamic_ncols=True)
        callbacks = ms.measure_callback.MeasureCallback.create("default") + [_progress_callback(specs, bar)]
        try:
            ms.tune.tune_tasks(
                tasks=tasks,
                task_weights=[1.0] * len(tasks),
                work_dir=work_dir,
                max_trials_global=trials * len(tasks),
                max_trials_per_task=trials,
                num_trials_per_iter=per_iter,
                builder=builder,
                runner=runner,
                database=db,
                cost_model=ms.cost_model.XGBModel(num_tuning_cores=cores),
                measure_callbacks=callbacks,
                task_scheduler="round-robin",
            )
        finally:
            if bar is not None:
                bar.close()
    finally:
        builder.close()
    results = []
    baselines = read_baselines(folder)
    for spec in specs:
        best = _best_in(db, spec, target, baselines)  # the log in memory holds this run's records
        records = len(db.records_for(tuning_workload(spec, target_kind=kind)))
        results.append(
            TuneResult(
                spec,
                records - before[spec.name],
                records,
                best.run_ms if best else None,
                best.gflops if best else None,
            )
        )
    return results


__all__ = [
    "TUNE_SHAPES",
    "tuning_workload",
    "open_log",
    "best_record",
    "best_records",
    "apply_record",
    "default_point",
    "tune",
    "default_logs_root",
    "log_dir",
]
