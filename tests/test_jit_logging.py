"""A first-use compile says what it compiles and where it caches it, through logging:
the first of a process as a warning, later ones as info, a cache hit not at all."""

import os
import subprocess
import sys


SCRIPT = r"""
import logging, sys, torch, swa_tvm
from swa_tvm.reference import sliding_window_attention_ref as ref
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stdout)
q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
for window in ((3, 0), (2, 1), (3, 0)):
    out = swa_tvm.sliding_window_attention(q, k, v, window_size=window)
    assert torch.allclose(out, ref(q, k, v, window_size=window)[0], atol=1e-10)
print("DONE")
"""


def test_first_use_compile_is_announced_once_per_kernel(tmp_path):
    env = dict(os.environ, SWA_TVM_CACHE=str(tmp_path / "cache"))
    run = lambda: subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,  # noqa: E731
                                 timeout=900)
    cold = run()
    assert cold.returncode == 0, cold.stderr
    said = [line for line in cold.stdout.splitlines() if "on first use" in line]
    assert len(said) == 2, cold.stdout  # two kernels; the third call reuses the first
    assert said[0].startswith("WARNING swa_tvm compiling kernel swa_local_d8_f64_l3_r0")
    assert said[1].startswith("INFO swa_tvm compiling kernel swa_local_d8_f64_l2_r1")
    assert all(str(tmp_path / "cache") in line for line in said)
    warm = run()  # a new process: both kernels come from the disk cache, silently
    assert warm.returncode == 0, warm.stderr
    assert "on first use" not in warm.stdout and "DONE" in warm.stdout
