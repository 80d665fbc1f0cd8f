"""Eager implementation behind torch.ops.swa_tvm.*: picks the registered kernels (compiled
on first use when no library is loaded), lays out their arguments and launches them."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import torch

from swa_tvm.checks import check_inputs, check_kv_inputs, normalize_window
from swa_tvm.runtime import library
from swa_tvm.spec import (
    BACKWARD_KINDS,
    CACHE_BLOCKS,
    CACHE_KEY_BLOCK,
    CACHE_MATRIX_BLOCK,
    DEFAULT_BLOCK_Q,
    MAX_SPEC_INT,
    KernelSpec,
)


def _available(device: str) -> str:
    ks = library.REGISTRY.kernels(device)
    return ", ".join(sorted({k.spec.name for k in ks})) or "none"


def _kernel_as_written(want: KernelSpec, device: str, left: int, right: int) -> library.Kernel:
    """``_kernel(want)``, unless a loaded library holds the same pattern with the window
    the caller wrote (``want`` normalized it: a library exported for window (255, 0)
    serves T = 100, whose window is unbounded)."""
    if (left, right) != (want.left, want.right) and max(left, right) <= MAX_SPEC_INT:
        hit = library.REGISTRY.find(dataclasses.replace(want, left=left, right=right), device)
        if hit is not None:
            return hit
    return _kernel(want, device)


def _kernel(want: KernelSpec, device: str) -> library.Kernel:
    """The registered kernel for ``want``; compiled on first use when no library is
    loaded. With libraries loaded, a missing kernel is an error naming what they hold."""
    hit = library.REGISTRY.find(want, device)
    if hit is not None:
        return hit
    if library.REGISTRY.libraries:
        have = library.REGISTRY.kernels(device)
        dims = sorted({k.spec.head_dim for k in have})
        if want.head_dim not in dims:
            raise ValueError(
                f"head dim D={want.head_dim} is not served by the loaded libraries "
                f"({', '.join(library.REGISTRY.libraries)}); they have head dims {dims}"
            )
        hint = ""
        if want.kind in BACKWARD_KINDS:
            hint = "; gradients need the backward kernels: export with 'backward' in the spec"
        if want.nonfinite:
            hint += (
                "; the result held NaN or inf, so an input does, and keeping it from rows that cannot see it "
                "needs the nonfinite kernels: export with 'nonfinite' in the spec"
            )
        raise ValueError(
            f"no kernel in the loaded libraries computes {want.name} "
            f"(window ({want.left}, {want.right}), dilation up to {want.max_dilation}, extras={want.extras}, "
            f"{want.dtype}); they hold: {_available(device)}{hint}"
        )
    from swa_tvm.compiler.jit import get_or_build_kernel

    # Round the dilation bound up so nearby dilations share one compiled kernel.
    md = 1 << (want.max_dilation - 1).bit_length()
    return get_or_build_kernel(KernelSpec(**{**want.to_dict(), "max_dilation": md}), "cuda" if device == "cuda" else None)


# TVM compiles every kernel assuming each tensor's data is aligned to 64 bytes (its
# default buffer alignment; the CUDA kernels' 16-byte vector loads rely on it), which a
# contiguous view into a larger tensor need not be (x[1:] of a flat buffer): such a view
# is copied, and _launch refuses any argument that is still misaligned.
ALIGNMENT = 64


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and ALIGNMENT-byte aligned (a copy only where it is not)."""
    x = x.contiguous()
    return x if x.data_ptr() % ALIGNMENT == 0 else x.clone()


# gridDim.y and gridDim.z of a CUDA launch (x allows 2**31 - 1).
CUDA_GRID_YZ = 65535


def _check_te_cuda_grid(kern: library.Kernel, args) -> None:
    """The TE kernels' CUDA grid (schedules/cuda.py) puts heads on blockIdx.y and the
    batch on blockIdx.z, and with a side of the window unbounded, batch x heads on z and
    the query blocks on y; refuse a shape past those axes' limit by name, before the
    launch fails with a bare CUDA error. (The fused kernels use blockIdx.x alone.)"""
    if kern.device != "cuda" or kern.schedule not in ("default", "tuned"):
        return
    shapes = [a.shape for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not shapes:
        return
    B, H, T = (max(shape[i] for shape in shapes) for i in range(3))
    s = kern.spec
    split = "split the call along the batch or heads"
    limits = [("batch size B", B, split), ("number of heads H", H, split)]
    if s.left < 0 or s.right < 0:
        blocks = -(-T // s.block_q) + s.max_dilation - 1
        limits += [("B x H", B * H, split), (f"number of {s.block_q}-row query blocks", blocks, "T is too long for it")]
    for what, n, advice in limits:
        if n > CUDA_GRID_YZ:
            raise ValueError(
                f"kernel {s.name} ({kern.schedule} schedule, schedules/cuda.py): its {what} = {n} exceeds the "
                f"{CUDA_GRID_YZ} blocks a CUDA grid allows on its y and z axes; {advice}"
            )


def _launch(kern: library.Kernel, device: torch.device, *args) -> None:
    """Call a kernel. CUDA kernels run under ``device`` (a device guard: TVM launches on
    the current device) and on torch's current stream there, so they order with the
    surrounding torch work and CUDA graphs capture them."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.numel() and a.data_ptr() % ALIGNMENT:
            raise ValueError(
                f"kernel {kern.spec.name}: a {tuple(a.shape)} argument's data is not {ALIGNMENT}-byte aligned "
                "(the kernels assume it; pass it through functional._dense)"
            )
    _check_te_cuda_grid(kern, args)
    if kern.device != "cuda" or device.type != "cuda":
        kern.func(*args)
        return
    import tvm_ffi

    if kern.cuda_arch:
        major, minor = torch.cuda.get_device_capability(device)
        built = int(kern.cuda_arch[3:].rstrip("a"))
        # sm_XYa code (wgmma) runs on that arch alone, sm_XY code on it and later ones.
        if major * 10 + minor < built or (kern.cuda_arch.endswith("a") and major * 10 + minor != built):
            raise RuntimeError(
                f"kernel {kern.spec.name} of {kern.origin} was built for {kern.cuda_arch}, but {device} is "
                f"sm_{major}{minor}; export a library for it with --target 'cuda -arch=sm_{major}{minor}'"
            )
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device), tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", device.index or 0), stream):
        kern.func(*args)


def global_pieces(B: int, H: int, G: int, T: int, device: torch.device) -> int:
    """Pieces of the keys for the split-K global rows (the forward's
    ``library.GLOBAL_WORKSPACE``, the gradients' ``GLOBAL_BWD_WORKSPACE``; the kernels
    take any number): about two thread blocks per SM, a block per 64 rows (the forward's
    default tiles') and piece, and a piece no shorter than 1024 keys."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    blocks = B * H * -(-G // 64)
    return max(1, min(-(-2 * sms // blocks), -(-T // 1024)))


def _extra_positions(global_idx, num_sinks: int, B: int, device) -> Optional[torch.Tensor]:
    """[B, E] int32: global positions and sinks, each once per row, -1 = padding."""
    parts = []
    if global_idx is not None and global_idx.shape[1]:
        parts.append(global_idx.to(torch.int32))
    if num_sinks:
        parts.append(torch.arange(num_sinks, dtype=torch.int32, device=device).expand(B, num_sinks))
    if not parts:
        return None
    x = torch.cat(parts, dim=1).sort(dim=1).values
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[:, 1:] = x[:, 1:] == x[:, :-1]
    return x.masked_fill(dup, -1).contiguous()


def _local_spec(q, left, right, dil, extra, nonfinite: bool = False) -> KernelSpec:
    dtype = str(q.dtype).replace("torch.", "")
    return KernelSpec(
        "local", q.shape[3], dtype, left, right, max(1, int(dil.max())), extras=extra is not None, block_q=DEFAULT_BLOCK_Q,
        nonfinite=nonfinite,
    )


def _global_spec(q, right, nonfinite: bool = False) -> KernelSpec:
    dtype = str(q.dtype).replace("torch.", "")
    return KernelSpec("global", q.shape[3], dtype, 0, 0 if right == 0 else -1, nonfinite=nonfinite)


# The NaN rule (KernelSpec.nonfinite): a key outside a row's view adds nothing to it,
# whatever its k or v hold. On the CPU the plain kernels multiply by probabilities of 0
# and take no select per product, so a NaN there would reach rows that cannot see it;
# but it then shows in their result, as NaN. A result that holds NaN or inf is
# therefore computed again with the nonfinite kernels: one pass over it on finite data
# (about 2% of a float32 forward; docs/design.md), twice the work on non-finite data.
# CUDA kernels always guard (compute.forward.product): no host sync.
def _redo_nonfinite(device: str, *results) -> bool:
    if device != "cpu":
        return False
    for x in results:
        if x is not None and x.numel():
            if x.dtype in (torch.float16, torch.bfloat16):
                # Min and max carry NaN and inf, exactly, and need no float32 conversion of
                # each element, which made a float32 sum of a bfloat16 result slow.
                if not all(math.isfinite(float(m)) for m in torch.aminmax(x)):
                    return True
            elif not math.isfinite(float(x.sum())):  # an overflowing sum only costs a redo
                return True
    return False


# A learned sink of +inf takes the whole softmax: out = 0 and lse = +inf, the limit. The
# kernels' max-subtraction would form inf - inf = NaN, so they get this finite stand-in,
# far above any score yet safe to scale by log2(e) in float32, and lse is set after.
SINK_CAP = 3.4028234663852886e38 / 8


def _sink_or_none(sink_logits, H, acc, device):
    """Learned sinks as the kernels take them: [H] in the accumulation dtype, -inf = none,
    +inf capped (SINK_CAP)."""
    if sink_logits is not None:
        sink = sink_logits.to(acc)
        return _dense(sink.masked_fill(torch.isposinf(sink), SINK_CAP))
    return torch.full((H,), float("-inf"), dtype=acc, device=device)


def _dilation(dilation, T):
    """[H] int32 as the kernels take it: a dilation of T or more means T (no int32 wrap)."""
    return _dense(dilation.clamp(max=max(T, 1)).to(torch.int32))


def _no_rows(like: torch.Tensor, shape) -> torch.Tensor:
    """An empty tensor of ``shape`` (one extent 0) with the compact strides TVM checks
    (torch's own give the empty extent a stride as if it were 1)."""
    strides, n = [], 1
    for extent in reversed(shape):
        strides.insert(0, n)
        n *= extent
    return torch.empty_strided(shape, strides, dtype=like.dtype, device=like.device)


def _put_rows(x, idx, rows, accumulate=False):
    """x[b, :, idx[b, j]] = rows[b, :, j] (+= with ``accumulate``, repeats summed), in
    place, for x [B, H, T, ...] and rows [B, H, J, ...]. torch's CPU scatter_ with an
    expanded index takes the whole tensor's time for a bfloat16 tensor (8 ms for 16 rows
    of [1, 8, 16384, 64]: tools/experiments/row_writes.py); index_put_ on a
    [B, T, H, ...] view touches the J rows alone."""
    b = torch.arange(x.shape[0], device=x.device)[:, None].expand(idx.shape)
    x.transpose(1, 2).index_put_((b, idx.long()), rows.transpose(1, 2), accumulate=accumulate)


def _global_rows(x, gi):
    """Rows global_idx of x [B, H, T, ...] -> [B, H, G, ...]."""
    idx = gi[:, None, :].expand(x.shape[0], x.shape[1], gi.shape[1])
    if x.dim() == 4:
        idx = idx[..., None].expand(*idx.shape, x.shape[3])
    return torch.gather(x, 2, idx)


def attention_forward(
    q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right
):
    """Eager implementation behind ``torch.ops.swa_tvm.attention``: (out, lse)."""
    check_inputs(
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right,
        values=True,
    )
    args = (q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right)
    out, lse = _forward(*args, nonfinite=False)
    if _redo_nonfinite(q.device.type, out):
        out, lse = _forward(*args, nonfinite=True)
    return out, lse


def _forward(
    q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right, *, nonfinite
):
    B, H, T, D = q.shape
    device = q.device.type
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    written = left, right
    left, right = normalize_window(left, right, T)
    q, k, v = _dense(q), _dense(k), _dense(v)
    dil = _dilation(dilation, T)
    sink = _sink_or_none(sink_logits, H, acc, q.device)
    extra = _extra_positions(global_idx, num_sinks, B, q.device)
    spec = _local_spec(q, left, right, dil, extra, nonfinite)
    kern = _kernel_as_written(spec, device, *written)
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=acc, device=q.device)
    args = [q, k, v, dil] + ([extra] if extra is not None else []) + [sink, float(scale), out, lse]
    _launch(kern, q.device, *args)

    G = global_idx.shape[1] if global_idx is not None else 0
    if G:
        gkern = _kernel(_global_spec(q, right, nonfinite), device)
        gi = global_idx.long()
        qg = _dense(q_global) if q_global is not None else _global_rows(q, gi)
        kg = _dense(k_global) if k_global is not None else k
        vg = _dense(v_global) if v_global is not None else v
        gout = torch.empty(B, H, G, D, dtype=q.dtype, device=q.device)
        glse = torch.empty(B, H, G, dtype=acc, device=q.device)
        workspace = []
        if gkern.workspace == library.GLOBAL_WORKSPACE:  # split-K (torch's allocator orders it by stream)
            S = global_pieces(B, H, G, T, q.device)
            workspace = [torch.empty(B, H, S, G, D, device=q.device), torch.empty(B, H, S, G, device=q.device)]
        _launch(gkern, q.device, qg, kg, vg, _dense(global_idx), sink, float(scale), gout, glse, *workspace)
        _put_rows(out, gi, gout)
        _put_rows(lse, gi, glse)
    if sink_logits is not None:
        lse.masked_fill_(torch.isposinf(sink_logits).view(1, H, 1), float("inf"))
    return out, lse


# Elements of dout (and of out) per piece of a 16-bit row statistic on the CPU: the
# pieces' float32 copies stay in cache. Whole-tensor copies made the statistic of a
# bfloat16 T=16384 backward ~6x slower, all of it memory traffic
# (python -m tools.experiments.backward_breakdown).
DELTA_PIECE = 1 << 17


def _row_delta(dout, out, dlse, acc):
    """delta_i = dout_i . out_i - dlse_i: the one row statistic every gradient kernel
    needs, in the accumulation dtype. einsum makes it a batched matrix product (4x
    faster on the CPU than (dout * out).sum(-1), which also writes a [B, H, T, D]
    temporary); 16-bit rows on the CPU go piece by piece (DELTA_PIECE)."""
    if dout.dtype == acc and out.dtype == acc or dout.device.type != "cpu":
        delta = torch.einsum("bhtd,bhtd->bht", dout.to(acc), out.to(acc))
    else:
        D = dout.shape[-1]
        rows_d, rows_o = dout.reshape(-1, D), out.reshape(-1, D)
        delta = torch.empty(rows_d.shape[0], dtype=acc, device=dout.device)
        step = max(1, DELTA_PIECE // max(D, 1))
        for i in range(0, rows_d.shape[0], step):
            torch.linalg.vecdot(rows_d[i:i + step].to(acc), rows_o[i:i + step].to(acc), out=delta[i:i + step])
        delta = delta.view(dout.shape[:-1])
    return delta if dlse is None else delta - dlse.to(acc)


def _sink_gradient(sink_logits, lse, delta, q):
    """d loss / d sink_logits [H], or an empty tensor without them:
    d lse_i / d sink_h = exp(sink_h - lse_i), and d out_i / d sink_h = -exp(sink_h - lse_i) out_i.
    A +inf sink (lse = +inf) takes all of it: exp(inf - inf) is NaN, the limit is 1."""
    if sink_logits is None:
        return q.new_empty(0)
    sink = sink_logits.to(lse.dtype).view(1, -1, 1)
    p_sink = torch.where(torch.isposinf(sink), 1.0, torch.exp(sink - lse))
    return -(p_sink * delta).sum((0, 2)).to(sink_logits.dtype)


def _group_sum(x, Hkv):
    """[B, H, ...] per query head -> [B, H_kv, ...]: the gradient of a GQA group's k/v."""
    B, H = x.shape[:2]
    return x if H == Hkv else x.view(B, Hkv, H // Hkv, *x.shape[2:]).sum(2)


# The five-product CPU backward (kind "local_bwd", schedules/cpu_flash_bwd.py) is one task
# per (batch, head); the TE gradient kernels split every head into query blocks. So the
# fused kernel runs where the (batch, head) pairs fill at least this share of the threads'
# waves: at B=1, H=8, T=16384 on 2 threads it took about 0.6x the TE kernels' time
# (tools/experiments/fused_backward_probe.py), so a wave at 3/4 still wins.
FUSED_BACKWARD_MIN_OCCUPANCY = 0.75


@functools.lru_cache(maxsize=1)
def _host_engine() -> str | None:
    """The bfloat16 engine of the kernels compiled here on first use (``compiler.targets.
    matrix_engine`` of the host target): "amx", "bf16_dot" or None."""
    # Importing targets loads no TVM; host_target asks LLVM, needed only where a flag is set.
    from swa_tvm.compiler.targets import AMX_FEATURES, BF16_DOT_FEATURES, host_target, matrix_engine

    if not (AMX_FEATURES.keys() | BF16_DOT_FEATURES.keys()) & library.host_cpu_flags():
        return None  # neither engine
    return matrix_engine(host_target())


def _fused_backward_kernel(fwd: KernelSpec, device: str, written, pairs: int) -> library.Kernel | None:
    """The "local_bwd" kernel for the gradients of ``fwd``, or None where the TE kernels
    run: not a CPU call, a case it does not serve (``KernelSpec.fused_backward``),
    a compile here on a CPU with a bfloat16 engine where ``compute.forward.
    fused_backward_runs`` says no (the TE kernels, in their matrix-engine form; export
    leaves the fused kernel out of such a library alike), too few (batch, head) pairs
    for the threads, or loaded libraries without it (exported before it existed, without
    'backward', or for such a case on a CPU with a bfloat16 engine). A loaded library may hold it for the window as written
    (``_kernel_as_written``)."""
    if device != "cpu":
        return None
    as_written = dataclasses.replace(fwd, left=written[0], right=written[1])
    wants = [s for s in dict.fromkeys((as_written, fwd))
             if min(s.left, s.right) >= 0 and max(s.left, s.right) <= MAX_SPEC_INT and s.fused_backward]
    if not wants:
        return None
    if not library.REGISTRY.libraries and _host_engine() is not None:
        from swa_tvm.compute.forward import fused_backward_runs  # compiles here anyway: no library loaded

        if not fused_backward_runs(dataclasses.replace(fwd, kind="local_bwd"), _host_engine()):
            return None
    threads = max(1, library.tvm_pool_threads())
    waves = -(-pairs // threads)
    if pairs / (waves * threads) < FUSED_BACKWARD_MIN_OCCUPANCY:
        return None
    if library.REGISTRY.libraries:
        for want in wants:
            hit = library.REGISTRY.find(dataclasses.replace(want, kind="local_bwd"), device)
            if hit is not None:
                return hit
        return None
    if not fwd.fused_backward:  # a compile serves the normalized window only
        return None
    return _kernel(dataclasses.replace(fwd, kind="local_bwd"), device)


def attention_backward(
    dout, dlse, q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right, out, lse
):
    """Eager implementation behind ``torch.ops.swa_tvm.attention_backward``.

    Returns (dq, dk, dv, dq_global, dk_global, dv_global, dsink_logits); the gradient
    of an input that was not given is an empty tensor. ``dlse`` (the gradient flowing
    into the returned lse) may be None.
    """
    args = (dout, dlse, q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale,
            left, right, out, lse)
    grads = _backward(*args, nonfinite=False)
    if _redo_nonfinite(q.device.type, *grads[:6]):
        grads = _backward(*args, nonfinite=True)
    return grads


def _backward(
    dout, dlse, q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right, out,
    lse, *, nonfinite
):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    device = q.device.type
    acc = lse.dtype
    written = left, right
    left, right = normalize_window(left, right, T)
    q, k, v, dout = _dense(q), _dense(k), _dense(v), _dense(dout)
    dil = _dilation(dilation, T)
    delta = _row_delta(dout, out, dlse, acc)
    lse = _dense(lse)
    # Distinct empty tensors: a custom op's outputs may not alias each other.
    none = lambda: q.new_empty(0)  # noqa: E731
    dsink = _sink_gradient(sink_logits, lse, delta, q)

    G = global_idx.shape[1] if global_idx is not None else 0
    lse_l, delta_l = lse, delta
    if G:
        gi = global_idx.long()
        dout_g = _global_rows(dout, gi)
        lse_g = _global_rows(lse, gi)
        delta_g = _global_rows(delta, gi)
        # Global rows are the global kernel's: the local kernels see them with lse = +inf,
        # so every one of their probabilities is exactly 0 and so is each term p * (...)
        # they add (dout stays as it is: zeroing it would copy [B, H, T, D] for nothing).
        lse_l, delta_l = lse.clone(), delta.clone()
        _put_rows(lse_l, gi, torch.full_like(lse_g, float("inf")))
        _put_rows(delta_l, gi, torch.zeros_like(lse_g))

    extra = _extra_positions(global_idx, num_sinks, B, q.device)
    fwd = _local_spec(q, left, right, dil, extra, nonfinite)
    common = [q, k, v, dil] + ([extra] if extra is not None else []) + [dout, _dense(lse_l), _dense(delta_l), float(scale)]
    dq = torch.empty_like(q)
    fused = _fused_backward_kernel(fwd, device, written, B * H)
    # Key gradients per query head come in the accumulation dtype: a GQA group and the
    # extra and global terms are summed before the one rounding to k's dtype. The
    # matrix-engine form rounds its own sums per query head (a GQA group then sums
    # bfloat16 terms, as FlashAttention's interface does, and the extra keys' and
    # global rows' terms are added in bfloat16): no float32 [B, H, T, D] pass.
    rounds_own = fused is not None and fused.schedule in library.MATRIX_SCHEDULES
    dk = torch.empty(B, H, T, D, dtype=k.dtype if rounds_own else acc, device=q.device)
    dv = torch.empty_like(dk)
    if extra is not None:
        E = extra.shape[1]
        dkx = torch.empty(B, H, E, D, dtype=acc, device=q.device)
        dvx = torch.empty_like(dkx)
    # The fused kernel with extra keys also takes the global rows where they attend to k
    # and v themselves (not to k_global / v_global): their dk/dv terms join the window's
    # in its key blocks, and it returns their dq (global_bwd's work).
    fold_globals = fused is not None and G > 0 and k_global is None and v_global is None
    if fused is not None:  # also the extra keys' dk and dv (local_dx's)
        # dq in the accumulation dtype, where the kernel sums it in place (not its
        # matrix-engine form, which rounds its own sums to q's dtype once).
        dq32 = dq if dq.dtype == acc or rounds_own else torch.empty(B, H, T, D, dtype=acc, device=q.device)
        rows = []
        if fold_globals:
            qg = _dense(q_global) if q_global is not None else _global_rows(q, gi)
            rows = [qg, _dense(global_idx), dout_g, _dense(lse_g), _dense(delta_g)]
        elif extra is not None:  # no global rows for it
            rows = [_no_rows(q, (B, H, 0, D)), _no_rows(extra, (B, 0)), _no_rows(q, (B, H, 0, D)),
                    _no_rows(lse, (B, H, 0)), _no_rows(lse, (B, H, 0))]
        if extra is not None:
            dqg32 = torch.empty(B, H, G, D, dtype=acc, device=q.device) if fold_globals else _no_rows(dkx, (B, H, 0, D))
        _launch(fused, q.device, *common, *rows, dq32, dk, dv, *((dkx, dvx, dqg32) if extra is not None else ()))
        if fold_globals and q_global is None:
            _put_rows(dq32, gi, dqg32.to(dq32.dtype), accumulate=True)
        if dq32 is not dq:
            dq.copy_(dq32)
    else:
        for kind, outs in (("local_dq", (dq,)), ("local_dkv", (dk, dv))) + (
                (("local_dx", (dkx, dvx)),) if extra is not None else ()):
            _launch(_kernel_as_written(dataclasses.replace(fwd, kind=kind), device, *written), q.device, *common, *outs)
    if extra is not None:
        # Padding entries (-1) have zero gradient; send them to row 0 harmlessly.
        xi = extra.long().clamp_min(0)
        _put_rows(dk, xi, dkx.to(dk.dtype), accumulate=True)
        _put_rows(dv, xi, dvx.to(dv.dtype), accumulate=True)
    dk, dv = _group_sum(dk, Hkv), _group_sum(dv, Hkv)

    dqg, dkg, dvg = none(), none(), none()
    if fold_globals:
        if q_global is not None:
            dqg = dqg32.to(q_global.dtype)
    elif G:
        gkern = _kernel(_global_spec(q, right, nonfinite).backward_kernels()[0], device)
        qg = _dense(q_global) if q_global is not None else _global_rows(q, gi)
        kg = _dense(k_global) if k_global is not None else k
        vg = _dense(v_global) if v_global is not None else v
        g_dq = torch.empty(B, H, G, D, dtype=q.dtype, device=q.device)
        g_dk = torch.empty(B, H, T, D, dtype=acc, device=q.device)
        g_dv = torch.empty_like(g_dk)
        workspace = []
        if gkern.workspace == library.GLOBAL_BWD_WORKSPACE:  # split-K dq (as the forward's global rows)
            S = global_pieces(B, H, G, T, q.device)
            workspace = [torch.empty(B, H, S, G, D, device=q.device)]
        _launch(gkern, q.device, qg, kg, vg, _dense(global_idx), dout_g, lse_g, delta_g, float(scale), g_dq, g_dk, g_dv,
                *workspace)
        g_dk, g_dv = _group_sum(g_dk, Hkv), _group_sum(g_dv, Hkv)
        if q_global is not None:
            dqg = g_dq
        else:
            _put_rows(dq, gi, g_dq, accumulate=True)
        if k_global is not None:
            dkg = g_dk.to(k_global.dtype)
        else:
            dk += g_dk
        if v_global is not None:
            dvg = g_dv.to(v_global.dtype)
        else:
            dv += g_dv
    return dq, dk.to(k.dtype), dv.to(v.dtype), dqg, dkg, dvg, dsink


# ----------------------------------------------------------------------------- KV cache


def cache_block_rows(rows: int) -> int:
    """Rows per block of the cache kernel (``compute.cache``) for ``rows`` = T_q x the
    GQA group: the smallest of ``CACHE_BLOCKS`` that holds them (a decode step's few
    rows do not fill 16 mostly with padding), else the largest."""
    return next((b for b in CACHE_BLOCKS if rows <= b), CACHE_BLOCKS[-1])


def _cache_side(name: str, side: int, span: int) -> int:
    """A window side as a cache kernel spec names it: as given up to MAX_SPEC_INT (so
    a library's kernel for window 4095 serves a decode at position 10), -1 beyond
    that where it spans every position."""
    if side <= MAX_SPEC_INT:
        return side
    if side >= span - 1:
        return -1
    raise ValueError(f"window_size {name} = {side} exceeds the {MAX_SPEC_INT} steps a kernel takes, and positions "
                     f"reach {span - 1}: no kernel serves it")


def cache_scan(q_pos, kv_pos, Tq: int, group: int, block: int, left: int, right: int, dmax: int):
    """(key_lo [B, NB] int32, nkeys): the key slots each block of rows scans, so that
    every slot in any of its rows' windows is among them.

    Where a batch row's valid slots hold increasing positions (a cache written in
    order: offsets, padding, unwritten tails), a block's slots are found by binary
    search on its rows' reach; elsewhere (a rolling buffer that has wrapped) the block
    scans every slot. Sinks outside the span are listed apart (``cache_sinks``)."""
    B, Tk = kv_pos.shape
    rows = Tq * group
    nb = -(-rows // block)
    device = kv_pos.device
    pos = kv_pos.to(torch.int64)
    valid = pos >= 0
    # Running max of the valid positions; -1 before the first one.
    run = torch.where(valid, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    prev = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=device), run[:, :-1]], dim=1)
    ordered = (~valid | (pos > prev)).all(dim=1)  # [B]
    first_row = torch.arange(nb, device=device, dtype=torch.int64) * block
    last_row = torch.clamp(first_row + block, max=rows) - 1
    qp0 = q_pos.to(torch.int64)[:, None]
    reach_lo = qp0 + first_row // group - (left * dmax if left >= 0 else 1 << 62)  # [B, NB]
    reach_hi = qp0 + last_row // group + (right * dmax if right >= 0 else 1 << 62)
    lo = torch.searchsorted(run, reach_lo, side="left")
    hi = torch.searchsorted(run, reach_hi, side="right")  # one past the last slot in reach
    lo = torch.where(ordered[:, None], lo, torch.zeros_like(lo))
    hi = torch.where(ordered[:, None], hi, torch.full_like(hi, Tk))
    lo = torch.minimum(lo, hi)
    nkeys = max(1, int((hi - lo).max()))
    return lo.to(torch.int32).contiguous(), nkeys


def cache_sinks(kv_pos, num_sinks: int):
    """[B, E] int32 (E >= 1): the slots holding the sink positions 0 .. num_sinks - 1,
    -1 = none (the kernel counts those inside a block's span there, once)."""
    is_sink = (kv_pos >= 0) & (kv_pos < num_sinks)
    E = max(1, int(is_sink.sum(dim=1).max()))
    order = torch.argsort((~is_sink).to(torch.int8), dim=1, stable=True)[:, :E]
    return torch.where(is_sink.gather(1, order), order, -1).to(torch.int32).contiguous()


class CachePlan(NamedTuple):
    """What a cache call's kernels get, forward and gradients alike."""

    spec: KernelSpec  # the "cache" kernel's (the forward's; its blocks are the gradients' in their plan)
    tables: list  # dilation, q_pos, kv_pos, key_lo (int32), then the sink slots if any
    scalars: list  # softcap (if any), the number of sink positions (if any), nkeys
    key_lo: torch.Tensor
    nkeys: int
    sink_slots: Optional[torch.Tensor]


def _matrix_block(spec: KernelSpec, rows: int, device: str) -> bool:
    """Whether a forward call of ``rows`` rows (T_q x the GQA group) runs in blocks of
    CACHE_MATRIX_BLOCK, the matrix-engine form's (bfloat16 on AMX or AVX-512 BF16): a CPU
    call of that many rows at least, where loaded libraries hold that kernel (export
    keeps it only in that form), or, compiling here, where the host has an engine."""
    if device != "cpu" or rows < CACHE_MATRIX_BLOCK or spec.dtype != "bfloat16" or spec.nonfinite:
        return False
    big = dataclasses.replace(spec, block_q=CACHE_MATRIX_BLOCK)
    if library.REGISTRY.libraries:
        return library.REGISTRY.find(big, device) is not None
    from swa_tvm.compute.forward import amx_serves  # compiles here anyway: no library loaded

    return amx_serves(big) and _host_engine() is not None


def _cache_plan(q, k, dilation, q_pos, kv_pos, num_sinks, softcap, left, right, nonfinite,
                forward: bool = False) -> CachePlan:
    """``forward``: the plan of a forward call, whose rows may take the matrix-engine
    form's larger blocks (``_matrix_block``); the gradient kernels keep float32 products
    and ``cache_block_rows``."""
    H, Tq, D = q.shape[1], q.shape[2], q.shape[3]
    q_pos32, kv_pos32 = _dense(q_pos.to(torch.int32)), _dense(kv_pos.to(torch.int32))
    span = max(int(q_pos32.max()) + Tq, int(kv_pos32.max()) + 1)
    left, right = _cache_side("left", left, span), _cache_side("right", right, span)
    dil = _dilation(dilation, span)
    dmax = int(dil.max())
    group = H // k.shape[1]
    S = min(num_sinks, span)
    spec = KernelSpec(
        "cache", D, str(q.dtype).replace("torch.", ""), left, right, 1 if dmax == 1 else 2, extras=S > 0,
        block_q=cache_block_rows(Tq * group), nonfinite=nonfinite, softcap=softcap > 0,
    )
    if forward and _matrix_block(spec, Tq * group, q.device.type):
        spec = dataclasses.replace(spec, block_q=CACHE_MATRIX_BLOCK)
    block = spec.block_q
    key_lo, nkeys = cache_scan(q_pos32, kv_pos32, Tq, group, block, left, right, dmax)
    slots = cache_sinks(kv_pos32, S) if S else None
    tables = [dil, q_pos32, kv_pos32, key_lo] + ([slots] if S else [])
    scalars = ([float(softcap)] if softcap > 0 else []) + ([S] if S else []) + [nkeys]
    return CachePlan(spec, tables, scalars, key_lo, nkeys, slots)


def attention_kv_forward(q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left, right):
    """Eager implementation behind ``torch.ops.swa_tvm.attention_kv``: (out, lse)."""
    check_kv_inputs(q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left, right, values=True)
    args = (q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left, right)
    out, lse = _kv_forward(*args, nonfinite=False)
    if _redo_nonfinite(q.device.type, out):
        out, lse = _kv_forward(*args, nonfinite=True)
    return out, lse


def _kv_forward(q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left, right, *, nonfinite):
    B, H, Tq, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    plan = _cache_plan(q, k, dilation, q_pos, kv_pos, num_sinks, softcap, left, right, nonfinite, forward=True)
    kern = _kernel(plan.spec, q.device.type)
    q, k, v = _dense(q), _dense(k), _dense(v)
    sink = _sink_or_none(sink_logits, H, acc, q.device)
    out = torch.empty(B, H, Tq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Tq, dtype=acc, device=q.device)
    _launch(kern, q.device, q, k, v, *plan.tables, sink, float(scale), *plan.scalars, out, lse)
    if sink_logits is not None:
        lse.masked_fill_(torch.isposinf(sink_logits).view(1, H, 1), float("inf"))
    return out, lse


def cache_row_blocks(key_lo: torch.Tensor, nkeys: int, Tk: int):
    """(row_lo [B, NKB] int32, nblocks): for each block of CACHE_KEY_BLOCK slots, the
    first row block whose span meets it and how many blocks each key block takes, for
    the dk/dv kernel (``compute.cache_backward.cache_dkv``). Spans start at
    non-decreasing slots along the row blocks (``cache_scan``), so the blocks meeting a
    key block are consecutive."""
    KB = CACHE_KEY_BLOCK
    lo = key_lo.to(torch.int64).contiguous()
    nb = lo.shape[1]
    starts = torch.arange(0, Tk, KB, device=lo.device, dtype=torch.int64).expand(lo.shape[0], -1).contiguous()
    first = torch.searchsorted((lo + nkeys).contiguous(), starts, side="right")
    last = torch.searchsorted(lo, (starts + KB - 1).contiguous(), side="right") - 1
    count = (last - first + 1).clamp(min=0)
    return first.clamp(max=nb - 1).to(torch.int32).contiguous(), max(1, int(count.max()))


def attention_kv_backward(dout, dlse, q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left,
                          right, out, lse):
    """Eager implementation behind ``torch.ops.swa_tvm.attention_kv_backward``: (dq, dk,
    dv, dsink_logits), an empty tensor for sink_logits when not given."""
    args = (dout, dlse, q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left, right, out, lse)
    grads = _kv_backward(*args, nonfinite=False)
    if _redo_nonfinite(q.device.type, *grads[:3]):
        grads = _kv_backward(*args, nonfinite=True)
    return grads


def _kv_backward(dout, dlse, q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left, right, out,
                 lse, *, nonfinite):
    B, D, Tk = q.shape[0], q.shape[3], k.shape[2]
    acc = lse.dtype
    plan = _cache_plan(q, k, dilation, q_pos, kv_pos, num_sinks, softcap, left, right, nonfinite)
    kernels = {s.kind: _kernel(s, q.device.type) for s in plan.spec.backward_kernels()}
    q, k, v, dout = _dense(q), _dense(k), _dense(v), _dense(dout)
    lse, delta = _dense(lse), _dense(_row_delta(dout, out, dlse, acc))
    common = [q, k, v, *plan.tables, dout, lse, delta]
    scalars = plan.scalars
    dq = torch.empty_like(q)
    _launch(kernels["cache_dq"], q.device, *common, float(scale), *scalars, dq)
    row_lo, nblocks = cache_row_blocks(plan.key_lo, plan.nkeys, Tk)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty_like(dk)
    _launch(kernels["cache_dkv"], q.device, *common, row_lo, float(scale), *scalars, nblocks, dk, dv)
    slots = plan.sink_slots
    if slots is not None:
        E = slots.shape[1]
        dkx = torch.empty(B, k.shape[1], E, D, dtype=acc, device=q.device)
        dvx = torch.empty_like(dkx)
        _launch(kernels["cache_dx"], q.device, *common, float(scale), *scalars, dkx, dvx)
        # Entries -1 have zero gradient; send them to slot 0 harmlessly.
        xi = slots.long().clamp_min(0)
        _put_rows(dk, xi, dkx, accumulate=True)
        _put_rows(dv, xi, dvx, accumulate=True)
    return dq, dk.to(k.dtype), dv.to(v.dtype), _sink_gradient(sink_logits, lse, delta, q)
