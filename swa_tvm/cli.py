"""The ``swa-tvm`` command line: tune kernels, validate their records, export a library,
describe one, import measurements made elsewhere.

Exit codes: 0 success, 1 the command failed (message on stderr), 2 usage error,
130 interrupted (tune keeps every record measured before the interrupt).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings

from swa_tvm.compiler.kernels import FUSED_KERNELS
from swa_tvm.runtime.library import check_manifest, read_manifest
from swa_tvm.spec import BACKWARD_KINDS, CPU_ONLY_KINDS, AttentionSpec

# The commands import the compiler and the tuner when they run, not here: `swa-tvm info`
# and `--help` work on the TVM runtime alone.


LOGS_HELP = "tuning log root (default: $SWA_TVM_TUNING_LOGS, else the package's swa_tvm/tuning_logs/)"


def _default_logs() -> str:
    """Where tune and the imports write: where export reads (records.default_logs_root)."""
    from swa_tvm.compiler.records import default_logs_root

    return default_logs_root()


def _specs(args):
    return [AttentionSpec.parse(s) for s in args.spec]


def _kernel_specs(args):
    return list(dict.fromkeys(k for s in _specs(args) for k in s.kernels()))


def _logs_arg(args):
    from swa_tvm.compiler.build import DEFAULT_LOGS

    if args.no_tuning:
        return None
    return args.logs or DEFAULT_LOGS


def _cmd_export(args) -> int:
    from swa_tvm import export_library
    from swa_tvm.compiler.build import UntunedKernelWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntunedKernelWarning)
        manifest = export_library(_specs(args), args.output, args.target, logs=_logs_arg(args))
    for w in caught:
        print(f"swa-tvm export: warning: {w.message}", file=sys.stderr)
    print(f"wrote {args.output} ({len(manifest['kernels'])} kernels, target {manifest['target_key']})")
    _print_kernels(manifest)
    return 0


def _print_kernels(manifest: dict) -> None:
    """A line per kernel (which schedule, tuned or not, its tiles), then ptxas's report
    for each of its CUDA kernels."""
    for k in manifest["kernels"]:
        print(f"  {k['name']}  ({_tuned_text(k)})")
        if k.get("workspace"):
            print(f"      the caller's workspace: {k['workspace']}")
        for fn, r in k.get("ptxas", {}).items():
            print(f"      {fn}: {_ptxas_text(r)}")


def _ptxas_text(r: dict) -> str:
    spills = f"spills {r['spill_stores']} B stored, {r['spill_loads']} B loaded" if r.get("spill_stores") else "no spills"
    return f"{r['registers']} registers, {spills}, {r.get('smem', 0)} B static shared memory"


# What `info` says of each fused CUDA kernel (compiler/kernels.py's table).
FUSED_TEXT = {k.name: k.description for k in FUSED_KERNELS}
FUSED_TEXT["amx"] = "matrix-engine (AMX) schedule"
FUSED_TEXT["bf16_dot"] = "matrix-engine schedule on AVX-512 BF16 dot products"
FUSED_TEXT["cpu_flash_bwd"] = "five-product CPU backward (schedules/cpu_flash_bwd.py)"


def _tuned_text(k) -> str:
    if not k["tuned"]:
        text = FUSED_TEXT.get(k.get("schedule"), "default schedule")
        tiles = ", ".join(f"{n}={v}" for n, v in k.get("tiles", {}).items())
        source = " (measured: tuning_logs tiles.json)" if k.get("tiles_from") == "measured" else ""
        return f"{text}, tiles {tiles}{source}" if tiles else text
    t = k.get("tuning", {})
    if t.get("default_point") and k.get("schedule") in FUSED_TEXT:
        return f"{FUSED_TEXT[k['schedule']]}: measured faster than its {t.get('records', '?')} tuning records"
    n = t.get("records", "?")
    if t.get("validation") == "kept":
        return (f"tuned: a searched record, validated at most {t['worst_ratio']:.2f}x the default's time at every "
                f"shape ({t['validated']}; {n} records)")
    if t.get("validation") == "default":
        return f"tuned: the default schedule (validation kept no searched record, {t['validated']}; {n} records)"
    if t.get("validation") == "none":
        return f"tuned: the default schedule (its {n} records are not validated, so no searched one applies)"
    if t.get("default_point"):
        return f"tuned: the default schedule (no searched record beat it by the required margin; {n} records)"
    return f"tuned: {t.get('gflops', 0):.1f} GFLOP/s at the tuning shape, best of {n} records"


def _cmd_tune(args) -> int:
    from swa_tvm.compiler.targets import normalize_target, target_key
    from swa_tvm.tuning.tune import check_tune_arguments, tune
    from swa_tvm.compiler.records import log_dir

    check_tune_arguments(args.trials, args.rpc_tracker, args.rpc_key, args.validate_candidates)
    target = normalize_target(args.target)
    # Hand-written kernels and the matrix engine's own blocks: nothing to search.
    specs = [k for k in _kernel_specs(args) if k.kind not in CPU_ONLY_KINDS and not k.engine_only]
    if args.kernels != "all":

        specs = [k for k in specs if (k.kind in BACKWARD_KINDS) == (args.kernels == "backward")]
        if not specs:
            raise ValueError(f"--kernels {args.kernels}: the specs have no such kernels (add ',backward' to a spec)")
    if target.get("kind") == "cuda" and args.kernels == "all":

        specs = [k for k in specs if k.kind not in BACKWARD_KINDS]  # CUDA tuning covers the forward kernels
    logs = args.logs or _default_logs()
    if args.batch_out:
        from swa_tvm.tuning.batch import build_batch

        batch = build_batch(specs, target, args.trials, logs, args.batch_out, seed=args.seed,
                            progress=lambda m: print(m, file=sys.stderr))
        n = sum(len(t["candidates"]) for t in batch["tasks"])
        print(f"wrote {args.batch_out}: {n} candidates and {len(batch['tasks'])} baselines of "
              f"{len(batch['tasks'])} kernel(s) for {batch['target_key']} (batch {batch['batch_id']})")
        print(f"measure it where the device is: python -m swa_tvm.tuning.measure {args.batch_out} --out OUT; "
              f"then here: swa-tvm import-measurements --batch {args.batch_out} OUT/measured.json")
        return 0
    work_dir = args.work_dir or os.path.join(logs, ".work", target_key(target))
    print(
        f"tuning {len(specs)} kernel(s) for {target_key(target)}, {args.trials} trials each; "
        f"records -> {log_dir(logs, target)}; MetaSchedule log -> {work_dir}/logs",
        file=sys.stderr,
    )
    t0 = time.time()
    # Ctrl-C exits from the signal handler itself. Raising KeyboardInterrupt there would
    # unwind through MetaSchedule's C++ frames (its task scheduler calls back into
    # Python), and about one interrupt in three then died in std::terminate (SIGSEGV)
    # instead of exiting. Nothing needs unwinding: every record line is written with one
    # write(2) and fsynced, and a Python handler runs between bytecodes, never inside a
    # write.
    def on_sigint(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one interrupt is enough
        print(
            f"swa-tvm tune: interrupted after {time.time() - t0:.0f}s; every record measured so far "
            f"is in {log_dir(logs, target)}; run the same command again to continue",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        results = tune(
            specs,
            target,
            args.trials,
            logs,
            work_dir,
            rpc_tracker=args.rpc_tracker,
            rpc_key=args.rpc_key,
            num_trials_per_iter=args.trials_per_iter,
            seed=args.seed,
            progress=not args.quiet,
            validate_candidates=args.validate_candidates,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    for r in results:
        best = f"{r.best_ms:.2f} ms, {r.best_gflops:.1f} GFLOP/s" if r.best_ms else "no valid record"
        which = " (the default schedule)" if r.default_point else ""
        print(f"  {r.spec.name}: {r.records} records (+{r.trials}), applied {best}{which}")
    print(f"done in {time.time() - t0:.0f}s")
    return 0


def _cmd_validate(args) -> int:
    from swa_tvm.compiler.targets import normalize_target
    from swa_tvm.tuning.validate import validate

    target = normalize_target(args.target)
    verdicts = validate(_kernel_specs(args), target, args.logs or _default_logs(), candidates=args.candidates,
                        rounds=args.rounds, passes=args.passes, progress=lambda m: print(m, file=sys.stderr))
    if not verdicts:
        print("no searched records to validate for these kernels")
    for v in verdicts:
        worst = v.entry["worst_ratio"]
        if v.kept:
            print(f"  {v.spec.name}: record {v.kept} kept, at most {worst[v.kept]:.2f}x the default's time")
        else:
            ratios = ", ".join(f"{w:.2f}" for w in worst.values()) or "none agreed with the default"
            print(f"  {v.spec.name}: the default schedule stays (records' worst ratios: {ratios})")
    return 0


def _cmd_import(args) -> int:
    from swa_tvm.tuning.batch import import_measurements

    logs = args.logs or _default_logs()
    counts = import_measurements(args.batch, args.measured, logs, progress=lambda m: print(m, file=sys.stderr))
    print(f"imported {counts['records']} records and {counts['baselines']} baselines "
          f"({counts['failed']} not measured) into {logs}")
    return 0


def _cmd_import_tiles(args) -> int:
    from swa_tvm.compiler.tiles import import_results

    logs = args.logs or _default_logs()
    for path in import_results(args.results, logs):
        with open(path) as f:
            recs = json.load(f)["records"]
        print(f"{path}: {len(recs)} tile records")
        for r in recs:
            speed = f", {r['default_ms'] / r['ms']:.2f}x the default" if r.get("default_ms") else ""
            print(f"  {r['kind']} {r['dtype']} D={r['head_dim']}: {r['function']} {r['ms']:.3f} ms{speed}")
    return 0


def _cmd_info(args) -> int:
    manifest = read_manifest(args.library)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    try:
        check_manifest(args.library, manifest)
        verdict = "yes"
    except Exception as e:  # noqa: BLE001 - report, do not fail `info`
        verdict = f"no: {e}"
    try:
        _print_manifest(args, manifest, verdict)
    except (KeyError, TypeError, AttributeError):  # a manifest the checks above refused
        print(f"library      {args.library}\nloadable     {verdict}")
        return 1
    return 0


def _print_manifest(args, manifest: dict, verdict: str) -> None:
    print(f"library      {args.library}")
    print(f"tvm version  {manifest['tvm_version']}")
    print(f"target       {json.dumps(manifest['target'])}  (class {manifest['target_key']})")
    if manifest.get("cuda_arch"):
        print(f"cuda arch    {manifest['cuda_arch']} (machine code and PTX)")
    else:
        print(f"cpu features {', '.join(manifest.get('cpu_features', [])) or '-'}")
    print(f"sha256       {manifest['sha256']}")
    print(f"loadable     {verdict}")
    print("kernels:")
    _print_kernels(manifest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swa-tvm", description="Sliding-window attention kernels built with Apache TVM.")
    sub = p.add_subparsers(dest="command", required=True)
    spec_help = "pattern, e.g. head_dim=64,window=511:0,dilation=2,globals,sinks,backward (repeatable)"
    target_help = (
        "'llvm' (this CPU: detected -mcpu, all cores), 'cuda -arch=sm_90' (a GPU class; plain 'cuda' "
        "takes this machine's GPU; compiling needs nvcc, not a GPU) or a JSON target dict"
    )

    t = sub.add_parser("tune", help="tune kernels with MetaSchedule; records go to LOGS/<target-key>/")
    t.add_argument("--spec", action="append", required=True, help=spec_help)
    t.add_argument("--target", default="llvm", help=target_help)
    t.add_argument("--trials", type=int, required=True, help="measured candidates per kernel, this run")
    t.add_argument("--logs", help=LOGS_HELP)
    t.add_argument("--work-dir", help="MetaSchedule scratch and log folder (default: LOGS/.work/<target-key>)")
    t.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on the devices of this TVM RPC tracker")
    t.add_argument("--rpc-key", help="device key registered with the RPC tracker")
    t.add_argument("--trials-per-iter", type=int, default=32, help="candidates built and measured per batch")
    t.add_argument("--seed", type=int, help="random seed of the search")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--kernels", choices=("all", "forward", "backward"), default="all",
                   help="tune only the forward or only the backward (gradient) kernels of the specs")
    t.add_argument("--batch-out", metavar="DIR",
                   help="build TRIALS candidates per kernel into DIR instead of measuring them here, for "
                        "python -m swa_tvm.tuning.measure on the device's machine (then import-measurements)")
    t.add_argument("--validate-candidates", type=int, default=3, metavar="N",
                   help="CPU: then time the N fastest searched records of each kernel against the default "
                        "schedule at the validation shapes (swa-tvm validate); 0 skips it (records then apply "
                        "only after swa-tvm validate)")
    t.set_defaults(func=_cmd_tune)

    val = sub.add_parser("validate", help="time a CPU class's searched records against the default schedule at "
                                          "the tuning shape, T=16384 and B=4; keep those that win at every shape")
    val.add_argument("--spec", action="append", required=True, help=spec_help)
    val.add_argument("--target", default="llvm", help=target_help)
    val.add_argument("--logs", help=LOGS_HELP)
    val.add_argument("--candidates", type=int, default=3, help="the fastest searched records tried per kernel")
    val.add_argument("--rounds", type=int, default=7, help="round-robin rounds per shape (their median is compared)")
    val.add_argument("--passes", type=int, default=2, help="times over all shapes; a record must win in each")
    val.set_defaults(func=_cmd_validate)

    m = sub.add_parser("import-measurements",
                       help="commit a batch measured elsewhere (swa_tvm.tuning.measure) as tuning records")
    m.add_argument("measured", help="the measured.json that python -m swa_tvm.tuning.measure wrote")
    m.add_argument("--batch", required=True, help="the batch folder it measured (tune --batch-out)")
    m.add_argument("--logs", help=LOGS_HELP)
    m.set_defaults(func=_cmd_import)

    g = sub.add_parser("import-tiles",
                       help="commit the GPU check's timings of the fused kernels' tiles as tile records")
    g.add_argument("results", help="the gpu_results.json of python -m tools.gpu_check (its variant rows)")
    g.add_argument("--logs", help=LOGS_HELP)
    g.set_defaults(func=_cmd_import_tiles)

    e = sub.add_parser("export", help="compile specs into a shared library with its manifest")
    e.add_argument("--spec", action="append", required=True, help=spec_help)
    e.add_argument("--target", default="llvm", help=target_help)
    e.add_argument("-o", "--output", required=True, help="path of the .so to write (manifest goes to PATH.json)")
    e.add_argument("--logs", help=LOGS_HELP)
    e.add_argument("--no-tuning", action="store_true", help="ignore tuning logs: default schedules only")
    e.set_defaults(func=_cmd_export)

    i = sub.add_parser("info", help="what a library holds: kernels, target, TVM version, tuned or default")
    i.add_argument("library")
    i.add_argument("--json", action="store_true", help="print the raw manifest")
    i.set_defaults(func=_cmd_info)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"swa-tvm {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
