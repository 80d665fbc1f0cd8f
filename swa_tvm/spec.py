"""Kernel specs: what one compiled library entry computes.

A user describes an attention *pattern* with :class:`AttentionSpec`; it expands into the
one or two :class:`KernelSpec` entries that the TE definitions in :mod:`swa_tvm.compute`
turn into PrimFuncs. Everything here is static (compile time). Sequence length, batch,
head counts, the number of global tokens and the per-head dilation values are runtime.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
# Half-precision kernels (fp32 accumulation, fp32 lse) are built for CUDA targets only.
HALF_DTYPES = ("float16", "bfloat16")
DTYPE_TAGS = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


def accum_dtype(dtype: str) -> str:
    """Scores, softmax statistics and lse are kept in float64 for float64 kernels and in
    float32 for every other dtype."""
    return "float64" if dtype == "float64" else "float32"

FORWARD_KINDS = ("local", "global", "cache")
# "local_bwd": dq, dk and dv in one kernel (schedules/cpu_flash_bwd.py), on CPUs, for the
# cases KernelSpec.fused_backward names; the others keep "local_dq" and "local_dkv".
BACKWARD_KINDS = ("local_dq", "local_dkv", "local_dx", "local_bwd", "global_bwd", "cache_dq", "cache_dkv", "cache_dx")
# Hand-written kernels without a TE compute: no search space, no tuning records, and
# built for CPU targets only.
CPU_ONLY_KINDS = ("local_bwd",)
KINDS = FORWARD_KINDS + BACKWARD_KINDS

# Rows per query block in the blocked ("chunks") formulation. The window's keys for one
# block form a contiguous band of block_q + left + right keys, so the score stage is a
# small dense matmul per block that tiling rules can work with; the waste is
# block_q / (left + right + 1) of the useful work.
DEFAULT_BLOCK_Q = 32


# Rows per block of the KV-cache kernels (query positions x a GQA group's heads): the
# caller (swa_tvm.eager.cache_block_rows) takes the smallest that holds a call's rows.
CACHE_BLOCKS = (4, 8, 16)
# Rows per block of the KV-cache forward's matrix-engine form (bfloat16 on AMX or AVX-512
# BF16: ``compute.forward.amx_serves``), for calls of at least that many rows (a prefill
# chunk): its products' register tiles need 64 rows to hold 16 sums.
CACHE_MATRIX_BLOCK = 64
# Key slots per block of the KV-cache dk/dv kernel (the caller lays out its row ranges).
CACHE_KEY_BLOCK = 32

# The largest window side, dilation bound or block a kernel spec takes.
MAX_SPEC_INT = 1 << 24


def _check_window_side(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < -1:
        raise ValueError(f"{name} must be >= -1 (-1 means unbounded), got {value}")


@dataclass(frozen=True)
class KernelSpec:
    """One PrimFunc of a library.

    kind "local": every row attends to its dilated window, plus (with ``extras``) a runtime
    list of extra key positions (global tokens and sinks) that it does not already see.
    kind "global": global rows attend to every key allowed by causality.
    kind "cache": query rows at absolute positions against key slots that carry their
    own positions (a KV cache: offsets, padding, rolling buffers); ``block_q`` is the
    rows of a block (query positions x the heads of a GQA group), ``extras`` the sinks
    (:mod:`swa_tvm.compute.cache`).
    The backward kinds (see :mod:`swa_tvm.compute_backward`) are the gradients of these:
    "local_dq", "local_dkv" and "local_dx" (extras' key gradients) of a local kernel,
    "global_bwd" of a global one.
    """

    kind: str  # one of KINDS
    head_dim: int
    dtype: str = "float32"
    left: int = 0
    right: int = 0
    max_dilation: int = 1
    extras: bool = False
    block_q: int = DEFAULT_BLOCK_Q
    # The variant for inputs that hold NaN or inf: every product of a probability (or a
    # score gradient) selects 0 where that weight is 0, so a key outside a row's view
    # adds nothing to it whatever it holds, and NaN scores propagate. The selects cost
    # 1.3-1.8x on the CPU, so calls with finite inputs take the plain variant.
    nonfinite: bool = False
    # Scores pass through softcap * tanh(score / softcap) before masking (Gemma 2); the
    # cap itself is a runtime argument. Kind "cache" only.
    softcap: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _check_window_side("left", self.left)
        _check_window_side("right", self.right)
        if self.max_dilation < 1:
            raise ValueError(f"max_dilation must be >= 1, got {self.max_dilation}")
        if self.block_q < 1:
            raise ValueError(f"block_q must be >= 1, got {self.block_q}")
        if self.softcap and not self.kind.startswith("cache"):
            raise ValueError(f"softcap is served by the cache kernels only, not by kind {self.kind!r}")
        if self.kind == "local_bwd" and not self.fused_backward:
            raise ValueError("kind 'local_bwd' serves float32, bfloat16 and float16, a bounded window and finite "
                             f"inputs; got dtype {self.dtype}, window ({self.left}, {self.right}), "
                             f"nonfinite={self.nonfinite}")
        # Bounds that keep every constant a kernel is built with far inside int32 and every
        # band allocatable: a side reaching the whole sequence is -1, and the op turns any
        # longer one into -1 (checks.normalize_window), and dilations beyond T into T.
        for name, value in (("left", self.left), ("right", self.right), ("max_dilation", self.max_dilation),
                            ("block_q", self.block_q)):
            if value > MAX_SPEC_INT:
                raise ValueError(
                    f"{name} must be at most {MAX_SPEC_INT} in a kernel spec, got {value}; "
                    "a window side that spans the sequence is -1 (unbounded)"
                )

    @property
    def causal(self) -> bool:
        return self.right == 0

    @property
    def is_global(self) -> bool:
        return self.kind in ("global", "global_bwd")

    @property
    def name(self) -> str:
        """The function's symbol in the compiled module; unique per spec."""
        dt = DTYPE_TAGS[self.dtype]
        if self.is_global:
            nf = "_nf" if self.nonfinite else ""
            return f"swa_{self.kind}_d{self.head_dim}_{dt}_{'causal' if self.causal else 'full'}{nf}"
        side = lambda x: "inf" if x < 0 else str(x)  # noqa: E731
        if self.kind.startswith("cache"):
            return (
                f"swa_{self.kind}_d{self.head_dim}_{dt}_l{side(self.left)}_r{side(self.right)}_md{self.max_dilation}"
                f"_x{int(self.extras)}_br{self.block_q}"
            ) + ("_sc" if self.softcap else "") + ("_nf" if self.nonfinite else "")
        return (
            f"swa_{self.kind}_d{self.head_dim}_{dt}_l{side(self.left)}_r{side(self.right)}"
            f"_md{self.max_dilation}_x{int(self.extras)}_bq{self.block_q}"
        ) + ("_nf" if self.nonfinite else "")

    @property
    def engine_only(self) -> bool:
        """Whether only the CPU matrix-engine form of this kernel is ever called: the
        KV-cache forward's blocks of CACHE_MATRIX_BLOCK rows (swa_tvm.eager takes them
        where that form serves). Export leaves it out for targets without an engine, and
        tuning skips it (that form has no search)."""
        return self.kind == "cache" and self.block_q == CACHE_MATRIX_BLOCK

    @property
    def fused_backward(self) -> bool:
        """Whether the five-product CPU kernel (kind "local_bwd") computes this local
        kernel's gradients: float32, bfloat16 or float16, a bounded window (any dilation,
        extra keys or not), finite inputs."""
        return (self.kind in ("local", "local_bwd") and self.dtype != "float64"
                and self.left >= 0 and self.right >= 0 and not self.nonfinite)

    def backward_kernels(self) -> list["KernelSpec"]:
        """The gradient kernels of this forward kernel: on a CPU, "local_bwd" replaces
        "local_dq" and "local_dkv" where it serves (``fused_backward``) and a call has
        enough (batch, head) pairs for the threads (``swa_tvm.eager``)."""
        if self.kind == "global":
            return [dataclasses.replace(self, kind="global_bwd")]
        if self.kind == "cache":
            kinds = ("cache_dq", "cache_dkv") + (("cache_dx",) if self.extras else ())
            return [dataclasses.replace(self, kind=k) for k in kinds]
        if self.kind != "local":
            raise ValueError(f"{self.name} is not a forward kernel")
        kinds = ("local_dq", "local_dkv") + (("local_dx",) if self.extras else ()) + (
            ("local_bwd",) if self.fused_backward else ())
        return [dataclasses.replace(self, kind=k) for k in kinds]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KernelSpec":
        return cls(**d)


@dataclass(frozen=True)
class AttentionSpec:
    """A pattern a library should serve.

    ``window=(left, right)`` and ``head_dim`` are exact. ``max_dilation`` bounds the
    runtime dilation (uniform or per head). ``globals`` adds global tokens (global rows
    with optional separate projections); ``sinks`` adds StreamingLLM sink positions.
    Learned sink logits need no flag: every kernel takes them. ``backward`` adds the
    gradient kernels, for training. ``nonfinite`` adds the kernels calls take when an
    input holds NaN or inf (KernelSpec.nonfinite), beside the plain ones. ``kvcache``
    adds the kernels of ``attention_with_kv_cache`` (kind "cache", one per block of
    rows in ``CACHE_BLOCKS``: decode steps, chunked prefill; in bfloat16 one more of
    CACHE_MATRIX_BLOCK rows, for a CPU's matrix engine), and ``softcap`` makes
    those cap their scores.
    """

    head_dim: int
    window: tuple[int, int]
    max_dilation: int = 1
    globals: bool = False
    sinks: bool = False
    dtype: str = "float32"
    block_q: int = DEFAULT_BLOCK_Q
    backward: bool = False
    nonfinite: bool = False
    kvcache: bool = False
    softcap: bool = False

    def __post_init__(self) -> None:
        if self.softcap and not self.kvcache:
            raise ValueError("softcap is served by the KV-cache kernels: add kvcache to the spec")
        if not (isinstance(self.window, tuple) and len(self.window) == 2):
            raise ValueError(f"window must be a (left, right) tuple, got {self.window!r}")
        self.kernels()  # each KernelSpec checks its fields: a bad spec fails here, by name

    def kernels(self) -> list[KernelSpec]:
        left, right = self.window
        out = [
            KernelSpec(
                "local",
                self.head_dim,
                self.dtype,
                left,
                right,
                self.max_dilation,
                self.globals or self.sinks,
                self.block_q,
            )
        ]
        if self.globals:
            # Only causality matters to a global row; left/right are normalised so that
            # every causal pattern shares one global kernel.
            out.append(KernelSpec("global", self.head_dim, self.dtype, 0, 0 if right == 0 else -1))
        if self.kvcache:
            cache = KernelSpec("cache", self.head_dim, self.dtype, left, right, 1 if self.max_dilation == 1 else 2,
                               self.sinks, CACHE_BLOCKS[0], softcap=self.softcap)
            out += [dataclasses.replace(cache, block_q=rows) for rows in CACHE_BLOCKS]
        if self.backward:
            out += [b for f in out for b in f.backward_kernels()]
        if self.nonfinite:
            out += [dataclasses.replace(k, nonfinite=True) for k in out if k.kind != "local_bwd"]
        if self.kvcache and self.dtype == "bfloat16":
            # The forward of calls of CACHE_MATRIX_BLOCK rows or more, on a CPU's matrix
            # engine (``engine_only``); its gradients, and calls with non-finite inputs,
            # run on the smaller blocks.
            out.append(dataclasses.replace(cache, block_q=CACHE_MATRIX_BLOCK))
        return out

    @classmethod
    def parse(cls, text: str) -> "AttentionSpec":
        """Parse ``head_dim=64,window=255:0,dilation=2,globals,sinks,backward,nonfinite,kvcache,softcap,dtype=float32``.
        Each field at most once; flags bare or ``=1/0, true/false, yes/no``."""
        aliases = {"d": "head_dim", "w": "window", "dilation": "max_dilation"}
        fields: dict = {}

        def integer(key: str, val: str) -> int:
            try:
                return int(val)
            except ValueError:
                raise ValueError(f"spec {text!r}: {key} must be an integer, got {val!r}") from None

        for part in filter(None, (p.strip() for p in text.split(","))):
            key, has_val, val = part.partition("=")
            key, val = key.strip(), val.strip()
            name = aliases.get(key, key)
            if name in fields:
                raise ValueError(f"spec {text!r}: {key} given twice")
            if name in ("head_dim", "max_dilation", "block_q"):
                fields[name] = integer(key, val)
            elif name == "window":
                m = re.fullmatch(r"(-?\d+)\s*:\s*(-?\d+)", val)
                if not m:
                    raise ValueError(f"spec {text!r}: window must look like LEFT:RIGHT, got {val!r}")
                fields["window"] = (int(m.group(1)), int(m.group(2)))
            elif name in ("globals", "sinks", "backward", "nonfinite", "kvcache", "softcap"):
                flag = val.lower() if has_val else "1"
                if flag not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(f"spec {text!r}: {key} is a flag (bare, or =1/0, true/false, yes/no), got {val!r}")
                fields[name] = flag in ("1", "true", "yes")
            elif name == "dtype":
                fields["dtype"] = val
            else:
                raise ValueError(f"spec {text!r}: unknown field {key!r}")
        for need in ("head_dim", "window"):
            if need not in fields:
                raise ValueError(f"spec {text!r}: missing {need}=")
        try:
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"spec {text!r}: {e}") from None
