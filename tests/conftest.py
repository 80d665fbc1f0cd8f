import os
import tempfile

# Kernels compiled by the tests go to a cache of their own unless the caller chose one
# (the Makefile points it into .venv so reruns reuse it).
os.environ.setdefault("SWA_TVM_CACHE", os.path.join(tempfile.gettempdir(), "swa_tvm_test_cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

from swa_tvm.reference import sliding_window_attention_ref  # noqa: E402


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def rand(*shape, seed=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=g, dtype=dtype)


def check_against_reference(q, k, v, tol=1e-5, **kw):
    """Run the kernel and the float64 dense reference; assert out and lse agree."""
    import swa_tvm

    out, lse = swa_tvm.sliding_window_attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3]
    assert torch.isfinite(out).all(), "kernel produced non-finite output"
    e = rel_err(out, ref_out)
    assert e < tol, f"out relative error {e:.2e} >= {tol} for {kw}"
    el = (lse.double() - ref_lse).abs().max().item()
    assert el < 1e-4, f"lse max abs error {el:.2e} for {kw}"
    return out, lse


def grads_against_reference(B, H, Hkv, T, D, window, slog=False, dilation=1, seed=0, projections=(),
                            dtype=torch.float32, **extra):
    """Relative errors of dq, dk, dv (the sink logits', then the global rows' own
    ``projections``: names of q_global, k_global, v_global) of <out, R1> + <lse, R2>
    against autograd through the float64 dense reference (of the same ``dtype`` inputs).
    ``extra``: global_idx, num_sinks."""
    import swa_tvm

    g = torch.Generator().manual_seed(seed)
    leaf = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    q, k, v = leaf(B, H, T, D), leaf(B, Hkv, T, D), leaf(B, Hkv, T, D)
    kw = dict(window_size=window, dilation=dilation, **extra)
    if slog:
        kw["sink_logits"] = leaf(H)
    for name in projections:
        kw[name] = leaf(B, H, extra["global_idx"].shape[1], D) if name == "q_global" else leaf(B, Hkv, T, D)
    names = (["sink_logits"] if slog else []) + list(projections)
    leaves = [q, k, v] + [kw[n] for n in names]
    out, lse = swa_tvm.sliding_window_attention(q, k, v, return_lse=True, **kw)
    d_out, d_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    got = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), leaves)
    wide = [x.detach().double().requires_grad_() for x in leaves]
    r_kw = dict(kw, **dict(zip(names, wide[3:])))
    r_out, r_lse = sliding_window_attention_ref(*wide[:3], **r_kw)
    want = torch.autograd.grad((r_out * d_out.double()).sum() + (r_lse * d_lse.double()).sum(), wide)
    return [rel_err(a, b) for a, b in zip(got, want)]


def run_cli(capsys, *argv):
    """``swa-tvm ARGV`` in this process (cli.main is what the console script runs; a
    subprocess costs ~9 s of imports here): rc, stdout, stderr."""
    from swa_tvm import cli

    rc = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(autouse=True)
def _libraries_unloaded_after_each_test():
    """A library a test loads leaves with the test: loaded libraries serve every later
    call in the process (pytest-xdist runs other modules' tests after it on the same
    worker), and one with other head dims would refuse them."""
    from swa_tvm.runtime import library

    saved = library.REGISTRY.snapshot()
    yield
    if library.REGISTRY.libraries != list(saved.libraries):
        library.REGISTRY.restore(saved)


@pytest.fixture
def fresh_registry():
    """Isolate tests that load libraries: the registry is process-global."""
    from swa_tvm.runtime import library

    saved = library.REGISTRY.snapshot()
    library.REGISTRY.clear()
    yield library.REGISTRY
    library.REGISTRY.restore(saved)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs two workers), the tests sharing a
    module-scoped fixture (a tuning run, an exported library, a built batch) go to one
    worker, one after another, so each such fixture is built once rather than once per
    worker or once per run of the module's tests on a worker."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = sorted(
            name for name in item.fixturenames
            if info is not None and name in info.name2fixturedefs and info.name2fixturedefs[name][-1].scope == "module"
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}::{shared[0]}"))

