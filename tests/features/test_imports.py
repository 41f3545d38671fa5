"""No import circle anywhere in selfspec, and every module imports only its own layer or those
below it (docs/design.md, "Layers"): every import statement of every module, function-level
ones and those under `if TYPE_CHECKING:` included, is an edge."""

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
    found = set()
    for node in ast.walk(tree):
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


def test_the_walk_finds_a_planted_circle_through_a_typing_only_import(tmp_path):
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
    assert graph["selfspec.c"] == {"selfspec.a"} and graph["selfspec.d"] == {"selfspec.c"}
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from selfspec.a import g\n")
    assert cycle_in(import_graph(package)) == ["selfspec.a", "selfspec.sub.b", "selfspec.a"]


# The layers of docs/design.md, bottom first; a module may import its own layer and those below.
# drafters/base.py is the loop's contract with the drafters (the Drafter protocol and the
# dataclasses they exchange), so it sits below the loop that uses it.
LAYERS = (
    ("leaves", ("errors", "checks", "devices", "metrics", "files", "quiet", "tracking",
                "corpus", "divergences")),
    ("core", ("verify", "sampling", "tree", "ranking")),
    ("model", ("model",)),
    ("step", ("step", "drafters.base")),
    ("loop", ("decode",)),
    ("drafters and heads", ("drafters", "heads")),
    ("training", ("training",)),
    ("measure", ("measure",)),
    ("composition", ("from_config", "cli", "demo", "")),
)


def layer_of(module: str) -> int:
    """The index of a module's layer: the longest prefix that names it wins."""
    name = module.removeprefix("selfspec").removeprefix(".")
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if name == p or name.startswith(p + ".") or (p == "" and name == "")),
               default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/design.md"
    return best[1]


def test_every_module_imports_only_its_layer_and_those_below():
    graph = import_graph(PACKAGE)
    upward = {f"{m} ({LAYERS[layer_of(m)][0]}) -> {i} ({LAYERS[layer_of(i)][0]})"
              for m, imports in graph.items() for i in imports if layer_of(i) > layer_of(m)}
    assert not upward, "\n".join(sorted(upward))


def test_the_layer_check_sees_an_upward_import():
    graph = {"selfspec.verify": {"selfspec.decode"}, "selfspec.decode": {"selfspec.verify"}}
    assert layer_of("selfspec.verify") < layer_of("selfspec.decode")
    assert layer_of("selfspec.drafters.base") < layer_of("selfspec.decode")
    assert layer_of("selfspec.drafters.eagle") > layer_of("selfspec.decode")
    assert [i for m, imports in graph.items() for i in imports
            if layer_of(i) > layer_of(m)] == ["selfspec.decode"]


def test_at_most_seventeen_modules_stand_directly_in_the_package():
    """Nine of them the core, the loop and its steps, the composition root's; the rest leaves."""
    modules = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 17, sorted(modules)
