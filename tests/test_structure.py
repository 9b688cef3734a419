"""How the code hangs together: imports run one way (launcher -> train), and the launcher's modules import each
other without a cycle, counting imports inside functions (a cycle held together by them is still a cycle)."""

from __future__ import annotations

import ast

from conftest import REPO


def imports_of(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports, at the top or inside a function."""
    graph = {}
    for path in sorted((REPO / package).glob("**/*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found.update(n for n in names if n == package or n.startswith(package + "."))
        graph[module] = found - {module}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (the modules in order), or []."""
    state, path = {}, []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_the_launchers_modules_import_each_other_without_a_cycle():
    graph = imports_of("launcher")
    assert cycle(graph) == [], " -> ".join(cycle(graph))
    backends = ("launcher.local", "launcher.slurm")
    assert not [b for b in backends if "launcher.doctor" in graph[b]]  # the doctor uses the backends, not the reverse


def test_train_never_imports_the_launcher():
    assert not {m: t for m, t in imports_of("train").items() if any(x.startswith("launcher") for x in t)}
    assert not [m for m, targets in imports_of("train").items() if any("submitit" in t or "hydra.main" in t for t in targets)]
