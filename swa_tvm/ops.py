"""Torch binding: every custom op of swa_tvm and its fake (meta) implementation, here.

``torch.ops.swa_tvm.attention`` is opaque to torch.compile: the fake below gives it
shapes, so ``torch.compile(fullgraph=True)`` traces through it without a graph break.
"""

from __future__ import annotations

from typing import Optional

import torch

from .functional import attention_forward, check_inputs


@torch.library.custom_op("swa_tvm::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dilation: torch.Tensor,
    global_idx: Optional[torch.Tensor],
    q_global: Optional[torch.Tensor],
    k_global: Optional[torch.Tensor],
    v_global: Optional[torch.Tensor],
    num_sinks: int,
    sink_logits: Optional[torch.Tensor],
    scale: float,
    left: int,
    right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B,H,T,D], lse [B,H,T]); see swa_tvm.sliding_window_attention."""
    return attention_forward(
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right
    )


@attention.register_fake
def _attention_fake(
    q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right
):
    check_inputs(
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, left, right, values=False
    )
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, T, D = q.shape
    return q.new_empty(B, H, T, D), q.new_empty(B, H, T, dtype=acc)
