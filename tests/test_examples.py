"""The examples run as a user runs them (``python examples/X.py`` from the repository
root, in a process of their own) and print what they promise; the training example
also learns (its loss falls well below chance)."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from cuda_helpers import needs_nvcc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run_example(name, *args, timeout=900):
    """``python examples/<name> ARGS`` from the repository root: its stdout (the test
    fails with its output unless it exits 0)."""
    path = os.path.join(EXAMPLES, name)
    if not os.path.exists(path):
        pytest.fail(f"examples/{name} does not exist")
    r = subprocess.run([sys.executable, path, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)  # fmt: skip
    assert r.returncode == 0, f"examples/{name} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.slow  # compiles the model's forward and gradient kernels, trains 120 steps
def test_copy_task_loss_falls():
    """examples/train_copy.py's model learns: a short run's loss falls."""
    spec = importlib.util.spec_from_file_location("train_copy", os.path.join(EXAMPLES, "train_copy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = mod.train(steps=120, log_every=0)
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    # Chance level is ln 16 = 2.77; the model must learn well beyond it.
    assert first > 2.5
    assert last < first - 0.5, f"loss did not fall enough: {first:.3f} -> {last:.3f}"


@pytest.mark.slow
def test_train_copy_runs():
    out = run_example("train_copy.py", "--steps", 10)
    assert re.search(r"^step    1  loss \d+\.\d+  copy accuracy \d\.\d\d", out, re.M), out
    assert re.search(r"^mean loss of the first 10 steps \d+\.\d+ \(chance: ln 16 = 2\.773\), of the last 10 \d+\.\d+$",
                     out, re.M), out  # fmt: skip


@pytest.mark.slow  # 256 generated tokens, each checked against a full-sequence call
def test_streaming_generate():
    """examples/streaming_generate.py: flat cache memory through 8x the window, every
    step equal to the full-sequence call on the tokens in view."""
    out = run_example("streaming_generate.py", "--window", 16, "--factor", 8)
    sizes = re.findall(r"^position +\d+: cache memory (\d+) bytes", out, re.M)
    assert len(sizes) == 8 and len(set(sizes)) == 1, out
    assert re.search(r"^every step equals the full-sequence call on the tokens in view: yes", out, re.M), out


@pytest.mark.slow  # two models, two caches, each generating twice per implementation
def test_hf_generate():
    """examples/hf_generate.py: a Mistral-shaped and a GPT-OSS-shaped transformers model
    generate eager's tokens on swa_tvm, on the dynamic and the static cache."""
    out = run_example("hf_generate.py", "--new-tokens", 24, "--window", 8)
    rows = re.findall(r"^  (dynamic|static) +cache: swa_tvm [\d.]+ s, eager [\d.]+ s for 24 tokens x 2 prompts; "
                      r"tokens (\w+)$", out, re.M)
    assert rows == [("dynamic", "identical"), ("static", "identical")] * 2, out
    assert re.search(r"^all generations identical to eager$", out, re.M), out


@pytest.mark.slow  # exports four D=64 kernels, then a process of its own
def test_export_and_load(tmp_path):
    """Exported with the compiler, served in a process where the TVM compiler cannot
    be imported, against the float64 reference."""
    out = run_example("export_and_load.py", "--out", tmp_path)
    m = re.search(r"^exported (\S+): (\d+) kernels for (\S+), CPU features", out, re.M)
    assert m and m.group(1) == str(tmp_path / "swa_attn.so") and m.group(3).startswith("llvm-"), out
    assert os.path.exists(tmp_path / "swa_attn.so") and os.path.exists(tmp_path / "swa_attn.so.json")
    assert f"loaded {m.group(2)} kernels from {tmp_path / 'swa_attn.so'}" in out, out
    errors = re.findall(r"relative error vs float64 reference (\S+)", out)
    assert len(errors) == 3 and all(float(e) < 1e-5 for e in errors), out
    assert out.rstrip().endswith("served without the TVM compiler"), out


@pytest.mark.slow
@needs_nvcc
def test_export_cuda(tmp_path):
    """A CUDA library exported without a GPU (nvcc only), its manifest's kernels listed,
    loaded here; without a GPU, a call says why it cannot run."""
    out = run_example("export_cuda.py", "--arch", "sm_80", "--head-dim", 32, "--out", tmp_path)
    lib = tmp_path / "swa_attn_sm_80.so"
    assert re.search(rf"^exported {re.escape(str(lib))} for sm_80 \(\d+ KiB\)$", out, re.M), out
    assert os.path.exists(lib) and os.path.exists(f"{lib}.json")
    kernels = re.findall(r"^  (swa_\w+): (\w+)", out, re.M)
    assert {schedule for _, schedule in kernels} == {"cuda_flash_tc", "cuda_flash_bwd_tc"}, out
    if torch.cuda.is_available():
        assert "ran on " in out, out
    else:
        assert f"loaded here: {len(kernels)} CUDA kernels registered" in out, out
        assert re.search(r"^calling one without a GPU: .*no CUDA device is present", out, re.M), out


@pytest.mark.slow
def test_demo():
    """make demo: three patterns at T=4096, each within 1e-5 of the float64 reference,
    timed next to SDPA with a mask."""
    out = run_example("demo.py", timeout=1800)
    assert re.search(r"^exported \S+swa_demo\.so \(\d+ kernels, \d+ tuned, llvm-\S+\) in \d+s$", out, re.M), out
    assert "B=1 H=8 T=4096 D=64 fp32" in out, out
    rows = re.findall(r"^(causal W=\d+.*?)\s+(\d\.\de[-+]\d+)\s+\d+\.\d\s+\d+\.\d\s+\d+\.\dx$", out, re.M)
    assert [name for name, _ in rows] == ["causal W=512", "causal W=256, dilation 2",
                                          "causal W=512 + 16 globals (own projections)"], out
    assert all(float(err) < 1e-5 for _, err in rows), out
    assert re.search(r"^done in \d+s$", out, re.M), out
