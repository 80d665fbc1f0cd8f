"""The NaN rule on the fused CUDA kernels, run on the CPU (thread loops serial, mma,
wgmma and shuffles emulated lane by lane, as in test_cuda_emulated.py): a key a row
does not see contributes exactly nothing to that row, whatever its k or v hold (NaN,
+-inf: an unwritten KV-cache slot), nor does one the softmax gives a weight of exactly
0 (the reference's rule); keys a row does see propagate NaN and inf. So NaN and inf go
into k and v where some rows of a tile see them and others do not (a window's edge
inside a block, a causal row's future, a chunk's rows clamped past either end of the
sequence, the padding of the extra keys), and every output (out, lse, gradients) is
held to a float64 reference computed pair by pair under that rule (``nan_reference``):
finite where it is, equal there, non-finite where it is not."""

import math

import pytest
import torch
from conftest import rand, rel_err
from cuda_helpers import serial_on_cpu

from swa_tvm import eager
from swa_tvm.reference import attention_mask
from swa_tvm.spec import KernelSpec

# Compiles each kernel serially for the CPU, many with mma emulated: `make test`, not `make check`.
pytestmark = pytest.mark.slow

NAN, INF = float("nan"), float("inf")
T_LEN = 128


def weighted(w, x):
    """sum over keys j of w[..., i, j] * x[..., i, j, :], where a weight of 0 adds
    nothing whatever x holds there (0 * NaN would be NaN)."""
    return torch.where((w != 0)[..., None], w[..., None] * x, 0.0).sum(-2)


def nan_reference(q, k, v, *, window_size, dilation=1, global_idx=None, q_global=None, k_global=None,
                  v_global=None, num_sinks=0, sink_logits=None, scale=None, d_out=None, d_lse=None):
    """float64 (out, lse), and with ``d_out`` the gradients (dq, dk, dv, dq_global,
    dk_global, dv_global, dsink_logits; None where not given) as the backward computes
    them from out, lse, delta = d_out . out - d_lse: pair by pair, with
    ``sliding_window_attention_ref``'s mask and softmax, every product of a weight (P,
    dS) taken by ``weighted``: a key outside a row's view (weight exactly 0) adds
    nothing. O(B H T^2 D): small shapes only."""
    q, k, v = (x.double() for x in (q, k, v))
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    rep = lambda x: x.double().repeat_interleave(H // x.shape[1], dim=1)  # noqa: E731
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dil = dilation.tolist() if isinstance(dilation, torch.Tensor) else int(dilation)
    mask, is_global = attention_mask(T, H, tuple(window_size), dil, global_idx, num_sinks)
    mask = mask.expand(B, H, T, T)
    glob = is_global.expand(B, T)[:, None, :, None, None] if global_idx is not None else torch.zeros(1, 1, T, 1, 1, dtype=torch.bool)
    gi = global_idx.long() if global_idx is not None else None
    rows_q = q
    if q_global is not None:
        rows_q = q.scatter(2, gi[:, None, :, None].expand(B, H, gi.shape[1], D), q_global.double())
    kl, vl = rep(k)[:, :, None], rep(v)[:, :, None]
    kg = rep(k_global)[:, :, None] if k_global is not None else kl
    vg = rep(v_global)[:, :, None] if v_global is not None else vl
    rows_k = torch.where(glob, kg, kl).expand(B, H, T, T, D)
    rows_v = torch.where(glob, vg, vl).expand(B, H, T, T, D)
    seen = mask[..., None]
    scores = torch.where(seen, rows_q[:, :, :, None, :] * rows_k, 0.0).sum(-1) * scale
    scores = scores.masked_fill(~mask, -INF)
    full = scores
    if sink_logits is not None:
        full = torch.cat([scores, sink_logits.double().view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.where(mask, torch.exp(scores - lse[..., None]), 0.0)
    out = weighted(p, rows_v)
    if d_out is None:
        return out, lse
    d_out, d_lse = d_out.double(), d_lse.double()
    delta = (d_out * out).sum(-1) - d_lse
    dp = torch.where(mask, (d_out[:, :, :, None, :] * torch.where(seen, rows_v, 0.0)).sum(-1), 0.0)
    ds = torch.where(p != 0, p * (dp - delta[..., None]), 0.0)
    d_rows_q = weighted(ds, rows_k) * scale
    # A key's gradients from the rows (as [B, H, key, row, D] pairs), split by the rows'
    # kind (local rows: k and v; global rows: the global projections where given),
    # summed over a GQA group.
    row_glob = glob[..., 0]  # [B|1, 1, row, 1]
    qx, ox = rows_q[:, :, None].expand(B, H, T, T, D), d_out[:, :, None].expand(B, H, T, T, D)

    def by_kind(w, x, kind):
        return weighted(torch.where(row_glob == kind, w, 0.0).transpose(-1, -2), x)

    group = lambda x: x.reshape(B, Hkv, H // Hkv, T, D).sum(2)  # noqa: E731
    sep_k, sep_v = k_global is not None, v_global is not None
    dk = group(by_kind(ds, qx, False) * scale if sep_k else weighted(ds.transpose(-1, -2), qx) * scale)
    dv = group(by_kind(p, ox, False) if sep_v else weighted(p.transpose(-1, -2), ox))
    dq = d_rows_q.clone()
    dqg = dkg = dvg = dsink = None
    if q_global is not None:
        dqg = torch.gather(d_rows_q, 2, gi[:, None, :, None].expand(B, H, gi.shape[1], D))
        dq = dq.masked_fill(is_global.expand(B, T)[:, None, :, None], 0.0)
    if sep_k:
        dkg = group(by_kind(ds, qx, True) * scale)
    if sep_v:
        dvg = group(by_kind(p, ox, True))
    if sink_logits is not None:
        dsink = -(torch.exp(sink_logits.double().view(1, H, 1) - lse) * delta).sum((0, 2))
    return dq, dk, dv, dqg, dkg, dvg, dsink


def test_nan_reference_is_the_reference_on_finite_inputs():
    """On finite inputs the pair-by-pair reference is the dense one: values, and
    gradients against autograd through it, with globals (separate projections), sinks,
    dilation and GQA."""
    from swa_tvm.reference import sliding_window_attention_ref

    B, H, Hkv, T, D, G = 2, 4, 2, 40, 8, 2
    leaf = lambda *shape: rand(*shape, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = leaf(B, H, T, D), leaf(B, Hkv, T, D), leaf(B, Hkv, T, D)
    kw = dict(window_size=(3, 0), dilation=torch.tensor([1, 2, 1, 3], dtype=torch.int32),
              global_idx=torch.tensor([[3, 30], [39, 5]], dtype=torch.int32), num_sinks=2,
              q_global=leaf(B, H, G, D), k_global=leaf(B, Hkv, T, D), v_global=leaf(B, Hkv, T, D), sink_logits=leaf(H))
    leaves = [q, k, v, kw["q_global"], kw["k_global"], kw["v_global"], kw["sink_logits"]]
    got, want = nan_reference(q, k, v, **kw), sliding_window_attention_ref(q, k, v, **kw)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-12
    d_out, d_lse = torch.randn_like(want[0]), torch.randn_like(want[1])
    grads = torch.autograd.grad((want[0] * d_out).sum() + (want[1] * d_lse).sum(), leaves)
    mine = nan_reference(q, k, v, **kw, d_out=d_out, d_lse=d_lse)
    for name, a, b in zip(("dq", "dk", "dv", "dqg", "dkg", "dvg", "dsink"), mine, grads):
        assert (a - b).abs().max() < 1e-10, name
    # Without separate projections, the global rows' shares land on q, k and v.
    for x in ("q_global", "k_global", "v_global"):
        kw.pop(x)
    want = sliding_window_attention_ref(q, k, v, **kw)
    grads = torch.autograd.grad((want[0] * d_out).sum() + (want[1] * d_lse).sum(), [q, k, v])
    mine = nan_reference(q, k, v, **kw, d_out=d_out, d_lse=d_lse)
    for name, a, b in zip(("dq", "dk", "dv"), mine, grads):
        assert (a - b).abs().max() < 1e-10, name


def poisoned(x, where):
    """x with x[..., position, column] = value for each (position, column, value)."""
    x = x.clone()
    for pos, col, value in where:
        x[..., pos, col] = value
    return x


def assert_nan_rule(name, got, want, tol, keep=None):
    """``got`` (a kernel's) against ``want`` (``nan_reference``'s, float64): finite
    exactly where ``want`` is, and within ``tol`` (relative) there. ``keep``: a mask of
    the entries to compare (broadcast over trailing dimensions). The message names the
    first leading-index rows (all but the last dimension) that differ."""
    got, want = got.double(), want.double()
    if keep is not None:
        while keep.dim() < got.dim():
            keep = keep[..., None]
        keep = keep.expand_as(got)
    else:
        keep = torch.ones_like(got, dtype=torch.bool)
    finite = torch.isfinite(want)
    wrong = (torch.isfinite(got) != finite) & keep
    if wrong.any():
        lead = wrong.reshape(-1, wrong.shape[-1]).any(-1) if wrong.dim() > 1 else wrong
        idx = lead.nonzero().flatten()[:12].tolist()
        shape = wrong.shape[:-1] if wrong.dim() > 1 else wrong.shape
        rows = [tuple(torch.unravel_index(torch.tensor(i), shape)[j].item() for j in range(len(shape))) for i in idx]
        leaked = int((torch.isfinite(want) & ~torch.isfinite(got) & keep).sum())
        missed = int((~torch.isfinite(want) & torch.isfinite(got) & keep).sum())
        raise AssertionError(f"{name}: {leaked} values non-finite where the reference is finite, {missed} finite where "
                             f"it is not; first rows {rows}")
    both = finite & keep
    e = rel_err(torch.where(both, got, 0.0), torch.where(both, want, 0.0))
    assert e < tol, f"{name}: relative error {e:.2e} >= {tol} on the finite entries"


# Forward local cases: window, per-head dilation, global positions (None: no extra
# keys), sinks, and the poison: (tensor, position, column, value). Positions are
# picked so that each poisoned key is seen by a few rows only (a window's edge inside
# a block and chunk); columns differ so that each poison's rows show apart.
LOCAL_CASES = {
    # Causal window: keys in the future of rows of their own block, 0 * NaN in P V and
    # (backward) dS K; a duplicate global position makes a padding entry of the extra
    # keys, which loads (clamped) position 0; the global position 100 is in the
    # future of every row before it (the extra keys' chunk).
    "causal_extras": ((3, 0), [1, 2], [[40, 40, 100]], 0, [
        ("v", 50, 0, NAN), ("v", 90, 1, INF), ("k", 20, 2, NAN), ("k", 66, 3, INF), ("v", 0, 4, -INF),
        ("v", 100, 5, NAN), ("k", 100, 6, INF), ("v", 77, 7, NAN),
    ]),
    # Both sides, dilation 2: chunks past either end of the sequence clamp their rows to
    # positions 0 and T - 1.
    "both_sides": ((5, 6), [2, 1], None, 0, [
        ("v", T_LEN - 1, 0, NAN), ("v", 0, 1, INF), ("k", T_LEN - 2, 2, NAN), ("k", 1, 3, -INF), ("v", 61, 4, NAN),
        ("k", 33, 5, NAN),
    ]),
    # A window long against the block, sinks and learned sink logits, the first head's
    # +inf (every key's weight exactly 0: out 0 whatever v holds): chunks every row sees
    # whole (no mask) next to edge ones.
    "long_window_sinks": ((40, 3), [1, 1], [[70]], 2, [
        ("v", 60, 0, NAN), ("v", 110, 1, INF), ("k", 30, 2, NAN), ("v", T_LEN - 1, 3, NAN), ("v", 70, 4, NAN),
    ]),
    # The backward's causal case: distinct global positions (each a global row once).
    "causal_globals": ((3, 0), [1, 2], [[40, 100]], 0, [
        ("v", 50, 0, NAN), ("v", 90, 1, INF), ("k", 20, 2, NAN), ("k", 66, 3, INF), ("v", 100, 5, NAN),
        ("v", 77, 7, NAN), ("k", 9, 4, NAN),
    ]),
}


def _local_inputs(dtype, case, D, B=1, H=2, Hkv=1, T=T_LEN, seed=0):
    """Inputs of one case, poisoned, the kernel's extra arguments, the rows a local
    kernel owns (global rows are the global kernel's), and the reference's keywords."""
    from swa_tvm.eager import _extra_positions

    window, dilation, gidx, sinks, poison = LOCAL_CASES[case]
    tdt = getattr(torch, dtype)
    torch.manual_seed(seed)
    q, k, v = rand(B, H, T, D).to(tdt), rand(B, Hkv, T, D).to(tdt), rand(B, Hkv, T, D).to(tdt)
    k = poisoned(k, [(p, c, x) for t, p, c, x in poison if t == "k"])
    v = poisoned(v, [(p, c, x) for t, p, c, x in poison if t == "v"])
    kw = dict(window_size=window, dilation=torch.tensor(dilation, dtype=torch.int32), sink_logits=rand(H))
    if gidx is not None:
        kw.update(global_idx=torch.tensor(gidx * B, dtype=torch.int32), num_sinks=sinks)
    extra = _extra_positions(kw.get("global_idx"), kw.get("num_sinks", 0), B, "cpu")
    rows = torch.ones(B, 1, T, dtype=torch.bool)
    for b, gs in enumerate(kw.get("global_idx", torch.empty(B, 0)).tolist()):
        rows[b, 0, gs] = False
    return (q, k, v), kw, ([extra] if extra is not None else []) + [kw["sink_logits"]], rows.expand(B, H, T)


TOL = {"float32": 1e-5, "float16": 5e-4, "bfloat16": 4e-3}


def _check_local(kernel, dtype, case, D):
    (q, k, v), kw, extra_args, keep = _local_inputs(dtype, case, D)
    B, H, T, _ = q.shape
    keep_lse = keep
    if case == "long_window_sinks":  # a +inf sink, as eager passes it (its lse set to +inf after)
        kw["sink_logits"][0] = INF
        extra_args[-1] = kw["sink_logits"].clone()
        extra_args[-1][0] = eager.SINK_CAP
        keep_lse = keep.clone()
        keep_lse[:, 0] = False
    out = torch.full((B, H, T, D), NAN, dtype=q.dtype)
    lse = torch.full((B, H, T), NAN)
    kernel(q, k, v, kw["dilation"], *extra_args, D**-0.5, out, lse)
    ref_out, ref_lse = nan_reference(q, k, v, **kw)
    # Every case leaves most rows finite, and some not: the check has something to hold.
    assert torch.isfinite(ref_out[keep]).float().mean() > 0.5 and not torch.isfinite(ref_out).all()
    assert_nan_rule(f"{case}: out", out, ref_out, TOL[dtype], keep)
    assert_nan_rule(f"{case}: lse", lse, ref_lse, 1e-4, keep_lse)


# The forward kernels: CUDA cores (small tiles: several items and chunks), tensor cores
# on mma.sync (synchronous loads; cp.async; two row tiles a warp; two K/V stages) and on
# wgmma (synchronous, cp.async, V transposed, overlapped, two stages); TCConfig fields.
FORWARD_KERNELS = {
    "cores": None,
    "tc": (2, 16),
    "tc_async": (2, 32, True, True),
    "tc_m2": (1, 32, True, True, 2),
    "tc_ring": (2, 16, True, True, 1, False, False, None, False, 2),
    "wgmma": (4, 16, True, False, 1, True),
    "wgmma_async": (4, 32, True, True, 1, True),
    "wgmma_vt": (4, 16, True, False, 1, True, True),
    "wgmma_overlap": (4, 16, True, False, 1, True, False, None, True),
    "wgmma_ring": (4, 16, True, True, 1, True, False, None, False, 2),
}
FORWARD_LOCAL = [(kern, case) for kern in FORWARD_KERNELS for case in ("causal_extras", "both_sides", "long_window_sinks")
                 if case != "long_window_sinks" or kern in ("cores", "tc", "wgmma", "wgmma_overlap")]


def _forward_func(kern, spec):
    from swa_tvm.schedules import cuda_flash, cuda_flash_tc

    if kern == "cores":
        return cuda_flash.flash(spec, cuda_flash.FlashConfig(32, 16, 64))
    return cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(*FORWARD_KERNELS[kern]), emulate=True)


@pytest.mark.parametrize("kern,case", FORWARD_LOCAL)
def test_forward_local_rows_keep_unseen_keys_out(kern, case):
    """The local forward kernels: out and lse against ``nan_reference``, with NaN and
    inf in k and v (``LOCAL_CASES``)."""
    window, dilation, gidx, _, _ = LOCAL_CASES[case]
    dtype, D = ("float32", 16) if kern == "cores" else ("bfloat16" if "wgmma" in kern else "float16", 32)
    spec = KernelSpec("local", D, dtype, *window, max_dilation=max(dilation), extras=gidx is not None)
    kernel = serial_on_cpu(_forward_func(kern, spec))[spec.name]
    _check_local(kernel, dtype, case, D)


# Global rows: (kernel, TCConfig fields or None). Causal: a global row sees no key past
# its position, so poison there must not reach it.
GLOBAL_KERNELS = {
    "cores": None,
    "tc": (2, 16, True, True),
    "tc_m2": (1, 16, True, True, 2),
    "tc_ring": (2, 16, True, True, 1, False, False, None, False, 2),
    "wgmma": (4, 16, True, False, 1, True),
    "wgmma_overlap": (4, 16, True, False, 1, True, False, None, True),
}


@pytest.mark.parametrize("kern", list(GLOBAL_KERNELS))
def test_forward_global_rows_keep_unseen_keys_out(kern):
    """The global rows' forward (causal; split-K in 3 pieces on tensor cores, empty
    ones among them): rows before a poisoned key stay finite and exact; a last, partial
    chunk clamps its rows to position T - 1, poisoned too."""
    from swa_tvm.schedules import cuda_flash, cuda_flash_tc

    dtype, D = ("float32", 16) if kern == "cores" else ("bfloat16", 32)
    spec = KernelSpec("global", D, dtype, 0, 0)
    if kern == "cores":
        func = cuda_flash.flash(spec, cuda_flash.FlashConfig(32, 16, 64))
    else:
        func = cuda_flash_tc.flash_tc(spec, cuda_flash_tc.TCConfig(*GLOBAL_KERNELS[kern]), emulate=True)
    kernel = serial_on_cpu(func)[spec.name]
    B, H, Hkv, T = 1, 2, 1, 150
    tdt = getattr(torch, dtype)
    torch.manual_seed(1)
    q, k, v = rand(B, H, T, D).to(tdt), rand(B, Hkv, T, D).to(tdt), rand(B, Hkv, T, D).to(tdt)
    k = poisoned(k, [(140, 0, NAN), (120, 1, INF)])
    v = poisoned(v, [(50, 2, NAN), (T - 1, 3, INF), (95, 4, -INF), (16, 5, NAN)])
    # 35 rows (a full block of 32 and a padded one; 64 on wgmma: one, padded), unsorted.
    gidx = torch.tensor([[int(x) for x in torch.randperm(T - 1)[:34]] + [T - 1]], dtype=torch.int32)
    gidx[0, :4] = torch.tensor([10, 45, 48, 15])
    sink = rand(H)
    ref_out, ref_lse = nan_reference(q, k, v, window_size=(3, 0), global_idx=gidx, sink_logits=sink)
    gi = gidx.long()
    G = gi.shape[1]
    qg = torch.gather(q, 2, gi[:, None, :, None].expand(B, H, G, D)).contiguous()
    out, lse = torch.full((B, H, G, D), NAN, dtype=tdt), torch.full((B, H, G), NAN)
    if kern == "cores":
        kernel(qg, k, v, gidx, sink, D**-0.5, out, lse)
    else:
        workspace = (torch.full((B, H, 3, G, D), NAN), torch.full((B, H, 3, G), NAN))
        kernel(qg, k, v, gidx, sink, D**-0.5, out, lse, *workspace)
    want_out = torch.gather(ref_out, 2, gi[:, None, :, None].expand(B, H, G, D))
    want_lse = torch.gather(ref_lse, 2, gi[:, None, :].expand(B, H, G))
    assert torch.isfinite(want_out).float().mean() > 0.5 and not torch.isfinite(want_out).all()
    assert_nan_rule("global out", out, want_out, TOL[dtype])
    assert_nan_rule("global lse", lse, want_lse, 1e-4)


# Backward builds: (gradient kernels, dtype, head dim, tiles). "cores": cuda_flash_bwd's
# BwdConfig; the others cuda_flash_bwd_tc's TCBwdConfig, mma emulated.
BACKWARD_BUILDS = {
    "cores": ("float32", 16, (16, 16, 64)),
    "tc": ("bfloat16", 32, (1, 16)),
    "tc_wgmma": ("bfloat16", 32, (4, 16, True, True)),
    "tc_ring": ("float16", 16, (2, 16, True, False, 2)),
    "tc_wgmma_ring": ("bfloat16", 32, (4, 16, True, True, 2)),
}
BACKWARD_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


@pytest.mark.parametrize("build,case,separate", [(b, c, sep) for b in BACKWARD_BUILDS
                                                 for c, sep in (("causal_globals", False), ("both_sides", False),
                                                                ("causal_globals", True))])
def test_backward_keeps_unseen_keys_out(build, case, separate, monkeypatch):
    """The whole backward (``eager.attention_backward``) on the fused gradient kernels,
    serial on the CPU: dq, dk, dv (and, with extra keys and global rows, their kernels'
    shares; the global rows' dq split-K in 3 pieces on tensor cores) and the sink
    gradient against ``nan_reference``'s, with the forward's poison (``separate``: the
    global rows with projections of their own, poisoned too, where the local kernels
    see the global rows with lse = +inf). What the reference makes non-finite spreads
    far in the backward (a row that sees NaN has NaN delta, and so every key it sees
    NaN dk), and exactly there."""
    from swa_tvm.runtime.library import GLOBAL_BWD_WORKSPACE, Kernel
    from swa_tvm.schedules import cuda_flash_bwd, cuda_flash_bwd_tc

    dtype, D, tiles = BACKWARD_BUILDS[build]

    def serial_kernel(want, device):
        if build == "cores":
            func = cuda_flash_bwd.flash_bwd(want, cuda_flash_bwd.BwdConfig(*tiles))
            return Kernel(want, serial_on_cpu(func)[want.name], device, "serial")
        func = cuda_flash_bwd_tc.flash_bwd_tc(want, cuda_flash_bwd_tc.TCBwdConfig(*tiles), emulate=True)
        workspace = GLOBAL_BWD_WORKSPACE if want.kind == "global_bwd" else None
        return Kernel(want, serial_on_cpu(func)[want.name], device, "serial, mma emulated", None, workspace)

    monkeypatch.setattr(eager, "_kernel", serial_kernel)
    monkeypatch.setattr(eager, "_fused_backward_kernel", lambda *a: None)  # a CPU kernel; CUDA's are emulated here
    monkeypatch.setattr(eager, "global_pieces", lambda B, H, G, T, device: 3)
    (q, k, v), kw, _, _ = _local_inputs(dtype, case, D)
    tdt = getattr(torch, dtype)
    B, H, T, _ = q.shape
    if separate:  # the global rows' own projections: a key in both rows' past, one in one's future
        G = kw["global_idx"].shape[1]
        kw.update(q_global=rand(B, H, G, D).to(tdt), k_global=poisoned(rand(B, 1, T, D), [(70, 1, NAN)]).to(tdt),
                  v_global=poisoned(rand(B, 1, T, D), [(20, 2, INF), (110, 3, NAN)]).to(tdt))
    ref_out, ref_lse = nan_reference(q, k, v, **kw)
    torch.manual_seed(2)
    d_out, d_lse = torch.randn_like(ref_out).to(tdt).double(), torch.randn_like(ref_lse)
    want = nan_reference(q, k, v, **kw, d_out=d_out, d_lse=d_lse)
    got = eager.attention_backward(
        d_out.to(tdt), d_lse.float(), q, k, v, kw["dilation"], kw.get("global_idx"), kw.get("q_global"),
        kw.get("k_global"), kw.get("v_global"), kw.get("num_sinks", 0), kw["sink_logits"].float(), D**-0.5,
        *kw["window_size"], ref_out.to(tdt), ref_lse.float(),
    )
    tol = BACKWARD_TOL[dtype]
    names = ("dq", "dk", "dv") + (("dq_global", "dk_global", "dv_global") if separate else ())
    for name, a, b in zip(names, got, want):
        assert_nan_rule(f"{case}: {name}", a, b, tol)
    # The sink's gradient sums every row's: non-finite with any of them.
    assert torch.isfinite(got[6]).tolist() == torch.isfinite(want[6]).tolist()
