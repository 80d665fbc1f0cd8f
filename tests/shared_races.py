"""A barrier check of generated CUDA source: which shared-memory accesses of a kernel
could race, read off the text TVM's codegen writes.

The serial CPU runs of the CUDA kernels (test_cuda) check their arithmetic in the GPU's
phase order but cannot see a missing barrier. This walks a kernel's statements in
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
- copies still in flight when the kernel ends.

It is a model of the source, not of the hardware: a buffer is one unit (a write and a
read of different halves without a barrier between counts as a race), so kernels whose
tiles TVM merged into one dynamic buffer are outside it; and a statement is classified
by where a buffer's name stands in it (left of the assignment: a write; elsewhere: a
read; a cp.async's first operand: an asynchronous write).
"""

from __future__ import annotations

import re

SYNC = "__syncthreads();"
WAIT = re.compile(r"\bswa_cp_async_wait_all\(\)")
ASYNC = re.compile(r"\bswa_cp_async_16\(\(&\((\w+)\[")
ASSIGN = re.compile(r"^(?P<lhs>[^=]+?)\s=\s(?P<rhs>.*);$")


def kernel_body(source: str, name: str) -> str:
    """The text of ``name``'s definition (``name`` as the source declares it, e.g. a
    kernel's ``global_symbol`` + ``_kernel``)."""
    m = re.search(r"\b" + re.escape(name) + r"\([^;{]*\)\s*\{", source)
    if m is None:
        raise ValueError(f"no definition of {name}")
    start = m.end() - 1
    depth = 0
    for i in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[start : i + 1]
    raise ValueError(f"unbalanced braces in {name}")


def shared_buffers(body: str) -> list[str]:
    return re.findall(r"__shared__[^;]*?\b(\w+)\[", body)


def _accesses(text: str, names) -> list[tuple[str, str]]:
    """(buffer, subscript text) of each shared buffer named in ``text``: ``buf[i]`` gives
    i, ``(buf + i)`` (a vector access) gives "+i", anything else ""."""
    found = []
    for m in names.finditer(text):
        j, sub = m.end(), ""
        if text.startswith("[", j) or text.startswith(" + ", j):
            opener, closer = ("[", "]") if text[j] == "[" else ("(", ")")
            depth, k = 1, j + 1
            while depth and k < len(text):
                depth += {opener: 1, closer: -1}.get(text[k], 0)
                k += 1
            sub = text[j : k - 1] if opener == "[" else "+" + text[j + 3 : k - 1]
        found.append((m.group(1), sub))
    return found


def events(body: str) -> list[tuple]:
    """The kernel's shared-memory events in program order: ("sync",), ("wait",),
    ("read", buf, subscript), ("write", buf, subscript), ("async", buf); each loop body
    twice."""
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
    found = []
    for i, (kind, *rest) in enumerate(events(body)):
        buf, sub = (rest + [None, None])[:2]
        if kind == "sync":
            read.clear()
            written.clear()
            waited.clear()
        elif kind == "wait":
            waited |= inflight
            inflight.clear()
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
            if kind == "async":
                inflight.add(buf)
            else:
                written.setdefault(buf, set()).add(sub)
    if inflight:
        found.append(f"end: cp.async into {sorted(inflight)} never waited for")
    return found
