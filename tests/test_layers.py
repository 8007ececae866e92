"""The package's layers import only downward (design.md section 2): g4ops/ops/ knows neither transformers nor peft
nor any g4ops layer above it, the engine knows no transformers glue and no server, the transformers glue (hf/) knows
no server. Read from the source (every import statement, inside functions too), so that a lazy import that only runs
on a GPU path is checked on CPU as well."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "g4ops"

# layer -> the modules (absolute names, or top-level packages) it must not import
FORBIDDEN = {
    "ops": ("g4ops.hf", "g4ops.engine", "g4ops.serve", "g4ops.models", "g4ops.optim", "transformers", "peft"),
    "engine": ("g4ops.hf", "g4ops.serve"),
    "hf": ("g4ops.serve",),
}


def _imports(path: Path) -> list[tuple[int, list[str]]]:
    """(line, the absolute module names it may import) for every import statement in the file, relative ones
    resolved against the file's package. `from .. import hf` imports a module by name, so `from M import a, b`
    gives M, M.a and M.b."""
    package = ["g4ops", *path.relative_to(PACKAGE).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, [module] + [f"{module}.{alias.name}" for alias in node.names]))
    return found


def _violations(layer: str) -> list[str]:
    """One line per import statement of the layer that reaches a module it must not import."""
    banned = FORBIDDEN[layer]
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, modules in _imports(path):
            hits = [m for m in modules if any(m == b or m.startswith(b + ".") for b in banned)]
            if hits:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {hits[0]}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downward(layer):
    assert (PACKAGE / layer).is_dir(), f"g4ops/{layer}/ is gone: update FORBIDDEN"
    assert _violations(layer) == []


def test_the_check_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    """The rule catches what it is for: a relative import two levels up, and one inside a function."""
    layer = tmp_path / "g4ops" / "ops"
    layer.mkdir(parents=True)
    (layer / "bad.py").write_text("from ..hf import patches\n\ndef f():\n    from transformers import AutoModel\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "g4ops")
    assert _violations("ops") == ["g4ops/ops/bad.py:1 imports g4ops.hf", "g4ops/ops/bad.py:4 imports transformers"]
