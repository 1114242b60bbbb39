"""The package's layers (docs/architecture.md): imports point one way, down."""
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
              "runlock", "cli", "__init__"},
}


def package_imports(path: Path):
    """The package modules a file imports, as dotted names relative to ``communities``."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    here = list(rel.parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                target = base + (node.module.split(".") if node.module else [])
                names = [target + [a.name] for a in node.names] if not node.module else [target]
            elif node.module and node.module.split(".")[0] == "communities":
                names = [node.module.split(".")[1:]]
            else:
                continue
            for parts in names:
                if parts and not ((PACKAGE.joinpath(*parts).with_suffix(".py")).exists()
                                  or PACKAGE.joinpath(*parts).is_dir()):
                    parts = parts[:-1]  # a name from a module (``from .. import __version__``), not a module
                yield ".".join(parts) or "__init__"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "communities":
                    yield ".".join(a.name.split(".")[1:]) or "__init__"


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


def _classes(*layers: str):
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


def test_no_class_in_the_engine_or_runtime_is_over_300_lines():
    big = [f"{where} {cls.name}: {cls.end_lineno - cls.lineno + 1} lines"
           for where, cls in _classes("engine", "runtime") if cls.end_lineno - cls.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"classes over {MAX_CLASS_LINES} lines: " + "; ".join(big)


def test_every_engine_attribute_is_first_set_in_init():
    found = list(_classes("engine"))
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
    for where, cls in _classes("engine", "core", "runtime"):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                positional = (fn.args.posonlyargs + fn.args.args)[1:]
                if len(positional) > 3:
                    long.append(f"{where} {cls.name}({', '.join(a.arg for a in positional)})")
    assert not long, "constructors with more than three positional parameters: " + "; ".join(long)
