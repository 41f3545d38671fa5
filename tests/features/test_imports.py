"""No import circle anywhere in selfspec: every import statement of every module (function-level
ones too, those under `if TYPE_CHECKING:` left out) is an edge, and the graph has no cycle."""

import ast
from pathlib import Path

import selfspec

PACKAGE = Path(selfspec.__file__).parent


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str, modules: set[str]) -> set[str]:
    """The selfspec modules `path` imports: `from a.b import c` names a.b.c when that is a
    module, else a.b."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test)
                   for statement in node.body for n in ast.walk(statement)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                      else node.module for a in node.names}
    return found & modules - {name}


def import_graph(package: Path) -> dict[str, set[str]]:
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    return {name: imported(path, name, set(paths)) for name, path in paths.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph as the modules along it, or None (depth-first search)."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for other in sorted(graph[module]):
            if found := visit(other):
                return found
        path.pop()
        done.add(module)
        return None

    return next((found for module in sorted(graph) if (found := visit(module))), None)


def test_selfspec_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and graph["selfspec.decode"]  # the walk found the package
    assert cycle_in(graph) is None, " -> ".join(cycle_in(graph))


def test_the_walk_finds_a_planted_circle_and_ignores_typing_only_imports(tmp_path):
    package = tmp_path / "selfspec"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from selfspec.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from selfspec.a import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from selfspec import a\n")
    (package / "d.py").write_text("from selfspec import c\n")
    graph = import_graph(package)
    assert cycle_in(graph) == ["selfspec.a", "selfspec.sub.b", "selfspec.a"]
    assert graph["selfspec.c"] == set() and graph["selfspec.d"] == {"selfspec.c"}


def test_nothing_below_measure_and_from_config_imports_them():
    graph = import_graph(PACKAGE)
    upper = ("selfspec.measure", "selfspec.from_config", "selfspec.cli")
    lower = [m for m in graph if not m.startswith(upper) and m != "selfspec"]
    wrong = {m: sorted(i for i in graph[m] if i.startswith(upper)) for m in lower}
    assert not {m: i for m, i in wrong.items() if i}
    measured = [m for m in graph if m.startswith("selfspec.measure")]
    assert not {m: sorted(i for i in graph[m] if i.startswith("selfspec.from_config"))
                for m in measured if any(i.startswith("selfspec.from_config") for i in graph[m])}
