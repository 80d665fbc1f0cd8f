"""MetaSchedule tuning: measuring, and the search that writes records into the tuning
logs (swa_tvm.compiler.records reads them back); the search space and the candidates'
builder are ``candidates``'s.

What is tuned. A record is measured on a *tuning workload*
(``records.tuning_workload``): the kernel's PrimFunc at a concrete shape with the scale
folded to a constant. The search space is the target's schedule (``schedules/cpu.py``,
``schedules/cuda.py``) run with ``Sampled`` knobs; it samples only loops whose extent the
spec fixes, so a record's trace replays unchanged on the symbolic-T kernel.

CUDA. A CUDA kernel without a record is a fused kernel (``build.default_schedule``), not
the TE this space schedules, so a CUDA record applies only where it measured faster than
that fused kernel at the tuning shape, on the same GPU: ``baselines.json`` beside the
records holds the fused kernels' measured times (written by ``swa_tvm.tuning.batch``).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.logging import get_loggers_from_work_dir
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.s_tir.meta_schedule.runner import (
    EvaluatorConfig,
    LocalRunner,
    RPCConfig,
    RPCRunner,
)

from swa_tvm.compiler.records import (
    _best_in,
    default_point,
    log_dir,
    open_log,
    read_baselines,
    read_validation,
    tuning_workload,
    tvm_target_of,
    workload_flops,
)
from swa_tvm.compiler.targets import _vector_lanes, local_cuda_arch
from swa_tvm.runtime.library import default_tvm_threads
from swa_tvm.schedules.intrinsics import preload_tensor_intrin
from swa_tvm.spec import KernelSpec
from swa_tvm.tuning.batch import measure_baselines
from swa_tvm.tuning.candidates import (
    check_cuda_specs,
    check_no_amx_specs,
    make_builder,
    space_generator,
    tuning_inputs,
)
from swa_tvm.tuning.validate import validate

log = logging.getLogger("swa_tvm.tuning")

# --------------------------------------------------------------------------- measuring


def alloc_args_local(device, args_info, alloc_repeat):
    return [[tvm.runtime.tensor(a, device=device) for a in tuning_inputs(args_info)] for _ in range(alloc_repeat)]


def alloc_args_local_threads(threads, device, args_info, alloc_repeat):
    """``alloc_args_local`` that first sizes the runner worker's TVM thread pool like the
    op's (library.configure_cpu_threads). It runs in the worker process before the
    worker's first kernel call creates the pool, so the setting stays in the worker: the
    tuner's own process (and a caller of ``tune``) keeps its environment."""
    default_tvm_threads(threads)
    return alloc_args_local(device, args_info, alloc_repeat)


def alloc_args_rpc(session, device, args_info, alloc_repeat):
    return alloc_args_local(device, args_info, alloc_repeat)


def _evaluator():
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


def check_tune_arguments(trials: int, rpc_tracker: str | None, rpc_key: str | None,
                         validate_candidates: int = 0) -> None:
    """The checks of ``tune``'s own arguments, before anything costs time (importing the
    tensor intrinsics, the logs, the search): a mistyped command fails at once."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if validate_candidates < 0:
        raise ValueError(f"validate_candidates must be >= 0, got {validate_candidates}")
    if rpc_tracker:
        parse_rpc_tracker(rpc_tracker, rpc_key)


def make_runner(
    rpc_tracker: str | None = None, rpc_key: str | None = None, timeout_s: float = 120.0, threads: int | None = None
):
    """MetaSchedule's runner: local (candidates measured on ``threads`` threads, default
    the usable cores), or the devices of an RPC tracker (which use their own setting)."""
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
    best_ms: float | None  # the applied record's (the default schedule's, unless one was validated)
    best_gflops: float | None
    default_point: bool = False


def _progress_callback(specs, bar):
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


def _measure_default_points(specs, db, builder, runner, tvm_target, lanes) -> None:
    """Measure each kernel's default point, unless its log already holds it, and commit
    it as an ordinary record. The evolutionary search seeds its population from the
    best records, so it starts at the default instead of random points only (32 random
    trials of the backward kernels' spaces all lost to the default)."""
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


def check_cuda_tuning(specs, rpc_tracker: str | None) -> None:
    """CUDA tuning measures on a GPU: this machine's, or an RPC tracker's."""
    check_cuda_specs(specs)
    if rpc_tracker is None:
        if local_cuda_arch() is None:
            raise RuntimeError(
                "tuning for CUDA measures candidates on a GPU and this machine has none: use "
                "--rpc-tracker, or build a batch here and measure it on a GPU machine "
                "(swa-tvm tune --batch-out DIR; see python -m swa_tvm.tuning.measure)"
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
    validate_candidates: int = 3,
) -> list[TuneResult]:
    """Tune every kernel of ``specs`` for ``trials`` more measured candidates each,
    appending records to ``<logs_root>/<target-key>/``. The default schedule's point is
    measured first (once per log); existing records seed the search, so a second run
    continues where the first stopped. On a CPU the ``validate_candidates`` fastest
    searched records of each kernel are then validated against the default schedule
    (``swa_tvm.tuning.validate``; 0: not validated here, so not applied until
    ``swa-tvm validate`` runs)."""
    check_tune_arguments(trials, rpc_tracker, rpc_key, validate_candidates)
    specs = list(dict.fromkeys(specs))
    kind = target.get("kind")
    if kind not in ("llvm", "cuda"):
        raise NotImplementedError(f"tuning for target kind {kind!r} is not supported")
    if kind == "cuda":
        check_cuda_tuning(specs, rpc_tracker)
    check_no_amx_specs(specs, target)
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
    if kind == "llvm" and validate_candidates > 0:
        if rpc_tracker:
            log.warning("the records were measured on the tracker's devices: validate them there (swa-tvm validate); "
                        "until then no searched record applies")
        else:
            validate(specs, target, logs_root, candidates=validate_candidates,
                     progress=(lambda m: print(m, file=sys.stderr)) if progress else None)
    results = []
    baselines, validation = read_baselines(folder), read_validation(folder)
    for spec in specs:
        # The log in memory holds this run's records.
        best = _best_in(db, spec, target, baselines, validation=validation)
        records = len(db.records_for(tuning_workload(spec, target_kind=kind)))
        results.append(
            TuneResult(
                spec,
                records - before[spec.name],
                records,
                best.run_ms if best else None,
                best.gflops if best else None,
                bool(best and best.default_point),
            )
        )
    return results


__all__ = ["tune", "TuneResult", "make_builder", "make_runner", "space_generator"]
