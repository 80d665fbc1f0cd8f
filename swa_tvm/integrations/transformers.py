"""Hugging Face transformers models on swa_tvm's kernels: ``attn_implementation="swa_tvm"``.

::

    import swa_tvm.integrations.transformers as swa_hf

    swa_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="swa_tvm")
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=32)

``register()`` adds two functions to transformers under one name, so that a model's
attention layers call swa_tvm for prefill, chunked prefill and every decode step, on
each cache transformers has (dynamic and static, their sliding-window layers included):

* :func:`slot_positions`, the mask function (``AttentionMaskInterface``). transformers
  calls it once per layer type and forward pass with that call's geometry: query rows
  at cache positions ``q_offset ..``, key slots at ``kv_offset ..``, the 2D padding
  mask, and the model's own mask function. It returns :class:`SlotPositions`: each key
  slot's position (-1 for a padding or unwritten slot) and the window. The window
  comes from the layer's ``local_size`` and from the model's mask function, and is
  checked against that function at every (row, slot) of the call (of a spread of rows
  in a call past 8192 x 8192 mask elements), so a model whose
  mask is not a window (packed sequences, image-token overlays) gets a ``ValueError``
  rather than a wrong answer.
* :func:`attention`, the attention function (``AttentionInterface``): the model's
  ``scaling``, ``softcap`` (Gemma 2) and learned sinks (``s_aux``, GPT-OSS) go through
  to :func:`swa_tvm.attention_with_kv_cache`, or to
  :func:`swa_tvm.sliding_window_attention` for a whole unpadded sequence.

Positions are transformers' cache indices, which count left padding: the window is
measured as transformers' own masks measure it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask, sdpa_mask
except ImportError as e:  # the optional extra
    raise ImportError("swa_tvm.integrations.transformers needs transformers: pip install 'swa_tvm[transformers]'") from e

from swa_tvm.functional import attention_with_kv_cache, sliding_window_attention

NAME = "swa_tvm"

# Mask elements the check against the model's mask function evaluates at once, and in
# all for one call (8192 x 8192; past that a spread of rows).
_CHECK_ELEMENTS = 1 << 24
_CHECK_ROWS_ELEMENTS = 1 << 26


@dataclasses.dataclass(frozen=True)
class SlotPositions:
    """What :func:`slot_positions` hands a layer of the model in place of a mask.

    ``kv_positions`` [B, kv_length] int32: the position of each key slot the layer gets
    from the cache, -1 where the slot holds no key (left padding, a static cache's
    unwritten slots). Query row i is at position ``q_offset + i`` in every batch row.
    ``window_size`` is ``(left, right)`` as :func:`swa_tvm.sliding_window_attention`
    takes it. ``whole`` marks a call over one whole unpadded sequence (queries and keys
    the same positions from 0), which the full-sequence kernels serve."""

    q_offset: int
    q_length: int
    kv_positions: torch.Tensor
    window_size: tuple[int, int]
    whole: bool
    # transformers reads ``ndim`` of a mask it is handed back (2 would mean a padding
    # mask still to be processed).
    ndim: int = 4


def register(name: str = NAME) -> str:
    """Register swa_tvm's attention and mask functions with transformers under ``name``
    (both are needed: without a mask function a layer gets no padding information).
    Then ``from_pretrained``/``from_config(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` select it. Returns ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    # transformers routes names containing these (or "org/repo") to its own backends.
    if any(word in name for word in ("sdpa", "flash", "flex", "paged", "/")):
        raise ValueError(f"name {name!r} would select one of transformers' own attention backends; pick another")
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, slot_positions)
    # Inside a model every kernel is followed by torch ops, and TVM's workers, spinning
    # for more work after each kernel, take the cores those ops need (docs/roadmap.md
    # measures it). The pool reads this when it starts, at the first kernel call; a
    # value the user set stays.
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    return name


def slot_positions(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    local_size: Optional[int] = None,
    use_vmap: bool = False,
    device="cpu",
    **kwargs,
) -> SlotPositions:
    """transformers' mask interface: the :class:`SlotPositions` of one layer type's call.
    Arguments as transformers' ``sdpa_mask`` takes them."""
    if isinstance(attention_mask, SlotPositions):
        return attention_mask  # a prepared mask handed back in (Mistral's forward under a static cache)
    if mask_function is None:
        raise ValueError("mask_function: transformers passes the model's mask function; got None")
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # a 0-d tensor from a static cache's full layers
    pos = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        valid = padding[:, kv_offset : kv_offset + kv_length].to(device=device, dtype=torch.bool)
    else:
        valid = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    # A slot past the last query holds no token yet (a static cache's tail): causal rows
    # never see it, and bidirectional ones must not.
    valid = valid & (pos < q_offset + q_length)
    pattern = _PatternOf(mask_function, batch_size, kv_length, kv_offset, use_vmap, device)
    window = _window_of(pattern, local_size, q_offset, q_length, pos)
    _check_window(pattern, window, q_offset, q_length, pos, valid)
    whole = q_offset == 0 and kv_offset == 0 and q_length == kv_length and bool(valid.all())
    kv_positions = torch.where(valid, pos, -1).to(torch.int32)
    return SlotPositions(q_offset, q_length, kv_positions, window, whole)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
):
    """transformers' attention interface: ``query`` [B, H, T_q, D], ``key``/``value``
    [B, H_kv, T_k, D] (the cache's slots), ``attention_mask`` the layer type's
    :class:`SlotPositions`. Returns (out [B, T_q, H, D], None): no attention weights."""
    if not isinstance(attention_mask, SlotPositions):
        raise TypeError(
            "attention_mask: swa_tvm's attention takes the SlotPositions of its own mask function, got "
            f"{type(attention_mask).__name__}: call swa_tvm.integrations.transformers.register(), which registers "
            "both (a paged cache, as continuous batching uses, builds no mask and is not served)"
        )
    if dropout:
        raise ValueError(f"dropout: swa_tvm applies no attention dropout, got {dropout} (set attention_dropout=0)")
    m = attention_mask
    if query.shape[2] != m.q_length or key.shape[2] != m.kv_positions.shape[1]:
        raise ValueError(
            f"attention_mask was built for {m.q_length} queries and {m.kv_positions.shape[1]} key slots, "
            f"got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    options = dict(window_size=m.window_size, sink_logits=s_aux, softcap=softcap, scale=scaling)
    if m.whole:
        out = sliding_window_attention(query, key, value, **options)
    else:
        kv_positions = m.kv_positions.to(key.device)
        out = attention_with_kv_cache(query, key, value, q_offset=m.q_offset, kv_positions=kv_positions, **options)
    return out.transpose(1, 2), None


class _PatternOf:
    """The model's own mask function evaluated through transformers' ``sdpa_mask``,
    without padding: [B, rows, kv_length] bool for query rows from ``row0``."""

    def __init__(self, mask_function, batch_size, kv_length, kv_offset, use_vmap, device):
        self.args = dict(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=None, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                         use_vmap=use_vmap, device=device)

    def __call__(self, row0: int, rows: int) -> torch.Tensor:
        return sdpa_mask(q_length=rows, q_offset=row0, **self.args)[:, 0]


def _window_of(pattern, local_size, q_offset: int, q_length: int, pos: torch.Tensor) -> tuple[int, int]:
    """(left, right) read off the model's pattern (batch row 0): how far back the last
    query row sees, and how far ahead the first one does. A side that reaches the end
    of the cache cannot be measured in this call, and any bound covering it computes
    the same: it gets ``local_size`` - 1 where that covers it (transformers passes
    ``local_size``, its ``sliding_window``, which counts the query itself, for sliding
    masks only), so that one layer keeps one kernel, else no bound; a first row that
    sees up to the last slot at its own position is causal. _check_window then holds
    every row of the call to the result."""
    bound = int(local_size) - 1 if local_size is not None else -1
    first_pos, last_pos = int(pos[0]), int(pos[-1])

    def unmeasured(reach: int) -> int:
        return bound if 0 <= reach <= bound else -1

    last_row = q_offset + q_length - 1
    seen = pattern(last_row, 1)[0, 0]
    if not bool(seen.any()):
        left = bound
    else:
        lo = int(pos[seen.nonzero()[0, 0]])
        left = last_row - lo if lo > first_pos else unmeasured(last_row - first_pos)
    seen = pattern(q_offset, 1)[0, 0]
    if not bool(seen.any()):
        right = 0
    else:
        hi = int(pos[seen.nonzero()[-1, 0]])
        if hi < last_pos:
            right = max(0, hi - q_offset)
        else:
            right = 0 if last_pos <= q_offset else unmeasured(last_pos - q_offset)
    return (left, right)


def _check_window(pattern, window, q_offset: int, q_length: int, pos: torch.Tensor, valid: torch.Tensor) -> None:
    """ValueError unless ``window`` sees exactly the slots the model's mask function
    allows, at every valid slot of every query row; past _CHECK_ROWS_ELEMENTS mask
    elements in the call (a prompt of more than 8192 tokens against as many keys), of a
    spread of rows: one in every ``stride``, and the last."""
    left, right = window
    B, kv_length = valid.shape
    per_row = max(1, B * kv_length)
    end = q_offset + q_length
    stride = -(-q_length * per_row // _CHECK_ROWS_ELEMENTS)
    if stride == 1:
        block = max(1, _CHECK_ELEMENTS // per_row)
        spans = [(row, min(block, end - row)) for row in range(q_offset, end, block)]
    else:
        spans = [(row, 1) for row in sorted({*range(q_offset, end, stride), end - 1})]
    for row0, rows in spans:
        qpos = torch.arange(row0, row0 + rows, device=pos.device)[:, None]
        ours = torch.ones(rows, kv_length, dtype=torch.bool, device=pos.device)
        if left >= 0:
            ours &= pos[None, :] >= qpos - left
        if right >= 0:
            ours &= pos[None, :] <= qpos + right
        differ = (pattern(row0, rows) != ours) & valid[:, None, :]
        if bool(differ.any()):
            b, i, j = (int(x) for x in differ.nonzero()[0])
            raise ValueError(
                f"the model's attention mask is not a window swa_tvm serves: at position {row0 + i} (batch row {b}) "
                f"it {'allows' if not ours[i, j] else 'masks'} position {int(pos[j])}, which window_size={window} "
                f"{'masks' if not ours[i, j] else 'allows'} (packed sequences and overlays such as image tokens "
                "are not served by this integration)"
            )
