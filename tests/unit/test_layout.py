"""The package's shape (docs/design.md, "Layers"): modules small enough to read, split by
concern, and no import loop among them. grimp (import-linter's graph) reads every import,
those inside functions and under TYPE_CHECKING included."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

import vllm_kvguard

PACKAGE = Path(vllm_kvguard.__file__).parent
MAX_LINES = 600


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def test_the_cycle_finder_finds_a_loop_and_only_loops() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_is_at_most_600_lines() -> None:
    sizes = {
        str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 40
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_no_import_loop_among_the_packages_modules() -> None:
    graph = grimp.build_graph("vllm_kvguard", include_external_packages=False)
    edges = {
        m: {i for i in graph.find_modules_directly_imported_by(m) if i.startswith("vllm_kvguard")}
        for m in graph.modules
    }
    assert "vllm_kvguard.connector.worker" in edges["vllm_kvguard.connector.facade"]
    assert _cycles(edges) == []


def _defined_in(init: Path) -> set[str]:
    """Names a package's ``__init__`` defines itself (not those it re-exports)."""
    own: set[str] = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own.update(t.id for t in targets if isinstance(t, ast.Name))
    return own


def test_submodules_import_names_from_their_defining_module_not_their_package() -> None:
    """``from vllm_kvguard.digest import KVPages`` inside the package goes through digest's
    re-exports (and back into digest's modules): a name comes from the module that defines it.
    A submodule (``from vllm_kvguard.digest import rowhash``) or a name the package's
    ``__init__`` defines itself (``__version__``) is fine."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("vllm_kvguard"):
                continue
            package = PACKAGE.parent / node.module.replace(".", "/")
            if not (package / "__init__.py").exists():
                continue
            own = _defined_in(package / "__init__.py")
            for alias in node.names:
                submodule = (package / f"{alias.name}.py").exists() or (package / alias.name).is_dir()
                if not submodule and alias.name not in own:
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}: from {node.module} import {alias.name}"
                    )
    assert found == []


# The engine core's side of the guard runs inside vLLM's schedule() and update_from_output(), on
# the engine core's main thread, beside its input and output threads. numpy's sorts (unique,
# sort, argsort, searchsorted, isin...) and compiled loops declared nogil let go of the GIL, and
# one of those threads then takes it: vLLM's step waits for work that would otherwise overlap
# the forward (docs/design/decisions.md, "The GIL").
SCHEDULER_SIDE = [
    "core/ledger.py",
    "core/ledger_state.py",
    "core/reads.py",
    "core/scrub.py",
    "core/_plankernels.py",
    "connector/scheduler.py",
    "connector/scheduler_state.py",
    "connector/planning.py",
    "connector/findings.py",
    "connector/views.py",
    "connector/finish.py",
    "digest/identity.py",
]
GIL_RELEASING = {
    "unique",
    "sort",
    "argsort",
    "lexsort",
    "searchsorted",
    "isin",
    "in1d",
    "intersect1d",
    "setdiff1d",
}


def _gil_releasing_calls(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "np" and node.func.attr in GIL_RELEASING:
                found.append(f"line {node.lineno}: np.{node.func.attr}")
            elif node.func.attr == "argsort":
                found.append(f"line {node.lineno}: .argsort")
        if isinstance(node, ast.keyword) and node.arg == "nogil":
            found.append(f"line {node.value.lineno}: nogil")
    return found


def test_the_rule_finds_what_it_forbids() -> None:
    bad = "import numpy as np\n@numba.njit(nogil=True)\ndef f(a):\n    return np.unique(a), a.argsort()\n"
    assert len(_gil_releasing_calls(bad)) == 3
    assert _gil_releasing_calls("import numpy as np\nx = sorted(set(np.asarray([1]).tolist()))\n") == []


def test_the_scheduler_side_keeps_the_gil() -> None:
    found = {m: _gil_releasing_calls((PACKAGE / m).read_text()) for m in SCHEDULER_SIDE}
    assert {m: f for m, f in found.items() if f} == {}
