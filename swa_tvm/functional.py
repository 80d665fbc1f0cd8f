"""Public API: ``sliding_window_attention``, its contract, and the normalization of its
arguments before they reach ``torch.ops.swa_tvm.attention`` (swa_tvm.ops)."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from swa_tvm import ops  # noqa: F401 - registers torch.ops.swa_tvm.*
from swa_tvm.checks import (
    INT32_MAX,
    _as_int,
    _check_tensor,
    check_window_and_sinks,
    normalize_dilation,
    normalize_window,
)
from swa_tvm.spec import MAX_SPEC_INT


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
    softcap: Optional[float] = None,
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
    * **Scale.** Scores are (q . k) * scale, with scale > 0 (1/sqrt(D) by default) and,
      for all but float64 inputs, at most float32's largest value (scores are float32).
    * **Values a row cannot see.** A key contributes exp(score - lse) * v only where
      that probability is nonzero. Every key outside a row's view (beyond its window, in
      a causal row's future, padding) has probability exactly 0 and contributes nothing
      to that row, nor to its gradients, whatever its k or v hold: NaN, inf, or the
      leftovers of an unwritten cache slot. A NaN or inf that a row does see reaches it,
      as in a dense softmax.
    * **Extreme integers.** A window side of T - 1 or more is unbounded, and a dilation
      of T or more reaches only the query itself and the extra keys: any int (beyond
      int64 included) or integer tensor means what it says, with no wrap-around.
    * **Log-sum-exp.** ``lse[b, h, i]`` = log of row i's softmax denominator: the
      log-sum-exp of its visible scaled scores, with the sink term exp(sink_logits[h])
      included when given, so out[i] = sum_j exp(score_ij - lse_i) * v_j exactly. Use it
      to merge partial results. A sink of +inf takes the whole softmax: out = 0 and
      lse = +inf for its head (the limit, never NaN).
    * **Softcap.** ``softcap=c`` maps each scaled score s to c * tanh(s / c) before
      masking (Gemma 2). It runs on the KV-cache kernels (:func:`attention_with_kv_cache`
      with every key valid), gradients included, and is not served with global tokens.

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
    left, right = _window(window_size)
    num_sinks = _as_int("num_sinks", num_sinks)
    # Everything the op's schema would refuse with a bare RuntimeError (a non-tensor, an
    # int beyond int64) is refused here first, by name.
    _check_tensor("q", q, 4)
    for name, x in (("global_idx", global_idx), ("q_global", q_global), ("k_global", k_global),
                    ("v_global", v_global), ("sink_logits", sink_logits)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    H, T, D = q.shape[1], q.shape[2], q.shape[3]
    check_window_and_sinks(left, right, num_sinks, T)
    # Sides past what a kernel spec holds (and the op's int64 schema) reach every row:
    # unbounded. Shorter ones reach the op as written, so that a library exported for
    # window (255, 0) serves T = 100 (swa_tvm.eager normalizes for the kernels it builds).
    left, right = (normalize_window(x, x, T)[0] if x > MAX_SPEC_INT else x for x in (left, right))
    dilation = _dilation_tensor(dilation, H, T, q.device)
    scale = _scale(scale, D)
    if softcap is not None:
        if global_idx is not None:
            raise ValueError("softcap is not served with global tokens (global_idx); pass one or the other")
        _check_tensor("k", k, 4)
        if k.shape[2] != T:
            raise ValueError(f"k/v must have q's T={T} positions, got {tuple(k.shape)}; attention_with_kv_cache "
                             "takes a cache of another length")
        return attention_with_kv_cache(q, k, v, q_offset=0, window_size=(left, right), dilation=dilation,
                                       num_sinks=num_sinks, sink_logits=sink_logits, softcap=softcap, scale=scale,
                                       return_lse=return_lse)
    out, lse = torch.ops.swa_tvm.attention(
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right
    )
    return (out, lse) if return_lse else out


def attention_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_offset: int | torch.Tensor | None = None,
    kv_offset: int | torch.Tensor = 0,
    kv_start: int | torch.Tensor = 0,
    kv_len: int | torch.Tensor | None = None,
    kv_positions: Optional[torch.Tensor] = None,
    window_size: tuple[int, int] = (-1, -1),
    dilation: int | torch.Tensor = 1,
    num_sinks: int = 0,
    sink_logits: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Attention of query rows against a KV cache: decode steps, chunked prefill,
    left-padded batches, rolling buffers.

    Shapes: ``q`` [B, H, T_q, D]; ``k``, ``v`` [B, H_kv, T_k, D] (the cache's slots),
    H % H_kv == 0. Returns ``out`` [B, H, T_q, D], or ``(out, lse)`` as
    :func:`sliding_window_attention` does.

    **Positions.** Every query row and key slot has an absolute position, and the
    pattern is :func:`sliding_window_attention`'s on those positions: window,
    dilation, causality (``right == 0``) and sinks (positions 0 .. num_sinks - 1). So
    the result equals the matching rows of one full-sequence call over the positions
    the cache holds.

    * Query row i of batch row b is at ``q_offset[b] + i``. The default aligns the
      last query with the last valid key (bottom-right, as FlashAttention): a decode
      step's one query is the newest token.
    * Key slot j of batch row b holds position ``kv_offset[b] + j``, and is a key only
      for ``kv_start[b] <= j < kv_start[b] + kv_len[b]`` (default: every slot from
      kv_start on). Slots outside that range (left padding, an unwritten tail) are
      never attended, whatever they hold.
    * Or ``kv_positions`` [B, T_k] (or [T_k]) int gives each slot's position, -1 for
      a slot without a key: a rolling buffer's slots in any order
      (:class:`swa_tvm.RollingKVCache` passes them). It excludes kv_offset, kv_start
      and kv_len.

    Offsets, starts and lengths are ints or integer tensors of shape [B]. Positions
    count slots, not tokens: with left padding the pad slots take positions, which
    shifts nothing in a window but makes the first pads the sinks. A row whose view
    holds no key and no learned sink gets ``out`` = 0 and ``lse`` = -inf.

    **Softcap.** ``softcap=c`` maps each scaled score s to c * tanh(s / c) before
    masking (Gemma 2). Global tokens are not served here (an encoder's pattern).
    ``window_size``, ``dilation``, ``num_sinks``, ``sink_logits`` and ``scale`` are
    as in :func:`sliding_window_attention`; the NaN rule holds as there: a slot a row
    cannot see adds nothing to it.

    **Gradients** flow to q, k, v (every slot, zero for slots no row sees) and
    sink_logits, through out and lse, softcap included.
    """
    left, right = _window(window_size)
    num_sinks = _as_int("num_sinks", num_sinks)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 4)
    if sink_logits is not None and not isinstance(sink_logits, torch.Tensor):
        raise TypeError(f"sink_logits must be a torch.Tensor or None, got {type(sink_logits).__name__}")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if k.shape[0] != B:
        raise ValueError(f"k/v must have q's batch size B={B}, got k {tuple(k.shape)}")
    check_window_and_sinks(left, right, num_sinks, None)
    # Any side or dilation beyond int32 reaches past every int32 position.
    left, right = normalize_window(left, right, INT32_MAX)
    if softcap is None:
        cap = 0.0
    elif isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
    else:
        cap = float(softcap)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap must be a positive finite number, got {softcap}")
    dilation = _dilation_tensor(dilation, H, INT32_MAX, q.device)
    scale = _scale(scale, D)
    kv_pos = _kv_positions(kv_positions, kv_offset, kv_start, kv_len, B, Tk, q.device)
    q_pos = _q_positions(q_offset, kv_pos, B, Tq, q.device)
    out, lse = torch.ops.swa_tvm.attention_kv(
        q, k, v, dilation, q_pos, kv_pos, num_sinks, sink_logits, cap, scale, left, right
    )
    return (out, lse) if return_lse else out


def _window(window_size) -> tuple[int, int]:
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a (left, right) pair, got {window_size!r}")
    return _as_int("window_size left", window_size[0]), _as_int("window_size right", window_size[1])


def _dilation_tensor(dilation, H: int, n: int, device) -> torch.Tensor:
    """An int dilation as the op takes it: int32 [H], a dilation of n or more (over n
    positions) as n; a tensor is left to the op's checks."""
    if isinstance(dilation, torch.Tensor):
        return dilation
    if isinstance(dilation, bool) or not isinstance(dilation, numbers.Integral):
        raise TypeError(f"dilation must be an int or an integer tensor of shape [H], got {type(dilation).__name__}")
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    return torch.full((H,), normalize_dilation(int(dilation), n), dtype=torch.int32, device=device)


def _scale(scale, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0  # D = 0 is refused by the op's checks, by name
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    try:
        return float(scale)
    except OverflowError:  # an int beyond float's range
        raise ValueError("scale must be a positive finite number, got an int beyond float range") from None


def _checkable() -> bool:
    """Whether checks may read tensor values here: not while torch.compile traces (a
    data-dependent branch breaks its graph); the op then checks the positions it gets."""
    return not torch.compiler.is_compiling()


def _per_batch(name: str, x, B: int, device) -> torch.Tensor:
    """An int or an integer tensor [B] (or a 0-d one) as int64 [B], each >= 0."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"{name} must be an int or an integer tensor of shape [B], got dtype {x.dtype}")
        if x.dim() == 0:
            x = x.expand(B)
        if tuple(x.shape) != (B,):
            raise ValueError(f"{name} must be an int or a tensor of shape [B]=[{B}], got {tuple(x.shape)}")
        x = x.to(device=device, dtype=torch.int64)
    else:
        n = _as_int(name, x)
        if not 0 <= n <= INT32_MAX:
            raise ValueError(f"{name} must lie in [0, 2**31), got {n}")
        return torch.full((B,), n, dtype=torch.int64, device=device)
    if _checkable() and bool((x < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {x.tolist()}")
    return x


def _kv_positions(kv_positions, kv_offset, kv_start, kv_len, B: int, Tk: int, device) -> torch.Tensor:
    """[B, Tk] int32: each key slot's position, -1 = no key."""
    if kv_positions is not None:
        if not isinstance(kv_positions, torch.Tensor):
            raise TypeError(f"kv_positions must be an integer tensor [B, T_k], got {type(kv_positions).__name__}")
        if not (isinstance(kv_offset, int) and kv_offset == 0 and isinstance(kv_start, int) and kv_start == 0
                and kv_len is None):
            raise ValueError("kv_positions gives every slot's position: pass it without kv_offset, kv_start or kv_len")
        if kv_positions.dtype.is_floating_point or kv_positions.dtype == torch.bool or kv_positions.is_complex():
            raise TypeError(f"kv_positions must have an integer dtype, got {kv_positions.dtype}")
        pos = kv_positions.expand(B, Tk) if kv_positions.dim() == 1 and kv_positions.shape[0] == Tk else kv_positions
        if tuple(pos.shape) != (B, Tk):
            raise ValueError(f"kv_positions must have shape [B, T_k]=[{B}, {Tk}] or [T_k], got {tuple(kv_positions.shape)}")
        if _checkable() and bool(((pos < -1) | (pos > INT32_MAX)).any()):
            raise ValueError("kv_positions must be positions in [0, 2**31), or -1 for a slot without a key")
        return pos.to(device=device, dtype=torch.int32).contiguous()
    offset = _per_batch("kv_offset", kv_offset, B, device)
    start = _per_batch("kv_start", kv_start, B, device)
    length = Tk - start if kv_len is None else _per_batch("kv_len", kv_len, B, device)
    if _checkable() and bool((start + length > Tk).any()):
        raise ValueError(
            f"kv_start + kv_len must be at most T_k={Tk} (the cache's slots), got kv_start {start.tolist()} and "
            f"kv_len {length.tolist()}"
        )
    if _checkable() and bool((offset + Tk - 1 > INT32_MAX).any()):
        raise ValueError(f"kv_offset + T_k - 1 must lie within int32, got kv_offset {offset.tolist()}")
    j = torch.arange(Tk, device=device, dtype=torch.int64)
    valid = (j >= start[:, None]) & (j < (start + length)[:, None])
    return torch.where(valid, offset[:, None] + j, -1).to(torch.int32)


def _q_positions(q_offset, kv_pos: torch.Tensor, B: int, Tq: int, device) -> torch.Tensor:
    """[B] int32: the position of each batch row's first query (bottom-right by default)."""
    if q_offset is not None:
        pos = _per_batch("q_offset", q_offset, B, device)
    else:
        pos = kv_pos.to(torch.int64).max(dim=1).values + 1 - Tq
        if _checkable() and bool((pos < 0).any()):
            b = int((pos < 0).nonzero()[0])
            raise ValueError(
                f"q has T_q={Tq} rows but batch row {b} holds keys only up to position {int(pos[b]) + Tq - 1}: "
                "aligned bottom-right (the last query at the last key) its first rows would sit before position 0. "
                "Pass q_offset (the position of each batch row's first query), and kv_len for what the cache holds"
            )
    if _checkable() and bool((pos + Tq - 1 > INT32_MAX).any()):
        raise ValueError(f"q_offset + T_q - 1 must lie within int32, got q_offset {pos.tolist()}")
    return pos.to(torch.int32)


def sliding_window_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    window_size: tuple[int, int] = (-1, -1),
    dilation: int | torch.Tensor = 1,
    num_sinks: int = 0,
    sink_logits: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Packed sequences (FlashAttention's varlen layout): several sequences of different
    lengths in one tensor, none attending across its boundaries.

    Shapes: ``q`` [total, H, D]; ``k``, ``v`` [total, H_kv, D]; ``cu_seqlens`` [N + 1]
    integer, the sequences' start offsets: 0, then strictly increasing, ending at total.
    Sequence s holds rows ``cu_seqlens[s] .. cu_seqlens[s + 1] - 1`` at positions 0, 1,
    ... of its own, so window, dilation, causality and sinks apply within it as in
    :func:`sliding_window_attention` on that sequence alone. Returns ``out`` [total, H, D],
    or ``(out, lse)`` with lse [H, total]. Differentiable in q, k, v and sink_logits,
    through out and lse.

    The sequences are laid out as a batch of the longest one's length, the shorter ones'
    tails masked as slots without keys (``attention_with_kv_cache``): work and memory
    follow N x the longest length, not the total.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 3)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an integer tensor [N + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool or cu_seqlens.is_complex():
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1 sequences, got shape {tuple(cu_seqlens.shape)}")
    total = q.shape[0]
    if k.shape[0] != total or v.shape[0] != total:
        raise ValueError(f"k and v must have q's {total} rows, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    if _checkable():
        if int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
        if int(cu[-1]) != total:
            raise ValueError(f"cu_seqlens must end at the number of rows, {total}, got {int(cu[-1])}")
        if bool((lens <= 0).any()):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {cu_seqlens.tolist()}")
    longest = int(lens.max())
    j = torch.arange(longest, device=q.device)
    valid = j[None, :] < lens[:, None]  # [N, longest]
    rows = torch.where(valid, cu[:-1, None] + j[None, :], 0)  # a padding row reads row 0 (masked)

    def batch(x):  # [total, heads, D] -> [N, heads, longest, D]
        return x[rows].transpose(1, 2)

    out, lse = attention_with_kv_cache(
        batch(q), batch(k), batch(v), q_offset=0, kv_len=lens, window_size=window_size, dilation=dilation,
        num_sinks=num_sinks, sink_logits=sink_logits, softcap=softcap, scale=scale, return_lse=True,
    )
    out = out.transpose(1, 2)[valid]  # [total, H, D], the sequences in order
    if not return_lse:
        return out
    return out, lse.transpose(1, 2)[valid].transpose(0, 1)
