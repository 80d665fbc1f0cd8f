"""Property tests: hypothesis over shapes and runtime parameters, against the reference.

The compiled specs are fixed (two windows, head dim 16, dilation bound 4) so that the
search explores runtime parameters without compiling a kernel per example.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import check_against_reference
from swa_tvm.compiler.jit import get_or_build_kernel
from swa_tvm.spec import KernelSpec

D = 16
WINDOWS = [(3, 1), (2, 0)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    # Register the max_dilation=4 kernels first: any dilation <= 4 then reuses them.
    for left, right in WINDOWS:
        for extras in (False, True):
            get_or_build_kernel(KernelSpec("local", D, "float32", left, right, 4, extras))


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.sampled_from([1, 2]))
    H = Hkv * draw(st.sampled_from([1, 2]))
    T = draw(st.integers(1, 70))
    window = draw(st.sampled_from(WINDOWS))
    per_head = draw(st.booleans())
    if per_head:
        dilation = torch.tensor(draw(st.lists(st.integers(1, 4), min_size=H, max_size=H)), dtype=torch.int32)
    else:
        dilation = draw(st.integers(1, 4))
    G = draw(st.integers(0, min(3, T)))
    kw = dict(window_size=window, dilation=dilation)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if G:
        kw["global_idx"] = torch.stack([torch.randperm(T, generator=g)[:G] for _ in range(B)]).to(torch.int32)
        if draw(st.booleans()):
            kw["q_global"] = torch.randn(B, H, G, D, generator=g)
            kw["k_global"] = torch.randn(B, Hkv, T, D, generator=g)
            kw["v_global"] = torch.randn(B, Hkv, T, D, generator=g)
    kw["num_sinks"] = draw(st.integers(0, min(3, T)))
    if draw(st.booleans()):
        kw["sink_logits"] = torch.randn(H, generator=g) * 2
    scale = draw(st.sampled_from([None, 0.1, 0.5]))
    if scale is not None:
        kw["scale"] = scale
    qkv = (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
           torch.randn(B, Hkv, T, D, generator=g))  # fmt: skip
    return qkv, kw


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_matches_reference(problem):
    (q, k, v), kw = problem
    check_against_reference(q, k, v, **kw)
