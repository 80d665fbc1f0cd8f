"""The JIT disk cache heals and works read-only.

A damaged entry (truncated or empty manifest, a library whose ELF header is gone,
another kernel's files under the entry's name, a library lacking the function its
manifest names) is a cache miss: the call rebuilds it, returns the right result, warns
once naming the entry, and the entry on disk serves the next process without a compile.
A cache that cannot be written serves its valid entries and compiles the rest in memory,
with one warning naming the cache, writing nothing into it.

The kernels are tiny (float64, D=8, T=20: seconds to compile); the two the tests use
are compiled once per module into a warm cache, which each test copies.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import shutil

import filelock
import pytest
import torch

import swa_tvm
from swa_tvm.compiler import jit
from swa_tvm.reference import sliding_window_attention_ref
from swa_tvm.runtime import library

WINDOW = (3, 0)  # the kernel each test asks for
OTHER = (2, 1)  # another kernel, whose files stand in for a foreign entry
NAMES = {WINDOW: "swa_local_d8_f64_l3_r0_md1_x0_bq32", OTHER: "swa_local_d8_f64_l2_r1_md1_x0_bq32"}


def call(window):
    """The op on small random float64 inputs, checked against the dense reference."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64, generator=g) for _ in range(3))
    out = swa_tvm.sliding_window_attention(q, k, v, window_size=window)
    ref = sliding_window_attention_ref(q, k, v, window_size=window)[0]
    assert out.shape == ref.shape and torch.allclose(out, ref, rtol=0, atol=1e-10), (out - ref).abs().max()


def entry(cache, window) -> str:
    """The library path of ``window``'s kernel in the cache folder ``cache``."""
    found = sorted(p for p in cache.rglob(NAMES[window] + "-*.so"))
    assert len(found) == 1, found
    return str(found[0])


def tree(root) -> dict:
    """Every file and folder under ``root`` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache folder holding both kernels, compiled once for the module's tests."""
    root = tmp_path_factory.mktemp("warm") / "cache"
    saved = library.REGISTRY.snapshot()
    library.REGISTRY.clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SWA_TVM_CACHE", str(root))
            for window in (WINDOW, OTHER):
                call(window)
    finally:
        library.REGISTRY.restore(saved)
    for window in (WINDOW, OTHER):
        entry(root, window)
    return root


@pytest.fixture
def cache(warm_cache, tmp_path, monkeypatch, fresh_registry):
    """A copy of the warm cache as $SWA_TVM_CACHE, with an empty registry."""
    root = tmp_path / "cache"
    shutil.copytree(warm_cache, root)
    monkeypatch.setenv("SWA_TVM_CACHE", str(root))
    return root


@pytest.fixture
def compiles(monkeypatch):
    """The paths the JIT compiles to, in order (export_library, spied on)."""
    calls = []
    export = jit.export_library

    def spy(specs, path, *args, **kwargs):
        calls.append(str(path))
        return export(specs, path, *args, **kwargs)

    monkeypatch.setattr(jit, "export_library", spy)
    return calls


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="swa_tvm")
    return caplog


def warnings_of(logs) -> list[str]:
    return [r.getMessage() for r in logs.records if r.name == "swa_tvm" and r.levelno >= logging.WARNING]


def assert_healed(cache, window, compiles, logs):
    """The entry on disk is whole again: its manifest vouches for its library, and a
    fresh registry loads it without a compile."""
    path = entry(cache, window)
    manifest = library.read_manifest(path)
    assert manifest["sha256"] == library.sha256_file(path)
    assert [k["name"] for k in manifest["kernels"]] == [NAMES[window]]
    library.REGISTRY.clear()
    compiles.clear()
    logs.clear()
    call(window)
    assert compiles == [], "the healed entry was compiled again"
    assert not any("compiling kernel" in r.getMessage() for r in logs.records)
    assert warnings_of(logs) == []


def assert_rebuilt_once(path, compiles, logs):
    """One compile in the call, and one warning that names the damaged entry."""
    assert len(compiles) == 1, compiles
    damaged = [m for m in warnings_of(logs) if path in m]
    assert len(damaged) == 1 and "rebuilding" in damaged[0], warnings_of(logs)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_manifest_is_rebuilt(cache, compiles, logs, damage):
    path = entry(cache, WINDOW)
    manifest = pathlib.Path(path + ".json")
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2] if damage == "truncated" else "")
    call(WINDOW)
    assert_rebuilt_once(path, compiles, logs)
    assert_healed(cache, WINDOW, compiles, logs)


def vouch_for(path):
    """Rewrite the manifest's sha256 to match the (damaged) library: the manifest then
    vouches for the file, and only the loader finds it broken."""
    manifest = library.read_manifest(path)
    manifest["sha256"] = library.sha256_file(path)
    with open(path + ".json", "w") as f:
        json.dump(manifest, f)


def test_library_without_elf_header_is_rebuilt(cache, compiles, logs):
    """The first 64 bytes zeroed, the manifest's sha256 rewritten to match: the manifest
    vouches for the file, and only the loader finds it broken."""
    path = entry(cache, WINDOW)
    with open(path, "r+b") as f:
        f.write(bytes(64))
    vouch_for(path)
    call(WINDOW)
    assert_rebuilt_once(path, compiles, logs)
    assert_healed(cache, WINDOW, compiles, logs)


def test_entry_holding_another_kernel_is_rebuilt(cache, compiles, logs):
    """The entry overwritten with another kernel's library and manifest (consistent with
    each other, so the library loads): its kernel must not be returned, nor stay
    registered from the wrong entry."""
    path, other = entry(cache, WINDOW), entry(cache, OTHER)
    shutil.copyfile(other, path)
    shutil.copyfile(other + ".json", path + ".json")
    call(WINDOW)
    assert_rebuilt_once(path, compiles, logs)
    assert {k.spec.name for k in library.REGISTRY.kernels()} == {NAMES[WINDOW]}
    assert_healed(cache, WINDOW, compiles, logs)


@pytest.mark.slow
def test_library_lacking_its_function_is_rebuilt(cache, compiles, logs):
    """The entry's manifest names the wanted kernel and vouches (sha256) for a library
    that holds another one: the load fails on the missing function, and leaves nothing
    registered."""
    path, other = entry(cache, WINDOW), entry(cache, OTHER)
    shutil.copyfile(other, path)
    vouch_for(path)
    call(WINDOW)
    assert_rebuilt_once(path, compiles, logs)
    assert {k.spec.name for k in library.REGISTRY.kernels()} == {NAMES[WINDOW]}
    assert_healed(cache, WINDOW, compiles, logs)


def test_a_fresh_build_that_does_not_serve_the_spec_raises(cache, monkeypatch):
    """get_or_build_kernel never returns None: a build whose library lacks the kernel
    (here: export writes another spec's) is an error naming the kernel, and is not cached."""
    path = entry(cache, WINDOW)
    os.remove(path)
    export = jit.export_library
    other_spec = swa_tvm.KernelSpec("local", 8, "float64", *OTHER)
    monkeypatch.setattr(jit, "export_library", lambda specs, p, *a, **k: export([other_spec], p, *a, **k))
    with pytest.raises(swa_tvm.LibraryError, match=NAMES[WINDOW]):
        call(WINDOW)
    assert not os.path.exists(path)


@pytest.fixture
def read_only(cache, monkeypatch):
    """The cache tree made read-only (folders 0555, files 0444), as on a shared or
    packaged install, and the tree as it was before the test.

    Root ignores permission bits, so when the tests run as root the refusal is emulated
    at the two points where a process finds out it cannot write there: os.access(...,
    W_OK) answers False for the cache's folders, and acquiring a lock file in the cache
    raises PermissionError(EACCES), which is what filelock raises for a non-root process
    in a read-only folder. A non-root run needs neither: the kernel refuses the writes.
    Either way the test checks afterwards that nothing in the cache changed, which also
    catches a write the emulation would let through."""
    for p in [cache, *cache.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    if os.geteuid() == 0:
        def inside(p):
            p = os.path.abspath(os.fspath(p))
            return p == str(cache) or p.startswith(str(cache) + os.sep)

        access, acquire = os.access, filelock.FileLock.acquire

        def no_write_access(p, mode, *a, **k):
            return False if mode & os.W_OK and inside(p) else access(p, mode, *a, **k)

        def refused(self, *a, **k):
            if inside(self.lock_file):
                raise PermissionError(errno.EACCES, "Permission denied", self.lock_file)
            return acquire(self, *a, **k)

        monkeypatch.setattr(os, "access", no_write_access)
        monkeypatch.setattr(filelock.FileLock, "acquire", refused)
    before = tree(cache)
    yield before
    for p in [cache, *cache.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def test_read_only_warm_cache_serves_its_entries(cache, read_only, compiles, logs):
    call(WINDOW)
    assert compiles == [], "a valid cached entry was compiled again"
    assert warnings_of(logs) == []
    assert tree(cache) == read_only


@pytest.mark.slow
@pytest.mark.parametrize("state", ["missing", "corrupt"])
def test_read_only_cold_cache_compiles_in_memory(cache, compiles, logs, state, request):
    """The kernel's entry missing (the cache holds others) or damaged, and nothing can be
    written: the kernel is compiled outside the cache, with one warning naming the cache
    and why, and the cache is left as it was."""
    path = entry(cache, WINDOW)
    if state == "missing":
        os.remove(path)
        os.remove(path + ".json")
    else:
        with open(path + ".json", "w") as f:
            f.write("{")
    before = request.getfixturevalue("read_only")
    call(WINDOW)
    assert len(compiles) == 1 and not compiles[0].startswith(str(cache)), compiles
    said = warnings_of(logs)
    assert len(said) == 1, said
    folder = os.path.dirname(path)
    assert folder in said[0] and "cannot be written" in said[0] and "in memory" in said[0]
    if state == "corrupt":
        assert path in said[0] and "unusable" in said[0]
    assert not os.path.exists(os.path.dirname(compiles[0])), "the private build folder was left behind"
    assert tree(cache) == before
    logs.clear()
    call(WINDOW)  # served from memory now
    assert len(compiles) == 1 and warnings_of(logs) == []
