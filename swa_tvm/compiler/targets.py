"""Targets: the host CPU class, CUDA architectures, and the key (``llvm-znver3``,
``cuda-sm_90``) that names a target class in the tuning logs, caches and benchmarks."""

from __future__ import annotations

import functools
import json
import os
import platform
import re

from swa_tvm.runtime.library import X86_FEATURES, cuda_device_arch

# tvm is imported inside the functions that use it: tiles and kernels import this module
# on the GPU machine, which has no TVM (tools/gpu_check.py).


def host_target(num_cores: int | None = None) -> dict:
    """The llvm target of this machine: detected -mcpu, all usable cores, and -mattr where
    LLVM's -mcpu and the CPU disagree on a bfloat16 engine (``_engine_mattr``)."""
    import tvm

    cores = num_cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    target = {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": int(cores or 1)}
    mattr = _engine_mattr(target)
    if mattr:
        target["mattr"] = mattr
    return target


# The CPU flags of each bfloat16 engine and LLVM's names for them (the manifest lists
# the flags): AMX with bfloat16, and AVX-512 BF16's dot products.
AMX_FEATURES = {"amx_tile": "amx-tile", "amx_bf16": "amx-bf16"}
BF16_DOT_FEATURES = {"avx512_bf16": "avx512bf16"}


def _engine_mattr(target: dict) -> list[str]:
    """``+feature`` for each engine's features this CPU has (/proc/cpuinfo) that LLVM's
    -mcpu for it lacks, ``-feature`` for each it implies that the CPU does not expose. A
    virtual machine may report an Intel CPU with AMX under an older model, which LLVM
    then names (rocketlake) without AMX or AVX-512 BF16; and an OS or hypervisor may hide
    a feature from a CPU whose name implies it. AVX-512 BF16 is added only to a -mcpu
    with AVX-512."""
    import tvm

    from swa_tvm.runtime.library import host_cpu_flags

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target(target))}
    flags = host_cpu_flags()
    mattr = []
    for features in (AMX_FEATURES, BF16_DOT_FEATURES):
        if set(features) <= flags:
            if features is AMX_FEATURES or "avx512f" in have:
                mattr += [f"+{name}" for name in features.values() if name not in have]
        else:
            mattr += [f"-{name}" for name in features.values() if name in have]
    return mattr


# sm_90a: Hopper's arch-specific target, whose code (wgmma) runs on sm_90 GPUs alone.
CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")


def local_cuda_arch() -> str | None:
    """sm_XY of this machine's first CUDA device (via torch), or None without one."""
    return cuda_device_arch(0)


def _cuda_target(arch: str | None) -> dict:
    arch = arch or local_cuda_arch()
    if arch is None:
        raise ValueError(
            "target 'cuda': this machine has no CUDA device to take the architecture from; "
            f"name it, e.g. 'cuda -arch=sm_90' (one of {', '.join(CUDA_ARCHS)})"
        )
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"CUDA arch {arch!r}: expected sm_XY such as sm_80 or sm_90")
    return {"kind": "cuda", "arch": arch}


def normalize_target(target: str | dict | None) -> dict:
    """Accept None/"llvm" (host CPU), "cuda" (this machine's GPU), "cuda -arch=sm_90" or
    "cuda:sm_90", a JSON string, or a dict; return a plain dict."""
    if target is None or target in ("llvm", "cpu", "host"):
        return host_target()
    if isinstance(target, str):
        text = target.strip()
        m = re.fullmatch(r"cuda(?:\s+-arch=(\S+)|:(\S+))?", text)
        if m:
            return _cuda_target(m.group(1) or m.group(2))
        if text.startswith("{"):
            return normalize_target(json.loads(text))
        raise ValueError(
            f"target {target!r}: use 'llvm' for this CPU, 'cuda -arch=sm_90' for a GPU class, or a JSON dict "
            'such as {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}'
        )
    target = dict(target)
    if target.get("kind") == "cuda":
        return _cuda_target(target.get("arch"))
    if target.get("kind") != "llvm":
        raise ValueError(f"target kind {target.get('kind')!r}: swa_tvm builds for 'llvm' (CPUs) and 'cuda' only")
    if "mcpu" in target:
        _check_llvm_cpu(target)
    return target


def _check_llvm_cpu(target: dict) -> None:
    """LLVM takes an -mcpu it does not know as 'generic' with a log line and carries on,
    which would write a baseline-ISA library under the misspelled name's class."""
    from tvm.target import codegen

    triple = target.get("mtriple") or codegen.llvm_get_system_triple()
    cpu = target["mcpu"]
    if not isinstance(cpu, str) or not codegen.llvm_is_valid_cpu(cpu, triple):
        portable = " (portable x86 levels: x86-64-v2, x86-64-v3, x86-64-v4)" if triple.startswith("x86_64") else ""
        raise ValueError(
            f"target mcpu {cpu!r} is not a CPU that LLVM {codegen.llvm_version_major()} knows for {triple}; "
            f"this machine is {codegen.llvm_get_system_cpu()!r}{portable}"
        )


def target_key(target: dict) -> str:
    """The target class: tuning records and caches are never shared across classes."""
    if target.get("kind") == "llvm":
        return f"llvm-{target.get('mcpu', 'generic')}"
    return f"{target.get('kind')}-{target.get('arch', 'unknown')}"


def matrix_form(spec, target) -> str | None:
    """The engine ``spec``'s matrix-engine form is built on for ``target`` (a dict or a
    tvm Target), or None where it keeps its float32 products: "amx" on an llvm target
    whose CPU has AMX with bfloat16 (amx-tile, amx-bf16); "bf16_dot", AVX-512 BF16 dot
    products, on one that has those (avx512bf16) but no AMX. The spec must have such a
    form (``compute.forward.amx_serves``). The form follows the target class, as tuning
    records and caches do."""
    from swa_tvm.compute.forward import amx_serves

    return matrix_engine(target) if amx_serves(spec) else None


def matrix_engine(target) -> str | None:
    """The bfloat16 engine of an llvm ``target``: "amx", else "bf16_dot", else None."""
    return "amx" if has_amx(target) else "bf16_dot" if has_bf16_dot(target) else None


def uses_amx(spec, target) -> bool:
    """Whether ``spec`` is built in its matrix-engine form on AMX tiles for ``target``
    (``matrix_form``): the loader then asks the OS for tile state."""
    return matrix_form(spec, target) == "amx"


def has_amx(target) -> bool:
    """Whether an llvm ``target`` (a dict or a tvm Target) has AMX with bfloat16."""
    return set(AMX_FEATURES.values()) <= _llvm_features(target)


def has_bf16_dot(target) -> bool:
    """Whether an llvm ``target`` (a dict or a tvm Target) has AVX-512 BF16's dot product."""
    return set(BF16_DOT_FEATURES.values()) <= _llvm_features(target)


def without_amx(target: dict) -> dict:
    """An llvm ``target`` with AMX turned off and its other -mattr kept (``host_target``
    may add AVX-512 BF16 to a -mcpu that lacks it): where the CPU has AVX-512 BF16, the
    dot-product engine's target."""
    return _turned_off(target, list(AMX_FEATURES.values()))


def without_engines(target: dict) -> dict:
    """An llvm ``target`` with both bfloat16 engines (AMX, AVX-512 BF16) turned off and
    its other -mattr kept: the float32-product form's target, on any x86 machine."""
    return _turned_off(target, [*AMX_FEATURES.values(), *BF16_DOT_FEATURES.values()])


def _turned_off(target: dict, names: list[str]) -> dict:
    kept = [m for m in target.get("mattr", []) if m.lstrip("+-") not in names]
    return dict(target, mattr=kept + [f"-{name}" for name in names])


def _llvm_features(target) -> frozenset:
    kind = target.get("kind") if isinstance(target, dict) else target.kind.name
    if kind != "llvm":
        return frozenset()
    return _features(json.dumps(target, sort_keys=True) if isinstance(target, dict) else str(target))


@functools.lru_cache(maxsize=None)
def _features(target: str) -> frozenset:
    import tvm

    tvm_target = tvm.target.Target(json.loads(target) if target.startswith("{") else target)
    return frozenset(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(tvm_target))


def _vector_lanes(tvm_target) -> int:
    """fp32 lanes of the target's widest vector unit. (llvm_get_vector_width reports 512
    for znver3, which has 256-bit units, so this asks for the features instead.)"""
    import tvm

    feats = tvm.target.codegen.llvm_get_cpu_features(tvm_target)
    if "avx512f" in feats:
        return 16
    if "avx" in feats:
        return 8
    return 4


def _cpu_features(tvm_target) -> list[str]:
    import tvm

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    feats = tvm.target.codegen.llvm_get_cpu_features(tvm_target)
    return sorted(X86_FEATURES[f] for f in X86_FEATURES if f in feats)
