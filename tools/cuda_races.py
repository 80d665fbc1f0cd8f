"""A barrier check of generated CUDA source: which shared-memory accesses of a kernel
could race, read off the text TVM's codegen writes. Needs TVM (to generate the source),
not nvcc nor a GPU:

    python -m tools.cuda_races --spec head_dim=128,window=4095:0,globals,backward,dtype=bfloat16 \
        --async-forward --deletions

The serial CPU runs of the CUDA kernels (tests/test_cuda_emulated.py) check their arithmetic in
the GPU's phase order but cannot see a missing barrier. This walks a kernel's statements in
program order with every loop body taken twice (so what one iteration leaves is what the
next meets) and every branch taken, and tracks per shared buffer what happened since the
last ``__syncthreads()``:

- a read after a write (another thread's element may not be there yet), unless the read's
  subscript is, as text, one written since the barrier (the thread's own element: TVM's
  barrier planner reasons so too, taking an index expression as one element per thread);
- a write, or a cp.async into the buffer, after a read (another thread may still need
  the old value), unless every read since the barrier was of the written subscript
  (a thread updating its own element); a write while a cp.async into the buffer is not
  complete;
- a read of a buffer a cp.async writes, unless ``cp.async.wait_group`` and then a barrier
  came between (the wait completes the issuing thread's copies, the barrier everyone's);
- copies still in flight when the kernel ends;
- a read by wgmma (the tensor cores' async proxy) of a buffer written since the last
  ``fence.proxy.async`` that was itself followed by a barrier: each writer must fence its
  own completed stores (a cp.async's after its wait), then everyone meets, then wgmma
  reads (PTX ISA, memory consistency of the async proxy);
- a write (or cp.async) into a buffer a wgmma still reads: wgmma reads shared memory
  until a ``wgmma.wait_group N`` leaves at most the N newest committed groups pending,
  so the read lasts from the issue to the wait that completes its group (a group left
  pending across a barrier is still reading), and only a barrier after that wait frees
  the buffer for the other threads; groups never waited for at the end.

It is a model of the source, not of the hardware: a buffer is one unit (a write and a
read of different halves without a barrier between counts as a race), so kernels whose
tiles TVM merged into one dynamic buffer are outside it; and a statement is classified
by where a buffer's name stands in it (left of the assignment: a write; elsewhere: a
read; a cp.async's first operand: an asynchronous write). ``--deletions`` deletes each
barrier and each wait in turn and says which deletions the check would not catch (a
barrier it cannot tell apart from a redundant one).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import tvm
import tvm_ffi

from swa_tvm.compiler.build import cuda_source, schedule_spec
from swa_tvm.schedules import cuda_flash_tc
from swa_tvm.spec import CPU_ONLY_KINDS, AttentionSpec

SYNC = "__syncthreads();"
WAIT = re.compile(r"\bswa_cp_async_wait_all\(\)")
PROXY_FENCE = re.compile(r"\bswa_fence_proxy_async\(\)")
# A wgmma product (cuda_wgmma's macros), not its fences or waits: its buffers are read
# by the async proxy.
WGMMA = re.compile(r"\bswa_wgmma_(?!fence|commit|wait)\w+\(")
# wgmma's groups: commit closes the thread's open group; wait N leaves N pending.
WGMMA_COMMIT = re.compile(r"\bswa_wgmma_commit(?:_wait0)?\(\)")
WGMMA_WAIT = re.compile(r"\bswa_wgmma_(?:commit_)?wait(\d)\(\)")
# cp.async of 16 bytes (tiles) or of 4 (the gradient kernels' lse and delta tables).
ASYNC = re.compile(r"\bswa_cp_async_(?:16|4)\(\(&\((\w+)\[")
ASSIGN = re.compile(r"^(?P<lhs>[^=]+?)\s=\s(?P<rhs>.*);$")


def kernel_body(source: str, name: str) -> str:
    """The text of ``name``'s definition (``name`` as the source declares it, e.g. a
    kernel's ``global_symbol`` + ``_kernel``)."""
    m = re.search(r"\b" + re.escape(name) + r"\([^;{]*\)\s*\{", source)
    if m is None:
        raise ValueError(f"no definition of {name}")
    return braced(source, m.end() - 1)


def braced(text: str, start: int) -> str:
    """The brace-delimited block of ``text`` that opens at or after ``start``."""
    first = text.index("{", start)
    depth = 0
    for i in range(first, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[first : i + 1]
    raise ValueError("unbalanced braces")


def shared_buffers(body: str) -> list[str]:
    return re.findall(r"__shared__[^;]*?\b(\w+)\[", body)


def _accesses(text: str, names) -> list[tuple[str, str]]:
    """(buffer, subscript text) of each shared buffer named in ``text``: ``buf[i]`` gives
    i, ``(buf + i)`` (a vector access) gives "+i", ``((T*)buf)[i]`` (a dead tile's
    storage reused for another type by TVM) "*i", anything else ""."""
    found = []
    for m in names.finditer(text):
        j, sub = m.end(), ""
        cast = text.startswith(")[", j)
        j += cast
        if text.startswith("[", j) or text.startswith(" + ", j):
            opener, closer = ("[", "]") if text[j] == "[" else ("(", ")")
            depth, k = 1, j + 1
            while depth and k < len(text):
                depth += {opener: 1, closer: -1}.get(text[k], 0)
                k += 1
            sub = ("*" if cast else "") + (text[j : k - 1] if opener == "[" else "+" + text[j + 3 : k - 1])
        found.append((m.group(1), sub))
    return found


def events(body: str) -> list[tuple]:
    """The kernel's shared-memory events in program order: ("sync",), ("wait",),
    ("proxy_fence",), ("read", buf, subscript), ("write", buf, subscript), ("async",
    buf), ("wgmma", buf), ("wgmma_commit",), ("wgmma_wait", n); each loop body twice."""
    shared = shared_buffers(body)
    names = re.compile(r"\b(" + "|".join(map(re.escape, shared)) + r")\b") if shared else None
    stack: list[tuple[str, list]] = [("top", [])]
    for raw in body.splitlines()[1:-1]:
        line = raw.strip()
        if not line or line.startswith("//") or "__shared__" in line:
            continue
        closes = line.startswith("}")
        opens = line.endswith("{")
        if closes:
            kind, inner = stack.pop()
            stack[-1][1].extend(inner * 2 if kind == "for" else inner)
            line = line[1:].strip()
        found: list[tuple] = []
        if line == SYNC:
            found.append(("sync",))
        elif WAIT.search(line):
            found.append(("wait",))
            if PROXY_FENCE.search(line):  # the wait and the fence on one line
                found.append(("proxy_fence",))
        elif PROXY_FENCE.search(line):
            found.append(("proxy_fence",))
        elif WGMMA_COMMIT.search(line) or WGMMA_WAIT.search(line):
            if WGMMA_COMMIT.search(line):
                found.append(("wgmma_commit",))
            if WGMMA_WAIT.search(line):
                found.append(("wgmma_wait", int(WGMMA_WAIT.search(line).group(1))))
        elif names and WGMMA.search(line):
            found += [("read", n, sub) for n, sub in _accesses(line, names)]
            found += [("wgmma", n) for n, _ in _accesses(line, names)]
        elif names:
            m = ASYNC.search(line)
            if m:
                found.append(("async", m.group(1)))
                line = line[m.end() :]
            a = ASSIGN.match(line) if not opens else None
            reads, writes = (a.group("rhs"), a.group("lhs")) if a else (line, "")
            targets = _accesses(writes, names)
            # A subscript on the left is read to find the element, not written.
            for _, sub in targets:
                reads += " " + sub
            found += [("read", n, sub) for n, sub in _accesses(reads, names)]
            found += [("write", n, sub) for n, sub in targets]
        stack[-1][1].extend(found)
        if opens:
            stack.append(("for" if line.startswith("for ") else "block", []))
    if len(stack) != 1:
        raise ValueError("unbalanced blocks")
    return stack[0][1]


def races(body: str) -> list[str]:
    """Every access (by its event index and what it is) that could race, per the model
    in the module docstring; empty for a kernel whose barriers are all in place."""
    read: dict = {}  # buffer -> subscripts read since the last barrier
    written: dict = {}  # buffer -> subscripts written since the last barrier
    inflight: set = set()  # issued, not waited for
    waited: set = set()  # waited for by the issuing thread, no barrier since
    unfenced: set = set()  # written (or cp.async-complete) since the last fence.proxy.async
    fenced: set = set()  # fenced, no barrier since
    open_group: set = set()  # read by this thread's wgmma since its last commit
    groups: list = []  # committed wgmma groups not yet waited for, oldest first
    found = []
    for i, (kind, *rest) in enumerate(events(body)):
        buf, sub = (rest + [None, None])[:2]
        if kind == "wgmma_commit":
            groups.append(open_group)
            open_group = set()
            continue
        if kind == "wgmma_wait":  # buf: how many groups may stay pending
            for done in groups[: max(len(groups) - buf, 0)]:
                for name in done:  # read until now: the others still need a barrier
                    read.setdefault(name, set()).add("<wgmma>")
            groups = groups[max(len(groups) - buf, 0):]
            continue
        if kind == "sync":
            read.clear()
            written.clear()
            waited.clear()
            fenced.clear()
        elif kind == "wait":
            waited |= inflight
            unfenced |= inflight  # the copies' stores are complete now, and generic
            inflight.clear()
        elif kind == "proxy_fence":
            fenced |= unfenced
            unfenced.clear()
        elif kind == "wgmma":
            if buf in unfenced or buf in fenced:
                found.append(f"{i}: wgmma reads {buf} written since the last fence.proxy.async and barrier")
            open_group.add(buf)
        elif kind == "read":
            # The same subscript text as a write since the barrier: the thread's own element.
            if buf in written and sub not in written[buf]:
                found.append(f"{i}: read of {buf}[{sub}] after a write, no barrier between")
            if buf in inflight or buf in waited:
                found.append(f"{i}: read of {buf} while a cp.async into it is not waited for and barriered")
            read.setdefault(buf, set()).add(sub)
        else:
            what = "cp.async into" if kind == "async" else "write of"
            if buf in read and (kind == "async" or read[buf] != {sub}):
                found.append(f"{i}: {what} {buf} after a read, no barrier between")
            # Copies of one tile issued together may land in any order; a plain write
            # may land before an earlier copy of the same place.
            if kind == "write" and (buf in inflight or buf in waited):
                found.append(f"{i}: {what} {buf} while a cp.async into it is not complete")
            if buf in open_group or any(buf in group for group in groups):
                found.append(f"{i}: {what} {buf} while a wgmma reading it is not waited for")
            if kind == "async":
                inflight.add(buf)
            else:
                written.setdefault(buf, set()).add(sub)
                unfenced.add(buf)
    if inflight:
        found.append(f"end: cp.async into {sorted(inflight)} never waited for")
    if open_group or groups:
        found.append(f"end: wgmma reading {sorted(set(open_group).union(*groups))} never waited for")
    return found


KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([\d, ]+\) )?(\w+)\([^;{]*\)\s*\{')


def kernel_bodies(source: str) -> dict[str, str]:
    """{kernel name: its definition's text} of every kernel defined in ``source``."""
    return {name: kernel_body(source, name) for name in KERNEL.findall(source)}


def dynamic(body: str) -> bool:
    """Tiles merged into one dynamic buffer: outside the model (one unit)."""
    return "extern __shared__" in body


def deletions(body: str) -> dict[str, tuple[int, list[int]]]:
    """For barriers, cp.async waits, async-proxy fences and wgmma's deferred waits (a
    commit's own wait0 is not deferred): (how many, lines whose deletion ``races`` does
    not catch)."""
    lines = body.splitlines()
    found = {}
    for what, texts in (("barriers", (SYNC,)), ("waits", ("swa_cp_async_wait_all();",)),
                        ("proxy fences", ("swa_fence_proxy_async();",)),
                        ("wgmma waits", ("swa_wgmma_wait0();", "swa_wgmma_wait1();"))):
        at = [i for i, line in enumerate(lines) if line.strip() in texts]
        found[what] = (len(at), [i for i in at if not races("\n".join(lines[:i] + lines[i + 1 :]))])
    return found


class source_only:
    """While compiling for CUDA, skip nvcc: only the CUDA source TVM generates is
    wanted (``build.cuda_source``), not device code."""

    def __enter__(self):
        self.previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", lambda code: bytearray(b"\0"), override=True)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", self.previous, override=True)


def generated_source(funcs: dict, arch: str = "sm_90") -> str:
    """The CUDA source TVM generates for PrimFuncs ``funcs`` ({name: func}), no nvcc."""
    with source_only():
        module = tvm.compile(tvm.IRModule(funcs), target=tvm.target.Target({"kind": "cuda", "arch": arch}))
        return cuda_source(module.mod)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cuda_races", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", action="append", default=[], help="an AttentionSpec (as swa-tvm export takes); repeatable")
    p.add_argument("--async-forward", action="store_true",
                   help="also each spec's tensor-core forward kernels with cp.async loads (default tiles)")
    p.add_argument("--source", action="append", default=[], help="a generated .cu file (as export writes beside a library)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--deletions", action="store_true", help="delete each barrier and wait in turn; say which go uncaught")
    args = p.parse_args(argv)
    sources = [open(path).read() for path in args.source]
    if args.spec:
        target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
        funcs = {}
        for text in args.spec:
            for k in AttentionSpec.parse(text).kernels():
                if k.kind in CPU_ONLY_KINDS:  # the five-product CPU backward: no CUDA build
                    continue
                funcs[k.name] = schedule_spec(k, target)
                if args.async_forward and cuda_flash_tc.supports(k):
                    cfg = dataclasses.replace(cuda_flash_tc.default_config(k), async_copy=True)
                    name = f"{k.name}__async"
                    funcs[name] = cuda_flash_tc.flash_tc(k, cfg).with_attr("global_symbol", name)
        sources.append(generated_source(funcs, args.arch))
    if not sources:
        p.error("give --spec or --source")
    bad = 0
    totals = {"barriers": [0, 0], "waits": [0, 0], "proxy fences": [0, 0], "wgmma waits": [0, 0]}
    for source in sources:
        for name, body in kernel_bodies(source).items():
            if dynamic(body):
                print(f"{name}: one dynamic shared buffer, outside the model")
                continue
            found = races(body)
            bad += bool(found)
            print(f"{name}: {'RACES ' + '; '.join(found[:5]) if found else 'no race'}")
            if args.deletions:
                for what, (n, missed) in deletions(body).items():
                    totals[what][0] += n
                    totals[what][1] += n - len(missed)
                    if missed:
                        print(f"  {what}: deleting the one at line {', '.join(map(str, missed))} of the body goes uncaught")
    if args.deletions:
        print(", ".join(f"{what}: {caught} of {n} deletions caught" for what, (n, caught) in totals.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
