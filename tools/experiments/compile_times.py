"""Seconds each kernel of a JIT cache folder takes to compile on this machine, as a
first use compiles it (``compiler.build.export_library`` of the one spec: record lookup,
schedule, TVM's passes, LLVM, link), one after another in this process.

    SWA_TVM_CACHE=$(mktemp -d) make check        # fills a cache with the quick tier's kernels
    python -m tools.experiments.compile_times CACHE_FOLDER [--top 10]

Reads every entry's manifest (``<name>-<key>.so.json``) under CACHE_FOLDER/<target key>
for this machine's target, rebuilds its spec into a temporary folder, and prints the
count, total and range of each group of kernels (KV-cache forward, KV-cache gradients,
other float32/float64, 16-bit), then the slowest kernels."""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

from tqdm import tqdm

from swa_tvm.compiler.build import export_library
from swa_tvm.compiler.targets import normalize_target, target_key
from swa_tvm.spec import KernelSpec


def cached_specs(folder: str, target: dict) -> list[tuple[KernelSpec, dict]]:
    """(spec, the target its entry was built for) of every entry under the folder of
    ``target``'s class: an entry's own target may differ (e.g. with an engine off)."""
    entries = {}
    for path in sorted(glob.glob(os.path.join(folder, target_key(target), "*.so.json"))):
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        for k in manifest["kernels"]:
            spec = KernelSpec.from_dict(k["spec"])
            entries[(spec.name, json.dumps(manifest["target"], sort_keys=True))] = (spec, manifest["target"])
    return list(entries.values())


def group(spec: KernelSpec) -> str:
    if spec.kind == "cache":
        return "KV-cache forward"
    if spec.kind.startswith("cache_"):
        return "KV-cache gradients"
    return "16-bit" if spec.dtype in ("bfloat16", "float16") else "float32 / float64"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", help="a JIT cache folder ($SWA_TVM_CACHE of the run that filled it)")
    p.add_argument("--top", type=int, default=10, help="how many of the slowest kernels to list")
    args = p.parse_args(argv)
    target = normalize_target(None)
    entries = cached_specs(args.cache, target)
    if not entries:
        p.error(f"no kernel manifests under {os.path.join(args.cache, target_key(target))}")
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        # One untimed compile first: the process's own warm-up is no kernel's cost.
        export_library([entries[0][0]], os.path.join(tmp, "warm-up.so"), entries[0][1], warn_untuned=False)
        for n, (spec, built_for) in enumerate(tqdm(entries, desc="compiling", unit="kernel")):
            t0 = time.perf_counter()
            export_library([spec], os.path.join(tmp, f"{n}.so"), built_for, warn_untuned=False)
            times[(spec.name, n)] = (group(spec), time.perf_counter() - t0)
    print(f"{len(times)} kernels for {target_key(target)}, one after another: {sum(t for _, t in times.values()):.1f} s")
    print("| kernels | count | total s | median s | range s |")
    print("| --- | --- | --- | --- | --- |")
    for g in sorted({g for g, _ in times.values()}):
        ts = sorted(t for gg, t in times.values() if gg == g)
        print(f"| {g} | {len(ts)} | {sum(ts):.1f} | {statistics.median(ts):.2f} | {ts[0]:.2f}–{ts[-1]:.2f} |")
    print("slowest:")
    for (name, _), (_, t) in sorted(times.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {t:6.2f} s  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
