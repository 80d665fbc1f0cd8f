"""The package's layers stay apart: the runtime loads and runs an exported library without
TVM's compiler, ``import swa_tvm`` compiles nothing, the modules' imports form no
cycle and respect the layers, and the wheel ships the tuning logs (and nothing of
benchmarks/ or tools/)."""

import ast
import functools
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "swa_tvm"
# The layers that compile: none of them may be imported where only the runtime is needed.
COMPILER_LAYERS = ("swa_tvm.compiler", "swa_tvm.compute", "swa_tvm.schedules", "swa_tvm.tuning")


def _in(module: str, layers) -> bool:
    return any(module == p or module.startswith(p + ".") for p in layers)


# ---------------------------------------------------------------------------------------
# The runtime without the compiler


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small CPU library (one local kernel), exported here with the compiler."""
    import swa_tvm

    path = tmp_path_factory.mktemp("layers") / "tiny.so"
    swa_tvm.export_library([swa_tvm.AttentionSpec.parse("head_dim=16,window=3:0")], path, logs=None)
    return path


# Runs in a fresh process: a meta-path finder makes ``import tvm`` (and every tvm.*)
# fail. "installed": TVM is installed but must not be imported (the package is still
# found, so the runtime locates libtvm_runtime.so in it). "runtime_dir": the tvm package
# is an empty folder (sys.argv[4]), the runtime library in $SWA_TVM_RUNTIME_DIR, as on
# a serving machine with the TVM runtime alone. (A finder cannot make find_spec("tvm")
# return None, what an uninstalled package gives, and torch asks for it: raising there
# would break torch, not test swa_tvm.)
RUNTIME_ONLY = r"""
import importlib.abc
import importlib.machinery
import sys

mode, lib = sys.argv[1], sys.argv[2]


class Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(f"{module.__name__}: the TVM compiler must not be imported here")


class BlockTVM(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "tvm" and not name.startswith("tvm."):
            return None  # tvm_ffi is the runtime's own package
        if mode == "runtime_dir":
            spec = importlib.machinery.ModuleSpec(name, Refuse(), is_package=True)
            spec.submodule_search_locations = [sys.argv[4]]
            return spec
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = Refuse()
        return spec


sys.meta_path.insert(0, BlockTVM())
try:
    import tvm  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("the finder did not block tvm")

import torch

import swa_tvm
import swa_tvm.runtime
from swa_tvm.reference import sliding_window_attention_ref
from swa_tvm.runtime import library

specs = swa_tvm.load_library(lib)
assert [k.origin for k in library.REGISTRY.kernels()] == [lib] * len(specs) and specs, specs
q, k, v = (torch.randn(2, 3, 50, 16) for _ in range(3))
out = swa_tvm.sliding_window_attention(q, k, v, window_size=(3, 0))
ref, _ = sliding_window_attention_ref(q, k, v, window_size=(3, 0))
err = ((out.double() - ref).norm() / ref.norm()).item()
assert err < 1e-5, err
loaded = sorted(m for m in sys.modules if m == "tvm" or m.startswith("tvm.")
                or any(m == p or m.startswith(p + ".") for p in sys.argv[3].split(",")))
assert loaded == [], loaded
print("OK", mode, len(specs), err)
"""


# "installed" is much what test_library.py's round trip sees: `make test` runs it.
@pytest.mark.parametrize("mode", [pytest.param("installed", marks=pytest.mark.slow), "runtime_dir"])
def test_runtime_loads_and_runs_a_library_without_the_compiler(exported, tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k != "SWA_TVM_RUNTIME_DIR"}
    if mode == "runtime_dir":
        # What a serving machine has of TVM: libtvm_runtime.so and its version.
        tvm_dir = importlib.util.find_spec("tvm").submodule_search_locations[0]
        runtime = tmp_path / "tvm_runtime"
        runtime.mkdir()
        shutil.copy(os.path.join(tvm_dir, "lib", "libtvm_runtime.so"), runtime)
        (runtime / "tvm_version").write_text(json.loads((exported.parent / "tiny.so.json").read_text())["tvm_version"])
        env["SWA_TVM_RUNTIME_DIR"] = str(runtime)
    (tmp_path / "no_tvm").mkdir()
    r = subprocess.run([sys.executable, "-c", RUNTIME_ONLY, mode, str(exported), ",".join(COMPILER_LAYERS),
                        str(tmp_path / "no_tvm")],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"OK {mode} 1 "), r.stdout


def test_import_swa_tvm_loads_no_compiler():
    """``import swa_tvm`` (and its runtime) imports neither tvm nor a module of the
    layers that compile: those come at the first JIT compilation or export."""
    code = (
        "import json, sys\n"
        "import swa_tvm, swa_tvm.runtime, swa_tvm.runtime.library\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    modules = json.loads(r.stdout.splitlines()[-1])
    assert "swa_tvm.runtime.library" in modules and "swa_tvm.functional" in modules
    loaded = [m for m in modules if m == "tvm" or m.startswith("tvm.") or _in(m, COMPILER_LAYERS)]
    assert loaded == [], f"import swa_tvm loaded {loaded}"


# ---------------------------------------------------------------------------------------
# The import graph, read from the sources


def _package_modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the package (a package by its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``, which never run."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line"} for every ``import`` and ``from``
    statement of each module of the package, at module level and inside functions
    (relative imports resolved; ``from P import name`` counts as importing P.name where
    that is a module, else P). Imported modules outside the package are kept by name."""
    modules = _package_modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges.setdefault(alias.name, where)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    edges.setdefault(full if full in modules else source, where)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) for each strongly
    connected component of the package's modules that has one (Tarjan)."""
    inside = {m: [t for t in edges if t in graph] for m, edges in graph.items()}
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in inside[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in inside[v]:
                components.append(sorted(component))

    for v in sorted(inside):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        # A shortest path back to the component's first module, inside the component.
        start, members = component[0], set(component)
        paths, frontier = {start: [start]}, [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in inside[v]:
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w in members and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return cycles


def _describe(cycle, graph) -> str:
    return " -> ".join(cycle) + "  (" + "; ".join(f"{a} -> {b} at {graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + ")"


def test_import_graph_is_read_whole():
    """The graph sees function-level and relative imports (the cases a regex would miss)."""
    graph = import_graph()
    assert "swa_tvm.runtime.library" in graph and "swa_tvm.compiler.build" in graph
    # swa_tvm.export_library imports the compiler inside the function.
    assert "swa_tvm.compiler.build" in graph["swa_tvm"]
    assert find_cycles({"a": {"b": "x"}, "b": {"c": "x"}, "c": {"a": "x"}, "d": {"a": "x"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a": "x"}, "b": {}}) == [["a", "a"]]
    assert find_cycles({"a": {"b": "x"}, "b": {}}) == []


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert cycles == [], "import cycles among the package's modules:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_layers_import_only_downwards():
    """runtime/ imports nothing that compiles; compute/ and schedules/ (the kernels'
    math and loop structure) never the compiler driver or the tuner; nothing in the
    package imports benchmarks/ or tools/ (which are not in the wheel)."""
    rules = [
        (("swa_tvm.runtime",), COMPILER_LAYERS),
        (("swa_tvm.compute", "swa_tvm.schedules"), ("swa_tvm.compiler", "swa_tvm.tuning")),
        (("swa_tvm",), ("benchmarks", "tools")),
    ]
    broken = []
    for module, edges in sorted(import_graph().items()):
        for layers, forbidden in rules:
            if _in(module, layers):
                broken += [f"{module} imports {target} at {where}" for target, where in sorted(edges.items())
                           if _in(target, forbidden)]  # fmt: skip
    assert broken == [], "\n".join(broken)


def test_integrations_sit_above_the_api():
    """swa_tvm.integrations (behind optional dependencies) uses the public API alone,
    and nothing else in the package imports it: ``import swa_tvm`` never needs them."""
    graph = import_graph()
    integrations = [m for m in graph if _in(m, ("swa_tvm.integrations",))]
    assert "swa_tvm.integrations.transformers" in integrations
    broken = []
    for module, edges in sorted(graph.items()):
        for target, where in sorted(edges.items()):
            if not _in(target, ("swa_tvm",)):
                continue
            if module in integrations and not _in(target, ("swa_tvm.functional", "swa_tvm.integrations")):
                broken.append(f"{module} imports {target} at {where} (integrations use swa_tvm.functional)")
            if module not in integrations and _in(target, ("swa_tvm.integrations",)):
                broken.append(f"{module} imports {target} at {where}")
    assert broken == [], "\n".join(broken)


# ---------------------------------------------------------------------------------------
# The wheel


@pytest.mark.slow
def test_wheel_ships_the_tuning_logs_and_not_the_tools(tmp_path):
    """A wheel built from the checkout holds every CPU class's and GPU's tuning records
    and validation verdicts (export applies them after ``pip install``) and the shipped
    spec set, and none of
    benchmarks/ or tools/. Built from a copy, so the checkout gets no build/ folder."""
    skip = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "demo_out",
                                  ".hypothesis", ".pytest_cache", ".work")
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=skip)
    out = tmp_path / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(source)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    [wheel] = out.glob("swa_tvm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    logs = PACKAGE / "tuning_logs"
    keys = sorted(p.name for p in logs.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    assert keys and any(k.startswith("llvm-") for k in keys), keys
    wanted = {f"swa_tvm/tuning_logs/{k}/database_tuning_record.json" for k in keys}
    wanted |= {f"swa_tvm/tuning_logs/{k}/database_workload.json" for k in keys}
    # The verdicts that let export apply a searched CPU record.
    wanted |= {f"swa_tvm/tuning_logs/{k}/validation.json" for k in keys if (logs / k / "validation.json").exists()}
    wanted.add("swa_tvm/tuning_logs/shipped_specs.txt")
    assert wanted - names == set(), sorted(wanted - names)
    assert "swa_tvm/runtime/library.py" in names and "swa_tvm/schedules/cuda_flash_tc.py" in names
    strays = sorted(n for n in names if n.split("/")[0] in ("benchmarks", "tools", "tests", "examples"))
    assert strays == [], strays
