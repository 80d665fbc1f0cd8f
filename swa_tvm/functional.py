"""Public API: ``sliding_window_attention``, its contract, and the normalization of its
arguments before they reach ``torch.ops.swa_tvm.attention`` (swa_tvm.ops)."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from swa_tvm import ops  # noqa: F401 - registers torch.ops.swa_tvm.*
from swa_tvm.checks import _as_int, _check_tensor, check_window_and_sinks, normalize_dilation, normalize_window


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
    # Everything the op's schema would refuse with a bare RuntimeError (a non-tensor, an
    # int beyond int64) is refused here first, by name.
    _check_tensor("q", q, 4)
    for name, x in (("global_idx", global_idx), ("q_global", q_global), ("k_global", k_global),
                    ("v_global", v_global), ("sink_logits", sink_logits)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    H, T, D = q.shape[1], q.shape[2], q.shape[3]
    check_window_and_sinks(left, right, num_sinks, T)
    left, right = normalize_window(left, right, T)
    if not isinstance(dilation, torch.Tensor):
        if isinstance(dilation, bool) or not isinstance(dilation, numbers.Integral):
            raise TypeError(f"dilation must be an int or an integer tensor of shape [H], got {type(dilation).__name__}")
        dilation = int(dilation)
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        dilation = torch.full((H,), normalize_dilation(dilation, T), dtype=torch.int32, device=q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0  # D = 0 is refused by the op's checks, by name
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond float's range
        raise ValueError("scale must be a positive finite number, got an int beyond float range") from None

    out, lse = torch.ops.swa_tvm.attention(
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right
    )
    return (out, lse) if return_lse else out
