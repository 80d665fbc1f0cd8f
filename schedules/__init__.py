"""Per-target schedules, kept apart from the math in swa_tvm.compute (as TVM's topi keeps
topi/nn apart from topi/x86 and topi/cuda). Installed as ``swa_tvm.schedules``."""
