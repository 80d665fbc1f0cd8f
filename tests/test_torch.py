"""torch integration: opcheck (forward checks) and torch.compile(fullgraph=True)."""

import torch

import swa_tvm
from conftest import rand, rel_err
from swa_tvm.reference import sliding_window_attention_ref as ref

D = 16


def _op_args(T=24, G=2):
    q, k, v = rand(1, 4, T, D), rand(1, 2, T, D), rand(1, 2, T, D)
    dil = torch.tensor([1, 2, 1, 3], dtype=torch.int32)
    gi = torch.tensor([[0, 9]], dtype=torch.int32)[:, :G]
    return (q, k, v, dil, gi, rand(1, 4, G, D), None, None, 2, rand(4), 0.25, 3, 1)


def test_opcheck_forward():
    # Forward-only checks: schema, fake tensor and dispatch; autograd comes with backward.
    for args in (_op_args(), _op_args(G=0)):
        torch.library.opcheck(
            torch.ops.swa_tvm.attention.default,
            args,
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
        )


def test_opcheck_bfloat16_with_autograd():
    """The op in bfloat16 on the CPU, autograd registration and AOT dispatch included
    (the fake implementations give out in q's dtype, lse in float32)."""
    q, k, v = (rand(1, 4, 40, D).to(torch.bfloat16).requires_grad_() for _ in range(3))
    args = (q, k, v, torch.tensor([1, 2, 1, 2], dtype=torch.int32), None, None, None, None, 1, None, 0.25, 5, 0)
    torch.library.opcheck(torch.ops.swa_tvm.attention.default, args)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 4, 100, 64), torch.empty(2, 1, 100, 64)
        out, lse = torch.ops.swa_tvm.attention(
            q, k, k, torch.ones(4, dtype=torch.int32), None, None, None, None, 0, None, 0.125, 7, 0
        )
        assert out.shape == (2, 4, 100, 64) and lse.shape == (2, 4, 100) and lse.dtype == torch.float32


def test_torch_compile_fullgraph():
    def layer(x, wq, wk, wv, gi):
        B, T, _ = x.shape
        q = (x @ wq).view(B, T, 4, D).transpose(1, 2)
        k = (x @ wk).view(B, T, 2, D).transpose(1, 2)
        v = (x @ wv).view(B, T, 2, D).transpose(1, 2)
        out = swa_tvm.sliding_window_attention(q, k, v, window_size=(3, 1), dilation=2, global_idx=gi)
        return out.transpose(1, 2).reshape(B, T, 4 * D)

    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    for T in (32, 45):  # a new T reuses the same TVM kernel (symbolic length)
        x = rand(2, T, 32)
        wq, wk, wv = rand(32, 4 * D), rand(32, 2 * D), rand(32, 2 * D)
        gi = torch.tensor([[0, 5], [3, T - 1]], dtype=torch.int32)
        got = compiled(x, wq, wk, wv, gi)
        want = layer(x, wq, wk, wv, gi)
        assert rel_err(got, want) < 1e-5
        q = (x @ wq).view(2, T, 4, D).transpose(1, 2)
        k = (x @ wk).view(2, T, 2, D).transpose(1, 2)
        v = (x @ wv).view(2, T, 2, D).transpose(1, 2)
        r, _ = ref(q, k, v, window_size=(3, 1), dilation=2, global_idx=gi)
        assert rel_err(got, r.transpose(1, 2).reshape(2, T, 4 * D)) < 1e-5


def test_misaligned_views_get_aligned_copies(monkeypatch):
    """TVM compiles the kernels assuming 64-byte aligned data (on CUDA a misaligned
    16-byte vector load faults): contiguous views at an odd offset (q, k, v, the global
    projections, global_idx, sink logits) reach every kernel, forward and backward, as
    aligned copies, with the aligned call's results and gradients; a misaligned tensor
    handed to a launch is refused by name."""
    import pytest

    from swa_tvm import eager

    seen = []
    launch = eager._launch

    def spy(kern, device, *args):
        seen.extend((kern.spec.kind, a.data_ptr() % 64) for a in args if isinstance(a, torch.Tensor) and a.numel())
        return launch(kern, device, *args)

    monkeypatch.setattr(eager, "_launch", spy)

    def odd(x):  # the same values, contiguous, 4 bytes past an aligned allocation
        flat = torch.empty(x.numel() + 1, dtype=x.dtype)
        flat[1:] = x.reshape(-1)
        return flat[1:].view(x.shape)

    T = 40
    inputs = dict(q=rand(1, 4, T, D), k=rand(1, 2, T, D), v=rand(1, 2, T, D), q_global=rand(1, 4, 2, D),
                  sink_logits=rand(4))
    gi = torch.tensor([[3, 30]], dtype=torch.int32)
    runs = []
    for make in (lambda x: x.clone(), odd):
        leaves = {n: make(x).requires_grad_() for n, x in inputs.items()}
        assert make is not odd or all(x.data_ptr() % 64 for x in leaves.values())
        out = swa_tvm.sliding_window_attention(
            leaves["q"], leaves["k"], leaves["v"], window_size=(5, 0), global_idx=make(gi), num_sinks=1,
            q_global=leaves["q_global"], sink_logits=leaves["sink_logits"],
        )
        grads = torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out))
        runs.append((out, grads))
    kinds = {kind for kind, _ in seen}
    # The gradients of the window, extra keys and global rows (q_global, reading k and v):
    # the five-product kernel, or the TE kernels.
    assert kinds >= {"local", "global"} and ("local_bwd" in kinds or kinds >= {"local_dq", "local_dkv", "local_dx",
                                                                                "global_bwd"}), kinds
    assert all(offset == 0 for _, offset in seen), [s for s in seen if s[1]]
    (out_a, grads_a), (out_b, grads_b) = runs
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert rel_err(out_a, ref(*[inputs[n] for n in "qkv"], window_size=(5, 0), global_idx=gi, num_sinks=1,
                              q_global=inputs["q_global"], sink_logits=inputs["sink_logits"])[0]) < 1e-5

    kern = eager._kernel(eager._local_spec(inputs["q"], 5, 0, torch.ones(4, dtype=torch.int32), None), "cpu")
    with pytest.raises(ValueError, match=r"\(1, 4, 40, 16\) argument's data is not 64-byte aligned"):
        launch(kern, torch.device("cpu"), odd(inputs["q"]))
