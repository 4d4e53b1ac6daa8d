"""The import rules of the package layout (README, "Layout"), enforced.

    core    pure and synchronous: the standard library (no asyncio), numpy, torch, zstandard,
            xxhash, and itself. No grpc, no protobuf, no event loop.
    net     core, grpc (and its health service's messages), protobuf: the one place the wire format lives.
    tiers   core, net, prometheus_client: the tiers' state machines and durability.
    server  tiers, net, core, grpc: the servicer, health and the process lifecycle.
    worker  core, net, torch, prometheus_client: what a training script imports.
    tools   anything (cli, launch, status, jobctl, wanem); demo likewise.

Every import counts, the lazy ones inside functions too: a rule that only holds at module
level holds until the first call.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)

# Third-party (and first-party) modules each layer may import, beside the standard library.
ALLOWED: dict[str, set[str]] = {
    "core": {"numpy", "torch", "zstandard", "xxhash", "ps.core"},
    "net": {"numpy", "xxhash", "grpc", "grpc_health", "google.protobuf", "ps.core", "ps.net"},
    "tiers": {"numpy", "xxhash", "prometheus_client", "ps.core", "ps.net", "ps.tiers"},
    "server": {"grpc", "grpc_health", "google.protobuf", "prometheus_client",
               "ps.core", "ps.net", "ps.tiers", "ps.server"},
    "worker": {"numpy", "torch", "prometheus_client", "ps.core", "ps.net", "worker"},
}
FORBIDDEN_STDLIB: dict[str, set[str]] = {"core": {"asyncio"}}


def layer_of(path: Path, root: Path = ROOT) -> str | None:
    rel = path.relative_to(root).parts
    if rel[0] == "worker":
        return "worker"
    if rel[0] == "ps" and len(rel) > 2 and rel[1] in ALLOWED and rel[1] != "worker":
        return None if rel[1:3] == ("net", "proto") else rel[1]  # generated code: protoc's
    return None


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every absolute module name a file imports, with its line; relative imports resolved."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name != "__future__":
                found.append((node.lineno, name))
    return found


def allowed(layer: str, module: str) -> bool:
    if module == "ps":  # the package root: its version string, nothing of any layer
        return True
    top = module.split(".")[0]
    if top in STDLIB:
        return top not in FORBIDDEN_STDLIB.get(layer, set())
    return any(module == a or module.startswith(a + ".") for a in ALLOWED[layer])


def violations(files, root: Path = ROOT) -> list[str]:
    """'path:line: layer imports module' for every import a layer's rule does not allow."""
    bad = []
    for path in files:
        layer = layer_of(path, root)
        if layer is None:
            continue
        for line, module in imports_of(path, root):
            if not allowed(layer, module):
                bad.append((str(path.relative_to(root)), line, f"{layer} imports {module}"))
    return [f"{p}:{line}: {what}" for p, line, what in sorted(bad)]


def sources() -> list[Path]:
    return sorted(p for d in ("ps", "worker") for p in (ROOT / d).rglob("*.py"))


def test_every_layer_imports_only_what_its_rule_allows():
    files = sources()
    assert sum(layer_of(p) is not None for p in files) > 40  # the walk found the packages
    assert violations(files) == []


def test_the_rule_check_catches_a_violation(tmp_path):
    # A core module that reaches for grpc lazily, imports the tiers relatively, and the loop;
    # a worker module that reaches into the tiers.
    core = tmp_path / "ps" / "core" / "probe.py"
    core.parent.mkdir(parents=True)
    core.write_text("import numpy\ndef f():\n    import grpc\n\nfrom ..tiers import root\nimport asyncio\n")
    work = tmp_path / "worker" / "probe.py"
    work.parent.mkdir(parents=True)
    work.write_text("from ps.net import wire\nfrom ps.tiers.root import Root\n")
    assert violations([core, work], tmp_path) == [
        "ps/core/probe.py:3: core imports grpc",
        "ps/core/probe.py:5: core imports ps.tiers",
        "ps/core/probe.py:6: core imports asyncio",
        "worker/probe.py:2: worker imports ps.tiers.root"]


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_core_loads_neither_grpc_nor_protobuf():
    # All core modules imported together in a fresh interpreter: if the union loads neither,
    # no single module does. (asyncio cannot be checked so: torch imports it itself, measured
    # with torch 2.13; the import walk above keeps it out of the core's own code.)
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in (ROOT / "ps" / "core").rglob("*.py"))
    assert "ps.core.view" in modules and "ps.core.codecs.topk" in modules
    loaded = _fresh(
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('grpc', 'google.protobuf') if m in sys.modules))")
    assert loaded == "[]"


@pytest.mark.parametrize("module", ["ps.core.errors", "ps.core.config", "ps.core.types", "ps.core.view",
                                    "ps.core.consistency", "ps.core.exactly_once"])
def test_the_torch_free_core_loads_no_event_loop_and_no_torch(module):
    # `hps status` and `hps job` import errors, config and types: they must not pay for torch
    # (seconds) to print; none of these modules needs an event loop.
    loaded = _fresh(f"import sys, {module}\n"
                    "print(sorted(m for m in ('torch', 'grpc', 'asyncio', 'matplotlib') if m in sys.modules))")
    assert loaded == "[]"


def test_status_and_job_tools_load_neither_torch_nor_matplotlib():
    loaded = _fresh("import sys, ps.tools.status, ps.tools.jobctl\n"
                    "print(sorted(m for m in ('torch', 'matplotlib', 'yaml') if m in sys.modules))")
    assert loaded == "[]"


def test_a_relay_process_loads_no_torch_until_a_job_needs_it():
    # What `hps serve --role zone|regional` imports, and the codecs a lossless job uses: torch
    # (seconds, ~180 MB) is imported by a relay only for a lossy codec or an outer inner loop
    # (tests/integration/test_relay_torch.py checks a serving zone).
    loaded = _fresh("import sys, ps.tools.cli, ps.server, ps.tiers.outer, ps.tiers.relay\n"
                    "from ps.core.codecs import get_codec\n"
                    "for name in ('fp32', 'fp32+zstd', 'rows'): get_codec(name)\n"
                    "print(sorted(m for m in ('torch',) if m in sys.modules))")
    assert loaded == "[]"
