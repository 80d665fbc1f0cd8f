"""Tile records of the fused CUDA kernels (swa_tvm.compiler.tiles): the GPU check's variant rows
become records per arch, and export builds with them (compile-only here)."""

import json
import warnings

import pytest

from swa_tvm.compiler import build, tiles
from swa_tvm.spec import AttentionSpec, KernelSpec

SPEC = {"kind": "local", "head_dim": 128, "dtype": "bfloat16", "left": 4095, "right": 0}


def row(function, kind, ms, err=1e-3, default=False, **cfg):
    kernel = "cuda_flash_tc" if kind == "local" else "cuda_flash_bwd_tc"
    base = {"warps": 4, "chunk": 64, "ldmatrix": True}
    if kind == "local":
        base.update(async_copy=False, m_tiles=1, wgmma=False, transpose_v=False)
    return {"function": f"k__{function}", "kind": kind, "kernel": kernel, **base, **cfg, "default": default,
            "rel_err_vs_default": err, "ms": ms, "tflops": 100.0 / ms}


def results(arch="sm_90a"):
    return {
        "device": "NVIDIA H200", "date": "2026-12-04 07:00:00 UTC",
        "variants_meta": {"spec": SPEC, "arch": arch, "shape": [1, 32, 8, 32768], "bundle": "abc1234"},
        "variants": [
            row("tc_w4_c64", "local", 15.0, default=True),
            row("tc_w4_c32_async", "local", 13.0, chunk=32, async_copy=True),
            row("tc_w8_c64_wgmma", "local", 6.0, warps=8, wgmma=True),
            row("wrong_but_fast", "local", 1.0, err=0.5, warps=2),  # disagreed with the default: never a record
            {"function": "k__cores", "kind": "local", "kernel": "cuda_flash", "ms": 0.5, "rel_err_vs_default": 0.0},
            {"function": "k__tc_w2_c32_dq", "kind": "local_dq", "kernel": "cuda_flash_bwd_tc", "error": "boom"},
            row("tc_w2_c32", "local_dq", 20.0, warps=2, chunk=32, default=True),
            row("tc_w4_c32", "local_dq", 17.0, chunk=32),
            {"function": "wgmma_probe_nk", "kind": "wgmma_probe", "kernel": "cuda_wgmma", "wgmma": True,
             "agrees": True, "rel_err": 0.0},
        ],
    }


def test_records_from_the_gpu_checks_rows(tmp_path):
    """Per kind the fastest agreeing tensor-core row, with its provenance; the wgmma one
    for sm_90a only, the fastest of the others for sm_90; a row that disagreed, a
    CUDA-core row and a failed row never; a second import replaces, not appends."""
    path = tmp_path / "gpu_results.json"
    path.write_text(json.dumps(results()))
    written = tiles.import_results(str(path), str(tmp_path / "logs"))
    assert sorted(written) == sorted(str(tmp_path / "logs" / f"cuda-{a}" / "tiles.json") for a in ("sm_90", "sm_90a"))
    got = {a: tiles.read(str(tmp_path / "logs"), {"kind": "cuda", "arch": a}) for a in ("sm_90", "sm_90a")}
    fwd = {a: next(r for r in recs if r["kind"] == "local") for a, recs in got.items()}
    assert fwd["sm_90a"]["function"] == "k__tc_w8_c64_wgmma" and fwd["sm_90a"]["tiles"]["wgmma"] is True
    assert fwd["sm_90"]["function"] == "k__tc_w4_c32_async" and fwd["sm_90"]["tiles"] == {
        "warps": 4, "chunk": 32, "ldmatrix": True, "async_copy": True, "m_tiles": 1, "wgmma": False,
        "transpose_v": False}
    assert fwd["sm_90"]["default_ms"] == 15.0 and fwd["sm_90"]["ms"] == 13.0
    assert fwd["sm_90"]["device"] == "NVIDIA H200" and fwd["sm_90"]["bundle"] == "abc1234"
    assert [r["kind"] for r in got["sm_90"]] == ["local", "local_dq"]  # no dk/dv rows measured: no record
    dq = next(r for r in got["sm_90"] if r["kind"] == "local_dq")
    assert dq["function"] == "k__tc_w4_c32" and dq["schedule"] == "cuda_flash_bwd_tc"
    tiles.import_results(str(path), str(tmp_path / "logs"))
    assert tiles.read(str(tmp_path / "logs"), {"kind": "cuda", "arch": "sm_90"}) == got["sm_90"]
    # A results file from before the variants' meta was written says so.
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"variants": []}))
    with pytest.raises(ValueError, match="variants_meta"):
        tiles.import_results(str(old), str(tmp_path / "logs"))


def test_records_apply_to_their_kernels_only(tmp_path):
    """find_tiles: a record applies to its kind, dtype and head dim (not to D=64, fp16
    or the global rows), never a wgmma config off sm_90a, never one past the shared
    memory of a block; an unknown format is refused."""
    path = tmp_path / "gpu_results.json"
    path.write_text(json.dumps(results()))
    logs = str(tmp_path / "logs")
    tiles.import_results(str(path), logs)
    specs = [KernelSpec("local", 128, "bfloat16", 4095, 0), KernelSpec("local", 64, "bfloat16", 4095, 0),
             KernelSpec("local", 128, "float16", 4095, 0), KernelSpec("global", 128, "bfloat16", 0, 0),
             KernelSpec("local_dq", 128, "bfloat16", 4095, 0)]
    sm90 = build.find_tiles(specs, {"kind": "cuda", "arch": "sm_90"}, logs)
    assert set(sm90) == {specs[0].name, specs[4].name}
    assert (sm90[specs[0].name].chunk, sm90[specs[0].name].async_copy) == (32, True)
    sm90a = build.find_tiles(specs, {"kind": "cuda", "arch": "sm_90a"}, logs)
    assert sm90a[specs[0].name].wgmma and sm90a[specs[0].name].warps == 8
    # A wgmma record read for sm_90 (a hand-edited file) is not used there.
    recs = tiles.read(logs, {"kind": "cuda", "arch": "sm_90a"})
    assert tiles.find(specs[0], "cuda_flash_tc", recs, "sm_90") is None
    # Tiles a spec cannot take (shared memory past the limit at D=256) are not used.
    big = dict(recs[0], head_dim=256, tiles=dict(recs[0]["tiles"], warps=8, chunk=256, wgmma=False))
    assert tiles.find(KernelSpec("local", 256, "bfloat16", 4095, 0), "cuda_flash_tc", [big], "sm_90") is None
    bad = tmp_path / "bad" / "cuda-sm_90"
    bad.mkdir(parents=True)
    (bad / "tiles.json").write_text(json.dumps({"format": 99, "records": []}))
    with pytest.raises(ValueError, match="format 99"):
        tiles.read(str(tmp_path / "bad"), {"kind": "cuda", "arch": "sm_90"})


@pytest.mark.slow  # compiles CUDA kernels
def test_export_builds_with_the_measured_tiles(tmp_path):
    """A CUDA export (compiled here with nvcc, no GPU) takes the record's tiles: the
    manifest says which and where from, and the code has them (cp.async for sm_90's
    record, wgmma for sm_90a's); without records the default, marked so."""
    path = tmp_path / "gpu_results.json"
    path.write_text(json.dumps(results()))
    logs = str(tmp_path / "logs")
    tiles.import_results(str(path), logs)
    specs = AttentionSpec.parse("head_dim=128,window=4095:0,dtype=bfloat16").kernels()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", build.UntunedKernelWarning)
        for arch, marker in (("sm_90", "cp.async.cg.shared.global"), ("sm_90a", "wgmma.mma_async")):
            out = tmp_path / f"lib_{arch}.so"
            manifest = build.export_library(specs, out, f"cuda -arch={arch}", logs=logs)
            (local,) = [k for k in manifest["kernels"] if k["spec"]["kind"] == "local"]
            assert local["tiles_from"] == "measured", local
            assert local["tiles"]["async_copy"] is (arch == "sm_90") and local["tiles"]["wgmma"] is (arch == "sm_90a")
            assert marker in (tmp_path / f"lib_{arch}.so.cu").read_text()
        manifest = build.export_library(specs, tmp_path / "plain.so", "cuda -arch=sm_90", logs=str(tmp_path / "none"))
    (local,) = [k for k in manifest["kernels"] if k["spec"]["kind"] == "local"]
    assert local["tiles_from"] == "default" and local["tiles"]["chunk"] == 64 and not local["tiles"]["async_copy"]
