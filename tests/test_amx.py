"""bfloat16 on the CPU's matrix engine: the local forward's and window gradients' products
as AMX tile instructions (swa_tvm.schedules.amx) or, on CPUs with AVX-512 BF16 but no
AMX, register tiles of dot products (swa_tvm.schedules.bf16_dot), against the float64
reference and torch's own bfloat16 SDPA, and the library's contract for each (manifest,
loader). The accuracy tests run the engine this CPU's kernels are built for."""

import json
import platform
import zlib

import pytest
import torch

import swa_tvm
from conftest import grads_against_reference, rand
from swa_tvm.compiler import build
from swa_tvm.compiler.targets import (host_target, matrix_engine, matrix_form, uses_amx, without_amx,
                                      without_engines)
from swa_tvm.compute.forward import amx_block, amx_serves
from swa_tvm.reference import attention_mask, sliding_window_attention_ref
from swa_tvm.runtime import library
from swa_tvm.schedules import bf16_dot
from swa_tvm.spec import KernelSpec

AMX_FLAGS = {"amx_tile", "amx_bf16"}
HAS_AMX = AMX_FLAGS <= library.host_cpu_flags()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU lacks AMX bfloat16 (amx_tile, amx_bf16)")
HAS_BF16_DOT = "avx512_bf16" in library.host_cpu_flags()
needs_bf16_dot = pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU lacks AVX-512 BF16 (avx512_bf16)")
# The engine this CPU's bfloat16 kernels are built on: the host target's, which follows
# the CPU's flags (compiler.targets.host_target).
HOST_ENGINE = matrix_engine(host_target()) if platform.machine() in ("x86_64", "AMD64") else None
needs_engine = pytest.mark.skipif(HOST_ENGINE is None, reason="this CPU lacks AMX bfloat16 (amx_tile, amx_bf16) and "
                                  "AVX-512 BF16 (avx512_bf16)")
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AMX is x86-64 only")
# A CPU class LLVM knows with AMX: libraries for it build on any x86 machine.
AMX_TARGET = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}
# One with AVX-512 BF16 and no AMX.
DOT_TARGET = {"kind": "llvm", "mcpu": "cooperlake", "num-cores": 2}



def _errors(q, k, v, **kw):
    """Errors against the float64 reference (max abs, relative Frobenius, lse max abs) of
    ours and of a bfloat16 peer: torch's bfloat16 SDPA with the same mask, or, where
    SDPA cannot express the pattern (learned sinks), the reference rounded to bfloat16
    (the floor for any bfloat16 output). The accuracy bar: the error torch's own
    bfloat16 attention has."""
    out, lse = swa_tvm.sliding_window_attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    B, H, T, _ = q.shape
    if "sink_logits" in kw:
        peer = ref.bfloat16()
    else:
        dil = kw.get("dilation", 1)
        dil = dil.tolist() if isinstance(dil, torch.Tensor) else dil
        mask, _ = attention_mask(T, H, kw["window_size"], dil, kw.get("global_idx"), kw.get("num_sinks", 0))
        rep = H // k.shape[1]
        peer = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask.expand(B, H, T, T),
            scale=kw.get("scale"),
        )

    def err(x):
        d = x.double() - ref
        return d.abs().max().item(), (d.norm() / ref.norm()).item()

    return err(out), err(peer), (lse.double() - ref_lse).abs().max().item(), out


CASES = {
    "causal": dict(shape=(2, 4, 4, 300, 64), window_size=(127, 0)),
    "symmetric": dict(shape=(1, 4, 4, 257, 64), window_size=(40, 40)),
    "dilation 3": dict(shape=(1, 2, 2, 333, 64), window_size=(50, 0), dilation=3),
    "per-head dilation, GQA": dict(shape=(1, 4, 2, 190, 64), window_size=(20, 7), dilation=[1, 2, 3, 1]),
    "head dim 128": dict(shape=(1, 2, 2, 150, 128), window_size=(33, 0)),
    "globals and sinks": dict(shape=(1, 2, 2, 260, 64), window_size=(60, 0), global_idx=[[0, 100]], num_sinks=2),
    "learned sinks, scale": dict(shape=(1, 2, 1, 120, 64), window_size=(30, 2), sink_logits=True, scale=0.3),
    "shorter than a block": dict(shape=(1, 2, 2, 5, 64), window_size=(3, 0)),
}


@needs_engine
@pytest.mark.parametrize("case", list(CASES))
def test_accuracy_within_torch_bfloat16_sdpa(case):
    """Ours is as close to float64 as torch's bfloat16 SDPA is (P rounded to bfloat16
    between the products, as FlashAttention does), in every pattern the form serves."""
    cfg = dict(CASES[case])
    B, H, Hkv, T, D = cfg.pop("shape")
    torch.manual_seed(zlib.crc32(case.encode()))
    q, k, v = rand(B, H, T, D).bfloat16(), rand(B, Hkv, T, D).bfloat16(), rand(B, Hkv, T, D).bfloat16()
    if isinstance(cfg.get("dilation"), list):
        cfg["dilation"] = torch.tensor(cfg["dilation"], dtype=torch.int32)
    if "global_idx" in cfg:
        cfg["global_idx"] = torch.tensor(cfg["global_idx"], dtype=torch.int32)
    if cfg.pop("sink_logits", False):
        cfg["sink_logits"] = torch.randn(H)
    (ours, ours_rel), (peer, peer_rel), lse_err, out = _errors(q, k, v, **cfg)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert ours <= 1.5 * peer + 1e-3, f"{case}: max error {ours:.2e} against the bfloat16 peer's {peer:.2e}"
    assert ours_rel <= 1.2 * peer_rel, f"{case}: relative error {ours_rel:.2e} against the peer's {peer_rel:.2e}"
    # Scores and softmax statistics stay float32: the lse is float32-accurate.
    assert lse_err < 1e-4, f"{case}: lse error {lse_err:.2e}"


GRAD_CASES = {
    "causal": dict(shape=(2, 4, 2, 230, 64), window_size=(20, 0)),
    "symmetric": dict(shape=(1, 4, 4, 200, 64), window_size=(64, 64)),
    "dilation 2": dict(shape=(1, 2, 2, 250, 64), window_size=(100, 0), dilation=2),
    "dilation 3, symmetric": dict(shape=(1, 2, 1, 250, 64), window_size=(30, 7), dilation=3),
    "wide, both sides": dict(shape=(1, 2, 2, 301, 64), window_size=(100, 70)),
    "head dim 128, right side": dict(shape=(1, 2, 1, 150, 128), window_size=(30, 5)),
    "globals and sinks": dict(shape=(1, 2, 2, 260, 64), window_size=(60, 3), global_idx=[[0, 100]], num_sinks=2),
    # Two chunks of extra keys and of global rows (32 each).
    "40 globals, causal": dict(shape=(1, 2, 2, 300, 64), window_size=(40, 0), global_idx=[list(range(3, 283, 7))]),
    "globals and a sink, dilation 2": dict(shape=(1, 2, 1, 261, 64), window_size=(50, 0), dilation=2,
                                           global_idx=[[3, 77, 150]], num_sinks=1),
    "globals, symmetric": dict(shape=(1, 4, 2, 220, 64), window_size=(30, 30), global_idx=[[5, 100, 219]]),
    "right side only, head dim 32": dict(shape=(1, 2, 2, 77, 32), window_size=(0, 9)),
    # Three groups of 32 features: the dot products' key rows two column groups at a time.
    "head dim 96": dict(shape=(1, 2, 1, 140, 96), window_size=(40, 0)),
    "shorter than a block": dict(shape=(1, 2, 1, 13, 64), window_size=(5, 3)),
}


# The quick tier runs one case of each form and pattern; these add shapes, in the full suite.
SLOW_GRAD_CASES = ("dilation 3, symmetric", "wide, both sides", "right side only, head dim 32", "head dim 96",
                   "shorter than a block",
                   "40 globals, causal", "globals, symmetric", "globals and a sink, dilation 2")


@needs_engine
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_GRAD_CASES else c
                                  for c in GRAD_CASES])
def test_gradients_within_torch_bfloat16_sdpa(case, monkeypatch):
    """dq, dk, dv of the matrix-engine gradients (P and dS rounded to bfloat16 for their
    products, as FlashAttention's backward does) are as close to float64 autograd as
    torch's bfloat16 SDPA's are; the kernels that ran are this CPU's engine's, and no
    call needed the guarded kernels. The five-product kernel runs where the (batch, head)
    pairs fill the threads, as here, with or without extra keys and global rows, in its
    matrix-engine form on this CPU's engine (schedules/cpu_flash_bwd_matrix.py). The TE
    gradient kernels' matrix-engine form,
    which runs where they do not, is held to the same bound with it turned off
    (symmetric: operands read in place; dilation 2: per-item band copies; globals and
    sinks: the extra keys' kernel, which converts to float32)."""
    from swa_tvm import eager

    te_cases = ("symmetric", "dilation 2", "globals and sinks")
    if case in te_cases:
        monkeypatch.setattr(eager, "_fused_backward_kernel", lambda *args: None)
    else:  # one thread in the eager layer's count, so any (batch, head) count takes it
        monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    fused = case not in te_cases
    _check_gradients(case, monkeypatch, HOST_ENGINE, fused=HOST_ENGINE if fused else None)


@x86
@pytest.mark.slow  # exports a library of every kernel of the pattern
@pytest.mark.parametrize("case", ["causal", "dilation 2", "globals and sinks"])
def test_converted_form_within_torch_bfloat16_sdpa(case, monkeypatch, tmp_path):
    """What a CPU without the matrix engine runs (a target without AMX and AVX-512 BF16,
    on any x86 machine): bfloat16 converted to float32 (each item's band once, into a buffer of the
    item), products in float32. Its forward and dq, dk, dv are as close to float64 as
    torch's bfloat16 SDPA's are. The window's and extra keys' gradients come from the
    five-product backward (the eager layer told of one thread, so any (batch, head) count
    fills it)."""
    target = without_engines(host_target())
    manifest = _load_case_library(case, target, tmp_path / "converted.so", monkeypatch)
    assert all(k["schedule"] not in ("amx", "bf16_dot") for k in manifest["kernels"])
    _check_gradients(case, monkeypatch, "default", fused="cpu_flash_bwd")


@needs_bf16_dot
@pytest.mark.skipif(not HAS_AMX, reason="this CPU's own kernels take AVX-512 BF16 already (the tests above)")
@pytest.mark.slow  # exports a library of every kernel of the pattern
@pytest.mark.parametrize("case", ["causal", "globals and sinks"])
def test_dot_product_gradients_on_a_cpu_with_amx(case, monkeypatch, tmp_path):
    """On a CPU with AMX, a library built with AMX turned off runs the forward and the
    five-product backward on dot products, with and without extra keys; both are as close
    to float64 as torch's bfloat16 SDPA's are."""
    manifest = _load_case_library(case, without_amx(host_target()), tmp_path / "dot.so", monkeypatch)
    assert {k["spec"]["kind"]: k["schedule"] for k in manifest["kernels"]}["local_bwd"] == "bf16_dot"
    _check_gradients(case, monkeypatch, "bf16_dot", fused="bf16_dot")


def _load_case_library(case, target, path, monkeypatch) -> dict:
    """Export and load a bfloat16 library with backward kernels of GRAD_CASES[case]'s
    pattern for ``target``; the eager layer told of one thread, so any (batch, head)
    count fills it. Returns the manifest."""
    from swa_tvm.spec import AttentionSpec

    cfg = GRAD_CASES[case]
    left, right = cfg["window_size"]
    text = f"head_dim={cfg['shape'][-1]},window={left}:{right},backward,dtype=bfloat16"
    text += f",dilation={cfg['dilation']}" if "dilation" in cfg else ""
    text += ",globals,sinks" if "global_idx" in cfg else ""
    manifest = swa_tvm.export_library([AttentionSpec.parse(text)], str(path), target=target, logs=None,
                                      warn_untuned=False)
    swa_tvm.load_library(str(path))
    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    return manifest


# Global positions that differ by batch row, some inside a row's window, and per-head
# dilation (an extra key's residue differs by head).
GLOBALS = torch.tensor([[3, 40, 77, 150, 199], [0, 64, 65, 120, 121]], dtype=torch.int32)
PER_HEAD = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
# Rounding the exact gradients to bfloat16 alone is about 2e-3 relative (2^-9 per element).
BF16_GRAD_TOLERANCE = 6e-3


@needs_engine
@pytest.mark.parametrize("case", ["q's rows", "q_global", "k_global and v_global",
                                  pytest.param("symmetric, dilation per head", marks=pytest.mark.slow),
                                  pytest.param("sinks with logits, dilation 2", marks=pytest.mark.slow)])
def test_matrix_engine_gradients_with_extra_keys_and_global_rows(case, monkeypatch):
    """The five-product kernel's matrix-engine form with extra keys: dq, dk, dv (the global
    rows' own q_global, k_global, v_global where given) against autograd through the
    float64 reference, within 3x bfloat16's rounding; it takes the global rows that attend
    to k and v (global_bwd runs only for k_global / v_global of their own)."""
    from swa_tvm import eager

    monkeypatch.setattr(library, "tvm_pool_threads", lambda: 1)
    launched, launch = [], eager._launch
    monkeypatch.setattr(eager, "_launch", lambda kern, *a: launched.append(kern) or launch(kern, *a))
    args = {"q's rows": ((2, 4, 2, 200, 64, (37, 0)), dict(global_idx=GLOBALS)),
            "q_global": ((2, 4, 2, 200, 64, (37, 0)), dict(global_idx=GLOBALS, projections=("q_global",))),
            "k_global and v_global": ((2, 4, 2, 200, 64, (37, 0)),
                                      dict(global_idx=GLOBALS, projections=("k_global", "v_global"))),
            "symmetric, dilation per head": ((2, 4, 4, 200, 64, (20, 17)), dict(global_idx=GLOBALS, dilation=PER_HEAD)),
            "sinks with logits, dilation 2": ((1, 2, 1, 150, 64, (37, 0)), dict(num_sinks=4, slog=True, dilation=2)),
            }[case]
    errors = grads_against_reference(*args[0], dtype=torch.bfloat16, **args[1])
    kinds = {kern.spec.kind: kern.schedule for kern in launched}
    assert kinds.get("local_bwd") == HOST_ENGINE and not {"local_dq", "local_dkv", "local_dx"} & set(kinds), kinds
    assert ("global_bwd" in kinds) == ("k_global" in args[1].get("projections", ())), kinds
    names = ("dq", "dk", "dv") + (("dsink",) if args[1].get("slog") else ()) + args[1].get("projections", ())
    for name, e in zip(names, errors):
        if name != "dsink":  # a sum over every row of a rounded output: torch's work, not the kernel's
            assert e < BF16_GRAD_TOLERANCE, f"{case} {name}: relative error {e:.2e}"


def _check_gradients(case, monkeypatch, schedule: str, fused: str | None = None):
    """GRAD_CASES[case]: the forward as accurate as torch's bfloat16 SDPA (max error
    1.5x, relative 1.2x, as the matrix-engine forward's test), dq, dk, dv within 1.25x
    SDPA's relative error against float64 autograd; the local kernels that ran have
    ``schedule`` (the gradients the five-product backward's, of schedule ``fused``,
    where given), and no call needed the guarded kernels."""
    from swa_tvm import eager

    cfg = dict(GRAD_CASES[case])
    B, H, Hkv, T, D = cfg.pop("shape")
    if "global_idx" in cfg:
        cfg["global_idx"] = torch.tensor(cfg["global_idx"], dtype=torch.int32)
    torch.manual_seed(zlib.crc32(case.encode()))
    q = rand(B, H, T, D).bfloat16().requires_grad_()
    k, v = (rand(B, Hkv, T, D).bfloat16().requires_grad_() for _ in range(2))
    redone, check = [], eager._redo_nonfinite
    monkeypatch.setattr(eager, "_redo_nonfinite", lambda *a: redone.append(check(*a)) or redone[-1])
    launched, launch = [], eager._launch
    monkeypatch.setattr(eager, "_launch", lambda kern, *a: launched.append(kern) or launch(kern, *a))
    out = swa_tvm.sliding_window_attention(q, k, v, **cfg)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert redone == [False, False], "a call was redone with the guarded kernels"
    schedules = {kern.spec.kind: kern.schedule for kern in launched}
    want = dict(local=schedule, **({"local_bwd": fused} if fused else dict(local_dq=schedule, local_dkv=schedule)))
    assert {kind: schedules.get(kind) for kind in want} == want, schedules
    assert not fused or "local_dq" not in schedules, schedules
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_grads = torch.autograd.grad(sliding_window_attention_ref(*xs, **cfg)[0], xs, g.double())
    mask, _ = attention_mask(T, H, cfg["window_size"], cfg.get("dilation", 1), cfg.get("global_idx"),
                             cfg.get("num_sinks", 0))
    ps = [x.detach().requires_grad_() for x in (q, k, v)]
    rep = H // Hkv
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        ps[0], ps[1].repeat_interleave(rep, 1), ps[2].repeat_interleave(rep, 1), attn_mask=mask.expand(B, H, T, T)
    )
    peer_grads = torch.autograd.grad(sdpa, ps, g)
    ref_out = sliding_window_attention_ref(*(x.detach().double() for x in (q, k, v)), **cfg)[0]
    d, d_peer = (y.detach().double() - ref_out for y in (out, sdpa))
    assert d.abs().max() <= 1.5 * d_peer.abs().max() + 1e-3, f"{case} out: max error"
    assert d.norm() <= 1.2 * d_peer.norm(), f"{case} out: relative error"
    for name, ours, peer, ref in zip(("dq", "dk", "dv"), grads, peer_grads, ref_grads):
        assert ours.dtype == torch.bfloat16 and torch.isfinite(ours).all(), name
        e_ours = ((ours.double() - ref).norm() / ref.norm()).item()
        e_peer = ((peer.double() - ref).norm() / ref.norm()).item()
        assert e_ours <= 1.25 * e_peer, f"{case} {name}: relative error {e_ours:.2e} against SDPA's {e_peer:.2e}"


@needs_engine
def test_the_jit_builds_the_matrix_engine_form(tmp_path, monkeypatch):
    """A bfloat16 call on this CPU compiles the matrix-engine form on its engine: the
    cached manifest says so, and the library's code holds the engine's instructions
    (TDPBF16PS on AMX, VDPBF16PS on AVX-512 BF16)."""
    monkeypatch.setenv("SWA_TVM_CACHE", str(tmp_path))
    q, k, v = (rand(1, 2, 70, 64).bfloat16() for _ in range(3))
    swa_tvm.sliding_window_attention(q, k, v, window_size=(13, 0))
    manifests = list(tmp_path.rglob("*.so.json"))
    assert manifests, "the call compiled nothing into the cache"
    entries = [e for m in manifests for e in json.loads(m.read_text())["kernels"]]
    assert [e["schedule"] for e in entries if e["spec"]["dtype"] == "bfloat16"] == [HOST_ENGINE]
    code = b"".join(m.with_suffix("").read_bytes() for m in manifests)
    if HOST_ENGINE == "amx":
        assert _has_tdpbf16ps(code), "no TDPBF16PS instruction in the compiled library"
    else:
        assert _has_vdpbf16ps(code), "no VDPBF16PS instruction in the compiled library"


def _has_tdpbf16ps(code: bytes) -> bool:
    """TDPBF16PS is VEX.128.F3.0F38 5C /r (tmm registers in ModRM and VEX.vvvv): the
    opcode byte 0x5C after a three-byte VEX prefix whose map is 0F38 and pp = F3."""
    for i in range(len(code) - 4):
        if code[i] == 0xC4 and (code[i + 1] & 0x1F) == 0x02 and (code[i + 2] & 0x83) == 0x02 and code[i + 3] == 0x5C:
            return True
    return False


def _has_vdpbf16ps(code: bytes) -> bool:
    """VDPBF16PS zmm is EVEX.512.F3.0F38.W0 52 /r: the EVEX byte 0x62, P0's map field
    0F38 (2), P1 with W = 0, its fixed bit set and pp = F3 (0b10), P2 with L'L = 512,
    then the opcode 0x52."""
    for i in range(len(code) - 5):
        if (code[i] == 0x62 and (code[i + 1] & 0x07) == 0x02 and (code[i + 2] & 0x87) == 0x06
                and (code[i + 3] & 0x60) == 0x40 and code[i + 4] == 0x52):
            return True
    return False


def test_five_product_form_per_engine():
    """The five-product backward's matrix-engine form calls its own engine's instructions
    only: on AMX the tile configuration and tile products, on AVX-512 BF16 the imported
    dot-product step (a stray call to it would be an unresolved symbol on AMX)."""
    from swa_tvm.schedules.cpu_flash_bwd_matrix import fused_backward_matrix

    for D in (32, 64, 96):
        spec = KernelSpec("local_bwd", D, "bfloat16", 31, 0)
        amx, dot = (fused_backward_matrix(spec, engine).script() for engine in ("amx", "bf16_dot"))
        assert "llvm.x86.ldtilecfg" in amx and "llvm.x86.tdpbf16ps" in amx and bf16_dot.STEP not in amx, D
        assert bf16_dot.STEP in dot and "pragma_import_llvm" in dot and "llvm.x86.tileloadd64" not in dot, D


@x86
@pytest.mark.slow  # compiles the five-product kernel twice
def test_five_product_libraries_hold_their_engines_instructions(tmp_path):
    """Compiled for an AMX class, the five-product kernel's code holds TDPBF16PS and no
    reference to the dot-product step; for a class with AVX-512 BF16 only, VDPBF16PS."""
    spec = KernelSpec("local_bwd", 64, "bfloat16", 31, 0)
    for target, has, engine in ((AMX_TARGET, _has_tdpbf16ps, "amx"), (DOT_TARGET, _has_vdpbf16ps, "bf16_dot")):
        path = tmp_path / f"{engine}.so"
        manifest = build.export_library([spec], path, target=target, logs=None)
        assert [e["schedule"] for e in manifest["kernels"]] == [engine]
        code = path.read_bytes()
        assert has(code), engine
        assert bf16_dot.STEP.encode() not in code, f"{engine}: the dot-product step left as a symbol"


@x86
def test_library_records_amx_and_refuses_a_cpu_without_it(tmp_path, monkeypatch):
    """A library built for an AMX CPU class names the features in its manifest, marks
    its matrix-engine kernels, and refuses, by feature name, to load where they are
    missing (compiled here whatever this CPU is: LLVM emits AMX for any host)."""
    spec = KernelSpec("local", 64, "bfloat16", 15, 0)
    plain = KernelSpec("local", 64, "float32", 15, 0)
    path = tmp_path / "amx.so"
    manifest = build.export_library([spec, plain], path, target=AMX_TARGET, logs=None)
    assert AMX_FLAGS <= set(manifest["cpu_features"]) and manifest["format"] == 3
    assert {e["name"]: e["schedule"] for e in manifest["kernels"]} == {spec.name: "amx", plain.name: "default"}
    # Without matrix-engine kernels the library needs no AMX (and older loaders read it).
    alone = build.export_library([plain], tmp_path / "plain.so", target=AMX_TARGET, logs=None)
    assert not AMX_FLAGS & set(alone["cpu_features"]) and alone["format"] == 2
    monkeypatch.setattr(library, "host_cpu_flags", lambda: set(manifest["cpu_features"]) - AMX_FLAGS)
    with pytest.raises(library.LibraryError, match="amx_bf16, amx_tile"):
        swa_tvm.load_library(path)


@x86
def test_library_records_bf16_dot_and_refuses_a_cpu_without_it(tmp_path, monkeypatch):
    """A library built for a class with AVX-512 BF16 and no AMX (cooperlake) builds its
    bfloat16 forward on dot products, says so in its manifest, needs no AMX, and
    refuses, by feature name, to load on a CPU without AVX-512 BF16."""
    spec = KernelSpec("local", 64, "bfloat16", 15, 0)
    path = tmp_path / "dot.so"
    manifest = build.export_library([spec], path, target=DOT_TARGET, logs=None)
    assert "avx512_bf16" in manifest["cpu_features"] and not AMX_FLAGS & set(manifest["cpu_features"])
    assert [e["schedule"] for e in manifest["kernels"]] == ["bf16_dot"]
    assert _has_vdpbf16ps(path.read_bytes())
    monkeypatch.setattr(library, "host_cpu_flags", lambda: set(manifest["cpu_features"]) - {"avx512_bf16"})
    with pytest.raises(library.LibraryError, match="avx512_bf16"):
        swa_tvm.load_library(path)


@x86
@pytest.mark.slow  # compiles the forward and both window gradients
@pytest.mark.parametrize("dilation", [1, 2])
def test_matrix_form_builds_for_an_amx_class(tmp_path, dilation):
    """On any x86 machine, the matrix form of the local forward and both window
    gradients builds for an AMX class with every product tensorized: at dilation bound
    1 the tile loads read the residue copies in place, at 2 each item copies its band;
    the five-product backward's form builds too. (Where the CPU has AMX, the accuracy
    tests above run them.)"""
    from swa_tvm.spec import AttentionSpec

    text = "head_dim=64,window=20:3,backward,dtype=bfloat16" + (f",dilation={dilation}" if dilation > 1 else "")
    path = tmp_path / "amx.so"
    manifest = swa_tvm.export_library([AttentionSpec.parse(text)], path, target=AMX_TARGET, logs=None,
                                      warn_untuned=False)
    schedules = {e["spec"]["kind"]: e["schedule"] for e in manifest["kernels"]}
    assert all(e["spec"]["max_dilation"] == dilation for e in manifest["kernels"])
    assert [schedules[kind] for kind in ("local", "local_dq", "local_dkv")] == ["amx"] * 3, schedules
    # The five-product backward's own matrix-engine form, each residue in turn.
    assert schedules.get("local_bwd") == "amx", schedules
    assert _has_tdpbf16ps(path.read_bytes()), "no TDPBF16PS instruction in the compiled library"


@x86
def test_refused_tile_state_is_a_library_error(tmp_path, monkeypatch):
    """Where the OS refuses the process AMX tile state, loading a library with AMX
    kernels raises LibraryError naming it; no kernel is registered to die of SIGILL."""
    path = tmp_path / "amx.so"
    manifest = build.export_library([KernelSpec("local", 64, "bfloat16", 7, 0)], path, target=AMX_TARGET, logs=None)
    monkeypatch.setattr(library, "host_cpu_flags", lambda: set(manifest["cpu_features"]))
    monkeypatch.setattr(library, "_amx_granted", False)

    class NoTiles:
        def syscall(self, *args):
            return -1

    monkeypatch.setattr(library.ctypes, "CDLL", lambda *a, **kw: NoTiles())
    before = library.REGISTRY.kernels("cpu")
    with pytest.raises(library.LibraryError, match="tile state"):
        swa_tvm.load_library(path)
    assert library.REGISTRY.kernels("cpu") == before


def test_which_specs_have_the_form():
    """bfloat16 local forwards and window gradients of bounded windows with whole tiles;
    not float32, not the nonfinite variant (its products guard each weight), not
    unbounded windows, not a head dim that is not a multiple of 32, not the extras' or
    global rows' kernels."""
    assert amx_serves(KernelSpec("local", 64, "bfloat16", 511, 0, 2, True))
    assert not amx_serves(KernelSpec("local", 64, "float32", 511, 0))
    assert not amx_serves(KernelSpec("local", 64, "bfloat16", 511, 0, nonfinite=True))
    assert not amx_serves(KernelSpec("local", 64, "bfloat16", -1, 0))
    assert not amx_serves(KernelSpec("local", 48, "bfloat16", 8, 0))
    assert amx_serves(KernelSpec("local_dq", 64, "bfloat16", 8, 0)) and amx_serves(KernelSpec("local_dkv", 64, "bfloat16", 8, 0))
    assert not amx_serves(KernelSpec("local_dx", 64, "bfloat16", 8, 0, extras=True))
    # The five-product backward's form: any dilation bound, extra keys, a window of at
    # most AMX_FUSED_MAX_SPAN keys, the head dim a multiple of 32.
    assert amx_serves(KernelSpec("local_bwd", 64, "bfloat16", 4095, 0))
    assert amx_serves(KernelSpec("local_bwd", 64, "bfloat16", 4095, 0, 8))
    assert amx_serves(KernelSpec("local_bwd", 64, "bfloat16", 8, 0, extras=True))
    for other in (KernelSpec("local_bwd", 48, "bfloat16", 8, 0, extras=True), KernelSpec("local_bwd", 64, "float16", 8, 0),
                  KernelSpec("local_bwd", 64, "bfloat16", 8192, 1), KernelSpec("local_bwd", 48, "bfloat16", 8, 0)):
        assert not amx_serves(other), other
    # A bfloat16 kvcache spec lists that kernel once (not its nonfinite copy), float32 not.
    from swa_tvm.spec import CACHE_MATRIX_BLOCK, AttentionSpec

    only = [k for k in AttentionSpec.parse("head_dim=64,window=20:0,kvcache,nonfinite,backward,dtype=bfloat16").kernels()
            if k.engine_only]
    assert only == [KernelSpec("cache", 64, "bfloat16", 20, 0, block_q=CACHE_MATRIX_BLOCK)], only
    assert not any(k.engine_only for k in AttentionSpec.parse("head_dim=64,window=20:0,kvcache,dtype=float32").kernels())
    assert not amx_serves(KernelSpec("global", 64, "bfloat16", 0, 0))
    # The KV-cache forward: bfloat16 blocks of CACHE_MATRIX_BLOCK rows, any window, sinks,
    # softcap; not its small blocks (decode), gradients, float32 or the nonfinite variant.
    assert amx_serves(KernelSpec("cache", 64, "bfloat16", -1, 0, 2, True, block_q=64, softcap=True))
    for other in (KernelSpec("cache", 64, "bfloat16", 8, 0, block_q=16), KernelSpec("cache", 64, "float32", 8, 0, block_q=64),
                  KernelSpec("cache", 64, "bfloat16", 8, 0, block_q=64, nonfinite=True),
                  KernelSpec("cache_dq", 64, "bfloat16", 8, 0, block_q=64), KernelSpec("cache", 48, "bfloat16", 8, 0, block_q=64)):
        assert not amx_serves(other), other
    assert amx_block(KernelSpec("local", 64, "bfloat16", 8, 0, block_q=32)) == 64
    spec = KernelSpec("local", 64, "bfloat16", 8, 0)
    assert uses_amx(spec, AMX_TARGET)
    assert not uses_amx(spec, {"kind": "llvm", "mcpu": "znver3"})
    assert not uses_amx(spec, {"kind": "cuda", "arch": "sm_90"})
    # The engine: AMX where the class has it, else AVX-512 BF16's dot products, for every
    # kernel of the form (the five-product backward's too).
    fused = KernelSpec("local_bwd", 64, "bfloat16", 8, 0)
    assert matrix_form(spec, AMX_TARGET) == "amx" and matrix_form(fused, AMX_TARGET) == "amx"
    for t in (DOT_TARGET, {"kind": "llvm", "mcpu": "znver4"}, dict(AMX_TARGET, mattr=["-amx-tile", "-amx-bf16"])):
        assert matrix_form(spec, t) == "bf16_dot" and matrix_form(fused, t) == "bf16_dot", t
        assert matrix_form(KernelSpec("local_dkv", 64, "bfloat16", 8, 0), t) == "bf16_dot"
    for t in ({"kind": "llvm", "mcpu": "znver3"}, {"kind": "llvm", "mcpu": "rocketlake"},
              dict(DOT_TARGET, mattr=["-avx512bf16"]), {"kind": "cuda", "arch": "sm_90"}):
        assert matrix_form(spec, t) is None and matrix_form(fused, t) is None, t
    assert matrix_form(KernelSpec("local", 64, "float32", 8, 0), DOT_TARGET) is None
    # AMX turned off, the other -mattr kept: the dot-product engine's target.
    off = without_amx(dict(AMX_TARGET, mattr=["+amx-tile", "+amx-bf16", "+avx512bf16"]))
    assert off["mattr"] == ["+avx512bf16", "-amx-tile", "-amx-bf16"] and matrix_form(spec, off) == "bf16_dot"
    # Both engines turned off, the other -mattr kept: the float32-product form's target.
    plain = without_engines(dict(DOT_TARGET, mattr=["+avx512bf16", "+avx512vl"]))
    assert plain["mattr"] == ["+avx512vl", "-amx-tile", "-amx-bf16", "-avx512bf16"]
    assert matrix_form(spec, plain) is None and matrix_form(fused, plain) is None


@needs_engine
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_beyond_the_window_reaches_no_row(where):
    """The NaN rule in the matrix-engine form: a NaN in the key or value at position 40,
    which only rows 40..44 of a causal window of 4 see, leaves every other row finite
    and right (the plain form's NaN shows in the result, and the call is redone with the
    guarded kernels)."""
    q, k, v = (rand(1, 2, 80, 64).bfloat16() for _ in range(3))
    (k if where == "k" else v)[:, :, 40] = float("nan")
    out = swa_tvm.sliding_window_attention(q, k, v, window_size=(4, 0))
    ref, _ = sliding_window_attention_ref(q, k, v, window_size=(4, 0))
    seen = torch.zeros(80, dtype=torch.bool)
    seen[40:45] = True
    assert torch.isnan(out[:, :, seen]).all()
    assert torch.isfinite(out[:, :, ~seen]).all()
    assert (out[:, :, ~seen].double() - ref[:, :, ~seen]).abs().max() < 2e-2


@pytest.mark.parametrize("engine", [pytest.param("amx", marks=needs_amx), pytest.param("bf16_dot", marks=needs_bf16_dot)])
@pytest.mark.parametrize("shape", [(48, 64, 96), (16, 48, 32), (32, 32, 64)])
def test_the_intrinsic_is_a_matmul(engine, shape):
    """Each engine's tensor intrinsic alone, tensorized into a TE matmul of pair words:
    equals A @ B in float32 (bfloat16 products are exact in float32; only the sums
    round). The dot products' register tile is 4 rows by 4, 1 and 2 columns of 16 in
    these shapes."""
    import tvm
    from tvm import s_tir, te

    from swa_tvm.compute.forward import bf16_bits, bf16_value, pair_word, word_half
    from swa_tvm.schedules import amx, bf16_dot

    if engine == "amx":
        library.request_amx("test")
    M, N, K = shape
    a_bits = te.placeholder((M, K), "uint16", name="a")
    b = te.placeholder((K, N), "bfloat16", name="b")
    words = te.compute((K // 2, N), lambda k2, j: pair_word(bf16_bits(b[2 * k2, j]), bf16_bits(b[2 * k2 + 1, j])), name="w")
    k2, e = te.reduce_axis((0, K // 2), "k2"), te.reduce_axis((0, 2), "e")
    c = te.compute((M, N), lambda i, j: te.sum(bf16_value(a_bits[i, 2 * k2 + e]) * word_half(words[k2, j], e), axis=[k2, e]),
                   name="c")
    sch = s_tir.Schedule(te.create_prim_func([a_bits, b, c]))
    sch.tensorize(sch.get_loops(sch.get_sblock("c"))[0], {"amx": amx, "bf16_dot": bf16_dot}[engine].register(M, N, K))
    target = AMX_TARGET if engine == "amx" else without_amx(host_target())
    mod = tvm.compile(sch.mod, target=tvm.target.Target(target))
    A, Bm = rand(M, K).bfloat16(), rand(K, N).bfloat16()
    C = torch.zeros(M, N)
    mod(tvm.runtime.from_dlpack(A.view(torch.uint16)), tvm.runtime.from_dlpack(Bm), tvm.runtime.from_dlpack(C))
    torch.testing.assert_close(C, A.float() @ Bm.float(), rtol=1e-5, atol=1e-5)


@needs_bf16_dot
@pytest.mark.skipif(not HAS_AMX, reason="this CPU's own kernels take AVX-512 BF16 already (the tests above)")
@pytest.mark.slow  # compiles two forwards
@pytest.mark.parametrize("case", ["causal", "dilation 3", "symmetric"])
def test_dot_product_form_on_a_cpu_with_amx(case, tmp_path):
    """On a CPU with AMX, whose own kernels use the tiles, the dot-product form (a target
    with AMX turned off) still runs here: its forward, called from its library, is as
    close to float64 as torch's bfloat16 SDPA is (the bound of the accuracy tests)."""
    import tvm

    cfg = dict(CASES[case])
    B, H, Hkv, T, D = cfg.pop("shape")
    left, right = cfg["window_size"]
    dil = cfg.get("dilation", 1)
    spec = KernelSpec("local", D, "bfloat16", left, right, max_dilation=dil)
    target = without_amx(host_target())
    manifest = build.export_library([spec], tmp_path / "dot.so", target=target, logs=None)
    assert [e["schedule"] for e in manifest["kernels"]] == ["bf16_dot"]
    kernel = tvm.runtime.load_module(str(tmp_path / "dot.so"))[spec.name]
    torch.manual_seed(zlib.crc32(case.encode()))
    q, k, v = rand(B, H, T, D).bfloat16(), rand(B, Hkv, T, D).bfloat16(), rand(B, Hkv, T, D).bfloat16()
    out, lse = torch.empty_like(q), torch.empty(B, H, T)
    kernel(q, k, v, torch.full((H,), dil, dtype=torch.int32), torch.full((H,), float("-inf")), D**-0.5, out, lse)
    kw = dict(window_size=(left, right), dilation=dil)
    ref, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    mask, _ = attention_mask(T, H, (left, right), dil)
    rep = H // Hkv
    peer = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask.expand(B, H, T, T))
    ours, theirs = (out.double() - ref), (peer.double() - ref)
    assert ours.abs().max() <= 1.5 * theirs.abs().max() + 1e-3 and ours.norm() <= 1.2 * theirs.norm()
    assert (lse.double() - ref_lse).abs().max() < 1e-4


@x86
def test_host_target_adds_amx_its_cpu_name_lacks(monkeypatch):
    """A CPU with AMX (or AVX-512 BF16) that LLVM names by a model without it (a virtual
    machine's Intel reported as rocketlake) gets it in the host target's -mattr, so its
    bfloat16 kernels use the engine; a CPU whose name implies one that the OS hides gets
    it taken out; the class key stays the -mcpu's."""
    from swa_tvm.compiler import targets

    monkeypatch.setattr(tvm_codegen(), "llvm_get_system_cpu", lambda: "rocketlake")
    monkeypatch.setattr(library, "host_cpu_flags", lambda: {"avx512f", "amx_tile", "amx_bf16", "amx_int8"})
    t = targets.host_target()
    assert t["mattr"] == ["+amx-tile", "+amx-bf16"] and targets.target_key(t) == "llvm-rocketlake"
    assert uses_amx(KernelSpec("local", 64, "bfloat16", 8, 0), t)
    # AVX-512 BF16 the name lacks: the dot products' engine.
    monkeypatch.setattr(library, "host_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    t = targets.host_target()
    assert t["mattr"] == ["+avx512bf16"] and matrix_form(KernelSpec("local", 64, "bfloat16", 8, 0), t) == "bf16_dot"
    monkeypatch.setattr(library, "host_cpu_flags", lambda: {"avx512f"})
    assert "mattr" not in targets.host_target()
    monkeypatch.setattr(tvm_codegen(), "llvm_get_system_cpu", lambda: "sapphirerapids")
    monkeypatch.setattr(library, "host_cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    assert "mattr" not in targets.host_target()  # LLVM's sapphirerapids has AMX already
    # The OS (or a hypervisor) hides AMX from a CPU whose name implies it: no AMX code;
    # hiding AVX-512 BF16 too leaves no engine.
    monkeypatch.setattr(library, "host_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    t = targets.host_target()
    assert t["mattr"] == ["-amx-tile", "-amx-bf16"]
    assert not uses_amx(KernelSpec("local", 64, "bfloat16", 8, 0), t)
    monkeypatch.setattr(library, "host_cpu_flags", lambda: {"avx512f"})
    t = targets.host_target()
    assert t["mattr"] == ["-amx-tile", "-amx-bf16", "-avx512bf16"] and matrix_engine(t) is None
    # No AVX-512 BF16 is added to a -mcpu without AVX-512 (a CPU LLVM does not know).
    monkeypatch.setattr(tvm_codegen(), "llvm_get_system_cpu", lambda: "x86-64-v3")
    monkeypatch.setattr(library, "host_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert "mattr" not in targets.host_target()


def tvm_codegen():
    import tvm

    return tvm.target.codegen


def test_short_exp_error():
    """The matrix-engine form's exp polynomial (forward.SHORT_EXP, degree 5 against
    Cephes' 7), evaluated in float32 as the kernels do, is within 3e-7 of exp relative
    over the scores' range, and exactly 0 below it."""
    import numpy as np
    import tvm
    from tvm import te

    from swa_tvm.compute.forward import SHORT_EXP, _exp

    x = te.placeholder((1 << 16,), "float32", name="x")
    y = te.compute(x.shape, lambda i: _exp(x[i], "float32", coeffs=SHORT_EXP), name="y")
    f = tvm.compile(te.create_prim_func([x, y]), target="llvm")
    xs = np.concatenate([-np.linspace(0, 87, (1 << 16) - 2), [-100.0, -np.inf]]).astype("float32")
    ys = np.empty_like(xs)
    f(tvm.runtime.tensor(xs), out := tvm.runtime.tensor(ys))
    ys = out.numpy()
    exact = np.exp(xs.astype("float64"))
    rel = np.abs(ys[:-2] - exact[:-2]) / exact[:-2]
    assert rel.max() < 3e-7, rel.max()
    assert ys[-2] == 0 and ys[-1] == 0



def test_tuning_refuses_the_matrix_engine_form():
    """The search space is the float32-product form's: a kernel the target builds on the
    matrix engine is refused by name (its records would apply to no build), others pass."""
    from swa_tvm.tuning.candidates import check_no_amx_specs

    amx_spec, plain = KernelSpec("local", 64, "bfloat16", 15, 0), KernelSpec("local", 64, "float32", 15, 0)
    for target in (AMX_TARGET, DOT_TARGET):
        with pytest.raises(ValueError, match=amx_spec.name):
            check_no_amx_specs([plain, amx_spec], target)
    check_no_amx_specs([plain, amx_spec], {"kind": "llvm", "mcpu": "znver3"})


# KV-cache calls of at least CACHE_MATRIX_BLOCK rows (query positions x the GQA group):
# (B, H, H_kv, D, positions, first query, queries) and the pattern.
KV_CASES = {
    "prefill chunk, GQA": dict(dims=(2, 8, 2, 64, 300, 200, 64), window_size=(127, 0)),
    "partial last block, head dim 128": dict(dims=(1, 4, 2, 128, 220, 150, 37), window_size=(60, 0)),
    "dilation 2, sinks, softcap": dict(dims=(1, 4, 1, 64, 400, 300, 40), window_size=(50, 0), dilation=2, num_sinks=3,
                                       softcap=20.0),
    "whole prompt, learned sinks": dict(dims=(1, 4, 4, 64, 150, 0, 150), window_size=(-1, 0), sink_logits=True),
    "rolling buffer": dict(dims=(1, 4, 2, 64, 300, 268, 32), window_size=(150, 0), ring=192),
}


@needs_engine
@pytest.mark.parametrize("case", [c if c == "dilation 2, sinks, softcap" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in KV_CASES])
def test_kv_cache_chunks_within_torch_bfloat16_sdpa(case, monkeypatch):
    """A bfloat16 KV-cache call of 64 rows or more (a prefill chunk, a whole prompt) runs
    the cache kernel's matrix-engine form, in blocks of 64 rows, on this CPU's engine;
    its rows are as close to the float64 full-sequence reference as torch's bfloat16
    SDPA's (transformers' eager bfloat16 attention where SDPA cannot express the
    pattern: softcap, learned sinks), and the lse within 1e-4."""
    from swa_tvm import eager
    from swa_tvm.spec import CACHE_MATRIX_BLOCK

    launched, launch = [], eager._launch
    monkeypatch.setattr(eager, "_launch", lambda kern, *a: launched.append(kern) or launch(kern, *a))
    cfg = dict(KV_CASES[case])
    B, H, Hkv, D, N, q0, Tq = cfg.pop("dims")
    ring = cfg.pop("ring", None)
    torch.manual_seed(zlib.crc32(case.encode()))
    q, k, v = rand(B, H, N, D).bfloat16(), rand(B, Hkv, N, D).bfloat16(), rand(B, Hkv, N, D).bfloat16()
    if cfg.pop("sink_logits", False):
        cfg["sink_logits"] = torch.randn(H)
    ref, ref_lse = sliding_window_attention_ref(q, k, v, **cfg)
    rows = slice(q0, q0 + Tq)
    mask, _ = attention_mask(N, H, cfg["window_size"], cfg.get("dilation", 1), None, cfg.get("num_sinks", 0))
    rep = H // Hkv
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if "sink_logits" in cfg or "softcap" in cfg:
        # SDPA has neither: transformers' eager bfloat16 attention (Gemma 2's softcap,
        # GPT-OSS's sink column), its softmax in float32.
        s = q @ kr.transpose(-1, -2) * D**-0.5
        if "softcap" in cfg:
            s = torch.tanh(s / cfg["softcap"]) * cfg["softcap"]
        s = s.masked_fill(~mask, float("-inf"))
        if "sink_logits" in cfg:
            s = torch.cat([s, cfg["sink_logits"].view(1, H, 1, 1).expand(B, H, N, 1).bfloat16()], -1)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).bfloat16()[..., :N]
        peer = (p @ vr)[:, :, rows]
    else:
        peer = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask.expand(B, H, N, N))[:, :, rows]
    end = q0 + Tq
    if ring is None:
        kc, vc, where = k[:, :, :end], v[:, :, :end], {}
    else:  # the ring's slots hold the last `ring` positions, rotated: out of order
        pos = torch.arange(end - ring, end).roll(50)
        kc, vc, where = k[:, :, pos], v[:, :, pos], dict(kv_positions=pos)
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, rows], kc, vc, q_offset=q0, return_lse=True, **where, **cfg)
    blocks = {kern.spec.block_q: kern.schedule for kern in launched if kern.spec.kind == "cache"}
    assert blocks == {CACHE_MATRIX_BLOCK: HOST_ENGINE}, blocks
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    want = ref[:, :, rows]

    def err(x):
        d = x.double() - want
        return d.abs().max().item(), (d.norm() / want.norm()).item()

    (ours, ours_rel), (theirs, theirs_rel) = err(out), err(peer)
    assert ours <= 1.5 * theirs + 1e-3, f"{case}: max error {ours:.2e} against the bfloat16 peer's {theirs:.2e}"
    assert ours_rel <= 1.2 * theirs_rel, f"{case}: relative error {ours_rel:.2e} against the peer's {theirs_rel:.2e}"
    lse_err = (lse.double() - ref_lse[:, :, rows]).abs().max().item()
    assert lse_err < 1e-4, f"{case}: lse error {lse_err:.2e}"


@needs_engine
@pytest.mark.slow  # compiles the decode, forward and both gradient kernels
def test_kv_cache_decode_and_gradients_keep_small_blocks(monkeypatch):
    """Calls of fewer than 64 rows (a decode step: T_q x the group) keep the cache
    kernel's small blocks and float32 products, and so do the gradients of a 64-row
    chunk, whose forward takes the matrix-engine form; all against the float64
    reference (gradients through its autograd)."""
    from swa_tvm import eager

    launched, launch = [], eager._launch
    monkeypatch.setattr(eager, "_launch", lambda kern, *a: launched.append(kern) or launch(kern, *a))
    q, k, v = rand(1, 8, 90, 64).bfloat16(), rand(1, 2, 90, 64).bfloat16(), rand(1, 2, 90, 64).bfloat16()
    ref, _ = sliding_window_attention_ref(q, k, v, window_size=(40, 0))
    out = swa_tvm.attention_with_kv_cache(q[:, :, -1:], k, v, window_size=(40, 0))
    assert (out.double() - ref[:, :, -1:]).abs().max() < 2e-2
    assert [(kern.spec.block_q, kern.schedule) for kern in launched] == [(4, "default")]

    launched.clear()
    leaves = [x[:, :, 70:].clone().requires_grad_() if x is q else x.clone().requires_grad_() for x in (q, k, v)]
    out = swa_tvm.attention_with_kv_cache(*leaves, window_size=(40, 0), q_offset=70)
    g = rand(*out.shape).bfloat16()
    grads = torch.autograd.grad(out, leaves, g)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = sliding_window_attention_ref(*exact, window_size=(40, 0))
    want = torch.autograd.grad(ref[:, :, 70:], exact, g.double())
    want = (want[0][:, :, 70:],) + want[1:]
    for name, x, w in zip("qkv", grads, want):
        rel = ((x.double() - w).norm() / w.norm()).item()
        assert rel < 1e-2, f"d{name}: relative error {rel:.2e}"
    assert [(kern.spec.kind, kern.spec.block_q, kern.spec.nonfinite, kern.schedule) for kern in launched] == [
        ("cache", 64, False, HOST_ENGINE), ("cache_dq", 16, False, "default"), ("cache_dkv", 16, False, "default")]


@needs_engine
@pytest.mark.slow  # compiles the engine's kernel and the guarded one
def test_kv_cache_chunk_ignores_nan_in_unwritten_slots(monkeypatch):
    """The NaN rule on the engine's blocks: a bfloat16 chunk of 80 rows against a cache
    whose unwritten tail holds NaN and inf gets the reference's rows, finite (a NaN that
    the plain products let through redoes the call on the guarded kernels)."""
    from swa_tvm import eager

    launched, launch = [], eager._launch
    monkeypatch.setattr(eager, "_launch", lambda kern, *a: launched.append(kern) or launch(kern, *a))
    q, k, v = rand(1, 8, 80, 64).bfloat16(), rand(1, 2, 80, 64).bfloat16(), rand(1, 2, 80, 64).bfloat16()
    ref, _ = sliding_window_attention_ref(q, k, v, window_size=(30, 0))
    kc = torch.cat([k, torch.full((1, 2, 20, 64), float("nan")).bfloat16()], 2)
    vc = torch.cat([v, torch.full((1, 2, 20, 64), float("inf")).bfloat16()], 2)
    out = swa_tvm.attention_with_kv_cache(q[:, :, 60:], kc, vc, q_offset=60, kv_len=80, window_size=(30, 0))
    assert torch.isfinite(out).all()
    assert (out.double() - ref[:, :, 60:]).abs().max() < 3e-2
    assert (launched[0].spec.block_q, launched[0].schedule) == (64, HOST_ENGINE)
    assert all(kern.spec.nonfinite and kern.spec.block_q == 16 for kern in launched[1:]), launched


@needs_engine
@pytest.mark.slow  # exports two libraries
def test_kv_cache_libraries_choose_the_block(tmp_path, fresh_registry, monkeypatch):
    """With libraries loaded, a bfloat16 chunk of 64 rows or more takes the engine's
    64-row kernel where a library holds it, and a library without it (exported before
    it existed) serves the chunk on its small blocks, without an error."""
    from swa_tvm import eager

    launched, launch = [], eager._launch
    monkeypatch.setattr(eager, "_launch", lambda kern, *a: launched.append(kern) or launch(kern, *a))
    q, k, v = rand(1, 8, 60, 64).bfloat16(), rand(1, 2, 60, 64).bfloat16(), rand(1, 2, 60, 64).bfloat16()
    ref, _ = sliding_window_attention_ref(q, k, v, window_size=(20, 0))
    for blocks, want in (((16, 64), (64, HOST_ENGINE)), ((16,), (16, "default"))):
        path = tmp_path / f"kv{len(blocks)}.so"
        build.export_library([KernelSpec("cache", 64, "bfloat16", 20, 0, block_q=b) for b in blocks], path, logs=None,
                             warn_untuned=False)
        fresh_registry.clear()
        swa_tvm.load_library(path)
        launched.clear()
        out = swa_tvm.attention_with_kv_cache(q[:, :, 40:], k, v, q_offset=40, window_size=(20, 0))
        assert (out.double() - ref[:, :, 40:]).abs().max() < 3e-2
        assert [(kern.spec.block_q, kern.schedule) for kern in launched] == [want]


@x86
@pytest.mark.slow  # compiles two cache kernels per target
def test_kv_cache_matrix_block_is_exported_for_an_engine_only(tmp_path):
    """Export keeps the KV-cache forward's 64-row blocks where the target has a matrix
    engine (in that form: on an AMX class its products are tile instructions) and
    leaves them out elsewhere, where no call takes them."""
    specs = [KernelSpec("cache", 64, "bfloat16", 20, 0, block_q=b) for b in (16, 64)]
    for target, want in ((DOT_TARGET, {16: "default", 64: "bf16_dot"}), (AMX_TARGET, {16: "default", 64: "amx"}),
                         ({"kind": "llvm", "mcpu": "znver3", "num-cores": 2}, {16: "default"})):
        path = tmp_path / f"{target['mcpu']}.so"
        manifest = build.export_library(specs, path, target=target, logs=None, warn_untuned=False)
        assert {e["spec"]["block_q"]: e["schedule"] for e in manifest["kernels"]} == want, target
        assert _has_tdpbf16ps(path.read_bytes()) == (target is AMX_TARGET), target
