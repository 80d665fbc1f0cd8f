"""The benchmark's own pieces: its FLOP count and its peers compute what they claim,
checked against the float64 dense reference (the timings themselves are not tested)."""

import pytest
import torch

from benchmarks import forward as bench
from swa_tvm.reference import attention_mask, sliding_window_attention_ref

from conftest import rel_err


def _ref_kwargs(cfg, gi):
    return dict(window_size=cfg["window"], dilation=cfg["dilation"], global_idx=gi)


@pytest.mark.parametrize("config", list(bench.CONFIGS))
@pytest.mark.parametrize("T", [200, 777])
def test_visible_pairs_matches_reference_mask(config, T):
    cfg = bench.CONFIGS[config]
    gi = bench.global_positions(T, cfg["G"]) if cfg["G"] else None
    mask, _ = attention_mask(T, 1, cfg["window"], cfg["dilation"], gi, 0)
    assert bench.visible_pairs(T, cfg) == int(mask.sum())


@pytest.mark.slow  # T=1100 through every peer
@pytest.mark.parametrize("config", list(bench.CONFIGS))
def test_peers_compute_the_pattern(config):
    """sliding chunks, SDPA's mask and FlexAttention's mask_mod all mean our pattern."""
    cfg = bench.CONFIGS[config]
    T = 1100  # several chunks of every chunk size used, plus a ragged tail
    gi = bench.global_positions(T, cfg["G"]) if cfg["G"] else None
    q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
    ref, _ = sliding_window_attention_ref(q, k, v, **_ref_kwargs(cfg, gi))
    assert rel_err(bench.sliding_chunks(q, k, v, cfg, gi), ref) < 1e-5
    mask = bench.dense_mask(T, cfg, gi)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert rel_err(sdpa, ref) < 1e-5
    ref_mask, _ = attention_mask(T, 1, cfg["window"], cfg["dilation"], gi, 0)
    assert torch.equal(mask, ref_mask[0, 0])


def test_spec_strings_cover_every_config():
    from swa_tvm.spec import AttentionSpec

    kernels = {k.name for s in bench.spec_strings() for k in AttentionSpec.parse(s).kernels()}
    assert len(bench.spec_strings()) == len(bench.CONFIGS)
    assert any(n.startswith("swa_global") for n in kernels)
    # --dtype bfloat16 exports the same patterns in bfloat16 (the float32 set unchanged).
    half = [AttentionSpec.parse(s) for s in bench.spec_strings("bfloat16")]
    assert [h.dtype for h in half] == ["bfloat16"] * len(bench.CONFIGS)
    assert [s.replace(",dtype=bfloat16", "") for s in bench.spec_strings("bfloat16")] == bench.spec_strings()
    from benchmarks import training as bench_train

    train = [AttentionSpec.parse(s) for s in bench_train.spec_strings(dtype="bfloat16")]
    assert all(t.backward and t.dtype == "bfloat16" for t in train) and len(train) == len(bench_train.CONFIGS)


def test_shipped_specs_are_the_benchmarks_specs():
    """swa_tvm/tuning_logs/shipped_specs.txt (what `make tune` tunes and the wheel
    ships records for) is the set of specs the benchmarks export: the forward's and the
    training's (comment lines aside)."""
    import pathlib

    from benchmarks import training as bench_train

    path = pathlib.Path(__file__).resolve().parent.parent / "swa_tvm" / "tuning_logs" / "shipped_specs.txt"
    shipped = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert sorted(shipped) == sorted(bench.spec_strings() + bench_train.spec_strings())
    assert len(set(shipped)) == len(shipped)


@pytest.mark.slow  # a process of its own
def test_cli_bench_help():
    """The benchmark's command line (``python -m benchmarks.forward``, `make bench`;
    `swa-tvm bench` before benchmarks/ left the package)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "benchmarks.forward", "--help"], capture_output=True, text=True, cwd=root)
    assert r.returncode == 0 and "--reuse-libs" in r.stdout and "--T" in r.stdout and "--dtype" in r.stdout


@pytest.mark.slow  # float64 autograd at T=700
@pytest.mark.parametrize("config", ["causal W=512", "W=512 + 16 globals"])
def test_training_peers_give_reference_gradients(config):
    """The training benchmark's torch peers (autograd through sliding chunks and SDPA
    with the dense mask) have the reference's gradients."""
    from benchmarks import training as bench_train

    cfg = bench.CONFIGS[config]
    T = 700
    gi = bench.global_positions(T, cfg["G"]) if cfg["G"] else None
    q, k, v = (torch.randn(1, 2, T, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 2, T, 16, dtype=torch.float64)
    ref, _ = sliding_window_attention_ref(q, k, v, **_ref_kwargs(cfg, gi))
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for method in ("sliding chunks", "SDPA + mask"):
        got = bench_train._grads(bench_train.make_method(method, T, cfg, gi), q, k, v, dout)
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-10, method


@pytest.mark.slow  # sleeps to be timed
def test_median_ms_repeats_short_calls():
    """At least ``runs`` timed calls; short ones repeated until they span min_seconds."""
    import time

    calls = []

    def sleeper(s):
        def fn():
            calls.append(s)
            time.sleep(s)

        return fn

    ms = bench.median_ms(sleeper(0.02), runs=5, min_seconds=0.05)
    assert len(calls) == 6 and 19 < ms < 60  # warm-up + 5: the 5 already span 0.1 s
    calls.clear()
    ms = bench.median_ms(sleeper(0.001), runs=5, min_seconds=0.05)
    assert 10 < len(calls) <= 51 and 0.9 < ms < 5  # sleep(1 ms) lasts at least 1 ms


@pytest.mark.slow  # sleeps to be timed
def test_interleaved_medians_time_every_method_round_robin():
    import time

    order = []

    def sleeper(name, s):
        def fn():
            order.append(name)
            time.sleep(s)

        return fn

    got = bench.interleaved_medians({"a": sleeper("a", 0.02), "b": sleeper("b", 0.001)}, runs=3, min_seconds=0.01)
    assert order[:2] == ["a", "b"]  # warm-ups
    # Round-robin while both need runs; each short call after an untimed one.
    assert order[2:14] == ["a", "a", "b", "b"] * 3
    assert order.count("a") == 7 and order.count("b") > 7  # b repeated until 0.01 s
    assert 19 < got["a"] < 60 and 0.9 < got["b"] < 5


@pytest.mark.slow  # sleeps to be timed
def test_time_growth_times_both_lengths_round_robin(monkeypatch):
    """The linearity check times the kernel at both lengths in one round-robin, and its
    ratio is large over small (a fake kernel whose time is linear in T reads ~4)."""
    import time

    order = []

    def fake_method(method, T, cfg, gi, libs):
        assert method == "swa_tvm tuned" and (gi is not None) == bool(cfg["G"])

        def fn(q, k, v):
            assert q.shape[2] == T
            order.append(T)
            time.sleep(T * 1e-6)

        return fn

    monkeypatch.setattr(bench, "make_method", fake_method)
    for dim in ("B", "H", "D"):
        monkeypatch.setattr(bench, dim, 1)  # tiny inputs: only their length matters here
    g = bench.time_growth("W=512 + 16 globals", 5000, 20000, libs={}, runs=3)
    # Warm-ups, then rounds of both (each short call after an untimed one).
    assert order[:2] == [5000, 20000] and order[2:8] == [5000, 5000, 20000, 20000, 5000, 5000]
    assert (g["T_small"], g["T_large"]) == (5000, 20000) and g["rounds"] == bench.GROWTH_ROUNDS
    assert order.count(20000) >= 1 + 2 * bench.GROWTH_ROUNDS  # warm-up, then untimed + timed per round
    assert 3.0 < g["ratio"] < 4.5 and g["ratio"] == pytest.approx(g["ms_large"] / g["ms_small"])


@pytest.mark.slow  # two small models, three attention implementations
def test_hf_models_clock_and_generation():
    """benchmarks.hf_models on small models of each family: every method's attention
    function is timed (a positive share, below the whole), the chunked prefill of eager
    and the copies of the prefilled cache give every method and run the same greedy
    tokens, and the original attention functions are back afterwards."""
    import transformers

    from benchmarks import hf_models

    import swa_tvm.integrations.transformers as swa_hf

    swa_hf.register()
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 sliding_window=8)
    sdpa = transformers.AttentionInterface._global_mapping["sdpa"]
    ids = torch.randint(3, hf_models.VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    for family, extra, methods in (("mistral", {}, ("swa_tvm", "sdpa", "eager")),
                                   ("gpt_oss", dict(num_local_experts=2, num_experts_per_tok=2), ("swa_tvm", "eager"))):
        model = hf_models.build(family, {**small, **extra}, layers=2)
        clock = hf_models.AttentionClock(family)
        tokens = []
        try:
            for impl in methods:
                model.set_attn_implementation(impl)
                chunk = 16 if impl == "eager" else None
                prefills, decodes = [], []
                for _ in range(2):
                    p_s, p_attn, cache, first = hf_models.prefill(model, clock, ids, chunk)
                    d_s, d_attn, generated = hf_models.decode(model, clock, cache, first, 6)
                    prefills.append((p_s, p_attn))
                    decodes.append((d_s, d_attn))
                    tokens.append(generated)
                row = hf_models.summarize(prefills, decodes, 40, 6, chunk)
                assert 0 < row["prefill_attention_share"] < 1 and 0 < row["decode_attention_share"] < 1, (impl, row)
                assert len(row["decode_runs_s"]) == 2 and row["decode_attention_ms_per_token"] > 0
                assert row["end_to_end_s"] == pytest.approx(row["prefill_s"] + row["decode_ms_per_token"] * 5 / 1e3)
        finally:
            clock.close()
        assert all(t == tokens[0] for t in tokens) and len(tokens[0]) == 6, tokens
    assert transformers.AttentionInterface._global_mapping["sdpa"] is sdpa
    assert transformers.AttentionInterface._global_mapping["swa_tvm"] is swa_hf.attention


def test_foreign_cpu_class_gets_its_own_results_folder_and_no_amx():
    """--mcpu builds another class's code on this machine: its results never land in
    the folder of the class's own machines, and the target keeps that class's features
    (no AMX added for an -mcpu without it)."""
    from swa_tvm.compiler.targets import host_target, target_key, uses_amx
    from swa_tvm.spec import KernelSpec

    host = host_target()
    assert bench.results_dir(None, bench.bench_target(None)).endswith(f"/{target_key(host)}")
    other = "znver3" if host["mcpu"] != "znver3" else "rocketlake"
    target = bench.bench_target(other)
    assert target == {"kind": "llvm", "mcpu": other, "num-cores": host["num-cores"]}
    assert bench.results_dir(None, target).endswith(f"/llvm-{other}-on-{host['mcpu']}")
    assert bench.results_dir("/x", target) == "/x"
    info = bench.machine_info(2, target)
    assert info["target_key"] == f"llvm-{other}" and info["host_key"] == target_key(host)
    assert "host_key" not in bench.machine_info(2)
    assert not uses_amx(KernelSpec("local", 64, "bfloat16", 511, 0), bench.bench_target("rocketlake"))
    with pytest.raises(ValueError, match="mcpu"):
        bench.bench_target("no-such-cpu")


def test_same_cpu_name_without_the_hosts_features_is_foreign(monkeypatch):
    """A virtual machine LLVM names rocketlake gets AMX in its host target; --mcpu
    rocketlake leaves it out, so its results are not the class's own."""
    vm = {"kind": "llvm", "mcpu": "rocketlake", "num-cores": 2, "mattr": ["+amx-tile", "+amx-bf16"]}
    monkeypatch.setattr(bench, "host_target", lambda: dict(vm))
    target = bench.bench_target("rocketlake")
    assert "mattr" not in target
    assert bench.results_dir(None, target).endswith("/llvm-rocketlake-on-rocketlake")
    assert bench.machine_info(2, target)["host_key"] == "llvm-rocketlake"
    assert bench.results_dir(None, bench.bench_target(None)).endswith("/llvm-rocketlake")


def test_float32_method_needs_a_16_bit_run(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--methods", bench.FLOAT32, "--T", "64"])
    assert "--dtype bfloat16" in capsys.readouterr().err


def test_report_names_16_bit_over_float32():
    from benchmarks import report

    rows = [dict(config="causal W=512", T=T, method=m, ms=ms, gflops=1.0, pct_peak=1.0)
            for T, m, ms in ((4096, "swa_tvm tuned", 12.0), (4096, bench.FLOAT32, 10.0),
                             (16384, "swa_tvm tuned", 45.0), (16384, bench.FLOAT32, 50.0))]
    d = {"rows": rows, "shape": {"B": 1, "H": 8, "D": 64, "dtype": "bfloat16"},
         "machine": {"cpu": "x", "target_key": "llvm-rocketlake", "host_key": "llvm-emeraldrapids"}}
    text = "\n".join(report.forward_section("llvm-rocketlake-on-emeraldrapids", "results_bfloat16.json", d))
    assert "swa_tvm tuned (bfloat16) / swa_tvm float32" in text and "0.90–1.20" in text
    assert "largest: causal W=512, T=4096" in text
    assert "code built for llvm-rocketlake on a llvm-emeraldrapids machine" in text
    header = next(line for line in text.splitlines() if line.startswith("| pattern"))
    assert header.startswith("| pattern | T | swa_tvm tuned ms | swa_tvm float32 ms |"), header
