"""Dense float64 reference with an explicit T x T mask. For tests and checks only: it
is O(T^2) on purpose, written straight from the semantics in
``swa_tvm.sliding_window_attention``'s docstring and sharing no code with the kernels."""

from __future__ import annotations

import math

import torch


def window_mask(T: int, left: int, right: int, dilation: int) -> torch.Tensor:
    """[T, T] bool: query i sees j = i + s*d for -left <= s <= right (-1 = unbounded)."""
    i = torch.arange(T).view(T, 1)
    j = torch.arange(T).view(1, T)
    off = j - i
    ok = off % dilation == 0
    s = torch.div(off, dilation, rounding_mode="floor")
    if left >= 0:
        ok &= s >= -left
    if right >= 0:
        ok &= s <= right
    return ok


def attention_mask(
    T: int,
    H: int,
    window: tuple[int, int],
    dilation,
    global_idx: torch.Tensor | None = None,
    num_sinks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (mask [B|1, H, T, T] bool, is_global [B|1, T] bool) for the full pattern.

    A global row sees every key allowed by causality; other rows see their window, the
    global positions and the sinks (causally). right == 0 means causal for every term.
    """
    left, right = window
    dil = [int(dilation)] * H if isinstance(dilation, int) else [int(x) for x in dilation]
    local = torch.stack([window_mask(T, left, right, d) for d in dil])  # [H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril() if right == 0 else torch.ones(T, T, dtype=torch.bool)
    B = 1 if global_idx is None else global_idx.shape[0]
    extra = torch.zeros(B, T, dtype=torch.bool)  # key columns every row also sees
    extra[:, : min(num_sinks, T)] = True
    is_global = torch.zeros(B, T, dtype=torch.bool)
    if global_idx is not None and global_idx.numel():
        gi = global_idx.long()
        is_global.scatter_(1, gi, True)
        extra.scatter_(1, gi, True)
    mask = local.unsqueeze(0) | (extra[:, None, None, :] & causal)  # [B, H, T, T]
    mask = torch.where(is_global[:, None, :, None], causal.expand_as(mask), mask)
    return mask, is_global


def _weighted_values(probs, values):
    """sum over keys j of probs[i, j] * values[j], where a key of probability 0 (every
    key outside row i's view, and any the softmax gives nothing) adds nothing, whatever
    its value holds: 0 * NaN would be NaN. A plain matmul when the values are finite;
    otherwise exactly, 64 rows at a time."""
    if bool(torch.isfinite(values).all()):
        return probs @ values
    out = []
    for r in range(0, probs.shape[-2], 64):
        p = probs[..., r : r + 64, :, None]
        out.append(torch.where(p != 0, p * values[..., None, :, :], 0.0).sum(-2))
    return torch.cat(out, dim=-2)


def sliding_window_attention_ref(
    q,
    k,
    v,
    *,
    window_size=(-1, -1),
    dilation=1,
    global_idx=None,
    q_global=None,
    k_global=None,
    v_global=None,
    num_sinks=0,
    sink_logits=None,
    scale=None,
    softcap=None,
):
    """float64 (out, lse) by dense masked softmax. Same arguments as the kernel API, and
    ``softcap`` (scores s -> softcap * tanh(s / softcap) before masking).

    Differentiable: torch autograd through it gives the reference gradients."""
    q, k, v = (x.double() for x in (q, k, v))
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    rep = lambda x: x.repeat_interleave(H // Hkv, dim=1)  # noqa: E731
    k, v = rep(k), rep(v)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dil = dilation.tolist() if isinstance(dilation, torch.Tensor) else int(dilation)
    mask, is_global = attention_mask(T, H, tuple(window_size), dil, global_idx, num_sinks)
    mask = mask.expand(B, H, T, T)
    scores = (q @ k.transpose(-1, -2)) * scale
    values = v.expand(B, H, T, D)
    if global_idx is not None and global_idx.numel():
        gi = global_idx.long()
        G = gi.shape[1]
        qg = q_global.double() if q_global is not None else torch.gather(q, 2, gi[:, None, :, None].expand(B, H, G, D))
        kg = rep(k_global.double()) if k_global is not None else k
        vg = rep(v_global.double()) if v_global is not None else v
        gscores = (qg @ kg.transpose(-1, -2)) * scale  # [B, H, G, T]
        scores = scores.scatter(2, gi[:, None, :, None].expand(B, H, G, T), gscores)
        # Global rows take their values from v_global: handle them as a separate product.
        glob_rows = is_global[:, None, :, None]
    else:
        vg, glob_rows = None, None
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink_logits is not None:
        sink = sink_logits.double().view(1, H, 1, 1).expand(B, H, T, 1)
        full = torch.cat([scores, sink], dim=-1)
    else:
        full = scores
    lse = torch.logsumexp(full, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = _weighted_values(probs, values)
    if vg is not None:
        out = torch.where(glob_rows, _weighted_values(probs, vg), out)
    return out, lse
