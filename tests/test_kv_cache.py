"""Attention against a KV cache (swa_tvm.attention_with_kv_cache, RollingKVCache).

The oracle for every case is the float64 full-sequence reference: a cache call's rows
must equal the matching rows of one full-sequence call over the positions the cache
holds (reference.sliding_window_attention_ref, dense with an explicit mask)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import swa_tvm
from swa_tvm.reference import sliding_window_attention_ref as reference

pytestmark = pytest.mark.xdist_group("kv_cache")

# Patterns every scenario runs under: window, dilation (uniform and per head), sinks,
# learned sinks, softcap, GQA (H=4 over H_kv=2 throughout).
H, HKV, D = 4, 2, 16
PATTERNS = {
    "window": dict(window_size=(7, 0)),
    "dilated": dict(window_size=(5, 0), dilation=2, num_sinks=3),
    "per_head": dict(window_size=(6, 0), dilation=torch.tensor([1, 2, 3, 1]), sink_logits=torch.tensor([0.5, -1.0, 2.0, -0.2])),
    "softcap": dict(window_size=(9, 0), softcap=1.5, num_sinks=2),
    "full_causal": dict(window_size=(-1, 0), num_sinks=1),
    "two_sided": dict(window_size=(4, 3), dilation=2),
}


def _patterns(*quick):
    """Every pattern, those not named in ``quick`` left to the full suite (slow)."""
    return [p if p in quick else pytest.param(p, marks=pytest.mark.slow) for p in sorted(PATTERNS)]


def _inputs(B, N, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(B, H, N, D), mk(B, HKV, N, D), mk(B, HKV, N, D)


def _reach(kw) -> int:
    """How far past a query its window reaches (the keys a cache must hold after it)."""
    right = kw["window_size"][1]
    d = kw.get("dilation", 1)
    dmax = int(d.max()) if isinstance(d, torch.Tensor) else d
    return 0 if right == 0 else right * dmax


def _close(out, lse, ro, rl, dtype=torch.float32):
    tol = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), rl, atol=tol, rtol=tol)


@pytest.mark.parametrize("pattern", _patterns("dilated", "softcap"))
@pytest.mark.parametrize(
    "q0,Tq",
    [(44, 1), (5, 1), (30, 9), (0, 47), (12, 16)],
    ids=["decode", "decode_early", "chunk", "whole", "chunk16"],
)
def test_rows_of_the_full_sequence(pattern, q0, Tq):
    """Decode steps and prefill chunks: q rows [q0, q0 + Tq) against the cache of
    every position up to what they may see equal those rows of the full call."""
    kw = PATTERNS[pattern]
    N = 47
    q, k, v = _inputs(2, N)
    ro, rl = reference(q, k, v, **kw)
    Tk = min(N, q0 + Tq + _reach(kw))
    out, lse = swa_tvm.attention_with_kv_cache(
        q[:, :, q0 : q0 + Tq], k[:, :, :Tk], v[:, :, :Tk], q_offset=q0, return_lse=True, **kw
    )
    _close(out, lse, ro[:, :, q0 : q0 + Tq], rl[:, :, q0 : q0 + Tq])


@pytest.mark.parametrize("pattern", ["window", pytest.param("per_head", marks=pytest.mark.slow),
                                     pytest.param("softcap", marks=pytest.mark.slow)])
def test_bottom_right_default(pattern):
    """Without q_offset the last query sits at the last valid key."""
    kw = PATTERNS[pattern]
    q, k, v = _inputs(1, 30)
    ro, rl = reference(q, k, v, **kw)
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, 26:], k, v, return_lse=True, **kw)
    _close(out, lse, ro[:, :, 26:], rl[:, :, 26:])


@pytest.mark.parametrize("pattern", [p for p in _patterns("per_head") if getattr(p, "values", [p])[0] in
                                     ("window", "dilated", "per_head", "softcap")])
def test_offsets_per_batch_row(pattern):
    """Each batch row's cache starts at its own position (kv_offset) and its queries
    at their own (q_offset): row b equals the full call over its positions."""
    kw = PATTERNS[pattern]
    N = 40
    q, k, v = _inputs(3, N, seed=1)
    ro, rl = reference(q, k, v, **kw)
    kv_offset = torch.tensor([0, 4, 9])
    Tk, Tq = 25, 3
    q_offset = kv_offset + Tk - Tq  # the newest rows of each cache
    # Slot j of row b holds position kv_offset[b] + j; the window must fit in it.
    kb = torch.stack([k[b, :, int(o) : int(o) + Tk] for b, o in enumerate(kv_offset)])
    vb = torch.stack([v[b, :, int(o) : int(o) + Tk] for b, o in enumerate(kv_offset)])
    qb = torch.stack([q[b, :, int(o) : int(o) + Tq] for b, o in enumerate(q_offset)])
    if kw.get("num_sinks"):
        kw = {**kw, "num_sinks": 0}  # sinks at positions 0.. are outside rows 1 and 2's caches
        ro, rl = reference(q, k, v, **kw)
    out, lse = swa_tvm.attention_with_kv_cache(qb, kb, vb, q_offset=q_offset, kv_offset=kv_offset, return_lse=True, **kw)
    for b, o in enumerate(q_offset.tolist()):
        _close(out[b], lse[b], ro[b, :, o : o + Tq], rl[b, :, o : o + Tq])


@pytest.mark.parametrize("pattern", [p for p in _patterns("window") if getattr(p, "values", [p])[0] != "two_sided"])
def test_left_padding(pattern):
    """A left-padded batch: each row's pad slots (NaN here) are never attended, and
    the row equals its prompt run alone with the positions shifted by its padding."""
    kw = dict(PATTERNS[pattern])
    kw.pop("num_sinks", None)  # pads take the first positions: sinks would be pads
    N = 24
    pads = [0, 5, 11]
    q, k, v = _inputs(len(pads), N, seed=2)
    for b, p in enumerate(pads):
        k[b, :, :p] = float("nan")
        v[b, :, :p] = float("nan")
    out, lse = swa_tvm.attention_with_kv_cache(q, k, v, kv_start=torch.tensor(pads), return_lse=True, **kw)
    for b, p in enumerate(pads):
        ro, rl = reference(q[b : b + 1, :, p:], k[b : b + 1, :, p:], v[b : b + 1, :, p:], **kw)
        _close(out[b : b + 1, :, p:], lse[b : b + 1, :, p:], ro, rl)
    # Query rows on pad positions see no key: out 0, lse -inf (with no learned sink).
    if "sink_logits" not in kw:
        assert torch.equal(out[2, :, :5], torch.zeros_like(out[2, :, :5]))
        assert bool(torch.isneginf(lse[2, :, :5]).all())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtypes(dtype):
    kw = PATTERNS["dilated"]
    q, k, v = _inputs(2, 33, dtype=dtype)
    ro, rl = reference(q, k, v, **kw)
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, 20:23], k[:, :, :23], v[:, :, :23], return_lse=True, **kw)
    assert out.dtype == dtype
    _close(out, lse, ro[:, :, 20:23], rl[:, :, 20:23], dtype)


def test_unwritten_slots_hold_anything():
    """The NaN rule: slots outside every view (an unwritten tail, NaN and inf) add
    nothing, and the result needs no second, guarded pass to be exact."""
    kw = PATTERNS["window"]
    q, k, v = _inputs(2, 20)
    ro, rl = reference(q, k, v, **kw)
    kc = torch.cat([k, torch.full((2, HKV, 12, D), float("nan"))], dim=2)
    vc = torch.cat([v, torch.full((2, HKV, 12, D), float("inf"))], dim=2)
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, 19:], kc, vc, q_offset=19, kv_len=20, return_lse=True, **kw)
    _close(out, lse, ro[:, :, 19:], rl[:, :, 19:])
    # A NaN the row does see reaches it, as in the reference.
    vc[0, 0, 18, 0] = float("nan")
    out = swa_tvm.attention_with_kv_cache(q[:, :, 19:], kc, vc, q_offset=19, kv_len=20, **kw)
    assert bool(torch.isnan(out[0, :2, 0, 0]).all()) and bool(torch.isfinite(out[1]).all())


def test_empty_rows_and_infinite_sink():
    q, k, v = _inputs(1, 8)
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, :2], k, v, q_offset=3, kv_len=0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    sink = torch.tensor([float("inf"), 0.0, 0.0, 0.0])
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, 7:], k, v, sink_logits=sink, return_lse=True)
    ro, rl = reference(q, k, v, sink_logits=sink)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and bool(torch.isposinf(lse[:, 0]).all())
    _close(out[:, 1:], lse[:, 1:], ro[:, 1:, 7:], rl[:, 1:, 7:])


@pytest.mark.parametrize("pattern,chunk", [("window", 1)] + [
    pytest.param(p, c, marks=pytest.mark.slow) for p in ("window", "dilated", "softcap") for c in (1, 5) if (p, c) != ("window", 1)
])
def test_rolling_cache_generates_like_the_full_sequence(pattern, chunk):
    """A rolling buffer through 8x its window, written `chunk` positions at a time:
    every step equals the full call's rows, and its memory never grows."""
    kw = dict(PATTERNS[pattern])
    W = kw["window_size"][0] + 1
    d = kw.get("dilation", 1)
    N = 8 * W * d
    q, k, v = _inputs(2, N, seed=3)
    ro, rl = reference(q, k, v, **kw)
    cache = swa_tvm.RollingKVCache(2, HKV, D, window=W, num_sinks=kw.get("num_sinks", 0), dilation=d, max_chunk=chunk)
    size = cache.nbytes
    extra = {key: kw[key] for key in ("softcap",) if key in kw}
    for t0 in range(0, N, chunk):
        t1 = min(t0 + chunk, N)
        out, lse = cache.attend(q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1], return_lse=True, **extra)
        _close(out, lse, ro[:, :, t0:t1], rl[:, :, t0:t1])
    assert cache.position == N and cache.nbytes == size
    assert cache.k.shape[2] == kw.get("num_sinks", 0) + (W - 1) * d + chunk


def test_full_layer_cache_grows_and_long_prompts_split():
    """A full layer (window None) keeps every position; a sliding layer's prompt longer
    than max_chunk is split into chunks; both equal the full call."""
    q, k, v = _inputs(1, 70, seed=4)
    full = swa_tvm.RollingKVCache(1, HKV, D, window=None, capacity=8)
    ro, _ = reference(q, k, v, window_size=(-1, 0))
    out = torch.cat([full.attend(q[:, :, :50], k[:, :, :50], v[:, :, :50]), full.attend(q[:, :, 50:], k[:, :, 50:], v[:, :, 50:])], 2)
    torch.testing.assert_close(out.double(), ro, atol=2e-5, rtol=2e-5)
    assert full.k.shape[2] == 128
    sliding = swa_tvm.RollingKVCache(1, HKV, D, window=6, num_sinks=2, max_chunk=16)
    ro, _ = reference(q, k, v, window_size=(5, 0), num_sinks=2)
    out = sliding.attend(q, k, v)
    torch.testing.assert_close(out.double(), ro, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    N=st.integers(1, 40),
    data=st.data(),
    left=st.integers(-1, 12),
    right=st.sampled_from([0, 0, 2, -1]),
    dilation=st.integers(1, 3),
    sinks=st.integers(0, 3),
)
def test_hypothesis_positions(N, data, left, right, dilation, sinks):
    """Random (T_q, T_k, offsets, window, dilation, sinks): the cache call equals the
    full call's rows over every position its rows may see."""
    q0 = data.draw(st.integers(0, N - 1))
    Tq = data.draw(st.integers(1, N - q0))
    reach = N if right < 0 else q0 + Tq + right * dilation
    Tk = min(N, reach)
    kw = dict(window_size=(left, right), dilation=dilation, num_sinks=min(sinks, N))
    q, k, v = _inputs(1, N, seed=N)
    ro, rl = reference(q, k, v, **kw)
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, q0 : q0 + Tq], k[:, :, :Tk], v[:, :, :Tk], q_offset=q0,
                                               return_lse=True, **kw)
    _close(out, lse, ro[:, :, q0 : q0 + Tq], rl[:, :, q0 : q0 + Tq])


# ----------------------------------------------------------------------------- bad input

def _call(**kw):
    q, k, v = _inputs(2, 10)
    args = dict(q=q[:, :, 8:], k=k, v=v)
    args.update(kw)
    return swa_tvm.attention_with_kv_cache(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(q_offset=-1), ValueError, "q_offset"),
        (dict(q_offset=torch.tensor([1, 2, 3])), ValueError, "q_offset"),
        (dict(q_offset=torch.tensor([1.0, 2.0])), TypeError, "q_offset"),
        (dict(kv_offset=-3), ValueError, "kv_offset"),
        (dict(kv_offset=2**40), ValueError, "kv_offset"),
        (dict(kv_start=torch.tensor([[0, 1]])), ValueError, "kv_start"),
        (dict(kv_len=11), ValueError, "kv_len"),
        (dict(kv_start=4, kv_len=7), ValueError, "kv_len"),
        (dict(kv_positions=torch.zeros(2, 9, dtype=torch.int32)), ValueError, "kv_positions"),
        (dict(kv_positions=torch.full((2, 10), -2)), ValueError, "kv_positions"),
        (dict(kv_positions=torch.zeros(2, 10)), TypeError, "kv_positions"),
        (dict(kv_positions=torch.zeros(2, 10, dtype=torch.int32), kv_len=3), ValueError, "kv_positions"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap="1"), TypeError, "softcap"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(num_sinks=-1), ValueError, "num_sinks"),
        (dict(dilation=0), ValueError, "dilation"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(sink_logits=[0.0] * H), TypeError, "sink_logits"),
        (dict(q=torch.randn(2, H, 12, D)), ValueError, "q_offset"),  # T_q > T_k, bottom-right before position 0
        (dict(q=torch.randn(2, 3, 1, D)), ValueError, "multiple"),
        (dict(q=torch.randn(2, H, 1, D + 1)), ValueError, "D="),
        (dict(q=torch.randn(2, H, 1, D, dtype=torch.float64)), TypeError, "dtype"),
    ],
)
def test_bad_input_is_named(kw, err, match):
    with pytest.raises(err, match=match):
        _call(**kw)


def test_bad_cache_use_is_named():
    with pytest.raises(ValueError, match="window"):
        swa_tvm.RollingKVCache(1, HKV, D, window=0)
    cache = swa_tvm.RollingKVCache(1, HKV, D, window=4, max_chunk=2)
    with pytest.raises(ValueError, match="max_chunk"):
        cache.write(torch.randn(1, HKV, 3, D), torch.randn(1, HKV, 3, D))
    with pytest.raises(ValueError, match="k must be"):
        cache.write(torch.randn(1, HKV + 1, 1, D), torch.randn(1, HKV + 1, 1, D))
    with pytest.raises(ValueError, match="dilation"):
        cache.attend(torch.randn(1, H, 1, D), torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D), dilation=2)


def _grads(out, lse, leaves, seed=5):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    return torch.autograd.grad((out.double() * dout).sum() + (lse.double() * dlse).sum(), leaves)


@pytest.mark.parametrize("pattern", _patterns("softcap"))
def test_gradients_of_the_full_sequence_rows(pattern):
    """Gradients through out and lse (q, k, v and sink logits) equal those of the
    matching rows of the full call, for a chunk of queries against the cache."""
    kw = dict(PATTERNS[pattern])
    q, k, v = (x.double().requires_grad_(True) for x in _inputs(2, 30, seed=6))
    leaves = [q, k, v]
    if "sink_logits" in kw:
        kw["sink_logits"] = kw["sink_logits"].double().requires_grad_(True)
        leaves.append(kw["sink_logits"])
    q0, Tq = 17, 9
    Tk = min(30, q0 + Tq + _reach(kw))
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, q0 : q0 + Tq], k[:, :, :Tk], v[:, :, :Tk], q_offset=q0,
                                               return_lse=True, **kw)
    ro, rl = reference(q, k, v, **kw)
    got = _grads(out, lse, leaves)
    want = _grads(ro[:, :, q0 : q0 + Tq], rl[:, :, q0 : q0 + Tq], leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.slow
def test_gradients_through_a_rolling_buffer_and_padding():
    """Slots out of order (a wrapped ring) and left padding: gradients flow to the
    slots that hold the keys, and none to slots outside every view."""
    kw = dict(window_size=(5, 0), num_sinks=2, softcap=2.0)
    q, k, v = (x.double() for x in _inputs(1, 24, seed=7))
    # A ring of 2 sinks + 8 slots after position 23: slot 2 + (p - 2) % 8.
    pos = torch.tensor([0, 1] + [p for p in range(16, 24)])
    slot = torch.tensor([0, 1] + [2 + (p - 2) % 8 for p in range(16, 24)])
    kr = torch.zeros(1, HKV, 10, D, dtype=torch.float64)
    vr = torch.zeros_like(kr)
    kr[:, :, slot], vr[:, :, slot] = k[:, :, pos], v[:, :, pos]
    slot_pos = torch.full((10,), -1, dtype=torch.int32)
    slot_pos[slot] = pos.to(torch.int32)
    qs, kr, vr = (x.clone().requires_grad_(True) for x in (q[:, :, 21:], kr, vr))
    out, lse = swa_tvm.attention_with_kv_cache(qs, kr, vr, kv_positions=slot_pos, return_lse=True, **kw)
    q2, k2, v2 = (x.clone().requires_grad_(True) for x in (q, k, v))
    ro, rl = reference(q2, k2, v2, **kw)
    got = _grads(out, lse, [qs, kr, vr])
    want = _grads(ro[:, :, 21:], rl[:, :, 21:], [q2, k2, v2])
    torch.testing.assert_close(got[0], want[0][:, :, 21:], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got[1][:, :, slot], want[1][:, :, pos], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got[2][:, :, slot], want[2][:, :, pos], atol=1e-10, rtol=1e-10)
    # Left padding (NaN in the pads): the pad slots get zero gradient, the rest the
    # gradient of the prompt run alone.
    pad = 4
    kp, vp = k.clone(), v.clone()
    kp[:, :, :pad] = float("nan")
    vp[:, :, :pad] = float("nan")
    qp, kp, vp = (x.requires_grad_(True) for x in (q.clone(), kp, vp))
    out, lse = swa_tvm.attention_with_kv_cache(qp, kp, vp, kv_start=pad, return_lse=True, window_size=(5, 0))
    got = _grads(out[:, :, pad:], lse[:, :, pad:], [qp, kp, vp])
    q3, k3, v3 = (x[:, :, pad:].clone().requires_grad_(True) for x in (q, k, v))
    ro, rl = reference(q3, k3, v3, window_size=(5, 0))
    want = _grads(ro, rl, [q3, k3, v3])
    for a, b in zip(got, want):
        assert bool((a[:, :, :pad] == 0).all())
        torch.testing.assert_close(a[:, :, pad:], b, atol=1e-10, rtol=1e-10)


@pytest.mark.slow
def test_gradcheck_softcap_and_sinks():
    q, k, v = (x.double().requires_grad_(True) for x in _inputs(1, 9, seed=8))
    sink = torch.tensor([0.1, -0.3, 0.7, 0.0], dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sink):
        return swa_tvm.attention_with_kv_cache(q[:, :, 5:], k, v, window_size=(3, 0), dilation=2, num_sinks=1,
                                               sink_logits=sink, softcap=1.1, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v, sink), eps=1e-6, atol=1e-7)


@pytest.mark.slow
def test_float32_gradients():
    kw = PATTERNS["softcap"]
    q, k, v = (x.requires_grad_(True) for x in _inputs(2, 40, seed=9))
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, 30:], k, v, q_offset=30, return_lse=True, **kw)
    q2, k2, v2 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ro, rl = reference(q2, k2, v2, **kw)
    got = _grads(out, lse, [q, k, v])
    want = _grads(ro[:, :, 30:], rl[:, :, 30:], [q2, k2, v2])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


def test_compile_traces_without_graph_break():
    q, k, v = _inputs(1, 12)
    f = torch.compile(lambda q, k, v: swa_tvm.attention_with_kv_cache(q, k, v, window_size=(3, 0)), fullgraph=True)
    ro, _ = reference(q, k, v, window_size=(3, 0))
    torch.testing.assert_close(f(q[:, :, 11:], k, v).double(), ro[:, :, 11:], atol=2e-5, rtol=2e-5)


def test_exp_argument_is_a_stage_in_every_kind():
    """The CPU exp is a polynomial that copies its argument ~30 times, so every kernel
    passes it loads of stages (compute.forward._exp), never the mask or the softcap: the
    cache gradients once inlined theirs, and each of their compiles took seconds more.
    Each expanded exp holds only its own two Selects, or is the softcap's tanh (its own
    stage: the polynomial's two, and eight of the tanh's exp branch) with no mask in it."""
    from swa_tvm.compute import COMPUTES, prim_func
    from swa_tvm.spec import KernelSpec

    seen = set()
    for kind in sorted(COMPUTES):
        for extras in (False, True):
            try:
                spec = KernelSpec(kind=kind, head_dim=16, left=7, right=0, extras=extras,
                                  softcap=1.5 if kind.startswith("cache") else 0.0,
                                  block_q=16 if kind.startswith("cache") else 32)
                script = prim_func(spec).script()
            except (ValueError, AssertionError):  # a combination the kind does not serve
                continue
            exps = [ln for ln in script.split("\n") if "0.693359375" in ln]  # ln 2's high part
            assert exps, spec.name
            for ln in exps:
                tanh = "T.float32(0.625)" in ln  # compute.forward._tanh's branch point
                assert ln.count("T.Select(") == (10 if tanh and spec.softcap else 2), spec.name
                assert "T.tanh(" not in ln and "kv_pos[" not in ln, spec.name
            seen.add(kind)
    assert seen == set(COMPUTES)


def test_softcap_tanh_error():
    """The softcap's tanh (compute.forward._tanh: TVM's own is two scalar expf calls per
    lane on the CPU), evaluated in float32 as the kernels do: within 2.5e-7 of tanh,
    relative, over both branches and the boundary between them, and +-1, NaN and exact 0
    where tanh has them."""
    import numpy as np
    import tvm
    from tvm import te

    from swa_tvm.compute.forward import _tanh

    x = te.placeholder((1 << 16,), "float32", name="x")
    y = te.compute(x.shape, lambda i: _tanh(x[i], "float32"), name="y")
    f = tvm.compile(te.create_prim_func([x, y]), target="llvm")
    g = np.random.default_rng(0)
    mags = np.concatenate([np.geomspace(1e-30, 50.0, 30000), g.uniform(0.6, 0.65, 2000), [0.625]])
    finite = np.concatenate([mags, -mags]).astype("float32")
    xs = np.concatenate([finite, [0.0, 100.0, np.inf, -np.inf, np.nan]]).astype("float32")
    xs = np.pad(xs, (0, (1 << 16) - len(xs)), constant_values=0.5)
    out = tvm.runtime.tensor(np.empty_like(xs))
    f(tvm.runtime.tensor(xs), out)
    ys, exact = out.numpy(), np.tanh(xs.astype("float64"))
    n = len(finite)
    rel = np.abs(ys[:n] - exact[:n]) / np.abs(exact[:n])
    assert rel.max() < 2.5e-7, (rel.max(), xs[np.argmax(rel)])
    assert list(ys[n:n + 4]) == [0.0, 1.0, 1.0, -1.0] and np.isnan(ys[n + 4])


@pytest.mark.slow  # exports nine kernels
def test_library_serves_cache_calls(tmp_path):
    """An exported library with kvcache serves decode steps and chunks by its kernels."""
    from swa_tvm.runtime import library

    spec = swa_tvm.AttentionSpec.parse(f"head_dim={D},window=7:0,sinks,kvcache,softcap")
    assert {k.block_q for k in spec.kernels() if k.kind == "cache"} == {4, 8, 16}
    path = str(tmp_path / "kv.so")
    swa_tvm.export_library([spec], path, logs=None, warn_untuned=False)
    library.REGISTRY.clear()
    try:
        swa_tvm.load_library(path)
        q, k, v = _inputs(1, 30)
        kw = dict(window_size=(7, 0), num_sinks=2, softcap=3.0)
        ro, rl = reference(q, k, v, **kw)
        for q0, Tq in ((29, 1), (20, 10)):
            out, lse = swa_tvm.attention_with_kv_cache(q[:, :, q0 : q0 + Tq], k[:, :, : q0 + Tq], v[:, :, : q0 + Tq],
                                                       return_lse=True, **kw)
            _close(out, lse, ro[:, :, q0 : q0 + Tq], rl[:, :, q0 : q0 + Tq])
        with pytest.raises(ValueError, match="no kernel"):
            swa_tvm.attention_with_kv_cache(q[:, :, 29:], k, v, window_size=(7, 0))  # no sinks: not exported
    finally:
        library.REGISTRY.clear()


def test_scale_matches_default():
    q, k, v = _inputs(1, 9)
    a = swa_tvm.attention_with_kv_cache(q[:, :, 8:], k, v)
    b = swa_tvm.attention_with_kv_cache(q[:, :, 8:], k, v, scale=1 / math.sqrt(D))
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- packed


@pytest.mark.parametrize("pattern", _patterns("dilated", "two_sided"))
def test_packed_sequences_attend_within_each(pattern):
    """Sequences of different lengths packed together (cu_seqlens): each equals the
    full call on that sequence alone, forward and gradients (out and lse), and no
    window crosses a boundary."""
    kw = dict(PATTERNS[pattern])
    lens = [7, 1, 19, 12]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(10)
    q = torch.randn(total, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse = swa_tvm.sliding_window_attention_varlen(q, k, v, cu, return_lse=True, **kw)
    assert out.shape == (total, H, D) and lse.shape == (H, total)
    got = _grads(out, lse, [q, k, v])
    ro, rl = [], []
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        o, l_ = reference(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), **kw)
        ro.append(o[0].transpose(0, 1))
        rl.append(l_[0])
    ro, rl = torch.cat(ro), torch.cat(rl, dim=1)
    torch.testing.assert_close(out, ro, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, rl, atol=1e-10, rtol=1e-10)
    want = _grads(ro, rl, [q, k, v])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.slow
def test_gradcheck_packed():
    cu = torch.tensor([0, 3, 8])
    g = torch.Generator().manual_seed(11)
    q = torch.randn(8, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(8, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(8, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    f = lambda q, k, v: swa_tvm.sliding_window_attention_varlen(q, k, v, cu, window_size=(2, 1), num_sinks=1)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "cu,err,match",
    [
        (torch.tensor([1, 4, 10]), ValueError, "start at 0"),
        (torch.tensor([0, 4, 9]), ValueError, "end at"),
        (torch.tensor([0, 6, 4, 10]), ValueError, "increasing"),
        (torch.tensor([0, 4, 4, 10]), ValueError, "increasing"),
        (torch.tensor([0.0, 10.0]), TypeError, "integer"),
        (torch.tensor([[0, 10]]), ValueError, "cu_seqlens"),
        ([0, 10], TypeError, "cu_seqlens"),
    ],
)
def test_bad_cu_seqlens_is_named(cu, err, match):
    q, k = torch.randn(10, H, D), torch.randn(10, HKV, D)
    with pytest.raises(err, match=match):
        swa_tvm.sliding_window_attention_varlen(q, k, k, cu)


def test_softcap_in_the_full_sequence_function():
    """sliding_window_attention(softcap=...) equals the reference, forward and gradients,
    with every other option but global tokens, which it refuses by name."""
    kw = dict(window_size=(4, 0), dilation=torch.tensor([1, 2, 1, 2]), num_sinks=2, softcap=1.7)
    q, k, v = (x.double().requires_grad_(True) for x in _inputs(2, 21, seed=12))
    out, lse = swa_tvm.sliding_window_attention(q, k, v, return_lse=True, **kw)
    ro, rl = reference(q, k, v, **kw)
    _close(out, lse, ro, rl, torch.float64)
    for a, b in zip(_grads(out, lse, [q, k, v]), _grads(ro, rl, [q, k, v])):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="global"):
        swa_tvm.sliding_window_attention(q, k, v, softcap=1.0, global_idx=torch.tensor([[0], [3]], dtype=torch.int32))
    with pytest.raises(ValueError, match="softcap"):
        swa_tvm.sliding_window_attention(q, k, v, softcap=-1.0)
