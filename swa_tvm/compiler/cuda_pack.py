"""CUDA device code compiled into exported libraries.

TVM 0.27 builds a CUDA module as its generated source (format "cuda") and compiles it
when the library is loaded, through a ``tvm_callback_cuda_compile`` that only the full
apache-tvm package registers (and that needs a CUDA compiler there). A library built so
would not load where TVM's runtime alone is installed, which is the point of exporting
one. ``export_module`` exports with every CUDA module's source replaced by an nvcc
fatbin (the arch's machine code and its PTX), which the runtime loads as is.

The replacement edits the serialized import blob TVM packs into the library
(``__tvm_ffi__library_bin``): u64 size; the import tree (two u64 vectors); then per
module its kind (u64-length string) and, but for the host placeholder "_lib", a
u64-length payload. A CUDA module's payload is its format string, its function table,
and its data (u64-length): format "cuda" with the source becomes "fatbin" with the
fatbin, the table untouched. ``read_cuda_modules`` reads the blob back (the tests check
exported libraries with it).
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile

from tvm.runtime import _ffi_api
from tvm.support import nvcc

BLOB_SYMBOL = "__tvm_ffi__library_bin"
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)


def nvcc_fatbin(code: str, arch: str) -> tuple[bytes, str]:
    """(fatbin, nvcc's report) of CUDA source ``code`` for ``arch`` ("sm_90"): the
    command of ``tvm.support.nvcc.compile_cuda`` (its flags, its ptxas options, whose
    ``-v`` report it discards and this keeps), with the arch's machine code and PTX."""
    return nvcc_compile(code, arch, "fatbin")


def nvcc_compile(code: str, arch: str, output: str) -> tuple[bytes, str]:
    """``nvcc_fatbin``'s command, for output "fatbin" or "cubin" (the machine code
    alone, as ``tools.sass`` disassembles it)."""
    num = arch[3:]
    with tempfile.TemporaryDirectory(prefix="swa_tvm_nvcc_") as tmp:
        src, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, f"kernels.{output}")
        with open(src, "w") as f:
            f.write(code)
        codes = f"[sm_{num},compute_{num}]" if output == "fatbin" else f"sm_{num}"
        cmd = ["nvcc", f"--{output}", "-O3", "-gencode", f"arch=compute_{num},code={codes}"]
        cmd += [f"-U__CUDA_NO_{x}__" for x in ("HALF_OPERATORS", "HALF_CONVERSIONS", "BFLOAT16_OPERATORS",
                                               "BFLOAT16_CONVERSIONS", "BFLOAT162_OPERATORS", "BFLOAT162_CONVERSIONS")]
        cmd += ["--expt-relaxed-constexpr", "--expt-extended-lambda"]
        cmd += [] if os.environ.get("TVM_CUDA_NVCC_NO_FAST_MATH") else ["--use_fast_math"]
        cmd += [f"--ptxas-options={','.join(nvcc._ptxas_option_flags())}", "-o", out, src]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
        with open(out, "rb") as f:
            return f.read(), proc.stdout + proc.stderr


def ptxas_resources(report: str) -> dict[str, dict]:
    """{kernel: {"registers", "spill_stores", "spill_loads", "stack", "smem"}} (bytes
    but registers; smem: static shared memory) from ptxas's ``-v`` report."""
    found: dict[str, dict] = {}
    name = None
    for line in report.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            name = m.group(1)
            found.setdefault(name, {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            found[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            smem = re.search(r"(\d+) bytes smem", line)
            found[name].update(registers=int(m.group(1)), smem=int(smem.group(1)) if smem else 0)
            name = None
    return {k: v for k, v in found.items() if "registers" in v}


class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return v

    def raw(self) -> bytes:
        n = self.u64()
        self.pos += n
        return self.data[self.pos - n : self.pos]


def _string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _modules(blob: bytes):
    """(kind, payload start, payload end) of each module in an import blob (None for
    payload-less ones), after checking its size field."""
    r = _Reader(blob)
    if r.u64() != len(blob) - 8:
        raise ValueError("import blob: size field does not match")
    for _ in range(2):  # the import tree: row pointers, child indices
        n = r.u64()
        r.pos += 8 * n
    while r.pos < len(blob):
        kind = r.raw().decode()
        if kind == "_lib":
            yield kind, None, None
            continue
        n = r.u64()
        yield kind, r.pos, r.pos + n
        r.pos += n


def _cuda_payload(payload: bytes) -> tuple[bytes, bytes, bytes]:
    """(format, function table bytes, data) of a CUDA module's payload. The table is
    not parsed: the data is the payload's last field, found as the u64 length that
    ends exactly there."""
    r = _Reader(payload)
    fmt = r.raw()
    table_start = r.pos
    for end_of_table in range(table_start, len(payload) - 7):
        (n,) = struct.unpack_from("<Q", payload, end_of_table)
        if end_of_table + 8 + n == len(payload):
            # The earliest such offset could be inside the table by chance; the data of
            # a source module starts as TVM's generated source does, a fatbin with its magic.
            data = payload[end_of_table + 8 :]
            if {b"cuda": data.lstrip().startswith(b"#"), b"fatbin": data[:4] == FATBIN_MAGIC}.get(fmt, True):
                return fmt, payload[table_start:end_of_table], data
    raise ValueError("CUDA module payload: no data field found")


def fatbin_blob(blob: bytes, arch: str) -> tuple[bytes, dict]:
    """The import blob with each CUDA module of format "cuda" (source) compiled by nvcc
    into format "fatbin"; and ptxas's report per kernel."""
    out, resources, last = [], {}, 0
    for kind, start, end in _modules(blob):
        if kind != "cuda":
            continue
        fmt, table, data = _cuda_payload(blob[start:end])
        if fmt != b"cuda":
            continue
        fatbin, report = nvcc_fatbin(data.decode(), arch)
        resources.update(ptxas_resources(report))
        payload = _string(b"fatbin") + table + _string(fatbin)
        out += [blob[last : start - 8], struct.pack("<Q", len(payload)), payload]
        last = end
    body = b"".join(out) + blob[last:]
    return struct.pack("<Q", len(body) - 8) + body[8:], resources


def fatbin_cubin(fatbin: bytes) -> bytes | None:
    """The machine code (ELF cubin) in an nvcc fatbin of one arch, which
    ``nvcc_compile(..., "cubin")`` would write; None if there is none uncompressed. A
    fatbin: u32 magic, u16 version, u16 header size, u64 size of the entries; each entry
    u16 kind (1 PTX, 2 ELF), u16, u32 header size, u64 payload size, then the payload."""
    if not fatbin.startswith(FATBIN_MAGIC):
        return None
    _, _, header, total = struct.unpack_from("<IHHQ", fatbin)
    at, end = header, header + total
    while at + 16 <= end:
        kind, _, entry_header, size = struct.unpack_from("<HHIQ", fatbin, at)
        payload = fatbin[at + entry_header : at + entry_header + size]
        if kind == 2 and payload.startswith(b"\x7fELF"):
            return payload
        at += entry_header + size
    return None


def read_cuda_modules(blob: bytes) -> list[tuple[str, bytes]]:
    """(format, data) of each CUDA module in an import blob."""
    found = []
    for kind, start, end in _modules(blob):
        if kind == "cuda":
            fmt, _, data = _cuda_payload(blob[start:end])
            found.append((fmt.decode(), data))
    return found


def library_blob(path: str) -> bytes:
    """The import blob of an exported library (read from its symbol, without loading it)."""
    out = subprocess.run(["nm", "-D", "--defined-only", "-S", path], capture_output=True, text=True, check=True).stdout
    m = re.search(rf"^([0-9a-f]+) ([0-9a-f]+) \w {BLOB_SYMBOL}$", out, re.M)
    if m is None:
        raise ValueError(f"{path}: no {BLOB_SYMBOL}")
    addr, size = int(m.group(1), 16), int(m.group(2), 16)
    # The symbol's file offset: its section's offset plus its place in the section.
    sections = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    for line in sections.splitlines():
        f = line.split()
        if len(f) > 6 and f[0].startswith("[") and not f[0].endswith("]"):
            f = [f[0] + f[1]] + f[2:]
        if len(f) > 6 and f[0].startswith("["):
            try:
                sec_addr, sec_off, sec_size = int(f[3], 16), int(f[4], 16), int(f[5], 16)
            except ValueError:
                continue
            if sec_addr <= addr < sec_addr + sec_size and f[2] != "NOBITS":
                with open(path, "rb") as fh:
                    fh.seek(sec_off + addr - sec_addr)
                    return fh.read(size)
    raise ValueError(f"{path}: {BLOB_SYMBOL} is in no section with data")


def _c_source(blob: bytes, template: str) -> str:
    """TVM's packed-imports C source ``template`` with its array's contents replaced by
    ``blob``."""
    definition = re.compile(rf"{BLOB_SYMBOL}\[\d+\] = \{{.*?\}};", re.S)
    hexes = ",".join(f"0x{b:02x}" for b in blob)
    return definition.sub(lambda _: f"{BLOB_SYMBOL}[{len(blob)}] = {{\n{hexes}\n}};", template, count=1)


def export_module(module, path: str, target: dict) -> dict:
    """``module.export_library(path)``; for a CUDA target with every CUDA module as an
    nvcc fatbin. Returns ptxas's report per kernel ({} for the CPU)."""
    if target.get("kind") != "cuda":
        module.export_library(path)
        return {}
    resources: dict = {}

    def pack(mod, is_system_lib, prefix, workspace_dir):
        template = _ffi_api.ModulePackImportsToC(mod, is_system_lib, prefix)
        start = template.index("= {") + 3
        hexes = template[start : template.index("};", start)]
        blob = bytes(int(x, 16) for x in re.findall(r"0x[0-9a-fA-F]{2}", hexes))
        blob, found = fatbin_blob(blob, target["arch"])
        resources.update(found)
        out = os.path.join(workspace_dir, f"{prefix}devc.c")
        with open(out, "w") as f:
            f.write(_c_source(blob, template))
        return out

    module.export_library(path, fpack_imports=pack)
    return resources
