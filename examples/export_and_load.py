"""Export a library on one machine, load it on another with the runtime alone.

    python examples/export_and_load.py [--out DIR] [--target x86-64-v3]

The build machine needs apache-tvm (the compiler). It writes ``DIR/swa_attn.so`` and its
manifest ``DIR/swa_attn.so.json``: the kernels, the target and CPU features they need,
the TVM version and a sha256 of the library. Copy both files to the serving machine.

The serving machine needs torch, tvm-ffi and the TVM *runtime* only (libtvm_runtime.so,
3 MB, found through $SWA_TVM_RUNTIME_DIR or an installed apache-tvm):
``swa_tvm.load_library`` checks the manifest (CPU features, TVM version, checksum) and
registers the kernels, and ``torch.ops.swa_tvm.*`` calls them; the TVM compiler is never
imported. This script plays the second machine in a fresh process where importing
``tvm`` fails and $SWA_TVM_RUNTIME_DIR points at a copy of the runtime, and checks the
results against the float64 reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

SERVE = r"""
import importlib.machinery
import sys

class NoCompiler:  # the serving machine: importing the TVM compiler fails
    def find_spec(self, name, path=None, target=None):
        if name == "tvm" or name.startswith("tvm."):
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ImportError(f"{spec.name} is not installed on the serving machine")
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, NoCompiler())

import torch
import swa_tvm
from swa_tvm.reference import sliding_window_attention_ref

specs = swa_tvm.load_library(sys.argv[1])
print(f"loaded {len(specs)} kernels from {sys.argv[1]}")
torch.manual_seed(0)
B, H, H_kv, T, D, G = 1, 8, 2, 1024, 64, 4
q = torch.randn(B, H, T, D)
k, v = torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
gi = torch.sort(torch.randperm(T)[:G]).values.int().view(1, G)
for name, kw in [
    ("causal W=256", dict(window_size=(255, 0))),
    ("dilation 2", dict(window_size=(127, 0), dilation=2)),
    ("4 globals + 2 sinks", dict(window_size=(255, 0), global_idx=gi, num_sinks=2)),
]:
    out = swa_tvm.sliding_window_attention(q, k, v, **kw)
    ref = sliding_window_attention_ref(q, k, v, **kw)[0]
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"{name:22s} relative error vs float64 reference {err:.1e}")
    assert err < 1e-5, err
assert "tvm" not in sys.modules
print("served without the TVM compiler")
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for the library (default: a temporary folder)")
    p.add_argument("--target", metavar="MCPU", default=None,
                   help="CPU class to build for: default this machine's; x86-64-v3 runs on any AVX2 machine")
    args = p.parse_args(argv)

    import swa_tvm

    out = args.out or tempfile.mkdtemp(prefix="swa_export_")
    os.makedirs(out, exist_ok=True)
    lib = os.path.join(out, "swa_attn.so")
    # What the serving side will call: D=64, GQA, three patterns; the spec's kernels
    # serve any B, H, H_kv and T.
    specs = [
        swa_tvm.AttentionSpec(head_dim=64, window=(255, 0)),
        swa_tvm.AttentionSpec(head_dim=64, window=(127, 0), max_dilation=2),
        swa_tvm.AttentionSpec(head_dim=64, window=(255, 0), globals=True, sinks=True),
    ]
    target = {"kind": "llvm", "mcpu": args.target} if args.target else None
    manifest = swa_tvm.export_library(specs, lib, target=target, warn_untuned=False)
    print(f"exported {lib}: {len(manifest['kernels'])} kernels for {manifest['target_key']}, "
          f"CPU features {', '.join(manifest.get('cpu_features', [])) or 'none'}")
    # What the serving machine gets besides the library: the TVM runtime alone.
    runtime = os.path.join(out, "tvm_runtime")
    os.makedirs(runtime, exist_ok=True)
    tvm_lib = os.path.join(list(importlib.util.find_spec("tvm").submodule_search_locations)[0], "lib")
    shutil.copy(os.path.join(tvm_lib, "libtvm_runtime.so"), runtime)
    env = dict(os.environ, SWA_TVM_RUNTIME_DIR=runtime)
    return subprocess.call([sys.executable, "-c", SERVE, lib], env=env)


if __name__ == "__main__":
    sys.exit(main())
