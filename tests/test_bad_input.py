"""Every bad input raises TypeError/ValueError naming the argument, before any kernel runs."""

import re

import pytest
import torch

import swa_tvm
from swa_tvm import eager

B, H, T, D = 1, 4, 12, 16


def args(**over):
    kw = dict(
        q=torch.randn(B, H, T, D),
        k=torch.randn(B, 2, T, D),
        v=torch.randn(B, 2, T, D),
        window_size=(2, 0),
    )
    kw.update(over)
    return kw


def call(**over):
    kw = args(**over)
    return swa_tvm.sliding_window_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


CASES = [
    ("rank", dict(q=torch.randn(H, T, D)), ValueError, r"q must have rank 4"),
    ("k rank", dict(k=torch.randn(2, T, D)), ValueError, r"k must have rank 4"),
    ("B mismatch", dict(k=torch.randn(2, 2, T, D), v=torch.randn(2, 2, T, D)), ValueError, r"k/v must be \[B=1"),
    ("T mismatch", dict(k=torch.randn(B, 2, T + 1, D), v=torch.randn(B, 2, T + 1, D)), ValueError, r"T=12"),
    ("D mismatch", dict(k=torch.randn(B, 2, T, 8), v=torch.randn(B, 2, T, 8)), ValueError, r"D=16"),
    ("k/v shapes", dict(v=torch.randn(B, 2, T, 8)), ValueError, r"k and v must have the same shape"),
    ("GQA", dict(k=torch.randn(B, 3, T, D), v=torch.randn(B, 3, T, D)), ValueError, r"multiple of k/v heads"),
    ("dtype mismatch", dict(k=torch.randn(B, 2, T, D, dtype=torch.float64)), TypeError, r"k has dtype torch.float64"),
    ("unsupported dtype", dict(q=torch.randn(B, H, T, D).to(torch.float8_e5m2), k=torch.randn(B, 2, T, D).to(torch.float8_e5m2),
                               v=torch.randn(B, 2, T, D).to(torch.float8_e5m2)), TypeError,
     r"q has dtype torch.float8_e5m2; on cpu the kernels support torch.float16, torch.bfloat16"),
    ("window < -1", dict(window_size=(-2, 0)), ValueError, r"window_size left must be >= -1"),
    ("right < -1", dict(window_size=(1, -5)), ValueError, r"window_size right must be >= -1"),
    ("window shape", dict(window_size=(1, 2, 3)), ValueError, r"window_size must be a \(left, right\) pair"),
    ("window type", dict(window_size=(1.5, 0)), TypeError, r"window_size left must be an int"),
    ("dilation 0", dict(dilation=0), ValueError, r"dilation must be >= 1"),
    ("dilation head < 1", dict(dilation=torch.tensor([1, 0, 2, 1], dtype=torch.int32)), ValueError,
     r"dilation must be >= 1 for every head"),
    ("dilation length", dict(dilation=torch.tensor([1, 2], dtype=torch.int32)), ValueError, r"dilation tensor must have shape \[H\]=\[4\]"),
    ("dilation float", dict(dilation=torch.ones(4)), TypeError, r"dilation tensor must have an integer dtype"),
    ("dilation type", dict(dilation=2.0), TypeError, r"dilation must be an int or an integer tensor"),
    ("dilation bool", dict(dilation=True), TypeError, r"dilation must be an int or an integer tensor of shape \[H\], got bool"),
    ("window bool", dict(window_size=(2, False)), TypeError, r"window_size right must be an int, got bool"),
    ("sinks bool", dict(num_sinks=True), TypeError, r"num_sinks must be an int, got bool"),
    ("global range", dict(global_idx=torch.tensor([[1, 12]], dtype=torch.int32)), ValueError,
     r"global_idx values must lie in \[0, T=12\), found 12"),
    ("global negative", dict(global_idx=torch.tensor([[-1]], dtype=torch.int32)), ValueError, r"global_idx values"),
    ("global duplicate", dict(global_idx=torch.tensor([[3, 5, 3]], dtype=torch.int32)), ValueError,
     r"global_idx row 0 repeats a position"),
    ("global dtype", dict(global_idx=torch.tensor([[3, 5]])), TypeError, r"global_idx must be an int32 tensor"),
    ("global B", dict(global_idx=torch.tensor([[3], [5]], dtype=torch.int32)), ValueError, r"global_idx must be \[B=1, G\]"),
    ("q_global alone", dict(q_global=torch.randn(B, H, 1, D)), ValueError, r"q_global was given without global_idx"),
    ("k_global alone", dict(k_global=torch.randn(B, 2, T, D)), ValueError, r"k_global was given without global_idx"),
    ("q_global shape", dict(global_idx=torch.tensor([[3, 5]], dtype=torch.int32), q_global=torch.randn(B, H, 3, D)),
     ValueError, r"q_global must have shape \[1, 4, 2, 16\]"),
    ("sinks > T", dict(num_sinks=13), ValueError, r"num_sinks must be in \[0, T=12\], got 13"),
    ("sinks < 0", dict(num_sinks=-1), ValueError, r"num_sinks must be in"),
    ("sink_logits shape", dict(sink_logits=torch.randn(3)), ValueError, r"sink_logits must have shape \[H\]=\[4\]"),
    ("not a tensor", dict(q=[[1.0]]), TypeError, r"q must be a torch.Tensor"),
    ("sinks type", dict(num_sinks=1.0), TypeError, r"num_sinks must be an int"),
    ("scale 0", dict(scale=0.0), ValueError, r"scale must be a positive finite number, got 0.0"),
    ("scale < 0", dict(scale=-0.25), ValueError, r"scale must be a positive finite number, got -0.25"),
    ("scale nan", dict(scale=float("nan")), ValueError, r"scale must be a positive finite number, got nan"),
    ("scale type", dict(scale="0.25"), TypeError, r"scale must be a float, got str"),
    # Values Python takes but float32 kernels or the op's int64 schema cannot: each
    # refused by name before any kernel or schema sees it.
    ("scale beyond float32", dict(scale=1e39), ValueError, r"scale must be at most 3.403e\+38 \(float32's largest\)"),
    ("scale beyond float", dict(scale=10**400), ValueError, r"scale must be a positive finite number"),
    ("D = 0", dict(q=torch.randn(B, H, T, 0), k=torch.randn(B, 2, T, 0), v=torch.randn(B, 2, T, 0)), ValueError,
     r"q and k must have non-empty dimensions"),
    ("sinks beyond int64", dict(num_sinks=2**63), ValueError, r"num_sinks must be in \[0, T=12\], got 9223372036854775808"),
    ("window beyond -int64", dict(window_size=(-2**64, 0)), ValueError, r"window_size left must be >= -1"),
    ("dilation beyond -int64", dict(dilation=-2**64), ValueError, r"dilation must be >= 1"),
    ("sink_logits list", dict(sink_logits=[0.1, 0.2, 0.3, 0.4]), TypeError, r"sink_logits must be a torch.Tensor or None, got list"),
    ("global_idx list", dict(global_idx=[[1, 2]]), TypeError, r"global_idx must be a torch.Tensor or None, got list"),
    ("v_global array", dict(global_idx=torch.tensor([[3]], dtype=torch.int32), v_global=1.0), TypeError,
     r"v_global must be a torch.Tensor or None, got float"),
]  # fmt: skip


@pytest.mark.parametrize("over,exc,msg", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(over, exc, msg):
    with pytest.raises(exc, match=msg):
        call(**over)


def test_numpy_scalars_taken_as_numbers():
    """Windows, sinks, dilation and scale computed with numpy are numbers like any other:
    the result is the float64 reference's for the same values as Python numbers."""
    import numpy as np
    from conftest import rand, rel_err
    from swa_tvm.reference import sliding_window_attention_ref

    q, k, v = rand(B, H, T, D), rand(B, 2, T, D), rand(B, 2, T, D)
    out, lse = swa_tvm.sliding_window_attention(
        q, k, v, window_size=(np.int64(2), np.int32(0)), dilation=np.int16(2), num_sinks=np.uint8(1),
        scale=np.float32(0.3), return_lse=True)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, window_size=(2, 0), dilation=2, num_sinks=1, scale=0.3)
    assert rel_err(out, ref_out) < 1e-5
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4


def test_bad_input_through_torch_op():
    """The op validates too: torch.ops.swa_tvm.attention is public."""
    q = torch.randn(B, H, T, D)
    k = torch.randn(B, 2, T, D)
    with pytest.raises(ValueError, match="num_sinks"):
        torch.ops.swa_tvm.attention(q, k, k, torch.ones(H, dtype=torch.int32), None, None, None, None, 99, None, 0.25, 2, 0)


def test_mixed_devices_named():
    q = torch.randn(B, H, T, D)
    k = torch.randn(B, 2, T, D)
    with pytest.raises(ValueError, match=r"sink_logits is on meta but q is on cpu"):
        swa_tvm.sliding_window_attention(q, k, k, window_size=(2, 0), sink_logits=torch.randn(H, device="meta"))


def test_device_not_served(monkeypatch):
    """No second device exists on this machine, so pretend the build serves only CUDA."""
    from swa_tvm import checks

    monkeypatch.setattr(checks, "SERVED_DEVICES", ("cuda",))
    with pytest.raises(ValueError, match=r"q is on cpu, but this build of swa_tvm has kernels only for cuda"):
        call()


@pytest.mark.parametrize("window,shape,what", [
    ((7, 0), (65536, 2, 64), r"batch size B = 65536"),
    ((7, 0), (2, 70000, 64), r"number of heads H = 70000"),
    ((7, -1), (300, 300, 64), r"B x H = 90000"),
    ((7, -1), (1, 1, 32 * 65536), r"number of 32-row query blocks = 65537"),
])
def test_te_cuda_grid_limits_named(window, shape, what):
    """The TE kernels' CUDA grid (schedules/cuda.py) has batch and heads on blockIdx.z/y,
    whose limit is 65535 blocks: a call past it is refused by name before the launch. The
    fused kernels (blockIdx.x alone) take the same shape. (Meta tensors: the check reads
    shapes only; no GPU is needed to reach it.)"""
    from swa_tvm.runtime import library
    from swa_tvm.spec import KernelSpec

    B_, H_, T_ = shape
    spec = KernelSpec("local", 16, "float16", *window, max_dilation=2)
    q = torch.empty(B_, H_, T_, 16, dtype=torch.float16, device="meta")
    calls = []
    for schedule in ("default", "tuned", "cuda_flash_tc"):
        kern = library.Kernel(spec, lambda *a: calls.append(a), "cuda", "test", "sm_90", schedule=schedule)
        if schedule == "cuda_flash_tc":
            eager._launch(kern, torch.device("meta"), q, q, q)
            assert len(calls) == 1
        else:
            with pytest.raises(ValueError, match=rf"kernel {spec.name} \({schedule} schedule.*{what} exceeds the 65535"):
                eager._launch(kern, torch.device("meta"), q, q, q)
    assert len(calls) == 1


@pytest.mark.parametrize("target,msg", [
    ('{"kind": "llvm", "mcpu": "znver9"}', r"target mcpu 'znver9' is not a CPU that LLVM \d+ knows for .*x86-64-v3"),
    ('{"kind": "llvm", "mcpu": 4}', r"target mcpu 4 is not a CPU"),
    ('{"kind": "opencl"}', r"target kind 'opencl': swa_tvm builds for 'llvm' \(CPUs\) and 'cuda' only"),
    ("vulkan", r"target 'vulkan': use 'llvm' for this CPU"),
])
def test_bad_export_target_named(target, msg, tmp_path, capsys):
    """LLVM would take an unknown -mcpu as 'generic' and carry on: the library would be
    baseline x86 code filed under the misspelled CPU's class. Refused before building."""
    from conftest import run_cli

    out = tmp_path / "x.so"
    rc, _, err = run_cli(capsys, "export", "--spec", "head_dim=16,window=3:0", "--target", target, "-o", out)
    assert rc != 0 and re.search(msg, err), err
    assert not out.exists()


@pytest.mark.parametrize("text,msg", [
    ("head_dim=64,window=511:0,dtype=bfloat", r"dtype must be one of .*got 'bfloat'"),
    ("head_dim=64,window=511:0,dilation=0", r"max_dilation must be >= 1, got 0"),
    ("head_dim=0,window=3:0", r"head_dim must be a positive int, got 0"),
    ("head_dim=64.5,window=3:0", r"head_dim must be an integer, got '64.5'"),
    ("head_dim=64,window=-2:0", r"left must be >= -1"),
    ("head_dim=64,window=3:0,block_q=0", r"block_q must be >= 1"),
    ("head_dim=64,window=3:0,window=5:0", r"window given twice"),
    ("head_dim=64,w=3:0,window=5:0", r"window given twice"),
    ("head_dim=64,window=3:0,sinks=2", r"sinks is a flag .*got '2'"),
    ("head_dim=64,window=3", r"window must look like LEFT:RIGHT, got '3'"),
    ("head_dim=64,window=3:0,globalz", r"unknown field 'globalz'"),
    ("window=3:0", r"missing head_dim="),
])
def test_bad_spec_text_named(text, msg):
    """A spec string is refused when read, naming the field; a repeated field or a flag
    with a value that is not a yes/no used to be taken silently (the last one, or True)."""
    from swa_tvm.spec import AttentionSpec

    with pytest.raises(ValueError, match=rf"spec {re.escape(repr(text))}: {msg}"):
        AttentionSpec.parse(text)


def test_spec_text_flags_and_aliases():
    from swa_tvm.spec import AttentionSpec

    got = AttentionSpec.parse(" d=16 , w = 7 : 0 , dilation=2, globals, sinks=no, backward=TRUE ,dtype=bfloat16")
    assert got == AttentionSpec(head_dim=16, window=(7, 0), max_dilation=2, globals=True, sinks=False,
                                dtype="bfloat16", backward=True)
