"""Torch binding: every custom op of swa_tvm, its fake (meta) implementation and its
autograd formula, here.

``torch.ops.swa_tvm.attention`` and ``torch.ops.swa_tvm.attention_backward`` are opaque
to torch.compile: the fakes below give them shapes, so ``torch.compile(fullgraph=True)``
traces through forward and backward without a graph break.
"""

from __future__ import annotations

from typing import Optional

import torch

from swa_tvm.checks import check_inputs, check_kv_inputs
from swa_tvm.eager import attention_backward as _backward_impl
from swa_tvm.eager import attention_forward, attention_kv_forward
from swa_tvm.eager import attention_kv_backward as _kv_backward_impl


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
        q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right,
        values=False,
    )
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, T, D = q.shape
    return q.new_empty(B, H, T, D), q.new_empty(B, H, T, dtype=acc)


@torch.library.custom_op("swa_tvm::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
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
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dq_global, dk_global, dv_global, dsink_logits); an input that was
    not given gets an empty tensor. Uses the forward's out and lse, no T x T tensor."""
    return _backward_impl(
        dout, dlse, q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right, out, lse
    )


@attention_backward.register_fake
def _attention_backward_fake(
    dout, dlse, q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right, out, lse
):
    like = lambda x: torch.empty_like(x) if x is not None else q.new_empty(0)  # noqa: E731
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        like(q_global),
        like(k_global),
        like(v_global),
        like(sink_logits),
    )


# Only what the backward reads is saved: the inputs it recomputes scores from, the
# integer tables, and the forward's out and lse (no probabilities).

def _setup_context(ctx, inputs, output):
    q, k, v, dilation, global_idx, q_global, k_global, v_global, num_sinks, sink_logits, scale, left, right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, dilation, global_idx, q_global, k_global, v_global, sink_logits, out, lse)
    ctx.num_sinks, ctx.scale, ctx.window = num_sinks, scale, (left, right)
    ctx.given = tuple(x is not None for x in (q_global, k_global, v_global, sink_logits))
    # An output the loss does not use gets None, not a zero tensor: the usual case, lse
    # unused, then skips a [B, H, T] fill and subtraction.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, dilation, global_idx, q_global, k_global, v_global, sink_logits, out, lse = ctx.saved_tensors
    if dout is None:  # only lse reaches the loss
        dout = torch.zeros_like(out)
    grads = torch.ops.swa_tvm.attention_backward(
        dout, dlse, q, k, v, dilation, global_idx, q_global, k_global, v_global,
        ctx.num_sinks, sink_logits, ctx.scale, *ctx.window, out, lse,
    )  # fmt: skip
    dq, dk, dv, dqg, dkg, dvg, dsink = grads
    dqg, dkg, dvg, dsink = (g if given else None for g, given in zip((dqg, dkg, dvg, dsink), ctx.given))
    # One entry per op input: dilation, global_idx, num_sinks, scale, left and right
    # have no gradient.
    return dq, dk, dv, None, None, dqg, dkg, dvg, None, dsink, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("swa_tvm::attention_kv", mutates_args=())
def attention_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dilation: torch.Tensor,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    num_sinks: int,
    sink_logits: Optional[torch.Tensor],
    softcap: float,
    scale: float,
    left: int,
    right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B,H,Tq,D], lse [B,H,Tq]) against a KV cache; see swa_tvm.attention_with_kv_cache.
    q_positions [B]: position of query row 0; kv_positions [B, Tk]: each slot's position,
    -1 = no key; softcap 0 = none."""
    return attention_kv_forward(
        q, k, v, dilation, q_positions, kv_positions, num_sinks, sink_logits, softcap, scale, left, right
    )


@attention_kv.register_fake
def _attention_kv_fake(q, k, v, dilation, q_positions, kv_positions, num_sinks, sink_logits, softcap, scale, left, right):
    check_kv_inputs(
        q, k, v, dilation, q_positions, kv_positions, num_sinks, sink_logits, softcap, scale, left, right, values=False
    )
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, Tq, D = q.shape
    return q.new_empty(B, H, Tq, D), q.new_empty(B, H, Tq, dtype=acc)


@torch.library.custom_op("swa_tvm::attention_kv_backward", mutates_args=())
def attention_kv_backward(
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dilation: torch.Tensor,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    num_sinks: int,
    sink_logits: Optional[torch.Tensor],
    softcap: float,
    scale: float,
    left: int,
    right: int,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink_logits) of attention_kv; dsink_logits is empty without sink_logits."""
    return _kv_backward_impl(dout, dlse, q, k, v, dilation, q_positions, kv_positions, num_sinks, sink_logits, softcap,
                             scale, left, right, out, lse)


@attention_kv_backward.register_fake
def _attention_kv_backward_fake(dout, dlse, q, k, v, dilation, q_positions, kv_positions, num_sinks, sink_logits,
                                softcap, scale, left, right, out, lse):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sink_logits) if sink_logits is not None else q.new_empty(0))


def _attention_kv_setup(ctx, inputs, output):
    q, k, v, dilation, q_positions, kv_positions, num_sinks, sink_logits, softcap, scale, left, right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, dilation, q_positions, kv_positions, sink_logits, out, lse)
    ctx.num_sinks, ctx.softcap, ctx.scale, ctx.window = num_sinks, softcap, scale, (left, right)
    ctx.set_materialize_grads(False)


def _attention_kv_backward(ctx, dout, dlse):
    q, k, v, dilation, q_positions, kv_positions, sink_logits, out, lse = ctx.saved_tensors
    if dout is None:  # only lse reaches the loss
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.swa_tvm.attention_kv_backward(
        dout, dlse, q, k, v, dilation, q_positions, kv_positions, ctx.num_sinks, sink_logits, ctx.softcap, ctx.scale,
        *ctx.window, out, lse,
    )
    # One entry per op input: the integer inputs, softcap and scale have no gradient.
    return dq, dk, dv, None, None, None, None, (dsink if sink_logits is not None else None), None, None, None, None


attention_kv.register_autograd(_attention_kv_backward, setup_context=_attention_kv_setup)
