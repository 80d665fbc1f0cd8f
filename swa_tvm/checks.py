"""Argument checks shared by the public API, the ops' fakes and the eager implementation:
bad input gets a TypeError/ValueError naming the argument."""

from __future__ import annotations

import math
import numbers

import torch


# Devices and dtypes the kernels serve; float16/bfloat16 accumulate in float32.
SERVED_DEVICES = ("cpu", "cuda")


SERVED_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}


# The largest finite float32: a float16/bfloat16/float32 kernel takes ``scale`` in float32.
FLOAT32_MAX = 3.4028234663852886e38
# Positions reach the kernels as int32.
INT32_MAX = (1 << 31) - 1


def normalize_window(left: int, right: int, n: int) -> tuple[int, int]:
    """(left, right) with a side of at least n - 1 steps made unbounded (-1): over n
    positions it reaches every one either way, and a kernel spec then never carries a
    constant beyond the sequence (a side of 2**31 once allocated a band of that width)."""
    reach = max(n - 1, 0)
    return (-1 if left >= reach else left), (-1 if right >= reach else right)


def normalize_dilation(d: int, n: int) -> int:
    """A dilation of at least n reaches only the query itself from any of n positions,
    as a dilation of n does: kernels never see a larger one (their work grows with it)."""
    return min(d, max(n, 1))


def check_window_and_sinks(left: int, right: int, num_sinks: int, T: int | None) -> None:
    """The integer arguments' ranges, for the public functions (before the ops' int64
    schemas see ints of any size) and for the ops themselves. ``T`` None (a KV cache,
    where sink positions the cache does not hold are simply absent): no upper bound on
    num_sinks."""
    for name, x in (("left", left), ("right", right)):
        if x < -1:
            raise ValueError(f"window_size {name} must be >= -1 (-1 means unbounded), got {x}")
    if T is None and num_sinks < 0:
        raise ValueError(f"num_sinks must be >= 0, got {num_sinks}")
    if T is not None and not 0 <= num_sinks <= T:
        raise ValueError(f"num_sinks must be in [0, T={T}], got {num_sinks}")


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


def _check_sink_logits(sink_logits, H: int) -> None:
    if sink_logits is not None:
        _check_tensor("sink_logits", sink_logits, 1)
        if sink_logits.shape[0] != H:
            raise ValueError(f"sink_logits must have shape [H]=[{H}], got {tuple(sink_logits.shape)}")
        if not sink_logits.dtype.is_floating_point:
            raise TypeError(f"sink_logits must be a floating tensor, got {sink_logits.dtype}")


def _check_heads_dtypes_scale(q, k, v, scale) -> None:
    """q [B, H, T_q, D] against k, v [B, H_kv, T_k, D] (batch and D already matched):
    non-empty, GQA groups whole, one dtype, a scale the kernels take."""
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if min(q.shape) < 1 or min(k.shape) < 1:
        raise ValueError(f"q and k must have non-empty dimensions, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    H, Hkv = q.shape[1], k.shape[1]
    if H % Hkv:
        raise ValueError(f"the number of query heads H={H} must be a multiple of k/v heads H_kv={Hkv}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, but q has {q.dtype}; all must match")
    # Types of the ints (and of scale) are checked by the op schema and the public function.
    # A positive scale: the GPU kernels take each row's max of the unscaled scores.
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if q.dtype != torch.float64 and scale > FLOAT32_MAX:
        raise ValueError(
            f"scale must be at most {FLOAT32_MAX:.4g} (float32's largest) for {q.dtype} inputs, whose scores "
            f"are float32; got {scale}"
        )


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
    _check_heads_dtypes_scale(q, k, v, scale)
    check_window_and_sinks(left, right, num_sinks, T)

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

    _check_sink_logits(sink_logits, H)

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


def check_kv_inputs(q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, softcap, scale, left, right, *,
                    values: bool) -> None:
    """The checks of ``torch.ops.swa_tvm.attention_kv`` (attention against a KV cache):
    TypeError/ValueError naming the argument. ``values=False`` checks shapes only."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 4)
    B, H, Tq, D = q.shape
    Bk, Hkv, Tk, Dk = k.shape
    if (Bk, Dk) != (B, D):
        raise ValueError(f"k/v must be [B={B}, H_kv, T_k, D={D}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    _check_heads_dtypes_scale(q, k, v, scale)
    if not (softcap == 0 or (math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"softcap must be a positive finite number (0 or None: no cap), got {softcap}")
    check_window_and_sinks(left, right, num_sinks, None)
    for name, x, shape in (("dilation", dilation, (H,)), ("q_positions", q_pos, (B,)), ("kv_positions", kv_pos, (B, Tk))):
        _check_tensor(name, x, len(shape))
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(x.shape)}")
    _check_sink_logits(sink_logits, H)
    named = [("q", q), ("k", k), ("v", v), ("dilation", dilation), ("q_positions", q_pos), ("kv_positions", kv_pos)]
    named += [("sink_logits", sink_logits)] if sink_logits is not None else []
    if q.device.type == "meta":
        return
    for n, x in named:
        if x.device != q.device:
            raise ValueError(f"{n} is on {x.device} but q is on {q.device}; all tensors must share a device")
    if q.device.type not in SERVED_DEVICES:
        raise ValueError(f"q is on {q.device}, but this build of swa_tvm has kernels only for {', '.join(SERVED_DEVICES)}")
    if q.dtype not in SERVED_DTYPES[q.device.type]:
        ok = ", ".join(str(d) for d in SERVED_DTYPES[q.device.type])
        raise TypeError(f"q has dtype {q.dtype}; on {q.device.type} the kernels support {ok}")
    if not values:
        return
    if bool((dilation < 1).any()):
        raise ValueError(f"dilation must be >= 1 for every head, got {dilation.tolist()}")
    # Positions are int32 in the kernels: the last query row's too.
    if bool((q_pos < 0).any()) or int(q_pos.max()) + Tq - 1 > INT32_MAX:
        raise ValueError(f"q_positions must lie in [0, 2**31 - T_q], got {q_pos.tolist()}")
    if bool(((kv_pos < -1) | (kv_pos > INT32_MAX)).any()):
        raise ValueError("kv_positions must be positions >= 0, or -1 for a slot that holds no key, within int32")
