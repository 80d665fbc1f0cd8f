"""The GPU harness in tools/ before it costs GPU time: tools.gpu_check's stages on the
CPU kernels (correctness, training timing, tile variants, its traffic model, the wgmma
probes), tools.gpu_bundle's variant library, and tools.sass's reading of nvdisasm's
listing."""

import dataclasses
import json
import os

import pytest
import torch
from cuda_helpers import needs_nvcc, serial_on_cpu

from swa_tvm.spec import AttentionSpec, KernelSpec

# Builds and runs kernels, child processes and nvcc: `make test`, not `make check`.
pytestmark = pytest.mark.slow


def test_gpu_check_harness_on_cpu(tmp_path, fresh_registry):
    """The GPU check's correctness and KV-cache stages, run on the CPU kernels: the
    harness itself (cases, reference, tolerances, results file) works before it costs
    GPU time."""
    from tools import gpu_check

    # A library that does not load (here: no manifest) is recorded and fails the run,
    # and the stages still run.
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "broken.so").write_bytes(b"not a library")
    rc = gpu_check.main(["--device", "cpu", "--libs", str(tmp_path / "libs"), "--out", str(tmp_path),
                         "--stages", "correctness,kv_cache"])
    results = json.load(open(tmp_path / "gpu_results.json"))
    assert rc == 1 and results["ok"] is False and results["stages"] == ["correctness", "kv_cache"]
    assert "variants" not in results and "timing" not in results and "tuning" not in results
    [broken] = results["libraries"]
    assert broken["path"].endswith("broken.so") and "broken.so" in broken["error"], broken
    assert len(results["correctness"]) == 6 and all(r["ok"] and r["out_rel_err"] < 1e-5 for r in results["correctness"])
    # Gradients of every float input, the own projections' and sink logits' included.
    grads = {r["case"]: r["grad_rel_err"] for r in results["correctness"]}
    assert set(grads["globals with own projections, sink logits"]) == {"q", "k", "v", "q_global", "k_global",
                                                                       "v_global", "sink_logits"}
    assert all(e < 1e-4 for g in grads.values() for e in g.values()), grads
    assert results["stream_and_compile"] == {"compile_fullgraph_equal": True}
    # The KV-cache stage: every case, out, lse and the gradients of q, k, v (and the sink
    # logits where given).
    kv = {r["case"]: r for r in results["kv_cache"]}
    assert set(kv) == {c[0] for c in gpu_check.KV_CASES}
    assert all(r["ok"] and r["out_rel_err"] < 1e-5 and max(r["grad_rel_err"].values()) < 1e-4 for r in kv.values()), kv
    assert set(kv["chunk, per-head dilation, sinks, sink logits"]["grad_rel_err"]) == {"q", "k", "v", "sink_logits"}


def test_gpu_check_runs_its_stages_in_the_order_of_what_they_decide(tmp_path, monkeypatch):
    """By default the forward variants (wgmma probes and kernels first), then the bars,
    training, scaling, the gradients' variants and correctness; the KV-cache check,
    decode timing and tuning batch only when named (tuning by --tune, last); the results
    file written after every stage; a spent budget skips every stage and says so."""
    from tools import gpu_check

    calls, seen = [], []

    def stage(name):
        def run(results, *args):
            # What the file held when this stage began: every earlier stage's time.
            on_disk = json.load(open(tmp_path / "gpu_results.json"))
            seen.append(sorted(k[:-len("_seconds")] for k in on_disk if k.endswith("_seconds")))
            calls.append(name if name != "time_variants" else args[3])
        return run

    for fn in ("bars", "training", "scaling", "check_patterns", "check_kv_cache", "bench_decode",
               "measure_tune_batch", "time_variants"):
        monkeypatch.setattr(gpu_check, fn, stage(fn))
    argv = ["--device", "cpu", "--libs", str(tmp_path / "none"), "--out", str(tmp_path)]
    assert gpu_check.main(argv) == 0
    want = ["variants", "bars", "training", "scaling", "grad_variants", "check_patterns"]
    assert tuple(gpu_check.DEFAULT_STAGES) == ("variants", "bars", "training", "scaling", "grad_variants", "correctness")
    assert calls == want
    assert [len(s) for s in seen] == list(range(6)) and seen[-1] == sorted(gpu_check.DEFAULT_STAGES[:5])
    results = json.load(open(tmp_path / "gpu_results.json"))
    assert results["stages"] == list(gpu_check.DEFAULT_STAGES) and results["ok"] is True
    calls.clear()
    assert gpu_check.main(argv + ["--stages", "decode,kv_cache,bars", "--tune"]) == 0
    assert calls == ["bench_decode", "check_kv_cache", "bars", "measure_tune_batch"]
    calls.clear()
    assert gpu_check.main(argv + ["--skip-bench", "--tune"]) == 0  # the bench's stages out, not the variants
    assert calls == ["variants", "grad_variants", "check_patterns", "measure_tune_batch"]
    with pytest.raises(SystemExit, match="unknown nonsense"):
        gpu_check.main(argv + ["--stages", "bars,nonsense"])
    # A spent budget (0 s): every stage skipped, each saying so, and the run failed.
    calls.clear()
    assert gpu_check.main(argv + ["--budget-s", "0"]) == 1
    results = json.load(open(tmp_path / "gpu_results.json"))
    assert calls == [] and [results[s] for s in gpu_check.DEFAULT_STAGES] == [gpu_check.OUT_OF_TIME] * 6


def test_variants_run_wgmma_probes_first_each_child_under_its_own_timeout(tmp_path, monkeypatch):
    """The variant stage's order (wgmma probes, wgmma kernels, then the rest) and its
    children: one that hangs is killed after its own timeout (--child-timeout-s, capped
    by the time the run has left), not the run's, and the rows after it still run; the
    results are saved after every row."""
    import sys
    import time

    from tools import gpu_check

    entries = [{"function": "k__tc_a", "kind": "local"}, {"function": "k__tc_slow_wgmma", "kind": "local", "wgmma": True},
               {"function": "k__dq", "kind": "local_dq"}, {"function": "k__tc_b_wgmma", "kind": "local", "wgmma": True},
               {"function": "probe_x", "kind": "wgmma_probe", "wgmma": True}]
    assert [e["function"] for e in gpu_check.variant_order(entries)] == ["probe_x", "k__tc_slow_wgmma",
                                                                         "k__tc_b_wgmma", "k__tc_a"]
    assert [e["function"] for e in gpu_check.variant_order(entries, gpu_check.GRAD_KINDS)] == ["k__dq"]

    def child(entry, libs, device, shape, budget_s):
        if "slow" in entry["function"]:
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        row = dict(entry, ms=1.0, tflops=1.0, rel_err_vs_default=0.0)
        return [sys.executable, "-c", f"print({gpu_check.VARIANT_ROW!r} + {json.dumps(json.dumps(row))})"]

    saved = []
    monkeypatch.setattr(gpu_check, "child_command", child)
    monkeypatch.setattr(gpu_check, "_child_timeout", 2.0)
    monkeypatch.setattr(gpu_check, "_saver", lambda: saved.append([r["function"] for r in results["variants"]]))
    # The in-process rows (none here: only the wgmma ones and a probe are of these kinds).
    monkeypatch.setattr(gpu_check, "variant_rows", lambda *a, **k: pytest.fail("no in-process rows expected"))
    results = {}
    t0 = time.monotonic()
    meta = {"spec": {"dtype": "bfloat16"}, "variants": [e for e in entries if e.get("wgmma")]}
    gpu_check.run_variants(results, meta, None, str(tmp_path), torch.device("cpu"))
    assert time.monotonic() - t0 < 20
    rows = {r["function"]: r for r in results["variants"]}
    assert [r["function"] for r in results["variants"]] == ["probe_x", "k__tc_slow_wgmma", "k__tc_b_wgmma"]
    assert rows["k__tc_slow_wgmma"]["error"] == "child process: no result within its timeout of 2 s"
    assert rows["k__tc_b_wgmma"]["ms"] == 1.0 and rows["probe_x"]["ms"] == 1.0
    assert saved == [["probe_x"], ["probe_x", "k__tc_slow_wgmma"], ["probe_x", "k__tc_slow_wgmma", "k__tc_b_wgmma"]]
    assert results["variant_best"]["local"]["function"] == "k__tc_b_wgmma"
    # Children that run out of their time in a row (a hang the wgmma code shares): past
    # MAX_CONSECUTIVE_TIMEOUTS, the wgmma kernels left are skipped, saying why.
    monkeypatch.setattr(gpu_check, "MAX_CONSECUTIVE_TIMEOUTS", 1)
    results = {}
    gpu_check.run_variants(results, meta, None, str(tmp_path), torch.device("cpu"))
    errors = [r.get("error", "") for r in results["variants"]]
    assert errors[0] == "" and errors[1].startswith(gpu_check.CHILD_TIMED_OUT), errors
    assert errors[2].startswith("skipped: 1 children in a row ran out of their time"), errors
    # The run's time left caps a child's timeout: 1.5 s left, a 60 s child timeout.
    monkeypatch.setattr(gpu_check, "_child_timeout", 60.0)
    monkeypatch.setattr(gpu_check, "_deadline", time.monotonic() + 1.5)
    t0 = time.monotonic()
    row = gpu_check.isolated_variant_row(entries[1], str(tmp_path), "cpu")
    assert time.monotonic() - t0 < 10 and "no result within its timeout of 1 s" in row["error"], row
    assert gpu_check.isolated_variant_row(entries[3], str(tmp_path), "cpu")["error"] == gpu_check.OUT_OF_TIME


def test_gpu_check_decode_timing_on_cpu():
    """The GPU check's decode stage (GPU-only there), on the CPU kernels at a tiny shape:
    every peer agrees with ours and is timed, with the ratios the bars ask for."""
    from tools import gpu_check

    results = {}
    gpu_check.bench_decode(results, torch.device("cpu"), quick=True)
    rows = results["decode"]
    assert [(r["layer"], r["B"], r["Tq"]) for r in rows] == [("sliding", 1, 1), ("sliding", 8, 1), ("full", 1, 1),
                                                            ("full", 8, 1), ("sliding", 1, 8)]
    for r in rows:
        assert "error" not in r, r
        assert {"swa_tvm", "SDPA + mask"} <= set(r["ms"]) and r["vs_whole_cache_peers"] > 0
        assert max(r["max_abs_diff"].values()) < 1e-4
    assert all(r["kv_gb_s"] > 0 and "vs_window_peer" in r for r in rows if r["layer"] == "sliding" and r["Tq"] == 1)


def test_gpu_check_training_timing_on_cpu():
    """The GPU check's training stage (GPU-only there), run on the CPU kernels at a tiny
    shape: it times ours and the banded-mask SDPA, and their gradients agree."""
    from tools import gpu_check

    results = {}
    gpu_check.time_training(results, torch.device("cpu"), None, 64, 8, shape=(1, 4, 2, 16), dtype=torch.float32)
    row = results["training"]
    assert not [k for k in row if k.endswith("_error")], row
    assert row["ours_fwd_bwd_ms"] > 0 and row["speedup_vs_sdpa_banded_mask"] > 0
    assert row["sdpa_banded_mask_grads_vs_ours_rel_err"] < 1e-4


@pytest.mark.parametrize("left,right", [(5, 0), (5, 3), (16, 0), (7, 9), (-1, 0), (3, -1), (-1, -1), (40, 0)])
@pytest.mark.parametrize("warps,m_tiles,chunk", [(1, 1, 16), (2, 2, 32), (4, 1, 16)])
def test_staged_bytes_counts_the_chunks_a_dense_mask_touches(left, right, warps, m_tiles, chunk):
    """The GPU check's traffic model of a tensor-core variant: per block of rows, the
    band chunks (aligned to the block's band index 0: partner m0 - left, or 0 with no
    left bound) holding a partner some row of the block sees in the dense mask; for the
    forward and dq the rows are queries and a chunk K's and V's rows, for dk/dv the rows
    are keys, the mask transposed, and a chunk Q's and dO's rows with lse and delta."""
    from tools import gpu_check
    from swa_tvm.reference import window_mask

    B, H, T, D = 2, 3, 50, 8
    spec = {"head_dim": D, "left": left, "right": right, "dtype": "bfloat16"}
    for kind, m in (("local", m_tiles), ("local_dq", 1), ("local_dkv", 1)):
        mask, origin_of = window_mask(T, left, right, 1), lambda m0: m0 - left if left >= 0 else 0
        if kind == "local_dkv":
            mask, origin_of = mask.T, lambda m0: m0 - right if right >= 0 else 0
        rows, blocks_chunks = 16 * warps * m, 0
        for m0 in range(0, T, rows):
            partners = mask[m0:m0 + rows].any(0).nonzero().flatten().tolist()
            blocks_chunks += len({(p - origin_of(m0)) // chunk for p in partners})
        column = D * 2 * 2 + (8 if kind == "local_dkv" else 0)
        entry = {"kind": kind, "warps": warps, "m_tiles": m, "chunk": chunk}
        assert gpu_check.staged_bytes(entry, spec, (B, H, 1, T)) == B * H * blocks_chunks * chunk * column, kind
        assert gpu_check.staged_bytes({"kind": kind, "config": "cores"}, spec, (B, H, 1, T)) is None


def test_gpu_check_variant_rows_on_cpu(monkeypatch, tmp_path):
    """The GPU check's variant stage (GPU-only there) on CPU kernels: each variant's
    arguments (forward; dq; dk/dv per query head) and its comparison with the default
    kernels' output and autograd's gradients; a failing variant gets an error row and
    the rest are still measured; the same from a child process."""
    import tvm

    from tools import gpu_check
    from swa_tvm.compiler.targets import host_target
    from swa_tvm.compiler.build import schedule_spec

    kernels = {k.kind: k for k in AttentionSpec.parse("head_dim=16,window=7:0,backward").kernels()}
    target = tvm.target.Target(host_target())
    funcs, entries = {}, []
    for kind in ("local", "local_dq", "local_dkv"):
        name = f"{kernels[kind].name}__te"
        funcs[name] = schedule_spec(kernels[kind], target).with_attr("global_symbol", name)
        entries.append({"function": name, "kind": kind})
    entries.insert(1, {"function": "absent__x", "kind": "local_dq"})
    # Written as the bundle writes lib/variants, and read back by the GPU check's loader.
    folder = tmp_path / "variants"
    folder.mkdir()
    tvm.compile(tvm.IRModule(funcs), target=target).mod.export_library(str(folder / "variants_cpu.so"))
    (folder / "variants.json").write_text(json.dumps(
        {"spec": kernels["local"].to_dict(), "library": "variants_cpu.so", "variants": entries}))
    meta, module = gpu_check.load_variants(str(tmp_path))
    assert meta["variants"] == entries
    rows = gpu_check.variant_rows(module, meta, torch.device("cpu"), shape=(1, 4, 2, 50))
    assert [r["kind"] for r in rows] == ["local", "local_dq", "local_dq", "local_dkv"]
    assert "error" in rows[1] and "ms" not in rows[1]
    for r in rows[:1] + rows[2:]:
        assert r["rel_err_vs_default"] < 1e-5 and r["ms"] > 0 and r["tflops"] > 0, r
    # The summary the defaults are set from: per kind the fastest variant that agreed,
    # never one that failed or disagreed.
    rows += [dict(rows[0], function="fast_but_wrong", ms=rows[0]["ms"] / 10, rel_err_vs_default=0.5),
             dict(rows[0], function="faster", ms=rows[0]["ms"] / 2, default=False)]
    rows[0]["default"] = True
    best = gpu_check.best_variants(rows, torch.float32)
    assert set(best) == {"local", "local_dq", "local_dkv"}
    assert best["local"]["function"] == "faster" and best["local"]["speedup_vs_default"] == pytest.approx(2.0)
    assert best["local_dq"]["function"] == rows[2]["function"] and best["local_dq"]["default_ms"] is None
    # A variant in a process of its own (the wgmma ones, whose failure could poison the
    # CUDA context): its row as in process; a child that fails is the row's error.
    child = gpu_check.isolated_variant_row(entries[0], str(tmp_path), "cpu", (1, 4, 2, 50))
    assert child["function"] == entries[0]["function"] and child["rel_err_vs_default"] < 1e-5 and child["ms"] > 0
    lost = gpu_check.isolated_variant_row({"function": "unlisted__y", "kind": "local"}, str(tmp_path), "cpu", (1, 4, 2, 50))
    assert "ms" not in lost and "child process rc 1" in lost["error"] and "unlisted__y: not in" in lost["error"], lost
    # Against the bars: each forward variant's speed against the bench stage's
    # FlexAttention (its causal row) and the matmul rate.
    bars = {"timing": [{"config": "dilation 2", "flex_attention_ms": 1.0},
                       {"config": "causal", "flex_attention_ms": rows[0]["ms"] * 3}],
            "matmul_tflops": rows[0]["tflops"] * 4, "variants": [dict(r) for r in rows],
            "variant_best": {"local": dict(best["local"])}}
    gpu_check.against_the_bars(bars)
    first = bars["variants"][0]
    assert first["speedup_vs_flex_attention"] == pytest.approx(3.0) and first["fraction_of_matmul"] == pytest.approx(0.25)
    assert "speedup_vs_flex_attention" not in bars["variants"][1]  # a failed row
    assert bars["variant_best"]["local"]["speedup_vs_flex_attention"] == pytest.approx(6.0)  # "faster": half the time
    # Past the run's time budget no variant is called: each says it was skipped.
    monkeypatch.setattr(gpu_check, "_deadline", 0.0)
    late = gpu_check.variant_rows(module, meta, torch.device("cpu"), shape=(1, 4, 2, 50))
    assert [r["error"] for r in late] == [gpu_check.OUT_OF_TIME] * 4 and not any("ms" in r for r in late)


def test_wgmma_probe_tells_the_layout_readings_apart():
    """The GPU check's wgmma probes (one instruction against a matrix product), emulated
    on the CPU with B read where the descriptor says (``canonical_address``): K's tile
    and V's tile and V's transposed agree with torch's product; V's tile under the other
    reading (LBO and SBO exchanged) does not, so on the GPU the probes name the reading
    the hardware has."""
    from tools import gpu_check
    from tools import gpu_bundle
    from swa_tvm.schedules import cuda_wgmma

    rows = []
    for operand, r, c, ks, swap in gpu_bundle.WGMMA_PROBES:
        entry = {"function": "probe", "kind": "wgmma_probe", "operand": operand, "rows": r, "cols": c, "ks": ks}
        func = cuda_wgmma.probe("bfloat16", operand, r, c, ks, swap, emulate=True).with_attr("global_symbol", "probe")
        rows.append(gpu_check.probe_row(serial_on_cpu(func), entry, torch.device("cpu")))
    assert [row["agrees"] for row in rows] == [not swap for *_, swap in gpu_bundle.WGMMA_PROBES], rows
    assert gpu_check.best_variants(rows, torch.bfloat16) == {}  # probes are not timing rows


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stub_machine(tmp_path, check_rc: int, ncu_sleep_for: str = ""):
    """A GPU machine of stubs for tools/gpu_check.sh and tools/gpu_decide.sh: $PY logs
    its arguments and fails tools.gpu_check with ``check_rc``; ncu logs its arguments
    (sleeping 30 s when they name ``ncu_sleep_for``) and writes its report. Returns
    (environment, log of every call)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "py").write_text(f"""#!/usr/bin/env bash
echo "py $*" >> {log}
case "$*" in
  *tools.gpu_check*) exit {check_rc} ;;
  *"--pick default"*) echo tc_w4_c64 ;;
  *"--pick best"*) echo tc_w8_c64_wgmma ;;
esac
exit 0
""")
    (bin_dir / "ncu").write_text(f"""#!/usr/bin/env bash
echo "ncu $*" >> {log}
if [ -n "{ncu_sleep_for}" ] && [[ "$*" == *"{ncu_sleep_for}"* ]]; then sleep 30; fi
prev=""
for a in "$@"; do [ "$prev" = "-o" ] && touch "$a.ncu-rep"; prev=$a; done
echo details
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PY=str(bin_dir / "py"), OUT=str(tmp_path / "out"),
               BUNDLE=str(tmp_path / "bundle"))
    return env, log


def test_gpu_check_sh_profiles_after_a_failed_check(tmp_path):
    """tools/gpu_check.sh: a check that fails (exit status 1) still leads to the
    profiles asked for, each by ncu's reduced sections (not --set full) under its own
    timeout, one that hangs killed and the next still run; the script's status is the
    check's."""
    import subprocess
    import time

    env, log = _stub_machine(tmp_path, check_rc=1, ncu_sleep_for="tc_slow_kernel")
    env.update(PROFILE="tc_slow tc_w4_c64", NCU_TIMEOUT="2")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_check.sh"), "--budget-s", "5"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 25
    assert proc.returncode == 1, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    check = next(i for i, c in enumerate(calls) if "-m tools.gpu_check" in c)
    assert "--budget-s 5" in calls[check] and "--out " + env["OUT"] in calls[check]
    profiles = [c for c in calls[check:] if c.startswith("ncu ") and " -o " in c]
    assert [p.split("-k ")[1].split()[0] for p in profiles] == ["regex:tc_slow_kernel", "regex:tc_w4_c64_kernel"]
    assert all("--set" not in p and "--section SpeedOfLight" in p and "--section WarpStateStats" in p for p in profiles)
    assert os.path.exists(os.path.join(env["OUT"], "ncu_tc_w4_c64.txt"))
    assert "gpu_check: exit status 1" in proc.stdout


def test_gpu_decide_sh_runs_every_step_and_profiles_three_kernels(tmp_path):
    """tools/gpu_decide.sh with stubs: the check (its deciding stages, its own budget and
    child timeout, no tuning batch), then the ablation, then three reduced ncu profiles
    (our fastest wgmma forward, our default, Flex's kernel), whatever the check's
    outcome; everything printed also in $OUT/log.txt."""
    import subprocess

    env, log = _stub_machine(tmp_path, check_rc=1)
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_decide.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    steps = [c for c in calls if "-m tools." in c or c.startswith("ncu ")]
    check = next(c for c in steps if "-m tools.gpu_check" in c)
    assert "--stages variants,bars,training,scaling" in check and "--child-timeout-s 30" in check
    assert "--tune" not in check and "--budget-s 260" in check
    order = [next(m for m in ("gpu_check", "flex_ablation", "--pick", "ncu", "gpu_summary") if m in c) for c in steps]
    assert order.index("gpu_check") < order.index("flex_ablation") < order.index("ncu") < order.index("gpu_summary")
    kernels = [c.split("-k ")[1].split()[0] for c in calls if c.startswith("ncu ") and " -o " in c]
    assert kernels == ["regex:tc_w8_c64_wgmma_kernel", "regex:tc_w4_c64_kernel", "regex:triton_tem"]
    assert {f"ncu_{n}.txt" for n in ("best", "default", "flex")} <= set(os.listdir(env["OUT"]))
    assert "gpu_check: exit status 1" in open(os.path.join(env["OUT"], "log.txt")).read()


def test_flex_ablation_rows_and_their_timeouts(tmp_path):
    """FlexAttention's ablation: Flex's own choice, then BLOCK_M 64 and 128 by 1 and 3
    stages at one BLOCK_N and warp count with TMA off, options the installed torch's
    Flex forward reads; a row whose child hangs is killed after the row's own timeout,
    the rows after it run in a new child, and every row is saved as it completes."""
    import inspect
    import sys
    import time

    from torch._inductor.kernel.flex import flex_attention as flex_source

    from tools import flex_ablation

    rows = flex_ablation.ABLATION_ROWS
    assert list(rows)[0] == "default" and rows["default"] is None
    tiles = {n: o for n, o in rows.items() if o is not None}
    assert sorted((o["BLOCK_M"], o["num_stages"]) for o in tiles.values()) == [(64, 1), (64, 3), (128, 1), (128, 3)]
    assert {(o["BLOCK_N"], o["num_warps"], o["USE_TMA"]) for o in tiles.values()} == {(64, 8, False)}
    source = inspect.getsource(flex_source)
    assert all(f'"{key}"' in source for o in tiles.values() for key in o), "a kernel option Flex does not read"

    def command(left):
        script = "import json, time\n"
        for name in left:
            if name == "m64_s3":
                script += "time.sleep(60)\n"
            script += f"print({flex_ablation.ROW!r} + json.dumps({{'config': {name!r}, 'ms': 1.0}}), flush=True)\n"
        return [sys.executable, "-c", script]

    saved = []
    t0 = time.monotonic()
    got = flex_ablation.run_rows(list(rows), command, 3.0, time.monotonic() + 60, lambda r: saved.append(r["config"]))
    assert time.monotonic() - t0 < 30
    assert [r["config"] for r in got] == list(rows) == saved
    assert "no result within 3 s (killed)" in got[2]["error"] and list(rows)[2] == "m64_s3"
    assert all(r["ms"] == 1.0 for i, r in enumerate(got) if i != 2)


def test_gpu_bundle_size_check_counts_tree_and_bundle(tmp_path, monkeypatch):
    """The bundle's size check: the files that travel with the tree (tracked and
    untracked-not-ignored, not ignored ones, not the bundle twice) plus the bundle,
    against the limit; over it, a loud failure saying by how much."""
    import subprocess

    from tools import gpu_bundle

    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("ignored/\n")
    (root / "tracked.bin").write_bytes(b"x" * (3 << 20))
    subprocess.run(["git", "-C", str(root), "add", "tracked.bin", ".gitignore"], check=True)
    (root / "untracked.bin").write_bytes(b"x" * (1 << 20))
    (root / "ignored").mkdir()
    (root / "ignored" / "big.bin").write_bytes(b"x" * (8 << 20))
    bundle = root / "bundle"  # not ignored: counted once, as the bundle
    (bundle / "lib").mkdir(parents=True)
    (bundle / "lib" / "a.so").write_bytes(b"x" * (2 << 20))
    tree, size = gpu_bundle.check_size(str(root), str(bundle), 7)
    assert size == 2 << 20 and tree == (4 << 20) + len("ignored/\n")
    with pytest.raises(SystemExit, match=r"come to 6\.0 MiB, 1\.0 MiB over the 5 MiB"):
        gpu_bundle.check_size(str(root), str(bundle), 5)
    # The bundle is built from this checkout's swa_tvm, and says which.
    assert gpu_bundle.source_checkout()[0] == REPO
    import swa_tvm

    monkeypatch.setattr(swa_tvm, "__file__", "/elsewhere/swa_tvm/__init__.py")
    with pytest.raises(SystemExit, match="imported from /elsewhere"):
        gpu_bundle.source_checkout()


def test_gpu_profile_picks_and_summary_outcome():
    """What the decision run profiles: variants.json's default forward, the fastest
    wgmma forward that agreed (not a faster one that disagreed, nor a gradient); and
    the summary's outcome from the probes and the wgmma rows against Flex."""
    from tools import gpu_profile, gpu_summary

    meta = {"variants": [{"function": "k__tc_w2_c32", "kind": "local_dq", "default": True},
                         {"function": "k__tc_w4_c64", "kind": "local", "default": True},
                         {"function": "k__tc_w8_c64", "kind": "local", "default": False}]}
    assert gpu_profile.pick_default(meta) == "tc_w4_c64"
    rows = [{"function": "k__tc_w4_c64", "kind": "local", "ms": 8.0, "rel_err_vs_default": 0.0},
            {"function": "k__tc_w8_c64_wgmma", "kind": "local", "wgmma": True, "ms": 6.0, "rel_err_vs_default": 1e-3},
            {"function": "k__tc_w8_c64_wgmma_vt", "kind": "local", "wgmma": True, "ms": 5.0, "rel_err_vs_default": 0.7},
            {"function": "k__tc_w4_c32_wgmma", "kind": "local_dq", "wgmma": True, "ms": 1.0, "rel_err_vs_default": 0.0},
            {"function": "probe", "kind": "wgmma_probe", "wgmma": True, "swap": False, "agrees": True}]
    results = {"variants_meta": {"spec": {"dtype": "bfloat16"}}, "variants": rows,
               "timing": [{"config": "causal", "flex_attention_ms": 7.0}]}
    assert gpu_profile.pick_best(results) == "tc_w8_c64_wgmma"
    assert gpu_summary.outcome(results) == "wgmma default"
    assert gpu_summary.outcome(dict(results, timing=[{"config": "causal", "flex_attention_ms": 5.5}])) == "wgmma behind"
    assert gpu_profile.pick_best(dict(results, variants=rows[:1])) == "tc_w4_c64"  # no wgmma row: the fastest
    assert gpu_summary.outcome(dict(results, variants=rows[:1])) == "no wgmma"
    swapped_agrees = dict(rows[4], swap=True)
    assert gpu_summary.outcome(dict(results, variants=rows + [swapped_agrees])) == "descriptors"


@needs_nvcc
def test_gpu_bundle_builds_tile_variants(tmp_path, monkeypatch):
    """The GPU check's tile-configuration sweep: one module, one function per variant
    (tensor-core configurations and the CUDA-core kernel of the forward, dq and dk/dv
    kernels), listed in variants.json with the kind each computes; for sm_90 built as
    sm_90a, with the wgmma forward (V transposed, overlapped); two K/V stages."""
    from tools import gpu_bundle

    # 16-bit loads and cp.async; two 16-row tiles per warp.
    monkeypatch.setattr(gpu_bundle, "TC_VARIANTS", ((4, 64), (2, 16, False, True), (1, 16, True, False, 2),
                                                    (4, 16, True, False, 1, True, True, None, True),
                                                    (2, 16, True, True, 1, False, False, None, False, 2)))
    # 4 x 32: dynamic shared memory; 2 x 16 with two chunk stages.
    monkeypatch.setattr(gpu_bundle, "TC_BWD_VARIANTS", ((2, 32), (4, 32), (2, 16, True, False, 2)))
    monkeypatch.setattr(gpu_bundle, "WGMMA_PROBES", (("kn", 64, 128, 1, True),))
    path = gpu_bundle.build_variants(str(tmp_path), "sm_90", gradients=True)
    meta = json.load(open(tmp_path / "lib" / "variants" / "variants.json"))
    assert os.path.exists(path) and meta["library"] == os.path.basename(path) and meta["arch"] == "sm_90a"
    assert meta["spec"]["kind"] == "local"
    got = [(v["kind"], v["function"].rsplit("__", 1)[-1], v["kernel"], v.get("default")) for v in meta["variants"]]
    assert got == [
        ("local", "tc_w4_c64", "cuda_flash_tc", True),  # bf16 D=128's default
        ("local", "tc_w2_c16_lds16_async", "cuda_flash_tc", False),
        ("local", "tc_w1_c16_m2", "cuda_flash_tc", False),
        ("local", "tc_w4_c16_wgmma_vt_ov", "cuda_flash_tc", False),
        ("local", "tc_w2_c16_async_s2", "cuda_flash_tc", False),
        ("local", "cores", "cuda_flash", None),
        ("local_dq", "tc_w2_c32", "cuda_flash_bwd_tc", True),
        ("local_dq", "tc_w4_c32", "cuda_flash_bwd_tc", False),
        ("local_dq", "tc_w2_c16_async_s2", "cuda_flash_bwd_tc", False),
        ("local_dq", "cores", "cuda_flash_bwd", None),
        ("local_dkv", "tc_w2_c32", "cuda_flash_bwd_tc", True),
        ("local_dkv", "tc_w4_c32", "cuda_flash_bwd_tc", False),
        ("local_dkv", "tc_w2_c16_async_s2", "cuda_flash_bwd_tc", False),
        ("local_dkv", "cores", "cuda_flash_bwd", None),
        ("wgmma_probe", "wgmma_probe_kn_r64_c128_k1_swapped", "cuda_wgmma", None),
    ]
    dq_rows = [v for v in meta["variants"] if v["kind"] == "local_dq"]
    assert [v.get("shared_bytes", 0) > 48 * 1024 for v in dq_rows] == [False, True, False, False]
    assert [v.get("stages") for v in dq_rows] == [1, 1, 2, None]
    # ptxas's report per variant; the dynamic tiles count no static shared memory.
    assert all(v["ptxas"]["registers"] <= 255 for v in meta["variants"]), meta["variants"]
    assert [v["ptxas"]["smem"] > 1024 for v in dq_rows] == [True, False, True, True]
    # And each one's hot loop from its machine code (tools.sass): the tensor-core
    # forward's mma per warp and chunk: (8 k-steps x chunk/8 score tiles + chunk/16 x 16
    # output tiles) x row tiles: 128 at the default 4 x 64, 32 at 2 x 16, 64 with two
    # row tiles at 1 x 16, 32 in wgmma's units (a warp's share of each HGMMA) at 4 x 16;
    # the gradients' dq 96 and dk/dv 128 at 32 keys (two chunks a turn with two
    # stages: 64 at 2 x 16 in the forward, 2 x 48 and 2 x 64 at 16 keys in dq and dk/dv).
    assert [v["sass"]["loop_mma"] for v in meta["variants"] if v["kernel"] != "cuda_flash_bwd"][:5] == [128, 32, 64, 32, 64]
    assert [v["sass"]["loop_mma"] for v in meta["variants"] if v["kernel"] == "cuda_flash_bwd_tc"] == [96, 96, 96, 128,
                                                                                                       128, 128]
    # The 4 x 32 gradient kernels (52 KiB, compiled by nvcc above) take dynamic shared
    # memory; tiles within 48 KiB static.
    from swa_tvm.schedules import cuda_flash_bwd_tc, cuda_flash_tc

    grad = KernelSpec("local_dq", 128, "bfloat16", 4095, 0)
    assert 'scope="shared.dyn"' in cuda_flash_bwd_tc.flash_bwd_tc(grad, cuda_flash_bwd_tc.TCBwdConfig(4, 32)).script()
    small = cuda_flash_bwd_tc.flash_bwd_tc(grad, cuda_flash_bwd_tc.TCBwdConfig(2, 32)).script()
    assert "shared.dyn" not in small and "T.alloc_shared(" in small
    with pytest.raises(ValueError, match=r"exceed the 99 KiB of a block"):
        cuda_flash_tc.flash_tc(dataclasses.replace(grad, kind="local", head_dim=256), cuda_flash_tc.TCConfig(8, 128))
    # wgmma kernels run on sm_90 alone, whose blocks may take 227 KiB: 4 x 64 gradients
    # with two chunk stages (99.3 KiB) are one, on mma.sync they are refused.
    two_stage = cuda_flash_bwd_tc.TCBwdConfig(4, 64, True, True, 2)
    assert 99 * 1024 < two_stage.shared_bytes(128, "bfloat16") and cuda_flash_tc.tile_scope(grad, two_stage) == "shared.dyn"
    with pytest.raises(ValueError, match=r"exceed the 99 KiB of a block"):
        cuda_flash_tc.tile_scope(grad, dataclasses.replace(two_stage, wgmma=False))
    with pytest.raises(ValueError, match=r"exceed the 227 KiB of a block"):
        cuda_flash_tc.tile_scope(dataclasses.replace(grad, head_dim=256), cuda_flash_bwd_tc.TCBwdConfig(8, 128, True, True, 2))


def test_sass_hot_loop_is_the_innermost_with_the_most_mma():
    """tools.sass's reading of nvdisasm's text: two loops of two HMMA each (the band's,
    then the extra keys'), and a branch back across both, as nvcc laid out the forward
    with extra keys: the hot loop is the first inner loop, not the range spanning both."""
    from tools import sass

    ops = []

    def emit(op, target=None):
        line = f"        /*{16 * len(ops):04x}*/                   {op}" + (f" `({target}) ;" if target else " R0, R1 ;")
        ops.append(line)

    text = ["//--------------------- .text.k_kernel --------------------------"]
    emit("IMAD")
    text += ops[-1:] + [".L_x_1:"]
    for op in ("LDSM", "HMMA", "HMMA", "FMUL"):
        emit(op)
        text.append(ops[-1])
    emit("BRA", ".L_x_1")
    text += [ops[-1], ".L_x_2:"]
    for op in ("HMMA", "HMMA", "IMAD", "IMAD", "IMAD"):
        emit(op)
        text.append(ops[-1])
    emit("BRA", ".L_x_2")
    text.append(ops[-1])
    emit("BRA", ".L_x_1")  # back across both
    text.append(ops[-1])
    kernels = sass.kernel_instructions("\n".join(text))
    insts, labels = kernels["k_kernel"]
    assert len(insts) == 13 and labels == {".L_x_1": 1, ".L_x_2": 6}
    r = sass.summarize(insts, labels)
    assert (r["loop_instructions"], r["loop_mma"], r["loop_per_mma"]) == (5, 2, 2.5), r


def test_sass_shortest_pass_takes_each_branch_the_shorter_way():
    """tools.sass.shortest_pass on a loop as nvcc lays out the forward's: a predicated
    branch over the unmasked path to the masked one (longer), which jumps back to the
    join; then a predicated skip of the rescale; then the back branch. The shortest pass
    is the unmasked path without the rescale; the mma on it are counted."""
    from tools import sass

    lines, labels = [], {}

    def emit(op, pred="", target=None):
        text = f"        /*{16 * len(lines):04x}*/               {pred}{op}" + (f" `({target}) ;" if target else " R0, R1 ;")
        lines.append(text)

    def label(name):
        labels[name] = len(lines)
        lines.append(f"{name}:")

    lines.append("//--------------------- .text.k_kernel --------------------------")
    label(".L_x_0")
    emit("HMMA")
    emit("BRA", "@P0 ", ".L_x_1")  # masked chunk: to the longer path
    emit("FMNMX")
    emit("BRA", "", ".L_x_2")  # unconditional: over the masked path
    label(".L_x_1")
    for op in ("ISETP", "FSEL", "FSEL", "FMNMX"):
        emit(op)
    label(".L_x_2")
    emit("BRA", "@!P1 ", ".L_x_3")  # no rescale: skip the multiplies
    for op in ("FMUL", "FMUL", "FMUL"):
        emit(op)
    label(".L_x_3")
    emit("HMMA")
    emit("BRA", "@P2 ", ".L_x_0")  # back
    insts, found = sass.kernel_instructions("\n".join(lines))["k_kernel"]
    start, end = sass.hot_loop(insts, found)
    assert (start, end) == (0, len(insts)) and len(insts) == 14
    # HMMA, BRA, FMNMX, BRA, BRA (the rescale's skip), HMMA, BRA back: 7, two mma.
    assert sass.shortest_pass(insts, found, start, end) == (7, 2)
    r = sass.summarize(insts, found)
    assert (r["loop_instructions"], r["shortest_pass"], r["shortest_pass_per_mma"]) == (14, 7, 3.5), r
    # A second chunk under a predicated branch (two K/V stages, odd chunk counts): the
    # pass skips what it can but not the products: + BRA, HMMA, FMUL.
    back = lines.pop()
    emit("BRA", "@!P3 ", ".L_x_4")
    emit("HMMA")
    emit("FMUL")
    label(".L_x_4")
    lines.append(back)
    insts, found = sass.kernel_instructions("\n".join(lines))["k_kernel"]
    start, end = sass.hot_loop(insts, found)
    assert sass.shortest_pass(insts, found, start, end) == (10, 3)
