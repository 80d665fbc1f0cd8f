"""swa_tvm: sliding-window attention kernels generated with Apache TVM, called from PyTorch.

Public API::

    swa_tvm.sliding_window_attention(q, k, v, window_size=(left, right), ...)
    swa_tvm.AttentionSpec / KernelSpec       # what a library serves
    swa_tvm.export_library(specs, path)      # compile + write .so and manifest
    swa_tvm.load_library(path)               # check manifest, register kernels
"""

__version__ = "0.1.0"

from .functional import sliding_window_attention  # noqa: E402
from .library import LibraryError, load_library  # noqa: E402
from .spec import AttentionSpec, KernelSpec  # noqa: E402
from . import ops  # noqa: E402,F401  (registers torch.ops.swa_tvm.*)


def export_library(specs, path, target=None):
    """Compile specs (KernelSpec or AttentionSpec) into ``path`` plus ``path + '.json'``."""
    from .build import export_library as _export

    kernels = []
    for s in specs:
        kernels.extend(s.kernels() if isinstance(s, AttentionSpec) else [s])
    return _export(kernels, path, target)


__all__ = [
    "sliding_window_attention",
    "load_library",
    "export_library",
    "AttentionSpec",
    "KernelSpec",
    "LibraryError",
    "__version__",
]
