"""Helpers shared by the CUDA tests (test_cuda_*.py, test_gpu_tools.py), which run
without a GPU: the CUDA kernels' loops run serially on the CPU, the toolkit's absence
skips what needs nvcc."""

import re
import shutil

import pytest

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH")


def serial_on_cpu(func):
    """The CUDA-scheduled PrimFunc with its thread bindings made serial loops and its
    shared/local buffers global, compiled for the CPU. Every thread then does its part
    in turn: the same loop nest, tiles, regions and predicates the GPU runs, minus
    concurrency (barriers: test_cuda_codegen.py's
    test_fused_cuda_kernels_have_the_barriers_they_need; what the hardware does: the
    GPU check)."""
    import tvm

    text = func.script()
    text = text.replace("T.thread_binding(", "T.serial(")
    text = re.sub(r', thread="[a-zA-Z.]+"\)', ")", text)
    text = re.sub(r', scope="(shared|shared\.dyn|local|wmma\.[a-z_]+)"', "", text)
    text = text.replace("T.alloc_local(", "T.alloc_buffer(")
    assert "thread_binding" not in text and 'scope="shared' not in text
    mod = tvm.script.from_source(text)
    # Unoptimized: what is checked is the TIR's arithmetic, which LLVM's passes keep, and
    # the emulated mma kernels took ~7 s each at -O3 against ~2 s.
    return tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "opt-level": 0}))
