"""Dependencies between top-level folders run one way: no import cycle between them, nothing shipped
imports `bench`, and only the vLLM adapter imports vLLM."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")


def modules(folder: str) -> Iterator[tuple[Path, set[str]]]:
    """Each module of `folder` with the top-level folders and outside packages it imports."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        yield path, names


def folder_edges() -> dict[str, dict[str, Path]]:
    """folder -> folder it imports -> one module that does (pilotfish.<folder> counts as <folder>)."""
    edges: dict[str, dict[str, Path]] = {}
    for folder in FOLDERS:
        for path, names in modules(folder):
            for name in names:
                parts = name.split(".")
                if parts[0] == "pilotfish" and len(parts) > 1 and parts[1] in FOLDERS and parts[1] != folder:
                    edges.setdefault(folder, {}).setdefault(parts[1], path)
    return edges


def test_no_import_cycle_between_top_level_folders() -> None:
    edges = folder_edges()
    cycles: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        for nxt in edges.get(node, {}):
            if nxt == trail[0]:
                cycles.append(" -> ".join([*trail, nxt]) + f" (closed by {edges[node][nxt].relative_to(ROOT)})")
            elif nxt not in trail:
                visit(nxt, [*trail, nxt])

    for folder in FOLDERS:
        visit(folder, [folder])
    assert not cycles, "\n".join(cycles)


def test_nothing_shipped_imports_bench() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for folder in FOLDERS
        if folder != "bench"
        for path, names in modules(folder)
        if any(n == "pilotfish.bench" or n.startswith("pilotfish.bench.") for n in names)
    ]
    assert not offenders


def test_only_the_vllm_adapter_imports_vllm() -> None:
    """Of what ships; bench's in-engine probes (run inside a vLLM process to time it) are measurement code."""
    importers = {
        str(path.relative_to(ROOT))
        for folder in FOLDERS
        if folder != "bench"
        for path, names in modules(folder)
        if any(n == "vllm" or n.startswith("vllm.") for n in names)
    }
    assert importers and all(p.startswith("vllm_plugin/adapters/") for p in importers), importers
