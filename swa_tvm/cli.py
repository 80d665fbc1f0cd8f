"""The ``swa-tvm`` command line: export a library, describe one.

Exit codes: 0 success, 1 the command failed (message on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_export(args) -> int:
    from . import export_library
    from .spec import AttentionSpec

    specs = [AttentionSpec.parse(s) for s in args.spec]
    target = args.target
    manifest = export_library(specs, args.output, target)
    print(f"wrote {args.output} ({len(manifest['kernels'])} kernels, target {manifest['target_key']})")
    for k in manifest["kernels"]:
        print(f"  {k['name']}  ({'tuned' if k['tuned'] else 'default schedule'})")
    return 0


def _cmd_info(args) -> int:
    from .library import check_manifest, read_manifest

    manifest = read_manifest(args.library)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    print(f"library      {args.library}")
    print(f"tvm version  {manifest['tvm_version']}")
    print(f"target       {json.dumps(manifest['target'])}  (class {manifest['target_key']})")
    print(f"cpu features {', '.join(manifest.get('cpu_features', [])) or '-'}")
    print(f"sha256       {manifest['sha256']}")
    try:
        check_manifest(args.library, manifest)
        print("loadable     yes")
    except Exception as e:  # noqa: BLE001 - report, do not fail `info`
        print(f"loadable     no: {e}")
    print("kernels:")
    for k in manifest["kernels"]:
        print(f"  {k['name']}  ({'tuned' if k['tuned'] else 'default schedule'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swa-tvm", description="Sliding-window attention kernels built with Apache TVM.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="compile specs into a shared library with its manifest")
    e.add_argument(
        "--spec",
        action="append",
        required=True,
        help="pattern, e.g. head_dim=64,window=511:0,dilation=2,globals,sinks (repeatable)",
    )
    e.add_argument("--target", default="llvm", help="'llvm' (this CPU) or a JSON target dict")
    e.add_argument("-o", "--output", required=True, help="path of the .so to write (manifest goes to PATH.json)")
    e.set_defaults(func=_cmd_export)
    i = sub.add_parser("info", help="what a library holds: kernels, target, TVM version")
    i.add_argument("library")
    i.add_argument("--json", action="store_true", help="print the raw manifest")
    i.set_defaults(func=_cmd_info)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"swa-tvm {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
