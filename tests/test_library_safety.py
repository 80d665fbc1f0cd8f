"""load_library refuses, by the file's name and before anything is registered, every
library or manifest it should not load: a damaged ELF file (before dlopen maps it), a
malformed or inconsistent manifest, a library swapped for another, CUDA device code
where the manifest says CPU and the reverse, and, where $SWA_TVM_LIBRARY_KEY is set, a
library not signed with that key. Three small libraries are exported once (CPU, a second
CPU one signed, CUDA where nvcc is present); each test corrupts copies of them."""

import hashlib
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys

import pytest
from cuda_helpers import needs_nvcc

import swa_tvm
from swa_tvm.runtime import library
from swa_tvm.spec import AttentionSpec

KEY = "0123456789abcdef-test-key-of-32-chars"
SPEC = AttentionSpec.parse("head_dim=16,window=3:0")
OTHER = AttentionSpec.parse("head_dim=16,window=2:0")  # the signed library: other kernels


def _export(folder, spec, key=None, target=None):
    saved = os.environ.pop(library.KEY_ENV, None)
    try:
        if key:
            os.environ[library.KEY_ENV] = key
        path = folder / "lib.so"
        swa_tvm.export_library(spec.kernels(), path, target=target, logs=None)
        return path
    finally:
        os.environ.pop(library.KEY_ENV, None)
        if saved is not None:
            os.environ[library.KEY_ENV] = saved


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An unsigned CPU library (one local kernel)."""
    return _export(tmp_path_factory.mktemp("plain"), SPEC)


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A CPU library of other kernels, exported with $SWA_TVM_LIBRARY_KEY set to KEY."""
    return _export(tmp_path_factory.mktemp("signed"), OTHER, key=KEY)


@pytest.fixture(scope="module")
def cuda_lib(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc (CUDA toolkit) not on PATH")
    return _export(tmp_path_factory.mktemp("cuda"), SPEC, target="cuda -arch=sm_80")


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    """No test inherits a key from the environment; the tests that need one set it."""
    monkeypatch.delenv(library.KEY_ENV, raising=False)


def copy(src, folder, name="copy.so", data=None, edit=None, manifest=None):
    """A copy of library ``src`` in ``folder``: its bytes (or ``data``), its manifest (or
    ``manifest``) passed through ``edit``, with the sha256 rewritten to match the bytes,
    as someone covering their tracks would."""
    dst = folder / name
    data = src.read_bytes() if data is None else data
    dst.write_bytes(data)
    m = library.read_manifest(src) if manifest is None else manifest
    m["sha256"] = hashlib.sha256(data).hexdigest()
    if edit:
        edit(m)
    (folder / (name + ".json")).write_text(json.dumps(m, indent=2))
    return dst


def assert_refused(path, *reasons, jit=False):
    """load_library(path) raises LibraryError naming the file and matching each of
    ``reasons``; the registry is as it was."""
    before = library.REGISTRY.snapshot()
    with pytest.raises(library.LibraryError) as e:
        swa_tvm.load_library(path, _jit_cache=jit)
    message = str(e.value)
    assert str(path) in message, message
    for reason in reasons:
        assert re.search(reason, message), f"{reason!r} not in: {message}"
    assert library.REGISTRY.snapshot() == before, "a refused library registered something"
    return message


def test_library_error_is_a_runtime_error():
    assert issubclass(library.LibraryError, RuntimeError)


def test_pristine_copies_load(exported, signed, tmp_path, fresh_registry):
    """The baseline every refusal below departs from: the copies load as they are."""
    specs = swa_tvm.load_library(copy(exported, tmp_path, "a.so"))
    assert [s.name for s in specs] == [k.name for k in SPEC.kernels()]
    swa_tvm.load_library(copy(signed, tmp_path, "b.so"))  # signed, loaded without a key: as before
    assert len(fresh_registry.kernels()) == 2


# ---------------------------------------------------------------------------------------
# The ELF file, checked before dlopen


def _elf_header(data):
    """(e_type, e_machine, e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize, e_shnum)."""
    f = struct.unpack_from("<HHIQQQIHHHHHH", data, 16)
    return f[0], f[1], f[4], f[5], f[8], f[9], f[10], f[11]


def _set(data, fmt, offset, *values):
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, offset, *values)
    return bytes(out)


def _first_load_segment(data):
    _, _, phoff, _, phentsize, phnum, _, _ = _elf_header(data)
    for i in range(phnum):
        at = phoff + i * phentsize
        if struct.unpack_from("<I", data, at)[0] == 1:  # PT_LOAD
            return i, at
    raise AssertionError("no PT_LOAD")


def _section(data, wanted):
    """(index, header offset, file offset, size) of the section named ``wanted``."""
    _, _, _, shoff, _, _, shentsize, shnum = _elf_header(data)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    shstrndx = struct.unpack_from("<H", data, 62)[0]
    names_at = headers[shstrndx][4]
    for i, h in enumerate(headers):
        name = data[names_at + h[0] : data.index(b"\0", names_at + h[0])].decode()
        if name == wanted:
            return i, shoff + i * shentsize, h[4], h[5]
    raise AssertionError(f"no section {wanted}")


OTHER_MACHINE = 183 if platform.machine() == "x86_64" else 62  # aarch64, else x86_64


def _bad_machine(d):
    return _set(d, "H", 18, OTHER_MACHINE)


def _segment_past_end(d):
    i, at = _first_load_segment(d)
    d = _set(d, "Q", at + 32, len(d) + 4096)  # p_filesz: a page more than the file holds
    return _set(d, "Q", at + 40, len(d) + 8192)  # p_memsz


def _section_past_end(d):
    i, at, _, _ = _section(d, ".text")
    return _set(d, "Q", at + 32, len(d))  # sh_size


# (case, corruption, the message's reason). Cases after the header ones would crash
# dlopen (SIGBUS) if the check missed them: they are checked with check_manifest, which
# never maps the file, and one of them in a process of its own with load_library.
HEADER_CASES = [
    ("magic", lambda d: b"\x7fELG" + d[4:], r"not an ELF shared library \(no ELF header\)"),
    ("empty", lambda d: b"", r"no ELF header"),
    ("class", lambda d: d[:4] + b"\x01" + d[5:], r"not a 64-bit ELF file \(class 1\)"),
    ("endianness", lambda d: d[:5] + b"\x02" + d[6:], r"byte order \(ELF data 2\) is not this machine's"),
    ("type", lambda d: _set(d, "H", 16, 2), r"not a shared library \(ELF type 2\)"),
    ("machine", _bad_machine, rf"holds code for {'aarch64' if OTHER_MACHINE == 183 else 'x86_64'}, this machine is"),
    ("phoff", lambda d: _set(d, "Q", 32, len(d) - 8), r"the program header table .* reaches past the end"),
    ("phnum", lambda d: _set(d, "H", 56, 0xFFF0), r"the program header table .* reaches past the end"),
    ("phentsize", lambda d: _set(d, "H", 54, 32), r"no valid program header table"),
    ("shoff", lambda d: _set(d, "Q", 40, len(d) - 32), r"the section header table .* reaches past the end"),
    ("shnum", lambda d: _set(d, "H", 60, 0xFF00), r"the section header table .* reaches past the end"),
]
CRASH_CASES = [
    ("truncated", lambda d: d[: len(d) // 3], r"reaches past the end of the file \(\d+ bytes\): it is truncated"),
    ("truncated_tail", lambda d: d[:-1], r"it is truncated"),
    ("segment", _segment_past_end, r"segment \d+ \(type 0x1\) .* reaches past the end of the file"),
    ("section", _section_past_end, r"section \d+ .* reaches past the end of the file"),
]


@pytest.mark.parametrize("case,corrupt,reason", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_damaged_elf_header_refused_before_dlopen(exported, tmp_path, fresh_registry, case, corrupt, reason):
    path = copy(exported, tmp_path, data=corrupt(exported.read_bytes()))
    assert_refused(path, reason)


@pytest.mark.parametrize("case,corrupt,reason", CRASH_CASES, ids=[c[0] for c in CRASH_CASES])
def test_extents_past_the_file_refused_without_mapping_it(exported, tmp_path, case, corrupt, reason):
    path = copy(exported, tmp_path, data=corrupt(exported.read_bytes()))
    with pytest.raises(library.LibraryError, match=reason) as e:
        library.check_manifest(path, library.read_manifest(path))
    assert str(path) in str(e.value)


TRUNCATED = r"""
import sys, swa_tvm
from swa_tvm.runtime import library
try:
    swa_tvm.load_library(sys.argv[1])
except library.LibraryError as e:
    assert library.REGISTRY.kernels() == [] and library.REGISTRY.libraries == []
    print("REFUSED", e)
else:
    print("LOADED")
"""


def test_truncated_library_is_refused_not_a_crash(exported, tmp_path):
    """A truncated library whose manifest's sha256 was rewritten to match: dlopen would
    map pages past the end of the file and the process would die of SIGBUS."""
    data = exported.read_bytes()
    path = copy(exported, tmp_path, data=data[: len(data) // 3])
    r = subprocess.run([sys.executable, "-c", TRUNCATED, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit status {r.returncode}:\n{r.stdout}{r.stderr}"
    assert r.stdout.startswith(f"REFUSED {path}: ") and "it is truncated" in r.stdout, r.stdout


# ---------------------------------------------------------------------------------------
# The keyed signature


def test_signed_library_loads_with_its_key(signed, tmp_path, monkeypatch, fresh_registry):
    m = library.read_manifest(signed)
    assert re.fullmatch(r"hmac-sha256:[0-9a-f]{64}", m["signature"])
    monkeypatch.setenv(library.KEY_ENV, KEY)
    specs = swa_tvm.load_library(copy(signed, tmp_path))
    assert [s.name for s in specs] == [k.name for k in OTHER.kernels()]


def test_unsigned_export_has_no_signature(exported):
    assert "signature" not in library.read_manifest(exported)


def test_wrong_key_refused(signed, tmp_path, monkeypatch, fresh_registry):
    monkeypatch.setenv(library.KEY_ENV, KEY + "-other")
    assert_refused(copy(signed, tmp_path), r"signature does not match \$SWA_TVM_LIBRARY_KEY")


def test_unsigned_library_refused_when_a_key_is_set(exported, tmp_path, monkeypatch, fresh_registry):
    monkeypatch.setenv(library.KEY_ENV, KEY)
    assert_refused(copy(exported, tmp_path), r"not signed, and \$SWA_TVM_LIBRARY_KEY is set")


def test_flipped_byte_with_rewritten_sha256_refused_when_a_key_is_set(signed, tmp_path, monkeypatch, fresh_registry):
    """The sha256 only detects accidents: flip a byte (in .comment, harmless to run),
    rewrite the sha256, and without a key the library loads; with one it is refused."""
    data = bytearray(signed.read_bytes())
    _, _, offset, size = _section(bytes(data), ".comment")
    data[offset + size // 2] ^= 0x01
    path = copy(signed, tmp_path, data=bytes(data))
    swa_tvm.load_library(path)  # no key: nothing to tell it from an honest build
    fresh_registry.clear()
    monkeypatch.setenv(library.KEY_ENV, KEY)
    assert_refused(path, r"signature does not match")


@pytest.mark.parametrize("edit", [
    lambda m: m["kernels"][0].update(tuned=True),
    lambda m: m.update(created="2000-01-01T00:00:00+00:00"),
    lambda m: m.update(cpu_features=m["cpu_features"][:-1]),
    lambda m: m.update(extra_field=1),
], ids=["tuned", "created", "cpu_features", "added_field"])  # fmt: skip
def test_signature_covers_the_manifest(signed, tmp_path, monkeypatch, fresh_registry, edit):
    monkeypatch.setenv(library.KEY_ENV, KEY)
    assert_refused(copy(signed, tmp_path, edit=edit), r"signature does not match")


def test_malformed_signature_refused(signed, tmp_path, fresh_registry):
    assert_refused(copy(signed, tmp_path, edit=lambda m: m.update(signature="sha1:00")),
                   r"malformed manifest .*signature 'sha1:00' is not hmac-sha256:")  # fmt: skip


def test_short_key_refused(exported, tmp_path, monkeypatch, fresh_registry):
    monkeypatch.setenv(library.KEY_ENV, "short")
    with pytest.raises(library.LibraryError, match=r"SWA_TVM_LIBRARY_KEY has 5 characters; use a random key of at least 16"):
        swa_tvm.load_library(copy(exported, tmp_path))
    assert fresh_registry.kernels() == []


def test_sign_manifest_is_what_load_checks(exported, tmp_path, monkeypatch, fresh_registry):
    """sign_manifest (what export_library calls) signs an existing library: the copy
    loads under the key, and under another key is refused."""
    path = copy(exported, tmp_path)
    m = library.read_manifest(path)
    library.sign_manifest(path, m, KEY.encode())
    (tmp_path / "copy.so.json").write_text(json.dumps(m))
    monkeypatch.setenv(library.KEY_ENV, KEY)
    swa_tvm.load_library(path)
    fresh_registry.clear()
    library.sign_manifest(path, m, b"another key of sixteen+ chars")
    (tmp_path / "copy.so.json").write_text(json.dumps(m))
    assert_refused(path, r"signature does not match")


# ---------------------------------------------------------------------------------------
# target.mcpu and target_key: informational, but they must agree


def test_edited_target_key_refused(exported, tmp_path, fresh_registry):
    assert_refused(copy(exported, tmp_path, edit=lambda m: m.update(target_key="llvm-znver5")),
                   r"inconsistent manifest: target_key 'llvm-znver5', but its target .* is of class 'llvm-")  # fmt: skip


def test_edited_mcpu_refused(exported, tmp_path, fresh_registry):
    assert_refused(copy(exported, tmp_path, edit=lambda m: m["target"].update(mcpu="znver5")),
                   r"inconsistent manifest: target_key 'llvm-\S+', but its target .*'llvm-znver5'")  # fmt: skip


def test_mcpu_is_informational_the_cpu_features_decide(exported, tmp_path, fresh_registry):
    """A consistent manifest naming another CPU loads: code for a lesser CPU runs on a
    better one, and the features it needs are what is compared with this CPU."""

    def edit(m):
        m["target"]["mcpu"] = "x86-64"
        m["target_key"] = "llvm-x86-64"

    swa_tvm.load_library(copy(exported, tmp_path, edit=edit))
    assert len(fresh_registry.kernels()) == 1


@pytest.mark.parametrize("target", [
    {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}, {"kind": "llvm"}, {"kind": "llvm", "mcpu": "x86-64-v3"},
    {"kind": "cuda", "arch": "sm_90a"}, {"kind": "cuda"},
])  # fmt: skip
def test_runtime_target_key_agrees_with_the_compilers(target):
    from swa_tvm.compiler.targets import target_key

    assert library.manifest_target_key(target) == target_key(target)


# ---------------------------------------------------------------------------------------
# Malformed and inconsistent manifests


def _write_manifest(folder, lib, text):
    path = folder / "copy.so"
    path.write_bytes(lib.read_bytes())
    (folder / "copy.so.json").write_bytes(text)
    return path


def test_truncated_manifest_refused(exported, tmp_path, fresh_registry):
    text = open(library.manifest_path(exported), "rb").read()
    path = _write_manifest(tmp_path, exported, text[: len(text) // 2])
    assert_refused(path, r"malformed manifest .*copy\.so\.json: not JSON")
    assert_refused(path, r"not JSON", jit=True)  # as the JIT cache loads its entries


def test_manifest_not_utf8_refused(exported, tmp_path, fresh_registry):
    assert_refused(_write_manifest(tmp_path, exported, b'{"format": 2, "x": "\xff"}'), r"not JSON")


@pytest.mark.parametrize("text,reason", [
    (b"[]", r"a JSON list, not an object"),
    (b"null", r"a JSON NoneType, not an object"),
    (b"2", r"a JSON int, not an object"),
    (b"[" * 100000, r"not JSON"),
])  # fmt: skip
def test_manifest_not_an_object_refused(exported, tmp_path, fresh_registry, text, reason):
    assert_refused(_write_manifest(tmp_path, exported, text), reason)


def _spec(m):
    return m["kernels"][0]["spec"]


MANIFEST_EDITS = [
    ("format_string", lambda m: m.update(format="2"), r"manifest format '2', expected one of \(2, 3, 4\)"),
    ("no_sha256", lambda m: m.pop("sha256"), r"malformed manifest .*no 'sha256'"),
    ("sha256_not_hex", lambda m: m.update(sha256="xyz"), r"sha256 'xyz' is not 64 lowercase hex digits"),
    ("tvm_version_number", lambda m: m.update(tvm_version=27), r"tvm_version is int 27, expected a string"),
    ("target_list", lambda m: m.update(target=["llvm"]), r"target is list .*, expected an object"),
    ("target_kind", lambda m: m["target"].update(kind="rocm"), r"target kind 'rocm': swa_tvm loads 'llvm' and 'cuda'"),
    ("mcpu_number", lambda m: m["target"].update(mcpu=3), r"target\.mcpu is int 3, expected a string"),
    ("cpu_features_string", lambda m: m.update(cpu_features="avx2"), r"cpu_features is str 'avx2', expected a list"),
    ("cpu_feature_number", lambda m: m.update(cpu_features=[1]), r"cpu_features\[0\] is int 1"),
    ("kernels_object", lambda m: m.update(kernels={}), r"kernels is dict .*, expected a list"),
    ("no_kernels", lambda m: m.update(kernels=[]), r"it lists no kernels"),
    ("kernel_string", lambda m: m.update(kernels=["swa"]), r"kernels\[0\] is str 'swa', expected an object"),
    ("kernel_no_spec", lambda m: m["kernels"][0].pop("spec"), r"kernels\[0\] has no 'spec'"),
    ("tuned_string", lambda m: m["kernels"][0].update(tuned="no"), r"kernels\[0\]\.tuned is str 'no'"),
    ("schedule_number", lambda m: m["kernels"][0].update(schedule=1), r"kernels\[0\]\.schedule is int 1"),
    ("unknown_spec_field", lambda m: _spec(m).update(bogus=1), r"kernels\[0\]\.spec has fields a KernelSpec does not: 'bogus'"),
    ("spec_field_type", lambda m: _spec(m).update(head_dim="16"), r"kernels\[0\]\.spec\.head_dim is str '16', expected an integer"),
    ("spec_bool_as_int", lambda m: _spec(m).update(extras=0), r"kernels\[0\]\.spec\.extras is int 0, expected true or false"),
    ("spec_invalid", lambda m: _spec(m).update(kind="sideways"), r"kernels\[0\]\.spec is not a valid kernel spec: kind must"),
    ("spec_edited", lambda m: _spec(m).update(left=5),
     r"inconsistent manifest: kernel 'swa_local_d16_f32_l3_\w+' has the spec of 'swa_local_d16_f32_l5_"),
    ("kernel_twice", lambda m: m["kernels"].append(m["kernels"][0]), r"inconsistent manifest: kernel \w+ is listed twice"),
    ("cuda_fields_on_cpu", lambda m: m.update(cuda_arch="sm_80"), r"inconsistent manifest: a CPU \(llvm\) target with CUDA"),
]  # fmt: skip


@pytest.mark.parametrize("case,edit,reason", MANIFEST_EDITS, ids=[c[0] for c in MANIFEST_EDITS])
def test_malformed_manifest_refused(exported, tmp_path, fresh_registry, case, edit, reason):
    assert_refused(copy(exported, tmp_path, edit=edit), reason)


def test_edited_spec_and_name_refused_as_missing_function(exported, tmp_path, fresh_registry):
    """A manifest whose spec and name were both edited lists a kernel the library does
    not define: refused before dlopen, by the kernel's name."""

    def edit(m):
        _spec(m)["left"] = 5
        m["kernels"][0]["name"] = library.KernelSpec.from_dict(_spec(m)).name

    assert_refused(copy(exported, tmp_path, edit=edit),
                   r"does not define kernel swa_local_d16_f32_l5_\w+, which its manifest lists")  # fmt: skip


def test_library_swapped_for_another_refused(exported, signed, tmp_path, fresh_registry):
    """Another swa_tvm library under this one's manifest, the sha256 rewritten."""
    path = copy(exported, tmp_path, data=signed.read_bytes())
    assert_refused(path, r"does not define kernel swa_local_d16_f32_l3_\w+, which its manifest lists")
    assert_refused(path, r"does not define kernel", jit=True)


def test_missing_function_after_dlopen_refused_and_nothing_registered(exported, signed, tmp_path, monkeypatch,
                                                                      fresh_registry):
    """The second line: with the ELF check out of the way, the loaded module's functions
    are checked before any kernel is registered (the first kernel listed is there, the
    second is not: neither is registered)."""
    monkeypatch.setattr(library, "check_elf", lambda *a: None)
    m = library.read_manifest(exported)
    m["kernels"] = m["kernels"] + library.read_manifest(signed)["kernels"]
    assert_refused(copy(exported, tmp_path, manifest=m),
                   r"the library has no function swa_local_d16_f32_l2_\w+, which its manifest lists")  # fmt: skip
    path = copy(exported, tmp_path, "swapped.so", data=signed.read_bytes())
    assert_refused(path, r"the library has no function swa_local_d16_f32_l3_\w+")


def test_manifest_of_another_library_half_served_registers_nothing(exported, signed, tmp_path, fresh_registry):
    """A manifest listing two kernels of which the library defines one: neither is
    registered."""
    m = library.read_manifest(exported)
    m["kernels"] = library.read_manifest(signed)["kernels"] + m["kernels"]
    assert_refused(copy(exported, tmp_path, manifest=m), r"does not define kernel swa_local_d16_f32_l2_")


def test_not_regular_files_refused(exported, tmp_path, fresh_registry):
    (tmp_path / "dir.so").mkdir()
    (tmp_path / "dir.so.json").write_text(open(library.manifest_path(exported)).read())
    assert_refused(tmp_path / "dir.so", r"not a regular file")
    path = tmp_path / "lib.so"
    path.write_bytes(exported.read_bytes())
    (tmp_path / "lib.so.json").mkdir()
    assert_refused(path, r"manifest .* is not a regular file")


def test_missing_library_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        swa_tvm.load_library(tmp_path / "none.so")


# ---------------------------------------------------------------------------------------
# CUDA device code, read from the ELF file


def _as_cuda(m):
    m["target"] = {"kind": "cuda", "arch": "sm_80"}
    m.update(target_key="cuda-sm_80", cuda_arch="sm_80", cuda_device_code="fatbin", cpu_features=[])


def test_cpu_library_with_a_cuda_manifest_refused(exported, tmp_path, fresh_registry):
    assert_refused(copy(exported, tmp_path, edit=_as_cuda),
                   r"its manifest says CUDA \(sm_80\), but the library holds no CUDA device code")  # fmt: skip


def test_cuda_arch_disagreeing_with_the_target_refused(exported, tmp_path, fresh_registry):
    def edit(m):
        _as_cuda(m)
        m["cuda_arch"] = "sm_90"

    assert_refused(copy(exported, tmp_path, edit=edit), r"inconsistent manifest: cuda_arch 'sm_90' but target arch 'sm_80'")


@needs_nvcc
def test_cuda_library_loads_and_with_a_cpu_manifest_is_refused(cuda_lib, exported, tmp_path, fresh_registry):
    swa_tvm.load_library(copy(cuda_lib, tmp_path, "good.so"))  # without a GPU: registered, calls say why
    assert [k.device for k in fresh_registry.kernels()] == ["cuda"]
    fresh_registry.clear()

    cpu = library.read_manifest(exported)

    def edit(m):
        for key in ("target", "target_key", "cpu_features", "machine"):
            m[key] = cpu[key]
        m["cuda_arch"] = None
        m.pop("cuda_device_code")

    assert_refused(copy(cuda_lib, tmp_path, edit=edit),
                   r"holds CUDA device code, but its manifest says it is a CPU \(llvm\) library")  # fmt: skip


@needs_nvcc
def test_cuda_device_code_not_as_the_manifest_says_refused(cuda_lib, tmp_path, fresh_registry):
    """The packed CUDA module's format is read from the library: not "fatbin" (its
    format string altered here) is refused; so is a damaged import blob."""
    data = cuda_lib.read_bytes()
    tag = struct.pack("<Q", 6) + b"fatbin"
    assert data.count(tag) == 1
    assert_refused(copy(cuda_lib, tmp_path, "a.so", data=data.replace(tag, struct.pack("<Q", 6) + b"fatbim")),
                   r"its CUDA device code is fatbim, not fatbin as its manifest says")  # fmt: skip
    length_at = data.index(tag) - 8  # the CUDA module's payload length, enlarged past the blob
    broken = data[:length_at] + struct.pack("<Q", 1 << 40) + data[length_at + 8 :]
    assert_refused(copy(cuda_lib, tmp_path, "b.so", data=broken), r"its packed device code is malformed")


@pytest.mark.parametrize("manifest", [[], {"format": 2}], ids=["a list", "fields missing"])
def test_info_reports_a_malformed_manifest(exported, tmp_path, capsys, manifest):
    """`swa-tvm info` says the library is not loadable and exits 1, where it once
    printed a KeyError traceback."""
    from conftest import run_cli

    path = copy(exported, tmp_path)
    (tmp_path / (path.name + ".json")).write_text(json.dumps(manifest))
    rc, out, _ = run_cli(capsys, "info", path)
    assert rc == 1 and "loadable     no:" in out and str(path) in out
