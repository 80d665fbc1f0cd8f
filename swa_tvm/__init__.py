"""swa_tvm: sliding-window attention kernels generated with Apache TVM, called from PyTorch.

Public API::

    swa_tvm.sliding_window_attention(q, k, v, window_size=(left, right), ...)
    swa_tvm.attention_with_kv_cache(q, k_cache, v_cache, ...)   # decode, chunked prefill, padding
    swa_tvm.RollingKVCache(...)              # a layer's rolling-buffer KV cache
    swa_tvm.AttentionSpec / KernelSpec       # what a library serves
    swa_tvm.export_library(specs, path)      # compile (tuned records applied) + .so and manifest
    swa_tvm.load_library(path)               # check manifest, register kernels
"""

from swa_tvm import ops  # noqa: F401  (registers torch.ops.swa_tvm.*)
from swa_tvm.cache import RollingKVCache
from swa_tvm.functional import attention_with_kv_cache, sliding_window_attention, sliding_window_attention_varlen
from swa_tvm.runtime.library import LibraryError, load_library
from swa_tvm.spec import AttentionSpec, KernelSpec
from swa_tvm.version import __version__


def export_library(specs, path, target=None, logs="default", warn_untuned=True):
    """Compile specs (KernelSpec or AttentionSpec) into ``path`` plus ``path + '.json'``.

    Each kernel uses its best tuning record for the target's CPU class from ``logs``
    (default: $SWA_TVM_TUNING_LOGS or the package's ``swa_tvm/tuning_logs/``; None: no records),
    else the default schedule, warning (UntunedKernelWarning) with the kernel's name.
    """
    from swa_tvm.compiler.build import export_library as _export

    kernels = []
    for s in specs:
        kernels.extend(s.kernels() if isinstance(s, AttentionSpec) else [s])
    return _export(kernels, path, target, logs=logs, warn_untuned=warn_untuned)


__all__ = [
    "sliding_window_attention",
    "attention_with_kv_cache",
    "sliding_window_attention_varlen",
    "RollingKVCache",
    "load_library",
    "export_library",
    "AttentionSpec",
    "KernelSpec",
    "LibraryError",
    "__version__",
]
