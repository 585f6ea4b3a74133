"""No import runs back up the floors of docs/ARCHITECTURE.md ("Layering"): every swarmlm module imports only
modules on its own floor or below. Checked on the source with `ast`, function-level imports included."""
from __future__ import annotations

import ast
from pathlib import Path

import swarmlm

ROOT = Path(swarmlm.__file__).parent
# lowest first; packages on one floor may import each other
FLOORS: list[set[str]] = [
    {"", "types", "errors", "config", "machine", "kernels", "stats", "small_reads", "event_loop", "collector"},  # "" = the package root (its version, lazy names)
    {"wire"},
    {"model"},
    {"perf"},
    {"planner"},
    {"sim", "server", "swarm"},
    {"client"},
    {"bench", "api"},
    {"cli"},
]


def floor_of(module: str) -> int:
    """swarmlm.a.b -> the floor of its top package `a` (swarmlm.types -> "types", swarmlm -> "")."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    for floor, names in enumerate(FLOORS):
        if top in names:
            return floor
    raise AssertionError(f"{module}: its package {top!r} is on no floor; add it to docs/ARCHITECTURE.md and here")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    module = module_name(path)
    return imports_in(path.read_text(), module if path.name == "__init__.py" else module.rpartition(".")[0])


def imports_in(source: str, package: str) -> list[tuple[int, str]]:
    """(line, imported swarmlm module) for every import statement of a module of `package`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "swarmlm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "swarmlm":
                found.append((node.lineno, target))
    return found


def test_floor_of_knows_the_layout():
    assert floor_of("swarmlm") == floor_of("swarmlm.types") == 0
    assert floor_of("swarmlm.perf.profile") < floor_of("swarmlm.server.stage")
    assert floor_of("swarmlm.wire.links") < floor_of("swarmlm.server.push") < floor_of("swarmlm.client.session")
    assert floor_of("swarmlm.sim.routers") == floor_of("swarmlm.server.push")


def test_a_back_import_is_found_wherever_it_hides():
    """The check itself can fail: upward imports, absolute, relative or inside a function, are all found."""
    source = ("import torch\nfrom swarmlm.types import Span\nfrom ..server.stage import Stage\n"
              "def f():\n    import swarmlm.client.session\n")
    found = imports_in(source, "swarmlm.perf")
    assert found == [(2, "swarmlm.types"), (3, "swarmlm.server.stage"), (5, "swarmlm.client.session")]
    assert [floor_of(m) > floor_of("swarmlm.perf.profile") for _, m in found] == [False, True, True]


def test_no_import_runs_back_up():
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
            continue  # generated
        here = module_name(path)
        for line, target in imports_of(path):
            if floor_of(target) > floor_of(here):
                violations.append(f"{path.relative_to(ROOT.parent)}:{line} ({here}) imports {target}")
    assert not violations, "imports that run back up the floors:\n" + "\n".join(violations)


# files that import each other (a circle of two or more), every import counted: inside functions and under
# TYPE_CHECKING too. None is left (issue 36 started from 6).
IMPORT_KINDS = ("module", "type_checking", "function")  # run at import / for annotations only / when called


def import_statements(tree: ast.Module):
    """(import node, kind) for every import of a module; kind is one of IMPORT_KINDS."""
    def walk(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and kind == "module":
                yield from walk(child, "type_checking")
            else:
                yield from walk(child, kind)
    yield from walk(tree, "module")


def import_graph(kinds: tuple[str, ...] = IMPORT_KINDS) -> dict[str, set[str]]:
    """swarmlm module -> the swarmlm modules it imports by statements of `kinds` (`from pkg import mod` names the
    module, not the package)."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node, kind in import_statements(ast.parse(path.read_text())):
            if kind not in kinds:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in paths}
            else:
                resolved = imports_in(ast.unparse(node), package)  # ([] for a module outside swarmlm)
                target = resolved[0][1] if resolved else ""
                named = {f"{target}.{a.name}" for a in node.names} & paths.keys()
                targets |= named or ({target} & paths.keys())
        graph[module] = targets - {module, "swarmlm"}  # (the root package's lazy names are no import)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_import_kinds_are_told_apart():
    source = ("from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\n"
              "def f():\n    import c\n")
    kinds = [(node.names[0].name, kind) for node, kind in import_statements(ast.parse(source))]
    assert kinds == [("TYPE_CHECKING", "module"), ("a", "module"), ("b", "type_checking"), ("c", "function")]


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, f"modules that import each other: {sorted(map(sorted, found))}"
