"""Per-target schedules, kept apart from the math in swa_tvm.compute (as TVM's topi keeps
topi/nn apart from topi/x86 and topi/cuda). Installed as ``swa_tvm.schedules``."""

import inspect

from tvm.script.parser.core.parser import ScriptMacro


def _find_parser_def(self):
    """The parser of the TVMScript function being parsed: the nearest caller frame whose
    globals hold it. TVM 0.27's own ``ScriptMacro._find_parser_def`` finds the same
    frame through ``inspect.getouterframes``, which builds a FrameInfo (source lines,
    and a scan of sys.modules in ``inspect.getmodule``) for every frame of the stack at
    every macro call: most of the time the fused kernels take to build (cProfile of a
    D=32 bfloat16 forward's build shows it)."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


ScriptMacro._find_parser_def = _find_parser_def
