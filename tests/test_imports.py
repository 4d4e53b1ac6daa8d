"""Every first-party ``from X import name`` in the tree binds, the lazy ones inside functions too.

A module moved or a name renamed leaves imports behind in code that no test runs end to end
(benchmarks import inside the functions a full run calls; one imported a name for weeks after
it had moved): this finds them without running them.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("ps", "worker", "benchmarks", "tests")


def first_party_imports() -> dict[tuple[str, str], list[str]]:
    """(module, name) -> the places that import it; name "" for a plain ``import module``."""
    found: dict[tuple[str, str], list[str]] = {}
    for d in ("ps", "worker", "benchmarks", "tests"):
        for path in sorted((ROOT / d).rglob("*.py")):
            if "proto" in path.relative_to(ROOT).parts[:3]:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] in FIRST_PARTY:
                    for a in node.names:
                        found.setdefault((node.module, a.name), []).append(where)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] in FIRST_PARTY:
                            found.setdefault((a.name, ""), []).append(where)
    return found


IMPORTS = first_party_imports()


@pytest.mark.parametrize("module", sorted({m for m, _ in IMPORTS}))
def test_every_imported_first_party_name_exists(module):
    mod = importlib.import_module(module)
    missing = []
    for (m, name), places in sorted(IMPORTS.items()):
        if m != module or not name or name == "*" or hasattr(mod, name):
            continue
        try:  # a submodule: ``from ps.core import codecs``
            importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            missing.append(f"{name} (imported at {', '.join(places)})")
    assert not missing, f"{module} has no " + "; ".join(missing)


def test_the_walk_sees_the_benchmarks_lazy_imports():
    assert ("ps.net.wire", "encode_pull_reply") in IMPORTS
    assert any(p.startswith("benchmarks/") for p in IMPORTS[("ps.net.wire", "encode_pull_reply")])
