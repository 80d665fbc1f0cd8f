"""What a tuning search proposes and builds, shared by the search here (``tune``) and the
batches measured elsewhere (``batch``): a kernel's design space, the builder of its
candidates, the forward-only rule of CUDA tuning, and how a candidate's inputs are filled.
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np

from tvm.s_tir import meta_schedule as ms

from swa_tvm.compiler.cuda_pack import export_module
from swa_tvm.compiler.targets import _vector_lanes, matrix_form
from swa_tvm.schedules import cpu as cpu_schedules
from swa_tvm.schedules import cuda as cuda_schedules
from swa_tvm.spec import BACKWARD_KINDS, KernelSpec
from swa_tvm.tuning.builder import PooledBuilder


def input_fills(args_info) -> list[dict]:
    """How each tensor argument ``("TENSOR", dtype, shape)`` of a kernel is filled to
    measure it, the one rule for MetaSchedule's runner (``tuning_inputs``) and the
    GPU batch runner (``measure``, from ``batch``'s annotations): floats random normal;
    the [H] int table (dilation) ones; the [B, E] int tables (extra and global
    positions) distinct and sorted below T, the longest third dim of the 4-D tensors
    (q_global's is G), so every index is in range and global rows see the sequence."""
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


def space_generator(spec: KernelSpec, tvm_target):
    """MetaSchedule's design space for ``spec``: the target's schedule with Sampled knobs.
    CUDA candidates that exceed the GPU's limits (threads, shared memory) are dropped
    before building."""
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
    path = os.path.join(tempfile.mkdtemp(prefix="swa_tvm_candidate_"), "candidate.so")
    export_module(mod, path, target or {"kind": "llvm"})
    return path


def make_builder(target: dict, cores: int, shared_library: bool = False):
    """A MetaSchedule builder for ``target`` whose workers persist across batches
    (``builder.PooledBuilder``; ``close()`` it when done). ``shared_library``:
    export .so files (for measuring with the runtime alone) instead of MetaSchedule's
    tar; CUDA candidates always are."""
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
    if any(s.kind in BACKWARD_KINDS for s in specs):
        raise ValueError("CUDA tuning covers the forward kernels only (the gradient kernels are fused, "
                         "with no search space); tune with --kernels forward")


def check_no_amx_specs(specs, target: dict) -> None:
    """The search space is the float32-product form's; a kernel the target builds in its
    matrix-engine form (AMX or AVX-512 BF16) would be tuned for records no build applies."""
    matrix = [s.name for s in specs if matrix_form(s, target) is not None]
    if matrix:
        raise ValueError(
            f"{', '.join(matrix)}: built in the matrix-engine form for {target.get('mcpu')}, which tuning does "
            "not search; leave them out, or tune for a target without it (-mattr -amx-tile,-amx-bf16,-avx512bf16)"
        )

