"""Adversarial inputs: extreme integers, non-finite values where rows cannot see them,
learned sinks of +inf, and a fuzz over every argument. Each either returns the float64
reference's answer (swa_tvm.reference, whose mask is written from the docstring) or
raises TypeError/ValueError naming the argument."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import swa_tvm
from swa_tvm.reference import attention_mask, sliding_window_attention_ref

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def assert_like_reference(got, want, dtype, what):
    """Non-finite exactly where the reference is (NaN and inf alike: a row that sees a
    NaN key may show NaN or inf), and close wherever it is finite."""
    fin, got_fin = torch.isfinite(want), torch.isfinite(got)
    if not torch.equal(got_fin, fin):
        bad = (got_fin != fin).nonzero()[:4].tolist()
        raise AssertionError(f"{what}: finite where the reference is not, or the reverse, at {bad}")
    if fin.any():
        err = (got.double()[fin] - want[fin]).abs().max().item()
        scale = max(1.0, want[fin].abs().max().item())
        assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} (tolerance {TOL[dtype] * scale:.3g})"


def run_both(q, k, v, **kw):
    out, lse = swa_tvm.sliding_window_attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    assert_like_reference(out, ref_out, q.dtype, "out")
    assert_like_reference(lse, ref_lse, q.dtype, "lse")
    return out, lse


# -- extreme integers --------------------------------------------------------------

H, T, D = 2, 9, 8
BIG = 2**62  # the reference takes ints below int64's limit; beyond it, T + 5 means the same


def _ref_int(x: int) -> int:
    return x if abs(x) < BIG else T + 5


EXTREME = [
    # (label, window_size, dilation): sides of at least T - 1 reach everything; a
    # dilation of at least T reaches only the query (and the extras).
    ("int64 dilation wrapping int32", (3, 0), torch.full((H,), 2**32 + 1, dtype=torch.int64)),
    ("per-head int64 dilation", (2, 2), torch.tensor([1, 2**40], dtype=torch.int64)),
    ("dilation 2**30", (3, 0), 2**30),
    ("dilation 2**31", (3, 0), 2**31),
    ("dilation beyond int64", (3, 0), 2**64),
    ("window 2**31 - 40", (2**31 - 40, 0), 1),
    ("window 2**40", (2**40, 0), 1),
    ("window beyond int64", (2**63, 2**64), 1),
    ("window and dilation 2**16", (2**16, 2**16), 2**16),
    ("window T - 1", (T - 1, T - 1), 1),
]


@pytest.mark.parametrize("window,dilation", [c[1:] for c in EXTREME], ids=[c[0] for c in EXTREME])
def test_extreme_integers_mean_what_they_say(window, dilation):
    """Once a crash (bad_alloc), a hang, a TVM InternalError or a silent int32 wrap;
    now the reference's answer for the same pattern."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    out, lse = swa_tvm.sliding_window_attention(
        q, k, v, window_size=window, dilation=dilation, num_sinks=1, return_lse=True
    )
    ref_dil = dilation.clamp(max=BIG).tolist() if isinstance(dilation, torch.Tensor) else _ref_int(dilation)
    ref_dil = [_ref_int(d) for d in ref_dil] if isinstance(ref_dil, list) else ref_dil
    ref_out, ref_lse = sliding_window_attention_ref(
        q, k, v, window_size=tuple(_ref_int(w) for w in window),
        dilation=torch.tensor(ref_dil) if isinstance(ref_dil, list) else ref_dil, num_sinks=1,
    )
    assert_like_reference(out, ref_out, torch.float32, "out")
    assert_like_reference(lse, ref_lse, torch.float32, "lse")


# -- non-finite values a row cannot see ----------------------------------------------

PATTERNS = {
    "window edge": dict(window_size=(3, 0)),
    "dilation 2": dict(window_size=(3, 0), dilation=2),
    "symmetric + sinks": dict(window_size=(2, 2), num_sinks=2),
    "learned sinks": dict(window_size=(5, 0), sink_logits=torch.tensor([0.5, -1.0])),
    "causal globals": dict(window_size=(3, 0), global_idx=torch.tensor([[5, 20]], dtype=torch.int32)),
}
POISON_AT = 50  # key position: inside some rows' windows, outside most


def _poisoned(dtype, where: str, value: float, Tn=64):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, Tn, 8, generator=g).to(dtype) for _ in range(3))
    {"k": k, "v": v}[where][:, :, POISON_AT, 1] = value
    return q, k, v


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("where,value", [("v", math.nan), ("v", math.inf), ("k", math.nan), ("k", -math.inf)])
def test_non_finite_stays_with_the_rows_that_see_it(pattern, where, value):
    """T=64, one NaN or inf at key 50: only rows that see key 50 (per the reference's
    mask) may come out non-finite. Once rows 32-63 all did (p = 0 times v = NaN)."""
    q, k, v = _poisoned(torch.float32, where, value)
    out, _ = run_both(q, k, v, **PATTERNS[pattern])
    assert torch.isfinite(out[:, :, :POISON_AT - 8]).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_non_finite_stays_in_every_dtype(dtype, pattern):
    for where, value in (("v", math.nan), ("k", math.nan), ("v", -math.inf)):
        run_both(*_poisoned(dtype, where, value), **PATTERNS[pattern])


def test_non_finite_global_values_stay_with_the_global_rows_that_see_them():
    """A NaN in v_global at key 30 reaches the causal global row at 40 (it sees every
    earlier key), never the one at 5, nor any ordinary row (they read v)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(3))
    gi = torch.tensor([[5, 40]], dtype=torch.int32)
    kg, vg = torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g)
    vg[:, :, 30, 0] = math.nan
    out, _ = run_both(q, k, v, window_size=(3, 0), global_idx=gi, k_global=kg, v_global=vg)
    assert torch.isnan(out[:, :, 40, 0]).all()
    assert torch.isfinite(out[:, :, torch.arange(64) != 40]).all()


def _unaffected(mask, j):
    """Rows that cannot see key j, and keys no row that sees j also sees (their
    gradients involve no row whose out or delta the poison reached)."""
    sees = mask[..., j]  # [B, H, T]
    rows_free = ~sees
    keys_free = ~(mask & sees[..., None]).any(dim=2)  # [B, H, T]
    keys_free[..., j] = False
    return rows_free, keys_free


GRAD_CASES = [
    pytest.param(dtype, pattern, id=f"{pattern}-{str(dtype)[6:]}",
                 marks=() if (dtype, pattern) == (torch.float32, "window edge") else pytest.mark.slow)
    for dtype in (torch.float32, torch.float64) for pattern in ("window edge", "dilation 2", "symmetric + sinks", "causal globals")
]


@pytest.mark.parametrize("dtype,pattern", GRAD_CASES)
@pytest.mark.parametrize("where,value", [("v", math.nan), ("k", math.inf)])
def test_gradients_untouched_by_what_rows_cannot_see(dtype, pattern, where, value):
    """dq of a row that cannot see the poisoned key, and dk/dv of keys that no row seeing
    it sees, are finite and equal the reference gradients with the poison replaced by a
    finite value (they cannot depend on it)."""
    kw = PATTERNS[pattern]
    q, k, v = _poisoned(dtype, where, value)
    qs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = swa_tvm.sliding_window_attention(*qs, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    out.backward(dout)

    clean = [x.clone() for x in (q, k, v)]
    clean["kv".index(where) + 1][:, :, POISON_AT, 1] = 0.5
    refs = [x.double().requires_grad_() for x in clean]
    ref_out, _ = sliding_window_attention_ref(*refs, **kw)
    ref_out.backward(dout.double())

    mask, _ = attention_mask(64, 2, kw["window_size"], kw.get("dilation", 1), kw.get("global_idx"), kw.get("num_sinks", 0))
    rows_free, keys_free = _unaffected(mask.expand(1, 2, 64, 64), POISON_AT)
    assert rows_free.sum() > 30 and keys_free.sum() > 30
    for name, got, want, free in (("dq", qs[0].grad, refs[0].grad, rows_free), ("dk", qs[1].grad, refs[1].grad, keys_free),
                                  ("dv", qs[2].grad, refs[2].grad, keys_free)):
        assert_like_reference(got[free], want[free], dtype, name)


# -- learned sinks of +inf ----------------------------------------------------------

def test_infinite_sink_takes_the_whole_softmax():
    """sink_logits = +inf: out = 0 and lse = +inf for that head (the limit), once NaN;
    its q/k/v gradients are 0 and d sink = -(dout . out - dlse) = dlse summed; the other
    head is the reference's."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g, requires_grad=True) for _ in range(3))
    sink = torch.tensor([math.inf, 0.3], requires_grad=True)
    out, lse = swa_tvm.sliding_window_attention(q, k, v, window_size=(4, 0), sink_logits=sink, return_lse=True)
    assert (out[:, 0] == 0).all() and torch.isposinf(lse[:, 0]).all()
    dlse = torch.randn(lse.shape, generator=g)
    ((out * torch.randn(out.shape, generator=g)).sum() + (lse[:, 1] * dlse[:, 1]).sum()).backward()
    assert (q.grad[:, 0] == 0).all() and (k.grad[:, 0] == 0).all() and (v.grad[:, 0] == 0).all()
    assert sink.grad[0].item() == 0.0  # dlse of head 0 was not used, and out is 0 there

    refs = [x.detach().double()[:, 1:].requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = sliding_window_attention_ref(*refs, window_size=(4, 0), sink_logits=sink.detach()[1:])
    assert_like_reference(out[:, 1:].detach(), ref_out.detach(), torch.float32, "out")
    assert_like_reference(lse[:, 1:].detach(), ref_lse.detach(), torch.float32, "lse")


def test_infinite_sink_lse_gradient_is_the_limit():
    """With only lse in the loss, d sink = sum of dlse over the +inf head (p_sink = 1)."""
    q, k, v = (torch.randn(1, 1, 12, 8, requires_grad=True) for _ in range(3))
    sink = torch.tensor([math.inf], requires_grad=True)
    _, lse = swa_tvm.sliding_window_attention(q, k, v, window_size=(2, 0), sink_logits=sink, return_lse=True)
    w = torch.randn(lse.shape)
    (lse.clamp(max=1e30) * w).sum().backward()  # clamp: inf * w would make the loss NaN, not the op
    assert torch.isfinite(sink.grad).all() and (q.grad == 0).all()


# -- fuzz over every argument ---------------------------------------------------------

FUZZ_D = 8
FUZZ_WINDOWS = [(2, 0), (1, 1), (-1, 0), (-1, -1)]
HUGE = [2**31 - 40, 2**40, 2**63 - 1, 2**63, 2**64]


@st.composite
def adversarial(draw, dtypes):
    """One call: shapes, patterns, extreme integers, non-finite values anywhere, views,
    and now and then one bad argument (with the name its error must carry)."""
    dtype = draw(st.sampled_from(dtypes))
    B, Hkv = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    Hn, Tn = Hkv * draw(st.sampled_from([1, 2])), draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    left, right = draw(st.sampled_from(FUZZ_WINDOWS))
    # An unbounded side, or a side of T - 1 or more, written as any such int.
    side = lambda x: draw(st.sampled_from([-1, max(Tn - 1, 0), Tn + 3] + HUGE)) if x < 0 else x  # noqa: E731
    window = (side(left), side(right))
    kind = draw(st.sampled_from(["int", "huge int", "int32 heads", "int64 heads"]))
    if kind == "int":
        dilation = draw(st.integers(1, 4))
    elif kind == "huge int":
        dilation = draw(st.sampled_from([Tn, Tn + 1] + HUGE))
    else:
        values = draw(st.lists(st.sampled_from([1, 2, 3, Tn + 2] + ([2**32 + 1, 2**40] if kind == "int64 heads" else [2**31 - 1])),
                               min_size=Hn, max_size=Hn))
        dilation = torch.tensor(values, dtype=torch.int64 if kind == "int64 heads" else torch.int32)
    kw = dict(window_size=window, dilation=dilation)
    G = draw(st.integers(0, min(2, Tn)))
    if G:
        kw["global_idx"] = torch.stack([torch.randperm(Tn, generator=g)[:G] for _ in range(B)]).to(torch.int32)
        if draw(st.booleans()):
            kw["v_global"] = torch.randn(B, Hkv, Tn, FUZZ_D, generator=g).to(dtype)
    kw["num_sinks"] = draw(st.integers(0, min(2, Tn)))
    if draw(st.booleans()):
        sink = torch.randn(Hn, generator=g)
        sink[0] = draw(st.sampled_from([0.0, math.inf, -math.inf, 40.0]))
        kw["sink_logits"] = sink
    scale = draw(st.sampled_from([None, 0.3, 1e-30, 1e20]))
    if scale is not None:
        kw["scale"] = scale
    # q, k, v as [B, T, H, D] storage seen as [B, H, T, D] (non-contiguous) or plain.
    def tensor(h):
        if draw(st.booleans()):
            return torch.randn(B, Tn, h, FUZZ_D, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(B, h, Tn, FUZZ_D, generator=g).to(dtype)
    q, k, v = tensor(Hn), tensor(Hkv), tensor(Hkv)
    for _ in range(draw(st.integers(0, 2))):
        target = draw(st.sampled_from(["k", "v", "v_global"] if "v_global" in kw else ["k", "v"]))
        x = {"k": k, "v": v}.get(target, kw.get("v_global"))
        x[draw(st.integers(0, B - 1)), draw(st.integers(0, Hkv - 1)), draw(st.integers(0, Tn - 1)),
          draw(st.integers(0, FUZZ_D - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    bad = None
    if draw(st.integers(0, 5)) == 0:
        bad, value = draw(st.sampled_from([
            ("window_size left", (-2 - 2**40, 0)), ("dilation", 0), ("dilation", -2**64), ("num_sinks", Tn + 1),
            ("num_sinks", 2**64), ("scale", 1e39 if dtype != torch.float64 else math.nan), ("scale", -0.5),
            ("scale", math.inf), ("sink_logits", [1.0] * Hn),
        ]))  # 1e39 overflows only float32 scores: float64 inputs take it
        key = "window_size" if bad.startswith("window") else bad
        kw[key] = value
    return q, k, v, kw, bad


def _fuzz_one(case):
    q, k, v, kw, bad = case
    if bad is not None:
        with pytest.raises((TypeError, ValueError), match=bad):
            swa_tvm.sliding_window_attention(q, k, v, **kw)
        return
    out, lse = swa_tvm.sliding_window_attention(q, k, v, return_lse=True, **kw)
    ref_kw = dict(kw)
    ref_kw["window_size"] = tuple(x if x < BIG else q.shape[2] + 3 for x in kw["window_size"])
    d = kw["dilation"]
    ref_kw["dilation"] = d.clamp(max=q.shape[2] + 1) if isinstance(d, torch.Tensor) else min(d, q.shape[2] + 1)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, **ref_kw)
    assert_like_reference(out, ref_out, q.dtype, "out")
    assert_like_reference(lse, ref_lse, q.dtype, "lse")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial([torch.float32]))
def test_fuzz_every_argument(case):
    _fuzz_one(case)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_fuzz_every_argument_every_dtype(case):
    _fuzz_one(case)


# -- the plain and nonfinite kernels ---------------------------------------------------

def _registered(nonfinite: bool) -> set:
    from swa_tvm.runtime import library

    return {k.spec.name for k in library.REGISTRY.kernels("cpu") if k.spec.nonfinite == nonfinite}


def test_finite_calls_take_the_plain_kernels_nonfinite_ones_the_guarded(fresh_registry):
    """The guarded (nonfinite) kernels cost a select per product, so a call with finite
    inputs never compiles or runs them; one whose result shows a NaN is computed again
    with them, and gets the reference's answer."""
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    run_both(q, k, v, window_size=(3, 0))
    assert _registered(True) == set() and len(_registered(False)) == 1
    v[:, :, 30, 2] = math.nan
    out, _ = run_both(q, k, v, window_size=(3, 0))
    assert len(_registered(True)) == 1
    assert torch.isfinite(out[:, :, :30]).all() and torch.isfinite(out[:, :, 34:]).all()


def test_library_without_nonfinite_kernels_refuses_by_name(tmp_path, fresh_registry):
    """A loaded library serves only what it holds: a NaN input needs its nonfinite
    kernels, and without them the call says so instead of returning a leaked NaN."""
    from swa_tvm.spec import AttentionSpec

    plain = str(tmp_path / "plain.so")
    swa_tvm.export_library([AttentionSpec(head_dim=8, window=(3, 0))], plain, warn_untuned=False)
    swa_tvm.load_library(plain)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    run_both(q, k, v, window_size=(3, 0))
    v[:, :, 30, 2] = math.nan
    with pytest.raises(ValueError, match="export with 'nonfinite' in the spec"):
        swa_tvm.sliding_window_attention(q, k, v, window_size=(3, 0))

    fresh_registry.clear()
    both = str(tmp_path / "both.so")
    swa_tvm.export_library([AttentionSpec.parse("head_dim=8,window=3:0,nonfinite")], both, warn_untuned=False)
    swa_tvm.load_library(both)
    run_both(q, k, v, window_size=(3, 0))


def test_spec_bounds_and_nonfinite_flag():
    from swa_tvm.spec import MAX_SPEC_INT, AttentionSpec, KernelSpec

    with pytest.raises(ValueError, match="left must be at most"):
        KernelSpec("local", 8, "float32", MAX_SPEC_INT + 1, 0)
    with pytest.raises(ValueError, match="max_dilation must be at most"):
        KernelSpec("local", 8, "float32", 3, 0, max_dilation=2**31)
    kernels = AttentionSpec.parse("head_dim=8,window=3:0,globals,backward,nonfinite").kernels()
    # Every kernel has its nonfinite twin but the five-product backward (no NaN rule).
    plain = [k for k in kernels if not k.nonfinite and k.kind != "local_bwd"]
    assert sum(k.nonfinite for k in kernels) == len(plain) == 6
    assert {k.name for k in kernels if k.nonfinite} == {k.name + "_nf" for k in plain}
