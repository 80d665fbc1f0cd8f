"""Gradients of every pattern: torch autograd through the dense float64 reference,
torch.autograd.gradcheck on the float64 kernels, opcheck and torch.compile."""

import pytest
import torch

import swa_tvm
from conftest import rel_err
from swa_tvm.reference import sliding_window_attention_ref as ref


def _case(B, H, Hkv, T, D, G=0, separate=False, slog=False, dtype=torch.float64, seed=0):
    """Fresh random leaves (requires_grad) and the keyword arguments of one call."""
    g = torch.Generator().manual_seed(seed)
    leaf = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v = leaf(B, H, T, D), leaf(B, Hkv, T, D), leaf(B, Hkv, T, D)
    kw = {}
    if G:
        kw["global_idx"] = torch.stack([torch.randperm(T, generator=g)[:G] for _ in range(B)]).to(torch.int32)
    if separate:
        kw.update(q_global=leaf(B, H, G, D), k_global=leaf(B, Hkv, T, D), v_global=leaf(B, Hkv, T, D))
    if slog:
        kw["sink_logits"] = leaf(H)
    return (q, k, v), kw


def _leaves(qkv, kw):
    return list(qkv) + [kw[n] for n in ("q_global", "k_global", "v_global", "sink_logits") if n in kw]


def check_grads(qkv, kw, tol):
    """Gradients of <out, R1> + <lse, R2> (so the lse output's gradient path counts
    too) from the kernels against autograd through the float64 dense reference."""
    out, lse = swa_tvm.sliding_window_attention(*qkv, return_lse=True, **kw)
    r_out, r_lse = ref(*qkv, **kw)
    d_out, d_lse = torch.randn_like(r_out), torch.randn_like(r_lse)
    leaves = _leaves(qkv, kw)
    got = torch.autograd.grad((out.double() * d_out).sum() + (lse.double() * d_lse).sum(), leaves)
    want = torch.autograd.grad((r_out * d_out).sum() + (r_lse * d_lse).sum(), leaves)
    names = ["q", "k", "v"] + [n for n in ("q_global", "k_global", "v_global", "sink_logits") if n in kw]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == leaves[names.index(name)].dtype
        assert torch.isfinite(a).all(), f"d{name} is not finite"
        e = rel_err(a, b)
        assert e < tol, f"d{name} relative error {e:.2e} >= {tol}"


# Small float64 cases: every pattern and combination. Every case has a head with
# dilation 3 or 4, so all share few compiled kernel sets (max_dilation 4; window (3, 1)
# or causal (2, 0); with or without extra keys), which keeps the compile time in check.
D64 = 8
PER_HEAD = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
MOSTLY_ONE = torch.tensor([1, 1, 1, 3], dtype=torch.int32)
CASES = {
    "asymmetric": ((3, 1), dict(), dict(dilation=MOSTLY_ONE)),
    "causal_gqa": ((2, 0), dict(Hkv=2), dict(dilation=MOSTLY_ONE)),
    "dilation_per_head": ((3, 1), dict(), dict(dilation=PER_HEAD)),
    "dilation_causal": ((2, 0), dict(Hkv=1), dict(dilation=3)),
    "globals_shared": ((3, 1), dict(G=3), dict(dilation=PER_HEAD)),
    "globals_separate_gqa": ((3, 1), dict(G=2, separate=True, Hkv=2), dict(dilation=MOSTLY_ONE)),
    "globals_causal_separate": ((2, 0), dict(G=3, separate=True), dict(dilation=PER_HEAD)),
    "sinks": ((2, 0), dict(slog=True), dict(num_sinks=2, dilation=MOSTLY_ONE)),
    "sink_logits_only": ((3, 1), dict(slog=True), dict(dilation=PER_HEAD)),
    "everything": ((2, 0), dict(G=2, separate=True, slog=True, Hkv=2), dict(num_sinks=3, dilation=4)),
    "unbounded": ((-1, -1), dict(), dict()),
}


def _make(name, seed=0, B=2, T=23):
    window, shape, extra = CASES[name]
    shape = {"B": B, "H": 4, "Hkv": 4, "T": T, "D": D64, **shape}
    qkv, kw = _case(seed=seed, **shape)
    kw.update(extra, window_size=window)
    return qkv, kw


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference_autograd(name):
    check_grads(*_make(name), tol=1e-10)


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck(name):
    qkv, kw = _make(name, seed=1, B=1, T=13)
    float_kw = {n: kw.pop(n) for n in ("q_global", "k_global", "v_global", "sink_logits") if n in kw}
    names = list(float_kw)

    def fn(q, k, v, *rest):
        out, lse = swa_tvm.sliding_window_attention(q, k, v, return_lse=True, **kw, **dict(zip(names, rest)))
        return out, lse

    assert torch.autograd.gradcheck(fn, tuple(qkv) + tuple(float_kw.values()), fast_mode=True)


@pytest.mark.slow  # compiles float32 kernel sets of its own
def test_float32_larger_shapes():
    # fp32 kernels on longer rows, against the float64 reference's gradients.
    for name, window in (("globals", (3, 1)), ("causal", (2, 0))):
        dil = torch.tensor([1, 2, 3, 1], dtype=torch.int32)  # the forward kernels of test_patterns
        qkv, kw = _case(2, 4, 2, 300, 16, G=3, separate=name == "globals", slog=True, dtype=torch.float32, seed=5)
        check_grads(qkv, dict(kw, window_size=window, dilation=dil, num_sinks=1), tol=2e-5)


# Half precision on the CPU (float32 accumulation, one rounding to the input dtype):
# the tolerances are the GPU check's, the rounding of out and of each gradient.
HALF_CASES = ("everything", "dilation_per_head", "causal_gqa", "unbounded")


@pytest.mark.slow  # a bf16 and an fp16 kernel set per case
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", HALF_CASES)
def test_half_precision_on_cpu(name, dtype):
    from tools.gpu_check import GRAD_TOLERANCE, TOLERANCE

    window, shape, extra = CASES[name]
    qkv, kw = _case(seed=7, dtype=dtype, **{"B": 2, "H": 4, "Hkv": 4, "T": 40, "D": 16, **shape})
    if "sink_logits" in kw:  # learned sink logits stay float32, as a model's parameters would
        kw["sink_logits"] = kw["sink_logits"].detach().float().requires_grad_()
    kw.update(extra, window_size=window)
    out, lse = swa_tvm.sliding_window_attention(*qkv, return_lse=True, **kw)
    r_out, r_lse = ref(*qkv, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, r_out) < TOLERANCE[dtype][0] and (lse.double() - r_lse).abs().max() < 1e-4
    check_grads(qkv, kw, tol=GRAD_TOLERANCE[dtype])


def test_integer_inputs_need_no_grad():
    # Only the float tensors require grad; dilation and global_idx are int32 tables.
    qkv, kw = _make("globals_shared")
    out = swa_tvm.sliding_window_attention(*qkv, **kw)
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in qkv)
    assert kw["global_idx"].grad is None and kw["dilation"].grad is None


def test_only_lse_used():
    # A loss on lse alone: the out gradient arrives as zeros, lse's drives everything.
    qkv, kw = _make("sinks")
    _, lse = swa_tvm.sliding_window_attention(*qkv, return_lse=True, **kw)
    g = torch.autograd.grad(lse.sum(), qkv[0])[0]
    r = torch.autograd.grad(ref(*qkv, **kw)[1].sum(), qkv[0])[0]
    assert rel_err(g, r) < 1e-10


def test_opcheck_all_checks():
    qkv, kw = _make("everything", T=17)
    q, k, v = (x.detach().requires_grad_() for x in qkv)
    args = (
        q, k, v, torch.full((4,), 4, dtype=torch.int32), kw["global_idx"], kw["q_global"], kw["k_global"], kw["v_global"],
        3, kw["sink_logits"], 0.3, 2, 0,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.swa_tvm.attention.default, args)  # every check, autograd and aot included
    qkv, kw = _make("asymmetric", T=17)
    args = (*qkv, MOSTLY_ONE, None, None, None, None, 0, None, 0.3, 3, 1)
    torch.library.opcheck(torch.ops.swa_tvm.attention.default, args)


def test_torch_compile_fullgraph_backward():
    qkv, kw = _make("globals_separate_gqa")

    def loss(q, k, v, qg, kg, vg):
        out, lse = swa_tvm.sliding_window_attention(
            q, k, v, window_size=(3, 1), dilation=MOSTLY_ONE, global_idx=kw["global_idx"], q_global=qg, k_global=kg,
            v_global=vg, return_lse=True,
        )
        return (out * out).sum() + lse.sum()

    leaves = _leaves(qkv, kw)
    compiled = torch.compile(loss, fullgraph=True, backend="inductor")
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(loss(*leaves), leaves)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-10
    r_out, r_lse = ref(*qkv, **kw)
    r = torch.autograd.grad((r_out * r_out).sum() + r_lse.sum(), leaves)
    for a, b in zip(got, r):
        assert rel_err(a, b) < 1e-10


@pytest.mark.slow  # points of the tuning search space, compiled
def test_sampled_backward_schedules_replay_and_are_correct(fresh_registry):
    """Random points of the backward kernels' search spaces, sampled on the concrete
    tuning workload and replayed on the symbolic-T kernels (as export does with a
    record), give the reference gradients at another shape."""
    import types

    import tvm
    from tvm import s_tir

    from swa_tvm.runtime import library
    from swa_tvm.compiler.targets import _vector_lanes, host_target
    from swa_tvm.compiler.build import compile_specs
    from swa_tvm.compiler.records import tuning_workload
    from swa_tvm.schedules import cpu
    from swa_tvm.spec import AttentionSpec

    specs = AttentionSpec(8, (2, 0), max_dilation=4, globals=True, sinks=True, dtype="float64", backward=True).kernels()
    lanes = _vector_lanes(tvm.target.Target(host_target()))
    records = {}
    for spec in specs:
        sch = s_tir.Schedule(tuning_workload(spec), seed=7)
        cpu.schedule(sch, spec, lanes, cpu.Sampled())
        records[spec.name] = types.SimpleNamespace(trace=sch.trace)
    module, _ = compile_specs(specs, host_target(), records)
    for spec in specs:
        fresh_registry.add(library.Kernel(spec, module[spec.name], "cpu", "test"), module)
    check_grads(*_make("everything", seed=3), tol=1e-10)


def test_library_without_backward_kernels_says_so(fresh_registry):
    from swa_tvm.runtime import library
    from swa_tvm.compiler.jit import get_or_build_kernel
    from swa_tvm.spec import KernelSpec

    qkv, kw = _make("asymmetric")
    fwd = get_or_build_kernel(KernelSpec("local", D64, "float64", 3, 1, 4, False))
    fresh_registry.clear()
    fresh_registry.add(library.Kernel(fwd.spec, fwd.func, "cpu", "forward_only.so"))
    fresh_registry.add_library("forward_only.so")  # as if that library were loaded
    out = swa_tvm.sliding_window_attention(*qkv, **kw)  # the forward is served
    with pytest.raises(ValueError, match="export with 'backward' in the spec"):
        out.sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_statistic_in_pieces_matches_float64(dtype, monkeypatch):
    """delta = dout . out - dlse, taken piece by piece for 16-bit rows on the CPU: equal
    to the float64 sum over pieces that end mid-tensor, for a non-contiguous dout, with
    and without dlse."""
    from swa_tvm import eager

    monkeypatch.setattr(eager, "DELTA_PIECE", 7 * 64)  # 7 rows of D=64 a piece: 3 * 2 * 333 is no multiple
    dout = torch.randn(3, 2, 64, 333).to(dtype).transpose(-1, -2)  # [B, H, T, D], not contiguous
    out = torch.randn(3, 2, 333, 64).to(dtype)
    dlse = torch.randn(3, 2, 333)
    want = (dout.double() * out.double()).sum(-1)
    for lse_grad, expected in ((None, want), (dlse, want - dlse.double())):
        got = eager._row_delta(dout, out, lse_grad, torch.float32)
        assert got.dtype == torch.float32 and got.shape == (3, 2, 333)
        assert (got.double() - expected).abs().max() < 1e-4
