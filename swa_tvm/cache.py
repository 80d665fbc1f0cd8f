"""A KV cache for generation with sliding windows and sinks: ``RollingKVCache``."""

from __future__ import annotations

from typing import Optional

import torch

from swa_tvm.checks import _as_int
from swa_tvm.functional import attention_with_kv_cache


class RollingKVCache:
    """One attention layer's keys and values during generation.

    A sliding layer (``window=W``: each query sees itself and the W - 1 positions
    before it, times ``dilation``) keeps a fixed ring of slots: position p >= S
    (``num_sinks``) lives at slot S + (p - S) mod R, the first S positions are pinned
    at slots 0 .. S - 1 (StreamingLLM), and R = (W - 1) * dilation + ``max_chunk``
    holds the window of every query of a chunk written at once. Its memory never
    grows: after 64K tokens it is what it was after W. A full layer (``window=None``)
    keeps every position and grows, doubling its capacity, as a model's global
    layers must. One model mixes both, a cache per layer (Gemma).

    The kernel gets each slot's position, so the ring is never unrolled or copied.

    Example, one decode step of a layer::

        cache = RollingKVCache(batch_size=1, num_kv_heads=8, head_dim=128, window=4096, num_sinks=4)
        out = cache.attend(q, k_new, v_new)   # q [B, H, T, D], k_new/v_new [B, H_kv, T, D]

    ``attend`` writes the T new positions (the next ones, from ``position``), then
    attends the T queries, at those positions, causally to what the layer's pattern
    lets them see; a T above ``max_chunk`` is processed in chunks of it. Slots start
    zeroed, and a slot no key has reached yet is never attended.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        window: Optional[int] = None,
        num_sinks: int = 0,
        dilation: int = 1,
        max_chunk: int = 256,
        capacity: int = 1024,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, x in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("dilation", dilation), ("max_chunk", max_chunk), ("capacity", capacity)):
            if _as_int(name, x) < 1:
                raise ValueError(f"{name} must be >= 1, got {x}")
        if _as_int("num_sinks", num_sinks) < 0:
            raise ValueError(f"num_sinks must be >= 0, got {num_sinks}")
        if window is not None and _as_int("window", window) < 1:
            raise ValueError(f"window must be >= 1 (keys a query sees, itself included) or None, got {window}")
        self.window, self.num_sinks, self.dilation, self.max_chunk = window, num_sinks, dilation, max_chunk
        self.position = 0  # the next position to be written
        if window is None:
            self.ring = None
            slots = capacity
        else:
            self.ring = (window - 1) * dilation + max_chunk
            slots = num_sinks + self.ring
        shape = (batch_size, num_kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Each slot's position, -1 before a key reaches it (what the kernel masks by).
        self.slot_positions = torch.full((slots,), -1, dtype=torch.int32, device=device)

    @property
    def window_size(self) -> tuple[int, int]:
        """The (left, right) window of ``sliding_window_attention`` this layer serves."""
        return (-1 if self.window is None else self.window - 1), 0

    @property
    def nbytes(self) -> int:
        """Bytes of the keys, values and slot positions held."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.slot_positions))

    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The slot of each position (int64)."""
        if self.ring is None:
            return positions
        S = self.num_sinks
        return torch.where(positions < S, positions, S + (positions - S) % self.ring)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values [B, H_kv, T, D] of the next T positions (T <= max_chunk
        for a sliding layer, so a chunk's queries keep their windows)."""
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            want = (self.k.shape[0], self.k.shape[1], x.shape[2] if x.dim() == 4 else -1, self.k.shape[3])
            if x.dim() != 4 or tuple(x.shape) != want:
                raise ValueError(f"{name} must be [B, H_kv, T, D]={list(want[:2])} + [T, {want[3]}], got {tuple(x.shape)}")
        T = k.shape[2]
        if self.ring is not None and T > self.max_chunk:
            raise ValueError(
                f"a sliding layer's cache takes at most max_chunk={self.max_chunk} positions at a time, got {T}: "
                "their queries' windows would be overwritten (attend() splits longer inputs)"
            )
        end = self.position + T
        if end > 2**31 - 1:
            raise ValueError("the cache has reached int32 positions; it cannot roll further")
        if self.ring is None and end > self.k.shape[2]:
            self._grow(end)
        positions = torch.arange(self.position, end, device=self.k.device)
        slots = self.slots_of(positions)
        self.k[:, :, slots] = k.to(self.k.dtype)
        self.v[:, :, slots] = v.to(self.v.dtype)
        self.slot_positions[slots] = positions.to(torch.int32)
        self.position = end

    def _grow(self, need: int) -> None:
        slots = self.k.shape[2]
        while slots < need:
            slots *= 2
        pad = slots - self.k.shape[2]
        B, H, _, D = self.k.shape
        self.k = torch.cat([self.k, self.k.new_zeros(B, H, pad, D)], dim=2)
        self.v = torch.cat([self.v, self.v.new_zeros(B, H, pad, D)], dim=2)
        self.slot_positions = torch.cat([self.slot_positions, self.slot_positions.new_full((pad,), -1)])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sink_logits=None, softcap=None,
               scale=None, dilation=None, return_lse: bool = False):
        """Write k, v [B, H_kv, T, D] at the next T positions and attend q [B, H, T, D]
        (the same positions) to the cache: ``out`` [B, H, T, D], or (out, lse).
        ``dilation`` defaults to the cache's (a per-head tensor may use less)."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise ValueError("q must be [B, H, T, D] and k, v [B, H_kv, T, D] tensors")
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"q and k must bring the same positions, got T={q.shape[2]} and {k.shape[2]}")
        dilation = self.dilation if dilation is None else dilation
        most = int(dilation.max()) if isinstance(dilation, torch.Tensor) and dilation.numel() else dilation
        if self.ring is not None and isinstance(most, int) and most > self.dilation:
            raise ValueError(
                f"dilation {most} reaches past this cache's window, kept for dilation {self.dilation}: "
                "build the cache with the largest dilation its layer uses"
            )
        step = self.max_chunk if self.ring is not None else max(q.shape[2], 1)
        kw = dict(window_size=self.window_size, dilation=dilation, num_sinks=self.num_sinks, sink_logits=sink_logits,
                  softcap=softcap, scale=scale, return_lse=True)
        outs, lses = [], []
        for t0 in range(0, q.shape[2], step):
            t1 = min(t0 + step, q.shape[2])
            self.write(k[:, :, t0:t1], v[:, :, t0:t1])
            # A full layer's slots are its positions: the kernel searches the span it needs.
            keys = dict(kv_len=self.position) if self.ring is None else dict(kv_positions=self.slot_positions)
            out, lse = attention_with_kv_cache(q[:, :, t0:t1], self.k, self.v, q_offset=self.position - (t1 - t0),
                                               **keys, **kw)
            outs.append(out)
            lses.append(lse)
        out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, dim=2), torch.cat(lses, dim=2))
        return (out, lse) if return_lse else out
