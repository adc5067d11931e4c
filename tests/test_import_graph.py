"""The intra-package import graph of ipex_train has no cycles and no private names cross packages.

Every ``import``/``from`` statement is read with ``ast`` (module-level and function-level alike: a lazy
import hides a cycle from the interpreter, not from the layering). Importing ``a.b.c`` also runs the
``__init__`` of package ``a.b``, so that is an edge too.

A *package* is a directory with an ``__init__.py``: ``ipex_train`` itself (its top-level modules) and each
sub-package such as ``ipex_train.optim``. Privacy rules:

* a private name defined in a module (``from ipex_train.frontend import _ATTR``) may be imported only by
  modules of the same package;
* a private module (``ipex_train.base.ops``, ``ipex_train.optim._layouts``) belongs to its package: modules of that
  package and of its sub-packages may import it (sub-packages build on their parent's internals), siblings and
  the parent may not. What other packages use of a package is a public module or name (``ipex_train.optim.registry``).

Layers: :data:`ALLOWED` says, for each top-level part of ipex_train (a sub-package, ``config``, or the package root
``__init__``/``__main__``), which other parts it may import. The table is acyclic, so it is a layer order, and every
part must be listed: a new package states its place in the layers here (docs/architecture.md draws the same table).
"""

import ast
import pathlib

import ipex_train

ROOT = pathlib.Path(ipex_train.__file__).parent
PKG = "ipex_train"


def _module_name(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module, is_pkg):
    return module if is_pkg else module.rpartition(".")[0]


def _modules():
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path)
        out[name] = (path, path.name == "__init__.py")
    return out


MODULES = _modules()

# part -> the parts it may import (see the module docstring); "" is the package root (__init__, __main__).
ALLOWED = {
    "base": set(),  # the C++ ops, options and environment parsing, choice lists, small torch helpers
    "optim": {"base"},  # the optimizers, their fused steps and state formats
    "attention": {"base"},  # kernels with their torch ops
    "rms_norm": {"base"},
    "add_norm": {"base"},
    "rope": {"base"},
    "swiglu": {"base"},
    "bias_gelu": {"base"},
    "linear": set(),  # F.linear with the bias in oneDNN's epilogue (torch's own op)
    "lora": {"base"},
    "xpu": {"base", "optim"},  # the same steps on SYCL queues
    "inference": {"base"},  # folding, export (TorchScript, AOTInductor)
    "precision": {"base"},  # what goes low precision, casts, master weights, channels-last, the optimize() record
    # how bf16 ops are computed; routes to our kernels
    "compute_policy": {"base", "attention", "rms_norm", "add_norm", "lora", "rope", "swiglu", "bias_gelu", "linear"},
    "config": {"base"},  # OptimizeConfig
    "training": {"base", "optim", "precision"},  # the returned optimizer, the step inside backward
    "distributed": {"base", "optim", "precision", "training"},  # FSDP2
    "checkpoint": set(),  # DCP checkpoints of plain training loops (through the objects' own state_dicts)
    "quantization": {"base", "precision", "inference", "compute_policy"},
    "reports": {"base", "optim", "precision", "compute_policy", "training", "xpu"},  # summary, memory, info: read only
    "frontend": {"base", "config", "optim", "precision", "compute_policy", "training", "distributed", "inference",
                 "reports", "xpu"},  # optimize(): plan + apply
    "integrations": {"base", "config", "optim", "precision", "compute_policy", "training", "distributed", "attention",
                     "reports", "frontend"},  # the libraries users train with
    "": {"base", "optim", "config", "frontend", "inference", "precision", "reports", "quantization"},
}


def _resolve(module, is_pkg, node):
    """Absolute base module of an ImportFrom."""
    if node.level == 0:
        return node.module or ""
    base = _package_of(module, is_pkg).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module):
    """(target module, imported private name or None) for every import in ``module`` inside ipex_train."""
    path, is_pkg = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PKG):
                    yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_pkg, node)
            if not base.startswith(PKG):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:
                    yield sub, None
                else:
                    yield base, alias.name if alias.name.startswith("_") else None


def _nearest_module(name):
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _edges():
    """module -> the ipex_train modules it imports, including the ``__init__`` of every package a target lies in
    (Python runs those first), except the importer's own enclosing packages (already importing)."""
    edges = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _ in _imports(module):
            target = _nearest_module(target)
            while target and target != PKG:
                if target != module and not module.startswith(target + "."):
                    edges[module].add(target)
                target = target.rpartition(".")[0]
    return edges


def _cycle(edges):
    state = {}
    stack = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = _cycle(_edges())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _is_private(dotted):
    leaf = dotted.rpartition(".")[2]
    return leaf.startswith("_") and not leaf.startswith("__")


def _crossings():
    """(private names imported from another package, private modules imported from outside their package)."""
    names, modules = set(), set()
    for module, (_, is_pkg) in MODULES.items():
        own = _package_of(module, is_pkg)
        for target, private in _imports(module):
            target_mod = _nearest_module(target)
            target_pkg = _package_of(target_mod, MODULES[target_mod][1])
            if private is not None and target_pkg != own:
                names.add((module, f"{target}.{private}"))
            for part in range(len(PKG) + 1, len(target_mod) + 1):
                prefix = target_mod[:part]
                if part < len(target_mod) and target_mod[part] != ".":
                    continue
                if prefix in MODULES and _is_private(prefix):
                    owner = prefix.rpartition(".")[0]
                    if own != owner and not own.startswith(owner + "."):
                        modules.add((module, prefix))
    return names, modules


EXTENSION = "ipex_train._C"  # the compiled kernels (setup.py); loaded by base.ops alone


def test_no_private_names_across_packages():
    names, _ = _crossings()
    loaders = {module for module, name in names if name == EXTENSION}
    assert loaders <= {"ipex_train.base.ops"}, f"only ipex_train.base.ops loads {EXTENSION}, not {loaders}"
    names = {(module, name) for module, name in names if name != EXTENSION}
    assert not names, "private names imported from another package:\n" + "\n".join(sorted(map(str, names)))


def test_private_modules_stay_in_their_package():
    _, modules = _crossings()
    assert not modules, "private modules imported from outside their package:\n" + "\n".join(sorted(map(str, modules)))


def _part(module):
    rest = module[len(PKG) + 1:] if module != PKG else ""
    first = rest.split(".")[0]
    return first if f"{PKG}.{first}" in MODULES and MODULES[f"{PKG}.{first}"][1] or first == "config" else ""


def test_every_part_has_a_layer():
    parts = {_part(m) for m in MODULES}
    assert parts <= set(ALLOWED), f"add these parts to ALLOWED (their place in the layers): {parts - set(ALLOWED)}"


def test_layers_are_acyclic():
    cycle = _cycle({part: set(targets) for part, targets in ALLOWED.items()})
    assert cycle is None, "the allowed-edges table has a cycle: " + " -> ".join(cycle)


def test_imports_follow_the_layers():
    wrong = sorted((module, target) for module, targets in _edges().items() for target in targets
                   if _part(target) != _part(module) and _part(target) not in ALLOWED[_part(module)])
    assert not wrong, "imports against the layers (tests/test_import_graph.py ALLOWED):\n" + "\n".join(
        f"{m} -> {t}" for m, t in wrong)
