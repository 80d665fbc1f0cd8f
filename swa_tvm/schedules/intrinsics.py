"""TVM's own tensor intrinsics (``tvm.s_tir.tensor_intrin``), imported the fast way.

Here, under ``schedules``, so that the schedules (``cuda.register_intrinsics``), the
tuning-log reader (``swa_tvm.compiler.records``) and the tuner all reach it without the
schedules importing the compiler.
"""

from __future__ import annotations

import inspect
import linecache
import sys


def preload_tensor_intrin() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` quickly.

    MetaSchedule imports it in every process that tunes or builds. It parses hundreds
    of TVMScript functions, and the parser calls ``inspect.stack()``, which resolves a
    source file for every frame of the (deep, import-machinery) stack by scanning
    ``sys.modules``: 80 s per process on this 2-core machine. The parser only reads the
    source line of the third frame (``is_defined_in_class``), so while importing, every
    frame gets its file name from the code object, and the first three their source
    line from ``linecache`` (``inspect.getframeinfo`` scanned ``sys.modules`` for each:
    the import took about 10 s with it, 7 s without, 2026-12-05).
    """
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    original = inspect.stack

    def stack(context: int = 1):
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            code, lines, index = frame.f_code, None, None
            if len(frames) < 3:
                lines, index = [linecache.getline(code.co_filename, frame.f_lineno, frame.f_globals)], 0
            frames.append(
                inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, lines, index, positions=None)
            )
            frame = frame.f_back
        return frames

    inspect.stack = stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401 - the import this function exists to speed up
    finally:
        inspect.stack = original
