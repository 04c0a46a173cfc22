"""Issue #12's layout rules, checked on the tree itself: file sizes, private names, import circles.

`lint-imports` (run by .ci/run) checks the layer contracts; this test adds what those contracts do
not say: no file over 400 lines, no module importing another module's `_private` name, and no two
modules anywhere (lucy, entity, poly) importing each other in a circle, lazy imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("poly", "entity", "lucy")
MAX_LINES = 400


def source_files() -> list[Path]:
    dirs = [*(ROOT / p for p in PACKAGES), ROOT / "tests", ROOT / "benchmarks", ROOT / "csrc"]
    return sorted(
        f for d in dirs for f in d.rglob("*") if f.suffix in {".py", ".c", ".h"} and f.is_file()
    )


def test_no_file_over_400_lines():
    long = {
        str(f.relative_to(ROOT)): n
        for f in source_files()
        if (n := len(f.read_text(errors="replace").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_module_imports_a_private_name():
    found = []
    for f in source_files():
        if f.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{f.relative_to(ROOT)}:{node.lineno} {alias.name}")
    assert found == []


def strongly_connected(adj: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of size > 1 (iterative: no recursion limit on deep graphs)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in adj:
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circles_anywhere():
    grimp = pytest.importorskip("grimp")  # installed with import-linter (the test extra)
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    adj = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert strongly_connected(adj) == []


def test_the_circle_finder_finds_circles():
    adj = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(adj) == [["a", "b", "c"]]
