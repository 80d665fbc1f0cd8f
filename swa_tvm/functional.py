"""Public API: argument checks, kernel choice and the call, in one place."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from . import library
from .spec import BACKWARD_KINDS, DEFAULT_BLOCK_Q, KernelSpec

# Devices and dtypes the kernels serve; float16/bfloat16 accumulate in float32.
SERVED_DEVICES = ("cpu", "cuda")
SERVED_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}


def _as_int(name: str, x) -> int:
    # Any integral number (numpy's included) is taken; bool is refused, as True
    # meaning 1 is almost always a mistake in a window or count.
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    return int(x)


def _check_tensor(name: str, x, rank: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")


def check_inputs(
    q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right, *,
    values: bool
) -> None:
    """Raise TypeError/ValueError, naming the argument, for any input the kernels would
    not compute exactly. ``values=False`` checks shapes only (for fake tensors)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 4)
    B, H, T, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Bk, Hkv, Tk, Dk = k.shape
    if (Bk, Tk, Dk) != (B, T, D):
        raise ValueError(
            f"k/v must be [B={B}, H_kv, T={T}, D={D}] to match q {tuple(q.shape)}, got {tuple(k.shape)}",
        )
    if T < 1 or D < 1 or H < 1 or Hkv < 1 or B < 1:
        raise ValueError(f"q and k must have non-empty dimensions, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if H % Hkv:
        raise ValueError(f"the number of query heads H={H} must be a multiple of k/v heads H_kv={Hkv}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, but q has {q.dtype}; all must match")
    # Types of the ints (and of scale) are checked by the op schema and the public function.
    # A positive scale: the GPU kernels take each row's max of the unscaled scores.
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    for name, x in (("left", left), ("right", right)):
        if x < -1:
            raise ValueError(f"window_size {name} must be >= -1 (-1 means unbounded), got {x}")

    # dilation: per-head int tensor (the public function turns an int into one).
    if not isinstance(dilation, torch.Tensor):
        raise TypeError(f"dilation must be an int or an integer tensor of shape [H], got {type(dilation).__name__}")
    if dilation.dtype.is_floating_point or dilation.dtype == torch.bool or dilation.is_complex():
        raise TypeError(f"dilation tensor must have an integer dtype (int32), got {dilation.dtype}")
    if dilation.shape != (H,):
        raise ValueError(f"dilation tensor must have shape [H]=[{H}], got {tuple(dilation.shape)}")

    G = 0
    if global_idx is not None:
        _check_tensor("global_idx", global_idx, 2)
        if global_idx.dtype != torch.int32:
            raise TypeError(f"global_idx must be an int32 tensor, got {global_idx.dtype}")
        if global_idx.shape[0] != B:
            raise ValueError(f"global_idx must be [B={B}, G], got {tuple(global_idx.shape)}")
        G = global_idx.shape[1]
    for name, x, shape in (
        ("q_global", q_global, (B, H, G, D)),
        ("k_global", k_global, (B, Hkv, T, D)),
        ("v_global", v_global, (B, Hkv, T, D)),
    ):
        if x is None:
            continue
        if global_idx is None:
            raise ValueError(f"{name} was given without global_idx; pass global_idx [B, G] int32 positions")
        _check_tensor(name, x, 4)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, but q has {q.dtype}; all must match")

    if num_sinks < 0 or num_sinks > T:
        raise ValueError(f"num_sinks must be in [0, T={T}], got {num_sinks}")
    if sink_logits is not None:
        _check_tensor("sink_logits", sink_logits, 1)
        if sink_logits.shape[0] != H:
            raise ValueError(f"sink_logits must have shape [H]=[{H}], got {tuple(sink_logits.shape)}")
        if not sink_logits.dtype.is_floating_point:
            raise TypeError(f"sink_logits must be a floating tensor, got {sink_logits.dtype}")

    named = [("q", q), ("k", k), ("v", v), ("dilation", dilation), ("global_idx", global_idx)]
    named += [("q_global", q_global), ("k_global", k_global), ("v_global", v_global), ("sink_logits", sink_logits)]
    named = [(n, x) for n, x in named if x is not None]
    if q.device.type != "meta":
        for n, x in named:
            if x.device != q.device:
                raise ValueError(f"{n} is on {x.device} but q is on {q.device}; all tensors must share a device")
        if q.device.type not in SERVED_DEVICES:
            raise ValueError(
                f"q is on {q.device}, but this build of swa_tvm has kernels only for {', '.join(SERVED_DEVICES)} tensors",
            )
        if q.dtype not in SERVED_DTYPES[q.device.type]:
            ok = ", ".join(str(d) for d in SERVED_DTYPES[q.device.type])
            raise TypeError(f"q has dtype {q.dtype}; on {q.device.type} the kernels support {ok}")

    if not values or q.device.type == "meta":
        return
    if bool((dilation < 1).any()):
        raise ValueError(f"dilation must be >= 1 for every head, got {dilation.tolist()}")
    if global_idx is not None and G:
        if bool(((global_idx < 0) | (global_idx >= T)).any()):
            bad = global_idx[(global_idx < 0) | (global_idx >= T)][0].item()
            raise ValueError(f"global_idx values must lie in [0, T={T}), found {bad}")
        srt = global_idx.sort(dim=1).values
        if G > 1 and bool((srt[:, 1:] == srt[:, :-1]).any()):
            row = int((srt[:, 1:] == srt[:, :-1]).any(dim=1).nonzero()[0])
            raise ValueError(f"global_idx row {row} repeats a position; each row's positions must be distinct")


def _available(device: str) -> str:
    ks = library.REGISTRY.kernels(device)
    return ", ".join(sorted({k.spec.name for k in ks})) or "none"


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
        raise ValueError(
            f"no kernel in the loaded libraries computes {want.name} "
            f"(window ({want.left}, {want.right}), dilation up to {want.max_dilation}, extras={want.extras}, "
            f"{want.dtype}); they hold: {_available(device)}{hint}"
        )
    from .build import get_or_build_kernel

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


def _local_spec(q, left, right, dil, extra) -> KernelSpec:
    dtype = str(q.dtype).replace("torch.", "")
    return KernelSpec(
        "local", q.shape[3], dtype, left, right, max(1, int(dil.max())), extras=extra is not None, block_q=DEFAULT_BLOCK_Q
    )


def _global_spec(q, right) -> KernelSpec:
    return KernelSpec("global", q.shape[3], str(q.dtype).replace("torch.", ""), 0, 0 if right == 0 else -1)


def _sink_or_none(sink_logits, H, acc, device):
    """Learned sinks as the kernels take them: [H] in the accumulation dtype, -inf = none."""
    if sink_logits is not None:
        return _dense(sink_logits.to(acc))
    return torch.full((H,), float("-inf"), dtype=acc, device=device)


def _global_rows(x, gi):
    """Rows global_idx of x [B, H, T, ...] -> [B, H, G, ...]."""
    idx = gi[:, None, :].expand(x.shape[0], x.shape[1], gi.shape[1])
    if x.dim() == 4:
        idx = idx[..., None].expand(*idx.shape, x.shape[3])
    return torch.gather(x, 2, idx), idx


def attention_forward(
    q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right
):
    """Eager implementation behind ``torch.ops.swa_tvm.attention``: (out, lse)."""
    check_inputs(
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right,
        values=True,
    )
    B, H, T, D = q.shape
    device = q.device.type
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = _dense(q), _dense(k), _dense(v)
    dil = _dense(dilation.to(torch.int32))
    sink = _sink_or_none(sink_logits, H, acc, q.device)
    extra = _extra_positions(global_idx, num_sinks, B, q.device)
    kern = _kernel(_local_spec(q, left, right, dil, extra), device)
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=acc, device=q.device)
    args = [q, k, v, dil] + ([extra] if extra is not None else []) + [sink, float(scale), out, lse]
    _launch(kern, q.device, *args)

    G = global_idx.shape[1] if global_idx is not None else 0
    if G:
        gkern = _kernel(_global_spec(q, right), device)
        gi = global_idx.long()
        qg = _dense(q_global) if q_global is not None else _global_rows(q, gi)[0]
        kg = _dense(k_global) if k_global is not None else k
        vg = _dense(v_global) if v_global is not None else v
        gout = torch.empty(B, H, G, D, dtype=q.dtype, device=q.device)
        glse = torch.empty(B, H, G, dtype=acc, device=q.device)
        workspace = []
        if gkern.workspace == library.GLOBAL_WORKSPACE:  # split-K (torch's allocator orders it by stream)
            S = global_pieces(B, H, G, T, q.device)
            workspace = [torch.empty(B, H, S, G, D, device=q.device), torch.empty(B, H, S, G, device=q.device)]
        _launch(gkern, q.device, qg, kg, vg, _dense(global_idx), sink, float(scale), gout, glse, *workspace)
        out.scatter_(2, gi[:, None, :, None].expand(B, H, G, D), gout)
        lse.scatter_(2, gi[:, None, :].expand(B, H, G), glse)
    return out, lse


def _group_sum(x, Hkv):
    """[B, H, ...] per query head -> [B, H_kv, ...]: the gradient of a GQA group's k/v."""
    B, H = x.shape[:2]
    return x if H == Hkv else x.view(B, Hkv, H // Hkv, *x.shape[2:]).sum(2)


def attention_backward(
    dout, dlse, q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right, out, lse
):
    """Eager implementation behind ``torch.ops.swa_tvm.attention_backward``.

    Returns (dq, dk, dv, dq_global, dk_global, dv_global, dsink_logits); the gradient
    of an input that was not given is an empty tensor. ``dlse`` (the gradient flowing
    into the returned lse) may be None.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    device = q.device.type
    acc = lse.dtype
    q, k, v, dout = _dense(q), _dense(k), _dense(v), _dense(dout)
    dil = _dense(dilation.to(torch.int32))
    # delta_i = dout_i . out_i - dlse_i: the one row statistic every gradient kernel needs.
    # einsum makes it a batched matrix product (4x faster on the CPU than (dout * out).sum(-1),
    # which also writes a [B, H, T, D] temporary).
    delta = torch.einsum("bhtd,bhtd->bht", dout.to(acc), out.to(acc))
    if dlse is not None:
        delta = delta - dlse.to(acc)
    lse = _dense(lse)
    # Distinct empty tensors: a custom op's outputs may not alias each other.
    none = lambda: q.new_empty(0)  # noqa: E731
    dsink = none()
    if sink_logits is not None:
        # d lse_i / d sink_h = exp(sink_h - lse_i), and d out_i / d sink_h = -exp(sink_h - lse_i) out_i.
        p_sink = torch.exp(sink_logits.to(acc).view(1, H, 1) - lse)
        dsink = -(p_sink * delta).sum((0, 2)).to(sink_logits.dtype)

    G = global_idx.shape[1] if global_idx is not None else 0
    lse_l, delta_l = lse, delta
    if G:
        gi = global_idx.long()
        dout_g, idx4 = _global_rows(dout, gi)
        lse_g, idx3 = _global_rows(lse, gi)
        delta_g = _global_rows(delta, gi)[0]
        # Global rows are the global kernel's: the local kernels see them with lse = +inf,
        # so every one of their probabilities is exactly 0 and so is each term p * (...)
        # they add (dout stays as it is: zeroing it would copy [B, H, T, D] for nothing).
        lse_l = lse.scatter(2, idx3, float("inf"))
        delta_l = delta.scatter(2, idx3, 0.0)

    extra = _extra_positions(global_idx, num_sinks, B, q.device)
    fwd = _local_spec(q, left, right, dil, extra)
    kernels = {s.kind: _kernel(s, device) for s in fwd.backward_kernels()}
    common = [q, k, v, dil] + ([extra] if extra is not None else []) + [dout, _dense(lse_l), _dense(delta_l), float(scale)]
    dq = torch.empty_like(q)
    _launch(kernels["local_dq"], q.device, *common, dq)
    # Key gradients per query head come in the accumulation dtype: a GQA group and the
    # extra and global terms are summed before the one rounding to k's dtype.
    dk = torch.empty(B, H, T, D, dtype=acc, device=q.device)
    dv = torch.empty_like(dk)
    _launch(kernels["local_dkv"], q.device, *common, dk, dv)
    if extra is not None:
        E = extra.shape[1]
        dkx = torch.empty(B, H, E, D, dtype=acc, device=q.device)
        dvx = torch.empty_like(dkx)
        _launch(kernels["local_dx"], q.device, *common, dkx, dvx)
        # Padding entries (-1) have zero gradient; send them to row 0 harmlessly.
        xi = extra.long().clamp_min(0)[:, None, :, None].expand(B, H, E, D)
        dk.scatter_add_(2, xi, dkx)
        dv.scatter_add_(2, xi, dvx)
    dk, dv = _group_sum(dk, Hkv), _group_sum(dv, Hkv)

    dqg, dkg, dvg = none(), none(), none()
    if G:
        gkern = _kernel(_global_spec(q, right).backward_kernels()[0], device)
        qg = _dense(q_global) if q_global is not None else _global_rows(q, gi)[0]
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
            dq.scatter_add_(2, idx4, g_dq)
        if k_global is not None:
            dkg = g_dk.to(k_global.dtype)
        else:
            dk += g_dk
        if v_global is not None:
            dvg = g_dv.to(v_global.dtype)
        else:
            dv += g_dv
    return dq, dk.to(k.dtype), dv.to(v.dtype), dqg, dkg, dvg, dsink


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window_size: tuple[int, int] = (-1, -1),
    dilation: int | torch.Tensor = 1,
    global_idx: Optional[torch.Tensor] = None,
    q_global: Optional[torch.Tensor] = None,
    k_global: Optional[torch.Tensor] = None,
    v_global: Optional[torch.Tensor] = None,
    num_sinks: int = 0,
    sink_logits: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Banded, dilated and global-augmented attention.

    Shapes: ``q`` [B, H, T, D]; ``k``, ``v`` [B, H_kv, T, D] with H % H_kv == 0 (GQA/MQA:
    query head h reads k/v head h // (H // H_kv)). Returns ``out`` [B, H, T, D] in q's
    dtype, or ``(out, lse)`` with ``lse`` [B, H, T] float32 (float64 for float64 inputs).
    Dtypes: float16, bfloat16, float32 and float64 on the CPU; float16, bfloat16 and
    float32 on CUDA. float16/bfloat16 scores, softmax and products accumulate in float32
    and ``out`` is rounded once; every float input shares q's dtype, except
    ``sink_logits``, which may be any float dtype.

    Which keys row i (query position i) sees, for head h:

    * **Window.** ``window_size=(left, right)``: query i attends to key
      j = i + s*d for every integer s with -left <= s <= right and 0 <= j < T, where d
      is head h's dilation. ``left`` and ``right`` count dilated steps on each side,
      excluding the query itself; -1 means unbounded (FlashAttention's convention).
      Mistral's window W (keys t-W < s <= t) is ``(W-1, 0)``; Longformer's symmetric w
      is ``(w//2, w//2)``. ``right == 0`` means causal, and causality then holds for
      every term below as well: no row ever sees j > i.
    * **Dilation.** ``dilation`` is an int, or an integer tensor of shape [H] giving each
      head its own dilation (Longformer mixes local and dilated heads). Every d >= 1.
    * **Global tokens.** ``global_idx`` is an int32 tensor [B, G] of distinct positions
      in [0, T). A global row attends to every key j allowed by causality. It uses
      ``q_global`` [B, H, G, D] (row g of it for position global_idx[b, g]) as its query
      and ``k_global`` / ``v_global`` [B, H_kv, T, D] for all keys and values, each when
      given, and the ordinary q / k / v otherwise. Every other row also attends to the
      global positions, through the ordinary k / v (Longformer's reference
      implementation). A position in both the window and the global set counts once.
    * **Sinks.** ``num_sinks`` = S (0 <= S <= T) pins positions 0..S-1 as visible to every
      row (StreamingLLM), subject to causality, counted once. ``sink_logits`` [H] is a
      learned per-head sink (GPT-OSS): exp(sink_logits[h]) is added to the softmax
      denominator of every row of head h and carries no value.
    * **Scale.** Scores are (q . k) * scale, with scale > 0 (1/sqrt(D) by default).
    * **Log-sum-exp.** ``lse[b, h, i]`` = log of row i's softmax denominator: the
      log-sum-exp of its visible scaled scores, with the sink term exp(sink_logits[h])
      included when given, so out[i] = sum_j exp(score_ij - lse_i) * v_j exactly. Use it
      to merge partial results.

    **Gradients.** Differentiable in q, k, v, q_global, k_global, v_global and
    sink_logits, through both out and lse (GQA: dk/dv summed over each group);
    dilation, global_idx and num_sinks are integer inputs without gradient. The
    backward saves only the inputs, out and lse, and costs O(T * (W + G)) like the
    forward. Each gradient comes in its input's dtype; float16/bfloat16 gradients are
    accumulated in float32 and rounded once (a GQA group's heads and the global and sink
    terms are summed first).

    Inputs may be non-contiguous, or contiguous views at any offset (the kernels get
    a 64-byte aligned copy of those, as of non-contiguous ones). Bad input raises
    TypeError or ValueError naming the argument. When a library is loaded (:func:`swa_tvm.load_library`) its kernels are
    used and a pattern it lacks is an error; with none loaded, the needed kernel is
    compiled on first use and cached in memory and on disk.
    """
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a (left, right) pair, got {window_size!r}")
    left = _as_int("window_size left", window_size[0])
    right = _as_int("window_size right", window_size[1])
    num_sinks = _as_int("num_sinks", num_sinks)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _check_tensor("q", q, 4)
    H, D = q.shape[1], q.shape[3]
    if not isinstance(dilation, torch.Tensor):
        if isinstance(dilation, bool) or not isinstance(dilation, numbers.Integral):
            raise TypeError(f"dilation must be an int or an integer tensor of shape [H], got {type(dilation).__name__}")
        dilation = int(dilation)
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        dilation = torch.full((H,), dilation, dtype=torch.int32, device=q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    from . import ops  # noqa: F401 - registers torch.ops.swa_tvm

    out, lse = torch.ops.swa_tvm.attention(
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, float(scale), left, right
    )
    return (out, lse) if return_lse else out
