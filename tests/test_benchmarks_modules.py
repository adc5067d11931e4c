"""Every benchmarks module imports (in a fresh process, leaving nothing in the temp folder) and no two modules
import each other, directly or through others."""
import ast
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import benchmarks

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(benchmarks.__file__).parent


def _modules() -> list[str]:
    return ["benchmarks"] + [m.name for m in pkgutil.walk_packages([str(PACKAGE)], "benchmarks.")]


def test_every_module_imports_and_leaves_no_temp_folder(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    names = _modules()
    assert {"benchmarks.suite.bench_train_step", "benchmarks.studies.int8_onednn_ops",
            "benchmarks.common.inference_variants"} <= set(names)
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TMPDIR=str(temp), PYTHONPATH=str(ROOT),
                                                # torch's own compile cache, which some imports create: not ours
                                                TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
    assert list(temp.iterdir()) == []


def _imports(path: Path, name: str, is_package: bool) -> set[str]:
    """The benchmarks modules ``name`` imports anywhere in its file (top level or inside functions)."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("benchmarks")}


def test_no_import_cycles():
    known = set(_modules())
    graph = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], "benchmarks."):
        rel = info.name.split(".")[1:]
        path = PACKAGE.joinpath(*rel, "__init__.py") if info.ispkg else PACKAGE.joinpath(*rel[:-1], rel[-1] + ".py")
        graph[info.name] = {m for m in _imports(path, info.name, info.ispkg) if m in known and m != info.name}
    # Parents are imported on the way to a child; a package's own __init__ imports nothing here.
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:  # on the current path: a cycle
                path = trail + [node]
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])
    assert graph["benchmarks.suite.bench_step"] >= {"benchmarks.suite.bench_state"}
