"""The house's import rules, read from the source: every import counts (module level,
inside functions, under ``TYPE_CHECKING``), so a circle hidden behind a late import
fails here rather than in a newcomer's head."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "bench", "engine", "kernels")
LONG_FILE = 400  # lines; a longer file says why at its top ("one idea: ...")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["trillm", *parts])


@functools.cache
def sources() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", modules)


def imports_in(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The trillm modules ``source`` imports: ``from a.b import c`` names ``a.b.c`` when that is
    a module, else ``a.b``. Parent packages imported implicitly are not arrows."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("trillm."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("trillm"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    files = sources()
    names = set(files)
    return {name: imports_of(path, names) for name, path in files.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_checker_sees_a_circle_and_a_late_import() -> None:
    """The rules below would pass vacuously if imports were not read: a circle through an
    import inside a function and one under ``TYPE_CHECKING`` must be found."""
    modules = {"trillm.x", "trillm.x.a", "trillm.x.b", "trillm.x.c"}
    a = "def f():\n    from trillm.x.b import g\n"
    b = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
    c = "import trillm.x.a\n"
    tree = {
        "trillm.x.a": imports_in(a, "trillm.x.a", False, modules),
        "trillm.x.b": imports_in(b, "trillm.x.b", False, modules),
        "trillm.x.c": imports_in(c, "trillm.x.c", False, modules),
    }
    assert tree == {"trillm.x.a": {"trillm.x.b"}, "trillm.x.b": {"trillm.x.c"}, "trillm.x.c": {"trillm.x.a"}}
    assert circles(tree) == [["trillm.x.a", "trillm.x.b", "trillm.x.c"]]
    assert graph()["trillm.api.cli"], "the real tree's imports were not read"


def test_no_import_circle() -> None:
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_scheduling_and_execution_never_import_each_other() -> None:
    halves = ("trillm.engine.scheduling", "trillm.engine.execution")
    crossing = [
        f"{src} -> {dst}"
        for src, dsts in graph().items()
        for dst in dsts
        for mine, other in (halves, halves[::-1])
        if src.startswith(mine) and dst.startswith(other)
    ]
    assert not crossing, "\n".join(sorted(crossing))


def test_api_and_bench_see_only_the_engines_public_face() -> None:
    reaching = [
        f"{src} -> {dst}"
        for src, dsts in graph().items()
        if src.startswith(("trillm.api", "trillm.bench"))
        for dst in dsts
        if dst.startswith("trillm.engine.")
    ]
    assert not reaching, "\n".join(sorted(reaching))


def test_a_long_file_says_why() -> None:
    unexplained = []
    for path in sources().values():
        text = path.read_text()
        lines = text.count("\n")
        head = ast.get_docstring(ast.parse(text)) or ""
        if lines > LONG_FILE and "one idea" not in head.lower():
            unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not unexplained, "over ~400 lines with no 'one idea: why' at the top:\n" + "\n".join(unexplained)
