"""The attention math as TVM tensor expressions, apart from any schedule (as TVM's topi):
``forward`` (the local and global rows), ``cache`` (rows against a KV cache),
``backward`` (their gradients), and here the
dispatch from a KernelSpec to its unscheduled PrimFunc."""

from __future__ import annotations

import tvm
from tvm import te

from swa_tvm.compute.backward import BACKWARD_COMPUTES
from swa_tvm.compute.cache import CACHE_COMPUTES
from swa_tvm.compute.cache_backward import CACHE_BACKWARD_COMPUTES
from swa_tvm.compute.forward import FORWARD_COMPUTES

COMPUTES = {**FORWARD_COMPUTES, **CACHE_COMPUTES, **BACKWARD_COMPUTES, **CACHE_BACKWARD_COMPUTES}
from swa_tvm.spec import KernelSpec


def prim_func(spec: KernelSpec, shapes: dict | None = None, target_kind: str = "llvm",
              amx: bool = False) -> tvm.tirx.PrimFunc:
    """The unscheduled PrimFunc of a spec for a target kind ("llvm" or "cuda"), named by
    ``spec.name``. The kinds compute the same values; they differ in how exp is computed
    and, for the gradients, in which gathers are shared (``compute_backward``). ``amx``:
    the matrix-engine form of a local forward or window gradient, or of the KV-cache
    forward (``forward.amx_serves``)."""
    if amx:
        args = COMPUTES[spec.kind](spec, shapes, native_exp=False, amx=True)
    else:
        args = COMPUTES[spec.kind](spec, shapes, native_exp=target_kind != "llvm")
    func = te.create_prim_func(args)
    return func.with_attr("global_symbol", spec.name)


def flops(spec: KernelSpec, B: int, H: int, T: int, G: int = 0, window_entries: int | None = None) -> float:
    """Useful FLOPs, for GFLOP/s reports: 2*D per visible score and product (forward:
    QK^T and PV; dq: QK^T, dO V^T, dS K; dk/dv: those plus P^T dO, dS^T Q recomputed).
    For "local_dx" the visible scores are the E extras of every row (pass them as
    window_entries)."""
    products = {"local": 2, "global": 2, "cache": 2, "local_dq": 3, "local_dkv": 4, "local_dx": 4, "local_bwd": 5,
                "global_bwd": 5,
                "cache_dq": 3, "cache_dkv": 4, "cache_dx": 4}[spec.kind]
    if spec.is_global:
        return 2.0 * products * B * H * G * T * spec.head_dim
    w = window_entries if window_entries is not None else spec.left + spec.right + 1
    return 2.0 * products * B * H * T * w * spec.head_dim
