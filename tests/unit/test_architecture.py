"""The package's shape (docs/concepts/architecture.md): its layers, whose imports point one way, down; no import circle;
no class over 300 lines and no function over 80; attributes declared in ``__init__``; keyword-only constructors.
Every rule walks every folder of the package recursively."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "communities"

# what each folder may import from the package, besides itself
ALLOWED = {
    "core": set(),
    "runtime": {"core", "errors"},
    "workload": {"core", "errors"},
    "engine": {"core", "runtime", "workload", "errors", "config", "results", "manifest", "runlock", "__init__"},
    "report": {"results", "manifest", "runlock", "errors", "core.clustering", "model_files"},
    "tools": {"core", "runtime", "workload", "engine", "report", "errors", "config", "refusals", "results", "manifest",
              "runlock", "cli", "parsers", "__init__"},
}


def module_name(path: Path) -> str:
    """``engine.mixing.gossip`` of communities/engine/mixing/gossip.py; a package's ``__init__.py`` is the package
    (``tools.compare``), the top one ``__init__``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _resolve(parts, root: Path = PACKAGE) -> str:
    """The module or package a dotted name relative to ``communities`` names: ``from ..core import clustering``
    is the module core.clustering; ``from ..jobs import ROOT`` the module tools.jobs (ROOT is a name in it)."""
    parts = list(parts)
    while parts and not (root.joinpath(*parts).with_suffix(".py").exists() or root.joinpath(*parts).is_dir()):
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


MODULE, FUNCTION, TYPE_CHECKING = "module level", "function level", "type checking"


def _imports_in(node: ast.AST, kind: str):
    """(import node, kind) of every import below ``node``: inside a function body it is a function-level import,
    under ``if TYPE_CHECKING:`` a type-checking one."""
    for child in ast.iter_child_nodes(node):
        here = kind
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            here = FUNCTION
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            here = TYPE_CHECKING if kind == MODULE else kind
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, here
        yield from _imports_in(child, here)


def package_edges(path: Path, root: Path = PACKAGE):
    """(module, kind, line) of every package module a file imports: dotted names relative to ``communities``
    (the package at ``root``), ``kind`` module level, function level or type checking."""
    here = list(path.relative_to(root).parts[:-1])
    for node, kind in _imports_in(ast.parse(path.read_text()), MODULE):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "communities":
                target = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:  # each name may be a module of the package it is imported from
                yield _resolve(target + [a.name], root), kind, node.lineno
        else:
            for a in node.names:
                if a.name.split(".")[0] == "communities":
                    yield _resolve(a.name.split(".")[1:], root), kind, node.lineno


def package_imports(path: Path):
    """The package modules a file imports, as dotted names relative to ``communities``."""
    for target, _, _ in package_edges(path):
        yield target


def test_every_package_folder_is_a_layer():
    """A new folder of the package must be given its place in ALLOWED, or no rule here would see it."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED), f"folders without a layer: {sorted(folders - set(ALLOWED))}"


def layer_files():
    for layer in ALLOWED:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            yield pytest.param(layer, path, id=str(path.relative_to(PACKAGE)))


@pytest.mark.parametrize("layer,path", list(layer_files()))
def test_imports_point_down(layer, path):
    bad = []
    for target in package_imports(path):
        if target == layer or target.startswith(layer + "."):
            continue
        if not any(target == a or target.startswith(a + ".") for a in ALLOWED[layer]):
            bad.append(target)
    assert not bad, f"communities/{path.relative_to(PACKAGE)} imports {sorted(set(bad))}, outside what {layer}/ may use"


def test_the_report_never_imports_torch_or_mpi():
    for path in (PACKAGE / "report").rglob("*.py"):
        tree = ast.parse(path.read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 and not n.level}
        assert not mods & {"torch", "mpi4py"}, path


# ---------------------------------------------------------------- the shape of the engine's classes

MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
EVERYWHERE = ("",)  # _classes(""): every file of the package, its top-level modules included


def _classes(*layers: str):
    """(file, class) of every class in the layers' folders, recursively."""
    for layer in layers:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    yield str(path.relative_to(PACKAGE)), node


def _self_targets(node: ast.AST, self_name: str):
    """The attribute names a function body assigns or annotates on ``self_name`` (``self.x = ...``, ``self.x: T``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        else:
            continue
        for target in targets:
            for t in ast.walk(target):  # tuple targets: ``self.a, self.b = ...``
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == self_name
                        and isinstance(t.ctx, ast.Store)):
                    yield t.attr


def _first_arg(fn) -> str:
    args = fn.args.posonlyargs + fn.args.args
    return args[0].arg if args else ""


def _decorated(fn, name: str) -> bool:
    return any(isinstance(d, ast.Name) and d.id == name for d in fn.decorator_list)


def _class_level(cls: ast.ClassDef) -> set:
    """Names set or annotated in the class body itself (dataclass fields, class constants)."""
    names = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return names


def _init_attributes(cls: ast.ClassDef) -> set:
    """What the class body, ``__init__`` and a classmethod that builds its instance set on ``self``."""
    known = _class_level(cls)
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if fn.name == "__init__":
            known |= set(_self_targets(fn, _first_arg(fn)))
        elif _decorated(fn, "classmethod"):
            for sub in ast.walk(fn):  # ``obj = cls(...)`` / ``cls.__new__(cls)``: obj's attributes are built here
                if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Call) and len(sub.targets) == 1 \
                        and isinstance(sub.targets[0], ast.Name):
                    known |= set(_self_targets(fn, sub.targets[0].id))
    return known


def _late_attributes(cls: ast.ClassDef, classes: Optional[dict] = None) -> list:
    """Attributes a method other than ``__init__`` assigns on ``self`` that ``__init__`` and the class never set.

    A classmethod that builds its instance (``obj = cls.__new__(cls)``; ``obj.x = ...``) counts as an ``__init__``.
    Bases found by name in ``classes`` (the classes of the package's layer) count too: what a base's
    ``__init__`` sets, a subclass may set again.
    """
    classes = classes or {}
    known, seen, todo = set(), set(), [cls]
    while todo:
        c = todo.pop()
        if c.name in seen:
            continue
        seen.add(c.name)
        known |= _init_attributes(c)
        todo += [classes[b.id] for b in c.bases if isinstance(b, ast.Name) and b.id in classes]
    late = {}
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _decorated(fn, "staticmethod") \
                or _decorated(fn, "classmethod") or fn.name == "__init__":
            continue
        for attr in _self_targets(fn, _first_arg(fn)):
            late.setdefault(attr, fn.name)
    return sorted(f"{cls.name}.{a} (in {m})" for a, m in late.items() if a not in known)


def test_no_class_in_the_package_is_over_300_lines():
    big = [f"{where} {cls.name}: {cls.end_lineno - cls.lineno + 1} lines"
           for where, cls in _classes(*EVERYWHERE) if cls.end_lineno - cls.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"classes over {MAX_CLASS_LINES} lines: " + "; ".join(big)


def test_no_function_in_the_package_is_over_80_lines():
    """Methods and nested functions count too, each with its signature, docstring and body."""
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    big.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not big, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(big)


@pytest.mark.parametrize("layer", list(ALLOWED))
def test_every_attribute_is_first_set_in_init(layer):
    found = list(_classes(layer))
    by_name = {cls.name: cls for _, cls in found}
    late = [f"{where} {a}" for where, cls in found for a in _late_attributes(cls, by_name)]
    assert not late, "attributes first set outside __init__ (set or annotate them there): " + "; ".join(late)


def test_the_attribute_rule_sees_what_it_should():
    src = '''
class A:
    x: int
    def __init__(self):
        self.a, self.b = 1, 2
    @classmethod
    def build(cls):
        obj = cls.__new__(cls)
        obj.c = 3
        return obj
    def later(self):
        self.a = self.x = self.c = 0
        self.d = 4
'''
    (cls,) = [n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)]
    assert _late_attributes(cls) == ["A.d (in later)"]


def test_the_attribute_rule_follows_bases_of_the_layer():
    src = """
class Base:
    def __init__(self):
        self.a = 1
class Child(Base):
    def later(self):
        self.a = 2
        self.e = 5
"""
    classes = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)}
    assert _late_attributes(classes["Child"], classes) == ["Child.e (in later)"]
    assert _late_attributes(classes["Child"]) == ["Child.a (in later)", "Child.e (in later)"]


def test_constructors_of_more_than_three_parameters_take_the_rest_as_keywords():
    """A call such as ``Mixer(cfg, world, timer, replica, agreement)`` cannot swap two arguments unseen."""
    long = []
    for where, cls in _classes(*ALLOWED):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                positional = (fn.args.posonlyargs + fn.args.args)[1:]
                if len(positional) > 3:
                    long.append(f"{where} {cls.name}({', '.join(a.arg for a in positional)})")
    assert not long, "constructors with more than three positional parameters: " + "; ".join(long)


MAX_POSITIONAL = 5


def _positional(fn: ast.AST, in_class: bool) -> list:
    """The parameters a call may pass by position (``self`` or ``cls`` of a method left out)."""
    args = fn.args.posonlyargs + fn.args.args
    return args[1:] if in_class and args and args[0].arg in ("self", "cls") else args


def long_positional(tree: ast.AST) -> list:
    """``name(params)`` of each function or method of ``tree`` that takes more than ``MAX_POSITIONAL`` by position."""
    methods = {id(fn) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for fn in cls.body}
    return [f"{fn.lineno} {fn.name}({', '.join(a.arg for a in _positional(fn, id(fn) in methods))})"
            for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and len(_positional(fn, id(fn) in methods)) > MAX_POSITIONAL]


def test_functions_of_more_than_five_parameters_take_the_rest_as_keywords():
    """A call such as ``train_unit(model, opt, x, y, cfg, seed, rank, t)`` cannot swap two arguments unseen."""
    long = [f"{path.relative_to(PACKAGE)}:{where}" for path in sorted(PACKAGE.rglob("*.py"))
            for where in long_positional(ast.parse(path.read_text()))]
    assert not long, f"functions with more than {MAX_POSITIONAL} positional parameters: " + "; ".join(long)


def test_the_positional_rule_counts_what_a_call_may_pass_by_position():
    src = """
def f(a, b, c, d, e, g): ...
def ok(a, b, c, d, e, *, g): ...
class A:
    def m(self, a, b, c, d, e): ...
    def n(self, a, b, c, d, e, g): ...
    @classmethod
    def k(cls, a, b, c, d, e, /, g): ...
"""
    assert long_positional(ast.parse(src)) == ["2 f(a, b, c, d, e, g)", "6 n(a, b, c, d, e, g)",
                                               "8 k(a, b, c, d, e, g)"]


# ---------------------------------------------------------------- import circles


def import_graph() -> dict:
    """{module: {imported module: (kind, line)}} of the whole package (a module importing itself left out)."""
    graph: dict = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        edges = graph.setdefault(name, {})
        for target, kind, line in package_edges(path):
            if target != name:
                edges.setdefault(target, (kind, f"{path.relative_to(PACKAGE)}:{line}"))
    return graph


def strongly_connected(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan): each is an import circle."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circle():
    """Module-level, function-level and TYPE_CHECKING imports all count: a function-level import that closes a
    circle works at run time, but the two modules can no longer be read, tested or moved apart. Implicit imports
    of a parent package (importing core.clustering runs core/__init__.py) do not count."""
    graph = import_graph()
    circles = strongly_connected(graph)
    lines = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} ({graph[a][b][0]}, {graph[a][b][1]})"
                                               for a in c for b in c if b in graph[a]) for c in circles]
    assert not circles, "import circles:\n" + "\n".join(lines)


def test_the_circle_finder_sees_each_kind_of_import(tmp_path):
    src = {"a.py": "from . import b\n", "b.py": "def f():\n    from .c import g\n",
           "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n", "d.py": "import os\n"}
    for name, text in src.items():
        (tmp_path / name).write_text(text)
    edges = {p.stem: [(t, k) for t, k, _ in package_edges(p, tmp_path)] for p in sorted(tmp_path.glob("*.py"))}
    assert edges == {"a": [("b", MODULE)], "b": [("c", FUNCTION)], "c": [("a", TYPE_CHECKING)], "d": []}
    graph = {k: dict.fromkeys(t for t, _ in v) for k, v in edges.items()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    del graph["c"]["a"]
    assert strongly_connected(graph) == []
