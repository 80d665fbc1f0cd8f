"""The five-product CPU backward (kind "local_bwd", schedules/cpu_flash_bwd.py): its
gradients against autograd through the float64 dense reference, and when it runs in
place of the TE gradient kernels (local_dq, local_dkv)."""

import dataclasses

import pytest
import torch

import swa_tvm
from conftest import grads_against_reference, rel_err
from swa_tvm.reference import sliding_window_attention_ref as ref
from swa_tvm import eager
from swa_tvm.runtime import library
from swa_tvm.spec import AttentionSpec, KernelSpec


@pytest.fixture
def launched(monkeypatch):
    """The kinds of the kernels each call launches, in order."""
    kinds = []
    launch = eager._launch

    def spy(kernel, *args, **kwargs):
        kinds.append(kernel.spec.kind)
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(eager, "_launch", spy)
    return kinds


# (B, H, Hkv, T, D, window, learned sink logits, dilation): several key blocks of 32 and
# query sub-blocks, T not a multiple of 32 (nor of the dilation), windows on either or
# both sides, GQA, B > 1, uniform and per-head dilation.
PER_HEAD = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
CASES = {
    "causal": (1, 4, 4, 200, 16, (37, 0), False, 1),
    "symmetric_gqa_batch": (2, 4, 2, 150, 16, (20, 17), False, 1),
    "right_only": (1, 2, 2, 70, 16, (0, 9), False, 1),
    "shorter_than_a_block": (1, 2, 1, 13, 16, (5, 3), False, 1),
    "sink_logits": (1, 2, 2, 90, 16, (37, 0), True, 1),
    "dilation_2": (1, 2, 2, 201, 16, (37, 0), False, 2),
    "dilation_per_head_gqa": (2, 4, 2, 183, 16, (20, 17), False, PER_HEAD),
}

# Extra keys (global positions, sinks) beside the window: the fused kernel adds their dq
# terms and returns their dk/dv (local_dx's), and takes the global rows (global_bwd's).
# Globals that differ by batch row, some inside a row's window (counted once), more than
# one chunk of 32 extras and global rows, global rows that see every key (a symmetric
# window), sinks with learned logits, per-head dilation (an extra's residue differs by
# head).
GLOBALS = torch.tensor([[3, 40, 77, 150, 199], [0, 64, 65, 120, 121]], dtype=torch.int32)
EXTRA_CASES = {
    "globals_causal": ((2, 4, 2, 200, 16, (37, 0), False, 1), dict(global_idx=GLOBALS)),
    # T = 210 (14 short of 7 key blocks, fewer than the window's right side): the last key
    # block's sub-blocks past it take their extras there.
    "globals_symmetric": ((1, 2, 2, 210, 16, (20, 17), False, 1), dict(global_idx=GLOBALS[:1, :4])),
    "globals_symmetric_dilation_per_head": ((2, 4, 4, 200, 16, (20, 17), False, PER_HEAD), dict(global_idx=GLOBALS)),
    "many_globals": ((1, 2, 2, 300, 16, (37, 0), False, 1),
                     dict(global_idx=torch.arange(5, 300, 7, dtype=torch.int32)[None])),
    "sinks_with_logits": ((1, 2, 1, 150, 16, (37, 0), True, 2), dict(num_sinks=4)),
}


# The quick tier runs the cases that share kernels with others or cover the most.
SLOW_CASES = ("right_only", "shorter_than_a_block", "dilation_2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_fused_gradients_match_reference(name, launched, monkeypatch):
    # One thread in the eager layer's count, so every case takes the fused kernel.
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    *shape, window, slog, dilation = CASES[name]
    errors = grads_against_reference(*shape, window, slog, dilation)
    assert "local_bwd" in launched and "local_dq" not in launched and "local_dkv" not in launched, launched
    for which, e in zip(("dq", "dk", "dv", "dsink"), errors):
        assert e < 2e-6, f"{which}: relative error {e:.2e}"


@pytest.mark.parametrize("name", [n if n in ("globals_causal", "globals_symmetric") else
                                  pytest.param(n, marks=pytest.mark.slow) for n in EXTRA_CASES])
def test_fused_gradients_with_extra_keys(name, launched, monkeypatch):
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    (*shape, window, slog, dilation), extra = EXTRA_CASES[name]
    errors = grads_against_reference(*shape, window, slog, dilation, **extra)
    assert "local_bwd" in launched and not {"local_dq", "local_dkv", "local_dx", "global_bwd"} & set(launched), launched
    for which, e in zip(("dq", "dk", "dv", "dsink"), errors):
        assert e < 2e-6, f"{which}: relative error {e:.2e}"


@pytest.mark.parametrize("projections", [(), ("q_global",), ("k_global", "v_global")])
def test_fused_kernel_takes_the_global_rows_that_read_k_and_v(projections, launched, monkeypatch):
    """The global rows' gradients come from the fused kernel, their key terms summed into
    its key blocks, where those rows attend to k and v (their queries q's rows or
    q_global); with k_global and v_global of their own, from global_bwd beside it."""
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    errors = grads_against_reference(2, 4, 2, 200, 16, (37, 0), projections=projections, global_idx=GLOBALS)
    folded = "k_global" not in projections
    assert "local_bwd" in launched and ("global_bwd" in launched) != folded, launched
    for which, e in zip(("dq", "dk", "dv") + projections, errors):
        assert e < 2e-6, f"{which}: relative error {e:.2e}"


@pytest.mark.slow  # a kernel set per head dim
@pytest.mark.parametrize("D", [64, 128, 80])
def test_fused_gradients_wider_heads(D, launched, monkeypatch):
    # Their dk/dv/dq register tiles hold fewer rows (feature_tile_rows), 80 not a whole
    # number of vectors.
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    errors = grads_against_reference(1, 2, 2, 300, D, (100, 0))
    assert "local_bwd" in launched
    assert max(errors) < 2e-6, errors


def test_fused_kernel_only_where_the_threads_are_occupied(monkeypatch):
    """The fused kernel runs one task per (batch, head): with 4 threads, 3 or 8 pairs take
    it (waves 3/4 and fully occupied), 2 and 5 keep the TE kernels (1/2 and 5/8)."""
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 4)
    fwd = KernelSpec("local", 16, "float32", 37, 0)
    chosen = {pairs: eager._fused_backward_kernel(fwd, "cpu", (37, 0), pairs) for pairs in (2, 3, 5, 8)}
    assert chosen[2] is None and chosen[5] is None
    assert chosen[3].spec.kind == "local_bwd" and chosen[8].spec.kind == "local_bwd"
    # Cases it does not serve, and devices other than the CPU, never take it.
    assert eager._fused_backward_kernel(dataclasses.replace(fwd, extras=True), "cpu", (37, 0), 8).spec.extras
    for other in (dataclasses.replace(fwd, dtype="float64"), dataclasses.replace(fwd, nonfinite=True),
                  dataclasses.replace(fwd, left=-1)):  # fmt: skip
        assert eager._fused_backward_kernel(other, "cpu", (other.left, 0), 8) is None
    assert eager._fused_backward_kernel(fwd, "cuda", (37, 0), 8) is None


def test_spec_names_the_fused_kernel_where_it_serves():
    kinds = lambda **kw: [k.kind for k in AttentionSpec(head_dim=16, window=(37, 0), backward=True, **kw).kernels()]  # noqa: E731
    assert "local_bwd" in kinds()
    for kw in (dict(dtype="bfloat16"), dict(dtype="float16"), dict(max_dilation=4), dict(globals=True),
               dict(sinks=True)):
        assert "local_bwd" in kinds(**kw), kw
    assert "local_bwd" not in kinds(dtype="float64")
    # The nonfinite set has every kernel of the plain set but the fused one (it has no
    # NaN rule): the guarded calls take the TE gradient kernels.
    both = AttentionSpec(head_dim=16, window=(37, 0), backward=True, nonfinite=True).kernels()
    plain = [k.kind for k in both if not k.nonfinite]
    guarded = [k.kind for k in both if k.nonfinite]
    assert "local_bwd" in plain and guarded == [k for k in plain if k != "local_bwd"], (plain, guarded)
    with pytest.raises(ValueError, match="local_bwd"):
        KernelSpec("local_bwd", 16, "float64", 37, 0)
    with pytest.raises(ValueError, match="local_bwd"):
        KernelSpec("local_bwd", 16, "float32", -1, 0)


def test_bfloat16_on_a_matrix_engine_the_fused_kernel_where_it_has_an_amx_form(fresh_registry, monkeypatch):
    """Compiled on first use, bfloat16 on a CPU with a matrix engine (AMX or AVX-512
    BF16) takes the fused kernel where it has a matrix-engine form (the head dim a
    multiple of 32, a window of at most AMX_FUSED_MAX_SPAN keys), the TE gradient kernels
    (theirs) where only they have one (a wider window), and the fused kernel in float32
    products where neither does (head dim 16). Without an engine, with extra keys (the
    extra keys' TE kernels use no engine), and float16 anywhere, the fused kernel. (The
    compile is stubbed: only the choice is checked, on any CPU.)"""
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    monkeypatch.setattr(eager, "_kernel", lambda want, device: want)
    fwd = KernelSpec("local", 32, "bfloat16", 37, 0)
    cases = [(None, "bfloat16", {}, True), (None, "bfloat16", dict(max_dilation=2), True)]
    for engine in ("amx", "bf16_dot"):
        cases += [(engine, "bfloat16", {}, True), (engine, "bfloat16", dict(max_dilation=2), True),
                  (engine, "bfloat16", dict(max_dilation=8), True), (engine, "bfloat16", dict(left=8192, right=1), False),
                  (engine, "bfloat16", dict(head_dim=16), True), (engine, "bfloat16", dict(extras=True), True),
                  (engine, "bfloat16", dict(extras=True, head_dim=16), True), (engine, "float32", {}, True),
                  (engine, "float16", {}, True)]
    for engine, dtype, kw, fused in cases:
        monkeypatch.setattr(eager, "_host_engine", lambda: engine)
        got = eager._fused_backward_kernel(dataclasses.replace(fwd, dtype=dtype, **kw), "cpu", (37, 0), 8)
        assert (got is not None and got.kind == "local_bwd") == fused, (engine, dtype, kw, got)


def test_cuda_targets_build_no_fused_cpu_kernel():
    import tvm

    from swa_tvm.compiler import build

    spec = KernelSpec("local_bwd", 16, "float32", 37, 0)
    with pytest.raises(ValueError, match="CPU kernel"):
        build.schedule_spec(spec, tvm.target.Target("cuda"))
    assert build.default_schedule(spec, "llvm") == "cpu_flash_bwd"


def test_libraries_with_and_without_the_fused_kernel(fresh_registry, tmp_path, launched, monkeypatch):
    """A library exported with 'backward' holds the fused kernel (manifest format 4) and
    serves a training step with it, also where T is short enough that the window as
    written spans every row (the call's own spec is then unbounded); one without it
    (exported before it existed) keeps its TE kernels instead of failing."""
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    spec = AttentionSpec(head_dim=16, window=(37, 0), backward=True)
    with_fused = tmp_path / "with.so"
    manifest = swa_tvm.export_library([spec], with_fused, logs=None)
    by_kind = {k["spec"]["kind"]: k for k in manifest["kernels"]}
    assert by_kind["local_bwd"]["schedule"] == "cpu_flash_bwd" and manifest["format"] == 4
    without = tmp_path / "without.so"
    swa_tvm.export_library([k for k in spec.kernels() if k.kind != "local_bwd"], without, logs=None)
    for lib, kinds in ((with_fused, ["local_bwd"]), (without, ["local_dq", "local_dkv"])):
        fresh_registry.clear()
        swa_tvm.load_library(str(lib))
        launched.clear()
        for T in (100, 30):
            launched.clear()
            errors = grads_against_reference(1, 2, 2, T, 16, (37, 0))
            assert [k for k in launched if k != "local"] == kinds, (lib, T, launched)
            assert max(errors) < 2e-6, (T, errors)


@pytest.mark.slow  # two libraries of their own
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_half_precision(dtype, fresh_registry, tmp_path, launched, monkeypatch):
    """bfloat16 and float16, converted to float32 as they are staged, as a CPU without
    the matrix engine runs them (a target without AMX and AVX-512 BF16, on any x86
    machine): the gradients
    within the tolerance the other half-precision gradients are held to, rounded once to
    the inputs' dtype."""
    from swa_tvm.compiler.targets import host_target, without_engines
    from swa_tvm.compiler.tiles import GRAD_TOLERANCE

    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    name = str(dtype).removeprefix("torch.")
    target = without_engines(host_target())
    lib = tmp_path / f"{name}.so"
    swa_tvm.export_library([AttentionSpec(head_dim=32, window=(20, 17), backward=True, dtype=name)], lib,
                           target=target, logs=None, warn_untuned=False)  # fmt: skip
    swa_tvm.load_library(str(lib))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 150, 32, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 150, 32, generator=g).to(dtype).requires_grad_() for _ in range(2))
    out = swa_tvm.sliding_window_attention(q, k, v, window_size=(20, 17))
    d_out = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    assert launched == ["local", "local_bwd"], launched
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(ref(*wide, window_size=(20, 17))[0], wide, d_out.double())
    for which, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), which
        assert rel_err(a, b) < GRAD_TOLERANCE[dtype], (which, rel_err(a, b))


@pytest.mark.slow  # compiles the matrix-engine form
def test_amx_targets_take_the_matrix_engine_gradients(tmp_path):
    """A bfloat16 library for a CPU with a matrix engine holds the five-product kernel in
    its matrix-engine form (any dilation bound, global tokens): "amx" for one with AMX
    (sapphirerapids), "bf16_dot" for one with AVX-512 BF16 and no AMX (cooperlake). For a
    window wider than it serves, none (the TE gradients multiply on the engine there);
    with global tokens and a head dim it does not serve, the float32-product one (the
    extra keys' TE kernels do not use the engine), as a float16 library (no such form)
    does."""
    for mcpu, engine in (("sapphirerapids", "amx"), ("cooperlake", "bf16_dot")):
        target = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
        for dtype, kw, schedule in (("bfloat16", {}, engine), ("bfloat16", dict(max_dilation=8), engine),
                                    ("bfloat16", dict(window=(8192, 1)), None),
                                    ("bfloat16", dict(globals=True), engine),
                                    ("bfloat16", dict(globals=True, head_dim=16), "cpu_flash_bwd"),
                                    ("float16", {}, "cpu_flash_bwd")):
            spec = AttentionSpec(**{"head_dim": 32, "backward": True, "dtype": dtype, "window": (31, 0), **kw})
            m = swa_tvm.export_library([spec], tmp_path / f"{mcpu}{dtype}{len(kw)}{kw.get('max_dilation', 0)}.so",
                                       target=target, logs=None, warn_untuned=False)
            got = {k["spec"]["kind"]: k["schedule"] for k in m["kernels"]}
            assert got.get("local_bwd") == schedule, (mcpu, dtype, kw, got)
            if schedule is None:
                assert got["local_dq"] == got["local_dkv"] == engine, got
