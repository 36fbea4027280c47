"""The house rules, read off the source tree (AST, no imports): the layers, the compat layer,
function-level imports with a reason, and module size. `docs/architecture.md` explains each.

Layers (an arrow is "may import"):
    cli -> zoo -> adapters -> engine (its public surface) -> engine steps -> compat
    specs are plain data: they import neither the engine nor anything above it.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "magi_zoo"
LIBRARIES = ("torch", "diffusers", "transformers")
COMPAT = "magi_zoo.engine.compat"
MAX_LINES = 500
# Private names of other libraries (not torch / diffusers / transformers) the project may use
# outside compat, each with why. Keep this short: a new entry needs a reason a reviewer accepts.
FOREIGN_PRIVATE_ALLOWED: dict[str, str] = {
    "_getframe": "CPython's sys._getframe: the caller's frame for graph-break locations (no public "
                 "equivalent short of inspect.currentframe, which is the same call)",
    "_flash_attn_forward": "the fa3-fwd wheel's forward op, read in one place (engine/kernels/fa3.py, "
                           "wheel_forward): the public flash_attn_func wraps it in an autograd.Function whose "
                           "backward calls a kernel this forward-only build lacks (the engine pairs the op with "
                           "cuDNN's backward instead), and takes no seqused_k (Self-Forcing's KV-cache prefix)",
}
LAZY_TAG = "# lazy:"  # a function-level import says why it is not at the top of its module


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(root.rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(path) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Imports:
    """Every import of one module: (target module, imported name or None, node, in a function)."""

    def __init__(self, module: str, path: Path, known: dict[str, Path]):
        self.module, self.path = module, path
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.lines = path.read_text().splitlines()
        self.items: list[tuple[str, str | None, ast.AST, bool]] = []
        self._walk(self.tree, False, known)

    def _walk(self, node: ast.AST, in_function: bool, known: dict[str, Path]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    self.items.append((a.name, None, child, in_function))
            elif isinstance(child, ast.ImportFrom):
                target = _absolute(self.module, self.path, child)
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    if sub in known:  # `from . import offload`: the submodule itself
                        self.items.append((sub, None, child, in_function))
                    else:
                        self.items.append((target, a.name, child, in_function))
            self._walk(child, inner, known)


def _all_imports() -> dict[str, _Imports]:
    known = _modules()
    return {m: _Imports(m, p, known) for m, p in known.items()}


def _owner(target: str, known) -> str | None:
    """The magi_zoo module a dotted import target names (its longest known prefix)."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def _graph(imports: dict[str, _Imports]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for m, imp in imports.items():
        for target, _name, _node, _inner in imp.items:
            owner = _owner(target, imports) if target.startswith("magi_zoo") else None
            if owner and owner != m:
                graph[m].add(owner)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# (importer package, imported package, why it is refused)
FORBIDDEN = [
    ("magi_zoo.engine", "magi_zoo.adapters", "the engine is model-agnostic: it never imports an adapter"),
    ("magi_zoo.engine", "magi_zoo.zoo", "the engine sits below the zoo"),
    ("magi_zoo.engine", "magi_zoo.cli", "the engine sits below the CLI"),
    ("magi_zoo.engine", "magi_zoo.train", "training is built on the engine, not inside it"),
    ("magi_zoo.specs", "magi_zoo.engine", "specs are plain data: they never import the engine"),
    ("magi_zoo.specs", "magi_zoo.adapters", "specs are plain data"),
    ("magi_zoo.specs", "magi_zoo.zoo", "specs are plain data"),
    ("magi_zoo.specs", "magi_zoo.cli", "specs are plain data"),
    ("magi_zoo.adapters", "magi_zoo.zoo", "adapters sit below the zoo"),
    ("magi_zoo.adapters", "magi_zoo.cli", "adapters sit below the CLI"),
    ("magi_zoo.train", "magi_zoo.zoo", "train.py is library code; the CLI composes it with zoo.load"),
    ("magi_zoo.train", "magi_zoo.cli", "train.py is library code"),
    ("magi_zoo.distributed", "magi_zoo.cli", "distributed.py is library code"),
    ("magi_zoo.distributed", "magi_zoo.zoo", "distributed.py is library code"),
    ("magi_zoo.engine.compat", "magi_zoo", "compat wraps the libraries and imports nothing of ours"),
]


def layer_violations(imports: dict[str, _Imports]) -> list[str]:
    bad = []
    graph = _graph(imports)
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            for src, dst, why in FORBIDDEN:
                if _in(m, src) and _in(t, dst) and not (src == "magi_zoo.engine.compat" and _in(t, src)):
                    bad.append(f"{m} imports {t}: {why}")
            # Steps sit below the engine's surface: none imports `magi_zoo.engine` or `apply`.
            if _in(m, "magi_zoo.engine") and m not in ("magi_zoo.engine", "magi_zoo.engine.apply") \
                    and t in ("magi_zoo.engine", "magi_zoo.engine.apply"):
                bad.append(f"{m} imports {t}: a step never imports the engine's surface (upward)")
            # Adapters see the engine through one surface: `magi_zoo.engine` (and compat).
            if _in(m, "magi_zoo.adapters") and _in(t, "magi_zoo.engine") and t != "magi_zoo.engine" \
                    and not _in(t, COMPAT):
                bad.append(f"{m} imports {t}: adapters import the engine through `magi_zoo.engine` only")
    return bad


def import_cycles(imports: dict[str, _Imports]) -> list[list[str]]:
    return _cycles(_graph(imports))


def unexplained_lazy_imports(imports: dict[str, _Imports]) -> list[str]:
    bad = []
    for m, imp in imports.items():
        for _target, _name, node, inner in imp.items:
            if not inner:
                continue
            line = imp.lines[node.lineno - 1]
            above = imp.lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
            if LAZY_TAG not in line and not above.startswith(LAZY_TAG):
                bad.append(f"{imp.path.relative_to(REPO)}:{node.lineno}: {line.strip()}")
    return sorted(set(bad))


def _own_private_names() -> set[str]:
    """Private identifiers magi_zoo defines itself (outside compat): its functions, classes,
    module and class names, and attributes it sets on `self` / `cls`."""
    names: set[str] = set()
    for m, path in _modules().items():
        if _in(m, COMPAT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                names.add(str(node.args[1].value))
    return {n for n in names if _private(n)}


def private_name_uses(modules: dict[str, Path] | None = None) -> list[str]:
    """Private names of torch / diffusers / transformers used outside the compat layer, and
    private names of other magi_zoo packages imported across a package boundary."""
    modules = modules if modules is not None else _modules()
    known = _modules()
    own = _own_private_names()
    bad = []
    for m, path in modules.items():
        if _in(m, COMPAT):
            continue
        tree = ast.parse(path.read_text())
        library_names: set[str] = set()  # local names bound to a library module or object
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path

        def flag(node: ast.AST, what: str) -> None:
            bad.append(f"{rel}:{node.lineno}: {what}")

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    root = a.name.split(".")[0]
                    if root in LIBRARIES:
                        if any(_private(s) for s in a.name.split(".")):
                            flag(node, f"import {a.name} (a private module)")
                        library_names.add(a.asname or root)
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(m, path, node)
                root = target.split(".")[0]
                if root in LIBRARIES:
                    if any(_private(s) for s in target.split(".")):
                        flag(node, f"from {target} import ... (a private module)")
                    for a in node.names:
                        if _private(a.name):
                            flag(node, f"from {target} import {a.name} (a private name)")
                        library_names.add(a.asname or a.name)
                elif root == "magi_zoo":
                    here = m if _is_package(path) else m.rpartition(".")[0]
                    for a in node.names:
                        owner = _owner(f"{target}.{a.name}", known) or _owner(target, known)
                        there = owner if owner and _is_package(known[owner]) else (owner or "").rpartition(".")[0]
                        if _private(a.name) and f"{target}.{a.name}" not in known and not _in(here, there):
                            flag(node, f"from {target} import {a.name}: another package's private name")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in library_names:
                    flag(node, f"{ast.unparse(node)} (a private name of {base.id})")
                elif node.attr.startswith("_magi_zoo"):
                    continue  # our own attribute namespace on foreign objects
                elif isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                elif node.attr not in own and node.attr not in FOREIGN_PRIVATE_ALLOWED:
                    flag(node, f"{ast.unparse(node)} (a private attribute magi_zoo does not define)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                name = node.args[1].value
                if _private(name) and not name.startswith("_magi_zoo") and name not in own:
                    flag(node, f"{node.func.id}(..., {name!r}) (a private attribute magi_zoo does not define)")
    return sorted(bad)


def oversized_modules() -> list[str]:
    out = []
    for _m, path in _modules().items():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            out.append(f"{path.relative_to(REPO)}: {n} lines")
    return out


# -- the tests ---------------------------------------------------------------------------------
def test_no_import_cycles():
    assert import_cycles(_all_imports()) == []


def test_layers_import_downward_only():
    assert layer_violations(_all_imports()) == []


def test_function_level_imports_say_why():
    """An import inside a function is for a cost (diffusers, transformers, triton, a kernel
    wheel) or an optional dependency; it carries `# lazy: <why>` on its line or the line above."""
    assert unexplained_lazy_imports(_all_imports()) == []


def test_private_library_names_only_in_compat():
    assert private_name_uses() == []


def test_no_module_over_500_lines():
    assert oversized_modules() == []


def test_the_checks_catch_what_they_guard(tmp_path):
    """Each rule fires on a module that breaks it (so an empty result above means something)."""
    bad = tmp_path / "magi_zoo" / "engine" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("import torch._dynamo\nfrom diffusers.models.attention_dispatch import _AttentionBackendRegistry\n"
                   "import torch\nx = torch._inductor.config\ny = pipe._prepare_latent_image_ids\n"
                   "z = getattr(model, '_cp_plan')\n")
    found = private_name_uses({"magi_zoo.engine.bad": bad})
    assert len(found) == 5, found
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
