"""The package's layers (docs/architecture.md): imports point one way, down."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "communities"

# what each folder may import from the package, besides itself
ALLOWED = {
    "core": set(),
    "runtime": {"core", "errors"},
    "workload": {"core", "errors"},
    "engine": {"core", "runtime", "workload", "errors", "config", "results", "manifest", "runlock", "__init__"},
    "report": {"results", "manifest", "runlock", "errors", "core.clustering"},
    "tools": {"core", "runtime", "workload", "engine", "report", "errors", "config", "results", "manifest", "runlock",
              "cli", "__init__"},
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
        for path in sorted((PACKAGE / layer).glob("*.py")):
            yield pytest.param(layer, path, id=f"{layer}/{path.name}")


@pytest.mark.parametrize("layer,path", list(layer_files()))
def test_imports_point_down(layer, path):
    bad = []
    for target in package_imports(path):
        if target == layer or target.startswith(layer + "."):
            continue
        if not any(target == a or target.startswith(a + ".") for a in ALLOWED[layer]):
            bad.append(target)
    assert not bad, f"communities/{layer}/{path.name} imports {sorted(set(bad))}, outside what {layer}/ may import"


def test_the_report_never_imports_torch_or_mpi():
    for path in (PACKAGE / "report").glob("*.py"):
        tree = ast.parse(path.read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 and not n.level}
        assert not mods & {"torch", "mpi4py"}, path
