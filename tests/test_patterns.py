"""Every pattern and combination against the float64 dense reference (explicit mask)."""

import pytest
import torch

from conftest import check_against_reference, rand

D = 16


def qkv(B=2, H=4, Hkv=4, T=45, dtype=torch.float32):
    return rand(B, H, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype)


def gidx(B, T, G):
    return torch.stack([torch.randperm(T)[:G] for _ in range(B)]).to(torch.int32)


@pytest.mark.parametrize("window", [(2, 0), (2, 2), (3, 1)], ids=["causal", "symmetric", "asymmetric"])
def test_window(window):
    check_against_reference(*qkv(), window_size=window)


def test_uniform_dilation():
    check_against_reference(*qkv(T=61), window_size=(2, 2), dilation=2)


def test_per_head_dilation_causal_gqa():
    q, k, v = qkv(H=4, Hkv=2, T=70)
    dil = torch.tensor([1, 3, 2, 4], dtype=torch.int32)
    check_against_reference(q, k, v, window_size=(2, 0), dilation=dil, num_sinks=1)


@pytest.mark.parametrize("separate", [False, True], ids=["shared_proj", "separate_proj"])
@pytest.mark.parametrize("window", [(2, 0), (3, 1)], ids=["causal", "asymmetric"])
def test_globals(window, separate):
    B, H, Hkv, T, G = 2, 4, 2, 53, 3
    q, k, v = qkv(B, H, Hkv, T)
    kw = dict(window_size=window, global_idx=gidx(B, T, G), dilation=torch.tensor([1, 2, 3, 1], dtype=torch.int32))
    if separate:
        kw.update(q_global=rand(B, H, G, D), k_global=rand(B, Hkv, T, D), v_global=rand(B, Hkv, T, D))
    check_against_reference(q, k, v, **kw)


def test_only_some_global_projections():
    B, H, T, G = 1, 2, 40, 2
    q, k, v = qkv(B, H, H, T)
    check_against_reference(q, k, v, window_size=(3, 1), global_idx=gidx(B, T, G), k_global=rand(B, H, T, D))


@pytest.mark.parametrize("window", [(2, 0), (3, 1)])
def test_sinks_and_sink_logits(window):
    q, k, v = qkv(T=50)
    check_against_reference(q, k, v, window_size=window, num_sinks=4, sink_logits=rand(4))
    check_against_reference(q, k, v, window_size=window, sink_logits=rand(4) * 3)


def test_sinks_overlapping_globals_count_once():
    B, T = 1, 30
    q, k, v = qkv(B, 2, 2, T)
    g = torch.tensor([[1, 20]], dtype=torch.int32)
    check_against_reference(q, k, v, window_size=(3, 1), global_idx=g, num_sinks=3)


def test_lse_is_the_softmax_denominator():
    """out_i = sum_j exp(score_ij - lse_i) v_j: with v = 1 the output is 1 - exp(sink - lse)."""
    import swa_tvm

    q, k, _ = qkv(B=1, H=2, Hkv=2, T=40)
    sink = rand(2)
    out, lse = swa_tvm.sliding_window_attention(
        q, k, torch.ones_like(k), window_size=(3, 1), sink_logits=sink, return_lse=True
    )
    want = 1 - torch.exp(sink.view(1, 2, 1).double() - lse.double())
    assert torch.allclose(out[..., 0].double(), want, atol=1e-6)


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (3, -1)], ids=["causal_full", "full", "left3_right_inf"])
def test_unbounded_windows(window):
    q, k, v = qkv(B=1, H=2, Hkv=2, T=37)
    check_against_reference(q, k, v, window_size=window)


def test_unbounded_with_globals_and_dilation():
    q, k, v = qkv(B=1, H=2, Hkv=1, T=33)
    check_against_reference(
        q, k, v, window_size=(-1, -1), dilation=torch.tensor([1, 3], dtype=torch.int32), global_idx=gidx(1, 33, 2)
    )


def test_edge_shapes():
    # T=1, a window far larger than T, G=0.
    check_against_reference(*qkv(B=1, H=2, Hkv=2, T=1), window_size=(2, 2))
    check_against_reference(*qkv(B=1, H=2, Hkv=2, T=5), window_size=(2, 2), dilation=4)
    q, k, v = qkv(B=2, H=2, Hkv=2, T=20)
    check_against_reference(q, k, v, window_size=(3, 1), global_idx=torch.zeros(2, 0, dtype=torch.int32))
    check_against_reference(*qkv(B=1, H=2, Hkv=2, T=7), window_size=(3, 1), num_sinks=7)


def test_non_contiguous_inputs():
    B, H, T = 2, 4, 33
    base = rand(B, T, H, 3 * D)  # a fused projection, heads in dim 2
    q, k, v = (base[..., i * D : (i + 1) * D].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    check_against_reference(q, k, v, window_size=(2, 2))


def test_float64():
    q, k, v = qkv(B=1, H=2, Hkv=2, T=30, dtype=torch.float64)
    check_against_reference(q, k, v, tol=1e-12, window_size=(2, 2))


def test_custom_scale_and_repeated_calls():
    import swa_tvm

    # Fresh inputs on every call: a kernel that reads stale buffers fails here.
    for _ in range(3):
        q, k, v = qkv(T=40)
        check_against_reference(q, k, v, window_size=(2, 2), scale=0.3)
    out1 = swa_tvm.sliding_window_attention(q, k, v, window_size=(2, 2))
    out2 = swa_tvm.sliding_window_attention(q, k, v, window_size=(2, 2))
    assert torch.equal(out1, out2)


@pytest.mark.slow  # D=64, T=1500: not a small shape
def test_realistic_size_everything_at_once():
    """D=64, T=1500 (47 blocks, several residues per head), GQA 8/2, per-head dilation,
    globals with their own projections, sinks and sink logits together."""
    B, H, Hkv, T, G, Dh = 1, 8, 2, 1500, 4, 64
    q, k, v = rand(B, H, T, Dh), rand(B, Hkv, T, Dh), rand(B, Hkv, T, Dh)
    gi = torch.stack([torch.randperm(T)[:G]]).to(torch.int32)
    check_against_reference(
        q, k, v,
        window_size=(100, 0),
        dilation=torch.tensor([1, 2, 1, 3, 1, 1, 4, 2], dtype=torch.int32),
        global_idx=gi, q_global=rand(B, H, G, Dh), k_global=rand(B, Hkv, T, Dh), v_global=rand(B, Hkv, T, Dh),
        num_sinks=4, sink_logits=rand(H),
    )  # fmt: skip
