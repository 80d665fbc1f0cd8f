"""The fused CUDA kernels: one entry per hand-written kernel under swa_tvm.schedules.

Without a tuning record, a CUDA spec is built by the first entry of ``FUSED_KERNELS``
that applies to it (``choose``), else by the TE compute under schedules/cuda.py. Adding a
kernel means one module under schedules/ and one entry here: the build, the manifest,
the tile records and ``swa-tvm info`` all read this table.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

from swa_tvm.runtime.library import GLOBAL_BWD_WORKSPACE, GLOBAL_WORKSPACE
from swa_tvm.spec import KernelSpec

# The kinds the fused kernels serve: the full-sequence ones (the KV-cache kinds take the
# TE schedule, schedules/cuda.py).
FULL_FORWARD = ("local", "global")
FULL_BACKWARD = ("local_dq", "local_dkv", "local_dx", "global_bwd")


@dataclass(frozen=True)
class FusedKernel:
    name: str  # the schedule name manifests and tile records carry
    module: str  # swa_tvm.schedules.<module>
    builder: str  # the module's (spec, config) -> PrimFunc
    kinds: tuple[str, ...]  # the spec kinds it can serve
    description: str  # what `swa-tvm info` prints
    config_class: str  # the module's tile configuration dataclass
    # Kinds whose tiles the GPU check sweeps, so that tiles.json may hold a record.
    swept_kinds: tuple[str, ...] = ()
    # Kind -> the extra arguments the caller allocates (runtime.library.WORKSPACES).
    workspaces: dict = field(default_factory=dict)

    def schedule_module(self):
        return importlib.import_module(f"swa_tvm.schedules.{self.module}")

    def default_config(self, spec: KernelSpec):
        """The module's default tiles for ``spec``; None where it cannot serve it."""
        if spec.kind not in self.kinds:
            return None
        return self.schedule_module().default_config(spec)

    def config_type(self):
        return getattr(self.schedule_module(), self.config_class)

    def build(self, spec: KernelSpec, config=None):
        """The kernel's PrimFunc, with ``config``'s tiles or the default ones."""
        return getattr(self.schedule_module(), self.builder)(spec, config)

    def tiles(self, spec: KernelSpec, config=None) -> dict:
        """The tile configuration the kernel is built with, for the manifest."""
        return dataclasses.asdict(config or self.default_config(spec))


# In order of preference: tensor cores where the dtype allows, then CUDA cores.
FUSED_KERNELS = (
    FusedKernel(
        "cuda_flash_tc", "cuda_flash_tc", "flash_tc", FULL_FORWARD,
        "fused kernel on tensor cores (schedules/cuda_flash_tc.py)", "TCConfig",
        swept_kinds=("local",), workspaces={"global": GLOBAL_WORKSPACE},
    ),
    FusedKernel(
        "cuda_flash", "cuda_flash", "flash", FULL_FORWARD,
        "fused kernel on CUDA cores (schedules/cuda_flash.py)", "FlashConfig",
    ),
    FusedKernel(
        "cuda_flash_bwd_tc", "cuda_flash_bwd_tc", "flash_bwd_tc", FULL_BACKWARD,
        "fused gradient kernel on tensor cores (schedules/cuda_flash_bwd_tc.py)", "TCBwdConfig",
        swept_kinds=("local_dq", "local_dkv"), workspaces={"global_bwd": GLOBAL_BWD_WORKSPACE},
    ),
    FusedKernel(
        "cuda_flash_bwd", "cuda_flash_bwd", "flash_bwd", FULL_BACKWARD,
        "fused gradient kernel on CUDA cores (schedules/cuda_flash_bwd.py)", "BwdConfig",
    ),
)  # fmt: skip

BY_NAME = {k.name: k for k in FUSED_KERNELS}


def fused_kernel(name: str | None) -> FusedKernel | None:
    """The entry named ``name`` (a manifest's "schedule"); None for the TE schedules."""
    return BY_NAME.get(name)


def choose(spec: KernelSpec) -> FusedKernel | None:
    """The fused kernel a CUDA ``spec`` gets without a tuning record, or None."""
    for kernel in FUSED_KERNELS:
        if kernel.default_config(spec) is not None:
            return kernel
    return None


def swept(kind: str) -> FusedKernel | None:
    """The fused kernel whose tiles the GPU check sweeps for ``kind``, or None."""
    for kernel in FUSED_KERNELS:
        if kind in kernel.swept_kinds:
            return kernel
    return None


__all__ = ["FusedKernel", "FUSED_KERNELS", "fused_kernel", "choose", "swept"]
