"""Write docs/performance.md from the committed benchmark results.

    python -m benchmarks.report                    # writes docs/performance.md
    python -m benchmarks.report --out -            # prints it instead
    python -m benchmarks.report --results DIR --out FILE

It reads benchmarks/results/<target-key>/ for results.json and results_bfloat16.json
(python -m benchmarks.forward), training.json and training_bfloat16.json
(python -m benchmarks.training), decode.json (python -m benchmarks.decode), hf_models.json
(python -m benchmarks.hf_models) and
gpu_results.json (bash tools/gpu_check.sh), and
writes one section per target key, each table with its command, date, machine and
versions. Standard library only; the output depends on the JSON files alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
OUT = os.path.join(ROOT, "docs", "performance.md")

FORWARD_FILES = ("results.json", "results_bfloat16.json")
TRAINING_FILES = ("training.json", "training_bfloat16.json")
GPU_FILE = "gpu_results.json"
DECODE_FILE = "decode.json"
HF_FILE = "hf_models.json"

# Methods in the order their columns appear; names a JSON row may carry.
# In a 16-bit run: our float32 library on float32 copies of the same inputs.
FLOAT32 = "swa_tvm float32"
METHODS = ("swa_tvm tuned", "swa_tvm default", "swa_tvm", FLOAT32, "FlexAttention", "sliding chunks", "SDPA + mask")
PEER = "FlexAttention"
OURS = ("swa_tvm tuned", "swa_tvm")

# What the JSON does not say about each machine class: hand-written, one line a key.
CLASSES = {
    "llvm-znver1": "2 cores of an AMD EPYC, family 23 model 1 (Zen 1 class): AVX2 and FMA, no AVX-512.",
    "llvm-znver3": "2 cores of an AMD EPYC, family 25 model 1 (Zen 3 class): AVX2 and FMA, no AVX-512.",
    "llvm-znver4": (
        "2 cores of an AMD EPYC, family 25 model 17 (Zen 4 class): AVX-512 with BF16, no AMX; the bfloat16 local "
        "forward and window gradients (the five-product backward's too) run on AVX-512 BF16 dot products."
    ),
    "llvm-rocketlake": (
        "2 cores of an Intel Xeon, family 6 model 167 (LLVM names it rocketlake): AVX-512 with BF16 and FP16, "
        "and AMX, which no kernel here uses."
    ),
    "llvm-emeraldrapids": (
        "2 cores of an Intel Xeon, family 6 model 207 (LLVM names it emeraldrapids): AVX-512 with BF16 and FP16, and AMX, "
        "on which the bfloat16 local forward and window gradients run."
    ),
    "llvm-rocketlake-on-emeraldrapids": (
        "The code of the llvm-rocketlake class (AVX-512 without its BF16 instructions, no AMX) with that class's "
        "tuning records, run on "
        "2 cores of the emeraldrapids machine (Intel Xeon, family 6 model 207; `--mcpu rocketlake`): what a CPU "
        "without the matrix engine runs, timed on hardware that has one."
    ),
    "llvm-znver3-on-znver4": (
        "The code of the llvm-znver3 class (AVX2 and FMA, no AVX-512) with that class's tuning records, run on 2 "
        "cores of an AMD EPYC, family 25 model 17 (Zen 4 class; `--mcpu znver3`): what a CPU without AVX-512 and "
        "without a bfloat16 engine runs, timed on hardware that has one."
    ),
    "cuda-sm_90": "One NVIDIA H200 (sm_90), driver 580.159.04, on a machine with torch and no TVM (the runtime only).",
}

# Notes on single result files, printed under their heading.
NOTES = {
    ("llvm-znver3", "results.json"): (
        "SDPA gets a dense boolean mask and is skipped at T=65536, where that mask alone is 4 GiB. "
        "In this run, under the 5% record margin then in force, the four local kernels ran their default "
        "schedule in \"tuned\" too, so for them the two columns differ by noise."
    ),
    ("llvm-znver3", "results_bfloat16.json"): (
        "This run (and the two training runs) ran on a Zen 4 class machine of the same pool "
        "(LLVM: znver4, AVX-512 with BF16). There were no bfloat16 tuning records, so \"tuned\" and "
        "\"default\" are the same default schedules. swa_tvm's kernels convert bfloat16 to float32 on load; "
        "the peers get the bfloat16 tensors as they are. % of matmul is against the float32 matmul."
    ),
    ("llvm-znver3", "training.json"): "Ran on a Zen 4 class machine of the same pool (LLVM: znver4).",
    ("llvm-znver3", "training_bfloat16.json"): "Ran on a Zen 4 class machine of the same pool (LLVM: znver4).",
    ("llvm-znver4", "results_bfloat16.json"): (
        "swa_tvm's local kernels multiply on AVX-512 BF16 dot products (bfloat16 operands, float32 sums); the global "
        "rows convert to float32. % of matmul is against the bfloat16 matmul of the same run. No tuning record applies "
        "to the dot-product form: \"tuned\" and \"default\" are the same schedules."
    ),
    ("llvm-znver4", "results.json"): (
        "Validation (2026-12-07) kept no searched record of this class, so \"tuned\" and \"default\" are the same "
        "schedules: their ratio is this run's noise. On the plain bands swa_tvm runs at 82–96% of this run's float32 "
        "matmul rate (counting the band's FLOPs only), while FlexAttention's float32 reaches 30–49% of it here: "
        "FlexAttention / swa_tvm there is 1.67–2.78×, under the 3× bar, with no float32 product left to save."
    ),
    ("llvm-znver4", "decode.json"): (
        "The bfloat16 prefill chunk (512 queries x 4 heads a KV head: 64-row blocks) runs the cache kernel's "
        "matrix-engine form, its products on AVX-512 BF16 dot products; decode steps keep float32 products. "
        "Before that form the bfloat16 chunk converted to float32 on load and took "
        "386 ms, against 317 for float32 and 316 for SDPA on the window's keys (the same command, same day)."
    ),
    ("llvm-znver4", "training_bfloat16.json"): (
        "The forward and the five-product backward multiply on AVX-512 BF16 dot products, with or without global "
        "tokens. Timed round-robin with the torch peers, whose large frees make glibc hand memory back to the OS, "
        "so each step faults its pages in again (docs/roadmap.md, CPU training)."
    ),
    ("llvm-emeraldrapids", "results_bfloat16.json"): (
        "swa_tvm's local kernels multiply on AMX tiles (bfloat16 operands, float32 sums); the global rows convert "
        "to float32. % of matmul is against the bfloat16 matmul of the same run (oneDNN on AMX). There are no "
        "tuning records for this key: \"tuned\" and \"default\" are the same schedules."
    ),
    ("llvm-emeraldrapids", "results.json"): (
        "There are no tuning records for this key: \"tuned\" and \"default\" are the same schedules, so their "
        "ratio below is the noise between two libraries timed in one run on this shared machine."
    ),
    ("llvm-emeraldrapids", "training.json"): "There are no tuning records for this key: the default schedules.",
    ("llvm-rocketlake-on-emeraldrapids", "results.json"): (
        "Validation (2026-12-07, against the defaults of this run) kept no searched record of a forward kernel, so "
        "\"tuned\" and \"default\" are the same schedules: their ratio is this run's noise."
    ),
    ("llvm-rocketlake-on-emeraldrapids", "results_bfloat16.json"): (
        "No AMX: the bfloat16 kernels convert each item's band to float32 and multiply in float32. They run their "
        "default schedules (validation kept no bfloat16 record of this class). % of matmul is against the bfloat16 "
        "matmul of the same run, which oneDNN runs on this hardware's AMX."
    ),
    ("llvm-znver3-on-znver4", "results_bfloat16.json"): (
        "No bfloat16 engine: the bfloat16 kernels convert k and v to float32 once per call and multiply in float32 "
        "(8 lanes), on their default schedules (no bfloat16 record of this class); \"swa_tvm float32\" applies the "
        "class's float32 records (not validated on their own class). % of matmul is against the bfloat16 matmul of "
        "the same run, which torch runs on this hardware's AVX-512 BF16."
    ),
    ("llvm-rocketlake", "results_bfloat16.json"): (
        "% of matmul is against the float32 matmul of the same run. swa_tvm's kernels convert bfloat16 to "
        "float32 on load; FlexAttention runs bfloat16 natively."
    ),
}

INTRO = """\
# Performance

<!-- Generated by `python -m benchmarks.report` (`make report`) from benchmarks/results/.
Edit benchmarks/report.py or the results, not this file. -->

Every table below is generated from a JSON file under `benchmarks/results/<target-key>/`.
Each names the command that wrote it, the date, the machine and the versions. A target
key is the class of machine a kernel is built for: `llvm-<mcpu>` as LLVM detects the CPU,
`cuda-<arch>` for a GPU. Tuning records apply per key, so a run measures the records of
its own key. A key `<key>-on-<mcpu>` holds runs of another class's code on a machine of
class `<mcpu>` (`--mcpu`): what a CPU without some feature runs, timed where it is
present.

How the CPU runs measure:

- The machines are 2-core shared cloud machines. Their speed drifts within seconds, so
  compare ratios within one table, not times across tables.
- The methods of one shape are timed round-robin, one call of each per round. Each gets
  at least 5 calls, short ones more until their calls span 0.5 s. The median is reported.
- Every peer is first checked against swa_tvm on the same inputs.
- A ratio "X / swa_tvm" is X's time over swa_tvm's: above 1.00×, swa_tvm is faster.
- "swa_tvm tuned" is a library exported with the committed tuning records of the key;
  "swa_tvm default" is the same specs with the default schedules. Export applies only
  searched records that validation timed faster at every shape
  ([tuning.md](tuning.md#validation-a-record-must-win-at-every-shape)); runs made before
  validation existed say so under their table, with the range of tuned / default. Runs
  made before 2026-12-07 timed the default library in both columns (a defect of the
  benchmark, since mended), which their tables also say.
- "FlexAttention" is `flex_attention` under `torch.compile(fullgraph=True)` with
  `create_block_mask`. "sliding chunks" is Longformer's chunked formulation in plain
  torch. "SDPA + mask" is `scaled_dot_product_attention` with a dense boolean mask.
- GFLOP/s count useful work only: 4·D per visible (query, key) pair. "% of matmul" is
  against a 4096² `torch.matmul` timed at the start of the same run, in the run's dtype
  (float32 in runs whose results record no `matmul_dtype`).
- Growth is t(large T) / t(small T) of the tuned kernel, both lengths timed round-robin;
  4.0 is linear for a 4× longer sequence.
- Peak memory is the resident-set high-water mark of one call in a fresh process, minus
  the resident set before the inputs; the ratio is against q + k + v + out.
- Training: "forward" is the call under `torch.no_grad()`, "fwd + bwd" the call plus
  `backward` of a fixed random output gradient. FlexAttention has no CPU backward.

Shown commands: `swa-tvm bench` is now `python -m benchmarks.forward` (and
`python -m benchmarks.training` with `--training`), and `--out` is the folder the results
are committed in. Each command runs from the repository root after `make venv`.

Regenerate this page with `make report` or `python -m benchmarks.report`.
"""


# ---------------------------------------------------------------- formatting


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, keep word characters, spaces and hyphens,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def ms(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def span(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}× to {hi:.2f}×"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def date_of(d: dict) -> str:
    return str(d.get("date", ""))[:10]


def forward_title(key: str, d: dict) -> str:
    return f"{key}: forward, {d.get('shape', {}).get('dtype', 'float32')}, {date_of(d)}"


def training_title(key: str, d: dict) -> str:
    return f"{key}: training, {d.get('shape', {}).get('dtype', 'float32')}, {date_of(d)}"


def gpu_title(key: str, d: dict) -> str:
    return f"{key}: one-call GPU check, {date_of(d)}"


def ordered(names) -> list[str]:
    names = set(names)
    return [m for m in METHODS if m in names] + sorted(names - set(METHODS))


def patterns(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["config"] not in seen:
            seen.append(r["config"])
    return seen


def skip_reason(text: str) -> str:
    """A skipped method's reason, its exception wrapper dropped."""
    m = re.search(r"NotImplementedError\('([^.']+)", text)
    return m.group(1) if m else text


# ---------------------------------------------------------------- commands


def quote_methods(args: str) -> str:
    """Re-quote method names with spaces after --methods (the JSON lost the quotes)."""
    m = re.search(r"--methods (.*?)(?= --|$)", args)
    if not m:
        return args
    rest, names = m.group(1), []
    while rest:
        for name in sorted(METHODS, key=len, reverse=True):
            if rest == name or rest.startswith(name + " "):
                names.append(f'"{name}"' if " " in name else name)
                rest = rest[len(name):].lstrip()
                break
        else:
            names.append(rest)
            rest = ""
    return args[: m.start(1)] + " ".join(names) + args[m.end(1):]


def command_of(d: dict, key: str) -> str:
    """The run's command under the current names, writing to its committed folder."""
    cmd = " ".join(str(d.get("command", "")).split())
    module = "benchmarks.forward"
    if cmd.startswith("swa-tvm bench"):
        args = cmd[len("swa-tvm bench"):].strip()
        if re.search(r"(^| )--training( |$)", args):
            module = "benchmarks.training"
            args = re.sub(r"(^| )--training(?= |$)", "", args).strip()
    else:
        m = re.match(r"python -m (benchmarks\.\w+)", cmd)
        module = m.group(1) if m else module
        args = re.sub(r"^python -m benchmarks\.\w+ ?", "", cmd)
    args = re.sub(r"(^| )--out \S+", "", args).strip()
    args = quote_methods(args)
    return " ".join(p for p in (f"python -m {module}", args, f"--out benchmarks/results/{key}") if p)


def run_lines(d: dict, key: str, command: str) -> list[str]:
    m, v, s = d.get("machine", {}), d.get("versions", {}), d.get("shape", {})
    machine = f"{m.get('cpu', '?')}, {m.get('machine', 'x86_64')}, {m.get('threads', '?')} torch threads"
    if m.get("host_key"):
        machine = f"{machine} (code built for {m.get('target_key')} on a {m['host_key']} machine)"
    machine += f" and {m.get('tvm_threads', '?')} TVM threads"
    versions = ", ".join(f"{name} {v[name]}" for name in ("torch", "tvm", "swa_tvm") if name in v)
    shape = " ".join(f"{k}={s[k]}" for k in ("B", "H", "D") if k in s)
    lines = [
        f"- Command: `{command}`",
        f"- Date: {date_of(d)}. Machine: {machine}. Versions: {versions}.",
        f"- Shape: {shape}, {s.get('dtype', '?')}.",
    ]
    if d.get("matmul_peak_gflops"):
        dtype = d.get("matmul_dtype", "float32")  # runs before matmul_dtype timed float32
        lines.append(f"- This run's 4096² {dtype} `torch.matmul`: {d['matmul_peak_gflops']:.1f} GFLOP/s.")
    return lines


# ---------------------------------------------------------------- CPU forward


def forward_rows(d: dict):
    """{(config, T): {method: row}} and the column order."""
    cells: dict = {}
    for r in d["rows"]:
        cells.setdefault((r["config"], r["T"]), {})[r["method"]] = r
    return cells, ordered(r["method"] for r in d["rows"])


def flex_over_ours(cell: dict) -> float | None:
    ours = next((cell[m] for m in OURS if m in cell and "ms" in cell[m]), None)
    peer = cell.get(PEER)
    if ours is None or peer is None or "ms" not in peer:
        return None
    return peer["ms"] / ours["ms"]


def ratio_range(cells: dict, top: str, bottom: str) -> tuple[float, float, str, int] | None:
    """The smallest and largest ``top`` ms / ``bottom`` ms over a run's rows, and the
    row (config, T) of the largest; None where no row timed both."""
    ratios = [(c[top]["ms"] / c[bottom]["ms"], config, T)
              for (config, T), c in cells.items() if "ms" in c.get(top, {}) and "ms" in c.get(bottom, {})]
    if not ratios:
        return None
    hi, config, T = max(ratios)
    return min(r[0] for r in ratios), hi, config, T


def tuned_over_default(cells: dict, d: dict) -> str | None:
    """The range of "swa_tvm tuned" ms / "swa_tvm default" ms over a run's rows, naming
    the row of the largest, and whether the run's records were applied unvalidated."""
    found = ratio_range(cells, "swa_tvm tuned", "swa_tvm default")
    if found is None:
        return None
    lo, hi, config, T = found
    text = f"swa_tvm tuned / swa_tvm default: {lo:.2f}–{hi:.2f} over the rows (largest: {config}, T={T})."
    if not d.get("library_per_call"):
        text += (" In this run both columns' timed calls ran the library loaded last, the default one (a defect "
                 "of the benchmark since mended): the ratio is noise, not the records.")
    elif d.get("record_rule") != "validated" and any(d.get("tuned_kernels", {}).values()):
        text += (" This run predates record validation: its \"tuned\" library applied any searched record "
                 "measured 5% faster at the tuning shape alone.")
    return text


def half_over_float32(cells: dict, d: dict) -> str | None:
    """The range of "swa_tvm tuned" ms / "swa_tvm float32" ms over a 16-bit run's rows."""
    found = ratio_range(cells, "swa_tvm tuned", FLOAT32)
    if found is None:
        return None
    lo, hi, config, T = found
    dtype = d.get("shape", {}).get("dtype", "?")
    return (f"swa_tvm tuned ({dtype}) / {FLOAT32} (the float32 library on float32 copies of the inputs, timed "
            f"round-robin with it): {lo:.2f}–{hi:.2f} over the rows (largest: {config}, T={T}); above 1.00 the "
            f"{dtype} kernels are the slower.")


def forward_section(key: str, name: str, d: dict) -> list[str]:
    cells, methods = forward_rows(d)
    out = [f"### {forward_title(key, d)}", ""]
    if (key, name) in NOTES:
        out += [NOTES[key, name], ""]
    out += run_lines(d, key, command_of(d, key)) + [""]
    ours = next((m for m in OURS if m in methods), None)
    header = ["pattern", "T"] + [f"{m} ms" for m in methods]
    header += [f"{ours} GFLOP/s (% of matmul)", f"{PEER} / {ours}"] if ours else []
    rows = []
    for (config, T), cell in cells.items():
        row = [config, str(T)]
        for m in methods:
            r = cell.get(m, {})
            row.append(ms(r.get("ms")) if "ms" in r else "skipped" if r.get("skipped") else "—")
        if ours:
            o = cell.get(ours, {})
            row.append(f"{o['gflops']:.1f} ({o['pct_peak']:.0f}%)" if "gflops" in o else "—")
            row.append(times(flex_over_ours(cell)))
        rows.append(row)
    out += table(header, rows)
    for line in (tuned_over_default(cells, d), half_over_float32(cells, d)):
        if line:
            out += ["", line]
    skipped = sorted({(r["method"], skip_reason(r["skipped"])) for r in d["rows"] if r.get("skipped")})
    if skipped:
        out += [""] + [f"Skipped: {m}, {why}." for m, why in skipped]
    if d.get("growth"):
        out += ["", f"Growth of {ours or 'swa_tvm'}, timed round-robin:", ""]
        out += table(
            ["pattern", "T", "ms (small T)", "ms (large T)", "ratio (4.0 = linear)"],
            [
                [g["config"], f"{g['T_small']} → {g['T_large']}", ms(g["ms_small"]), ms(g["ms_large"]), f"{g['ratio']:.2f}"]
                for g in d["growth"]
            ],
        )
    if d.get("memory"):
        mem: dict = {}
        for r in d["memory"]:
            mem.setdefault((r["config"], r["T"]), {})[r["method"]] = r
        mmethods = ordered(r["method"] for r in d["memory"])
        out += ["", "Peak memory of one call (MiB, and its ratio to q + k + v + out):", ""]
        out += table(
            ["pattern", "T"] + mmethods,
            [
                [config, str(T)]
                + [
                    f"{cell[m]['peak_bytes'] / 2**20:,.0f} ({cell[m]['ratio']:.2f}×)" if m in cell else "—"
                    for m in mmethods
                ]
                for (config, T), cell in mem.items()
            ],
        )
    return out + [""]


# ---------------------------------------------------------------- CPU training


def training_cells(d: dict) -> dict:
    cells: dict = {}
    for r in d["rows"]:
        cells.setdefault((r["config"], r["T"]), {})[r["method"]] = r
    return cells


def best_peer_over_ours(cell: dict) -> float | None:
    ours = cell.get("swa_tvm", {})
    peers = [r["train_ms"] for m, r in cell.items() if m != "swa_tvm" and "train_ms" in r]
    if "train_ms" not in ours or not peers:
        return None
    return min(peers) / ours["train_ms"]


def training_section(key: str, name: str, d: dict) -> list[str]:
    cells = training_cells(d)
    out = [f"### {training_title(key, d)}", ""]
    if (key, name) in NOTES:
        out += [NOTES[key, name], ""]
    out += run_lines(d, key, command_of(d, key)) + [""]
    peers = [m for m in ordered(r["method"] for r in d["rows"]) if m != "swa_tvm"]
    timed = [m for m in peers if any("train_ms" in c.get(m, {}) for c in cells.values())]
    header = ["pattern", "T", "swa_tvm forward ms", "swa_tvm fwd + bwd ms", "fwd + bwd / forward"]
    header += [f"{m} fwd + bwd ms" for m in timed] + ["fastest peer / swa_tvm"]
    rows = []
    for (config, T), cell in cells.items():
        o = cell.get("swa_tvm", {})
        row = [config, str(T), ms(o.get("forward_ms")), ms(o.get("train_ms")), f"{o['ratio']:.2f}" if "ratio" in o else "—"]
        for m in timed:
            r = cell.get(m, {})
            row.append(ms(r.get("train_ms")) if "train_ms" in r else "skipped" if r.get("skipped") else "—")
        row.append(times(best_peer_over_ours(cell)))
        rows.append(row)
    out += table(header, rows)
    skipped = sorted({(r["method"], skip_reason(r["skipped"])) for r in d["rows"] if r.get("skipped")})
    if skipped:
        out += [""] + [f"Skipped: {m}, {why}." for m, why in skipped]
    return out + [""]


# ---------------------------------------------------------------- GPU


GPU_COMMAND = (
    "`make gpu-bundle CUDA_ARCH=sm_90` on a machine with nvcc (no GPU needed), then, on the GPU machine "
    "with `build/gpu` copied to it, `bash tools/gpu_check.sh --budget-s 470`"
)


def gpu_section(key: str, d: dict) -> list[str]:
    out = [f"### {gpu_title(key, d)}", ""]
    out += [
        "The kernels this run timed have been rewritten since (see [the notes on this run]"
        "(notes/h200-2026-12-04.md)); these are the last GPU timings.",
        "",
        f"- Command: {GPU_COMMAND}.",
        f"- Date: {date_of(d)}. Device: {d.get('device')}. Versions: torch {d.get('torch')}, "
        f"Python {d.get('python')}, the TVM runtime only.",
        f"- This run's bfloat16 matmul (8192³): {d['matmul_tflops']:.1f} TFLOP/s.",
        "",
    ]
    corr = d.get("correctness", [])
    if corr:
        out += ["Correctness against the float64 reference (largest error over the cases of each dtype):", ""]
        rows = []
        for dtype in sorted({c["dtype"] for c in corr}):
            cs = [c for c in corr if c["dtype"] == dtype]
            grads = [e for c in cs for e in c.get("grad_rel_err", {}).values()]
            rows.append([
                dtype,
                str(len(cs)),
                "all" if all(c.get("ok") for c in cs) else f"{sum(bool(c.get('ok')) for c in cs)}",
                f"{max(c['out_rel_err'] for c in cs):.1e}",
                f"{max(c['lse_max_abs_err'] for c in cs):.1e}",
                f"{max(grads):.1e}" if grads else "—",
            ])
        out += table(["dtype", "cases", "passed", "out rel. error", "lse abs. error", "gradient rel. error"], rows)
        sc = d.get("stream_and_compile", {})
        out += [
            "",
            f"A call on a side stream equal to the eager call: {'yes' if sc.get('side_stream_equal') else 'no'}. "
            f"Under `torch.compile(fullgraph=True)`: {'yes' if sc.get('compile_fullgraph_equal') else 'no'}.",
            "",
        ]
    timing = d.get("timing", [])
    if timing:
        t0 = timing[0]
        out += [
            f"Forward, {d.get('bench_dtype')}, B=1 H=32 H_kv=8 D=128, T={t0['T']}, causal W={t0['W']}; "
            "median of 10 CUDA-event-timed calls after 3 warm-ups. TFLOP/s count useful work.",
            "",
        ]
        out += table(
            ["pattern", "swa_tvm ms", "FlexAttention ms", "FlexAttention / swa_tvm", "SDPA + banded mask ms",
             "SDPA causal, no window ms", "swa_tvm TFLOP/s", "% of matmul"],
            [
                [
                    r["config"], ms(r["ours_ms"], 2), ms(r.get("flex_attention_ms"), 2),
                    times(r.get("speedup_vs_flex_attention")), ms(r.get("sdpa_banded_mask_ms"), 2),
                    ms(r.get("sdpa_causal_full_ms"), 2), f"{r['ours_tflops']:.1f}",
                    f"{100 * r['ours_fraction_of_matmul']:.1f}%",
                ]
                for r in timing
            ],
        )
        out.append("")
    scaling = d.get("scaling", [])
    if scaling:
        out += ["swa_tvm's causal forward against T (median of 5 after 1 warm-up):", ""]
        rows, prev = [], None
        for r in scaling:
            rows.append([str(r["T"]), ms(r["ours_ms"], 2), f"{r['ours_ms'] / prev:.2f}" if prev else "—"])
            prev = r["ours_ms"]
        out += table(["T", "swa_tvm ms", "ratio to half the length"], rows) + [""]
    tr = d.get("training")
    if tr:
        out += [
            f"Training (forward + backward of q, k, v), {tr['dtype']}, B=1 H={tr['H']} H_kv={tr['H_kv']} "
            f"D={tr['D']}, T={tr['T']}, causal W={tr['W']}:",
            "",
        ]
        out += table(
            ["method", "forward ms", "fwd + bwd ms", "its fwd + bwd / swa_tvm"],
            [
                ["swa_tvm", ms(tr["ours_fwd_ms"], 2), ms(tr["ours_fwd_bwd_ms"], 2), "—"],
                ["FlexAttention", ms(tr.get("flex_attention_fwd_ms"), 2), ms(tr.get("flex_attention_fwd_bwd_ms"), 2),
                 times(tr.get("speedup_vs_flex_attention"))],
                ["SDPA + banded mask", ms(tr.get("sdpa_banded_mask_fwd_ms"), 2),
                 ms(tr.get("sdpa_banded_mask_fwd_bwd_ms"), 2), times(tr.get("speedup_vs_sdpa_banded_mask"))],
            ],
        )
        out.append("")
    variants = d.get("variants", [])
    if variants:
        defaults = {v["kind"]: v["ms"] for v in variants if v.get("default") and "ms" in v}
        out += [
            "Tile variants of the bench kernel (same shape), each checked against the default kernel first. "
            "warps × keys a chunk; \"row tiles\" is 16-row tiles per warp:",
            "",
        ]
        rows = []
        for v in variants:
            suffix = v["function"].split("__", 1)[-1]
            tc = v.get("warps") is not None
            rows.append([
                v["kind"], f"`{suffix}`", v.get("kernel", "?"),
                f"{v['warps']} × {v['chunk']}" if tc else "—",
                ("yes" if v.get("async_copy") else "no") if tc else "—",
                str(v.get("m_tiles")) if tc else "—",
                ("yes" if v.get("ldmatrix") else "no") if tc else "—",
                "yes" if v.get("default") else "",
                ms(v.get("ms"), 2) if "ms" in v else v.get("error") or v.get("skipped") or "—",
                times(defaults[v["kind"]] / v["ms"]) if "ms" in v and v["kind"] in defaults else "—",
            ])
        out += table(
            ["kernel", "variant", "schedule", "tiles", "cp.async", "row tiles", "ldmatrix", "default", "ms",
             "speed-up vs default"],
            rows,
        )
        out.append("")
    tuning = d.get("tuning")
    if tuning:
        base = tuning.get("baseline_ms") or []
        out += [
            f"MetaSchedule batch (the unfused TE kernel's CUDA space, bf16 D=128 W=4096 at B=1 H=8 T=8192): "
            f"{tuning['measured']} of {tuning['candidates']} candidates measured, {len(tuning.get('errors', []))} errors; "
            f"best candidate {tuning['best_candidate_ms']:.2f} ms against the fused kernel's "
            f"{base[0]:.2f} ms." if base else "",
            "",
        ]
    return out


# ---------------------------------------------------------------- page


# ---------------------------------------------------------------- KV-cache decode

DECODE_METHODS = ("swa_tvm", "swa_tvm rolling", "SDPA + mask", "SDPA window", "FlexAttention")


def decode_title(key: str, d: dict) -> str:
    return f"{key}: KV-cache decode, {date_of(d)}"


def decode_section(key: str, d: dict) -> list[str]:
    """One decode step (and prefill chunks) against a 32K cache: times, the ratios the
    bars ask for, and bandwidth against this run's read bandwidth."""
    title = decode_title(key, d)
    m, v, s = d.get("machine", {}), d.get("versions", {}), d.get("shape", {})
    versions = ", ".join(f"{name} {v[name]}" for name in ("torch", "tvm", "swa_tvm") if name in v)
    args = re.sub(r"^python -m benchmarks\.decode ?", "", " ".join(str(d.get("command", "")).split()))
    args = re.sub(r"(^| )--out \S+", "", args).strip()
    command = " ".join(p for p in ("python -m benchmarks.decode", args, f"--out benchmarks/results/{key}") if p)
    lines = [f"### {title}", ""] + ([NOTES[key, "decode.json"], ""] if (key, "decode.json") in NOTES else [])
    lines += [f"- Command: `{command}`",
             f"- Date: {date_of(d)}. Machine: {m.get('cpu', '?')}, {m.get('threads', '?')} torch threads and "
             f"{m.get('tvm_threads', '?')} TVM threads. Versions: {versions}.",
             f"- Shape: H={s.get('H')}, H_kv={s.get('H_kv')}, D={s.get('D')}, a cache of {s.get('context')} positions; "
             f"sliding layers see W={s.get('window')} keys, full layers all. This run's read bandwidth (a 256 MB "
             f"`torch.dot`): {d.get('read_bandwidth_gbs', 0):.1f} GB/s.",
             "- Bars: at least 2× the faster whole-cache peer (SDPA + mask, FlexAttention), at least 1.2× SDPA on "
             "exactly the window's keys, at least 70% of the read bandwidth on the K/V bytes a step reads.", ""]
    header = ["layer", "B", "T_q", "dtype"] + [f"{n} (ms)" for n in DECODE_METHODS]
    header += ["whole-cache peer / ours", "window peer / ours", "GB/s (share of read bandwidth)"]
    rows = []
    for r in d.get("rows", []):
        t, sm = r["ms"], r.get("summary", {})
        cells = [ms(t.get(n), 2) if n in t else ("failed" if n in r.get("failed", {}) else "—") for n in DECODE_METHODS]
        rows.append([r["layer"], str(r["B"]), str(r["Tq"]), r["dtype"]] + cells + [
            times(sm.get("vs whole-cache peers")), times(sm.get("vs window peer")),
            f"{sm['GB/s']:.1f} ({100 * sm['share of read bandwidth']:.0f}%)" if "GB/s" in sm else "—"])
    lines += table(header, rows) + [""]
    failed = sorted({f"{n}: {why}" for r in d.get("rows", []) for n, why in r.get("failed", {}).items()})
    if failed:
        lines += ["Peers that failed to compile at a shape: " + "; ".join(failed), ""]
    return lines


# ---------------------------------------------------------------- transformers models


def hf_title(key: str, d: dict) -> str:
    return f"{key}: transformers models, {date_of(d)}"


def hf_section(key: str, d: dict) -> list[str]:
    """Prefill and greedy decode of transformers models per attention implementation:
    tokens/s, attention's share, and the ratios the bars ask for."""
    title = hf_title(key, d)
    m, v = d.get("machine", {}), d.get("versions", {})
    versions = ", ".join(f"{name} {v[name]}" for name in ("torch", "transformers", "tvm", "swa_tvm") if name in v)
    args = re.sub(r"^python -m benchmarks\.hf_models ?", "", " ".join(str(d.get("command", "")).split()))
    args = re.sub(r"(^| )--out \S+", "", args).strip()
    command = " ".join(p for p in ("python -m benchmarks.hf_models", args, f"--out benchmarks/results/{key}") if p)
    chunk = d.get("eager_chunk")
    lines = [f"### {title}", ""] + ([NOTES[key, "hf_models.json"], ""] if (key, "hf_models.json") in NOTES else [])
    lines += [f"- Command: `{command}`",
             f"- Date: {date_of(d)}. Machine: {m.get('cpu', '?')}, {m.get('threads', '?')} torch threads and "
             f"{m.get('tvm_threads', '?')} TVM threads. Versions: {versions}.",
             f"- A prompt of {d.get('prompt')} tokens prefilled in one forward"
             + (f" (eager's in chunks of {chunk}: its scores would not fit in memory, and its chunks compute only "
                "the scores of the keys in its cache, fewer than one forward would)" if chunk else "")
             + f", then {d.get('new_tokens')} greedy tokens, one forward each; {d.get('layers')} layer{'s' if d.get('layers') != 1 else ''}, float32, "
             f"random weights. {d.get('runs')} runs of every method, round-robin; the median run of each phase. "
             "Attention: the time inside each method's attention function.",
             "- Bars: end-to-end generation faster than sdpa's and eager's; decode attention time per token at "
             "least 2× below sdpa's.", ""]
    header = ["model", "method", "prefill (s)", "of which attention (s)", "decode (tokens/s)", "decode (ms/token)",
              "of which attention (ms/token)", "end to end (s)", "tokens as the first method's"]
    rows = []
    for r in d.get("rows", []):
        decode_ms = r.get("decode_ms_per_token", 1e3 / r["decode_tokens_per_s"])
        rows.append([r["model"], r["method"], f"{r['prefill_s']:.1f}",
                     f"{r.get('prefill_attention_s', r['prefill_s'] * r['prefill_attention_share']):.1f}",
                     f"{r['decode_tokens_per_s']:.2f}", f"{decode_ms:.1f}", f"{r['decode_attention_ms_per_token']:.1f}",
                     f"{r['end_to_end_s']:.1f}", "yes" if r.get("tokens_match_first_method") else "no"])
    lines += table(header, rows) + [""]
    ratios = []
    for model in dict.fromkeys(r["model"] for r in d.get("rows", [])):
        by = {r["method"]: r for r in d["rows"] if r["model"] == model}
        ours = by.get("swa_tvm")
        if not ours:
            continue
        for peer in ("sdpa", "eager"):
            if peer not in by:
                continue
            other = by[peer]
            line = (f"{model}: end to end, {peer} / swa_tvm {times(other['end_to_end_s'] / ours['end_to_end_s'])}; "
                    f"prefill {times(other['prefill_s'] / ours['prefill_s'])}; decode tokens/s, swa_tvm / {peer} "
                    f"{times(ours['decode_tokens_per_s'] / other['decode_tokens_per_s'])}; "
                    f"decode attention per token, {peer} / swa_tvm "
                    f"{times(other['decode_attention_ms_per_token'] / ours['decode_attention_ms_per_token'])}")
            ours_ms = 1e3 / ours["decode_tokens_per_s"]
            peer_ms = 1e3 / other["decode_tokens_per_s"]
            lead = other["prefill_s"] - ours["prefill_s"]
            if lead > 0 and ours_ms > peer_ms:  # ahead after the prefill, behind per token
                line += f"; {peer} catches up after {lead / ((ours_ms - peer_ms) / 1e3):.0f} generated tokens"
            ratios.append(line)
    if ratios:
        lines += [f"- {r}" for r in ratios] + [""]
    return lines


def load(results: str) -> dict:
    """{key: {file name: parsed JSON}} for every known file under results/<key>/."""
    found: dict = {}
    for key in sorted(os.listdir(results)):
        folder = os.path.join(results, key)
        if not os.path.isdir(folder):
            continue
        for name in FORWARD_FILES + TRAINING_FILES + (DECODE_FILE, HF_FILE, GPU_FILE):
            path = os.path.join(folder, name)
            if os.path.exists(path):
                with open(path) as f:
                    found.setdefault(key, {})[name] = json.load(f)
    return found


def key_order(keys) -> list[str]:
    return sorted(keys, key=lambda k: (k.startswith("cuda"), k))


def glance(data: dict) -> list[str]:
    rows = []
    for key in key_order(data):
        files = data[key]
        for name in FORWARD_FILES:
            if name in files:
                d = files[name]
                cells, _ = forward_rows(d)
                ratios = [flex_over_ours(c) for c in cells.values()]
                big = max((T for (config, T) in cells if config == "causal W=512" and T <= 16384), default=None)
                cw = cells.get(("causal W=512", big), {})
                o = next((cw[m] for m in OURS if m in cw and "pct_peak" in cw[m]), None)
                mm = d.get("matmul_dtype", "float32")
                extra = f"causal W=512, T={big}: {o['pct_peak']:.0f}% of the {mm} matmul" if o else ""
                title = forward_title(key, d)
                rows.append([f"[{key}](#{anchor(key)})", f"[{title}](#{anchor(title)})",
                             f"{PEER} / swa_tvm: {span(ratios)}", extra])
        for name in TRAINING_FILES:
            if name in files:
                d = files[name]
                cells = training_cells(d)
                best = [best_peer_over_ours(c) for c in cells.values()]
                cw = cells.get(("causal W=512", 16384), {}).get("swa_tvm", {})
                extra = f"causal W=512, T=16384: fwd + bwd = {cw['ratio']:.2f}× forward" if "ratio" in cw else ""
                title = training_title(key, d)
                rows.append([f"[{key}](#{anchor(key)})", f"[{title}](#{anchor(title)})",
                             f"fastest CPU peer / swa_tvm: {span(best)}", extra])
        if DECODE_FILE in files:
            d = files[DECODE_FILE]
            sums = [r.get("summary", {}) for r in d.get("rows", [])]
            title = decode_title(key, d)
            shares = [100 * x["share of read bandwidth"] for x in sums if "share of read bandwidth" in x]
            rows.append([f"[{key}](#{anchor(key)})", f"[{title}](#{anchor(title)})",
                         f"whole-cache peers / swa_tvm: {span([x.get('vs whole-cache peers') for x in sums])}; "
                         f"window peer / swa_tvm: {span([x.get('vs window peer') for x in sums])}",
                         f"{min(shares):.0f}% to {max(shares):.0f}% of the read bandwidth" if shares else ""])
        if HF_FILE in files:
            d = files[HF_FILE]
            by = {(r["model"], r["method"]): r for r in d.get("rows", [])}
            cells = []
            for (model, method), r in by.items():
                ours = by.get((model, "swa_tvm"))
                if method != "swa_tvm" and ours:
                    cells.append(f"{model} {method} / swa_tvm: {times(r['end_to_end_s'] / ours['end_to_end_s'])} "
                                 "end to end")
            title = hf_title(key, d)
            rows.append([f"[{key}](#{anchor(key)})", f"[{title}](#{anchor(title)})", "; ".join(cells), ""])
        if GPU_FILE in files:
            d = files[GPU_FILE]
            t = {r["config"]: r for r in d.get("timing", [])}
            c = t.get("causal", {})
            title = gpu_title(key, d)
            ours_vs = ", ".join(f"{r['config']} {times(r['speedup_vs_flex_attention'])}" for r in d.get("timing", []))
            extra = f"causal: {100 * c['ours_fraction_of_matmul']:.1f}% of the bf16 matmul" if c else ""
            rows.append([f"[{key}](#{anchor(key)})", f"[{title}](#{anchor(title)})",
                         f"{PEER} / swa_tvm: {ours_vs}", extra])
    return ["## At a glance", ""] + table(["target key", "run", "swa_tvm against its peers", "also"], rows) + [""]


def render(results: str = RESULTS) -> str:
    data = load(results)
    lines = INTRO.splitlines() + [""] + glance(data)
    for key in key_order(data):
        files = data[key]
        lines += [f"## {key}", ""]
        if key in CLASSES:
            lines += [CLASSES[key], ""]
        for name in FORWARD_FILES:
            if name in files:
                lines += forward_section(key, name, files[name])
                png = "scaling.png" if name == "results.json" else "scaling_bfloat16.png"
                if os.path.exists(os.path.join(results, key, png)):
                    lines += [f"![time against T, log-log](../benchmarks/results/{key}/{png})", ""]
        for name in TRAINING_FILES:
            if name in files:
                lines += training_section(key, name, files[name])
        if DECODE_FILE in files:
            lines += decode_section(key, files[DECODE_FILE])
        if HF_FILE in files:
            lines += hf_section(key, files[HF_FILE])
        if GPU_FILE in files:
            lines += gpu_section(key, files[GPU_FILE])
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=RESULTS, help="folder of <target-key>/ result folders")
    p.add_argument("--out", default=OUT, help="file to write, or - for standard output (default docs/performance.md)")
    args = p.parse_args(argv)
    text = render(args.results)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
