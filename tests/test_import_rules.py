"""Which way imports may point, read from the source with ``ast`` (docs/architecture.md).

* ``transport`` never imports ``swarmd``.
* A decision core imports no event loop, network or HTTP library (asyncio, trio, libp2p,
  aiohttp, socket, threading, ...), imports inside swarmd/transport only other cores (and the
  error types), and reads no clock or global random state: time and randomness are
  parameters (``now``, ``rng: random.Random``), so the daemon and the simulators run the same
  code.
* The packages of ``swarmd`` form one order (``LAYERS``, bottom first): a package imports only
  packages below it, never one above it nor one on its own level. Every import counts: those
  inside functions and under ``if TYPE_CHECKING:`` too (``ast.walk`` reads the whole tree).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the pure decision cores (module names)
CORES = frozenset({
    "swarmd.protocols",
    "transport.lowbit",
    "transport.relay.policy",
    "swarmd.links",
    "swarmd.addresses",
    "swarmd.node.reachability",
    "swarmd.pipeline.wiring",
    "swarmd.pipeline.wiring_config",
    "swarmd.pipeline.penalties",
    "swarmd.pipeline.budgets",
    "swarmd.pipeline.slots",
    "swarmd.pipeline.messages",
    "swarmd.balancing.policy",
    "swarmd.balancing.placement",
    "swarmd.export.cut",
    "swarmd.membership.announcement",
    "swarmd.membership.schedule",
    "swarmd.membership.view",
    "swarmd.averaging.trigger",
    "swarmd.averaging.authority",
    "swarmd.averaging.plan",
    "swarmd.averaging.aggregation",
    "swarmd.averaging.messages",
    "swarmd.state.transfer",
    "swarmd.state.messages",
    "swarmd.state.replay",
    "transport.codecs",
    "swarmd.models.seam",
    "swarmd.pipeline.inflight",
    "swarmd.pipeline.held",
    "swarmd.pipeline.progress",
    "transport.ratelimit",
    "transport.liveness_policy",
    "swarmd.node.caps",
    "swarmd.node.shutdown",
    "swarmd.data.order",
    "swarmd.data.heldout",
    "swarmd.data.fingerprint",
    "swarmd.data.windows",
    "swarmd.manifest.document",
    "swarmd.manifest.settle",
    "swarmd.manifest.wire",
    "swarmd.peer_states",
})
#: what a core may import from swarmd/transport besides other cores
CORE_MAY_IMPORT = frozenset({"swarmd.errors", "transport.errors", "transport.limits",
                             "swarmd.membership", "transport.signing"})
#: libraries that do I/O or schedule work: never in a core
IO_MODULES = frozenset({"asyncio", "trio", "libp2p", "aiohttp", "socket", "threading",
                        "selectors", "subprocess", "concurrent", "uvloop", "multiaddr",
                        "urllib", "http", "requests"})
#: clock reads and global random state: attribute calls on these modules
CLOCK_CALLS = {"time": {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns",
                        "perf_counter_ns", "process_time", "sleep"},
               "datetime": {"now", "utcnow", "today"},
               "os": {"urandom"},
               "secrets": None}
#: random's module-level functions use the global generator; ``random.Random`` is a value
RANDOM_ALLOWED = {"Random"}


#: swarmd's packages (and top-level modules), bottom first; a package imports only packages on
#: a lower level (docs/architecture.md, "Layers"). ``swarmd`` is the package's own
#: ``__init__`` (``swarmd.train``), so it sits on top.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(f"swarmd.{p}" if p != "swarmd" else p
                                                     for p in level.split()) for level in (
    "errors version",
    "files links protocols peer_states runfiles addresses",
    "data",
    "config",
    "training",
    "models",
    "api",
    "averaging",
    "balancing",
    "membership",
    "state",
    "pipeline",
    "manifest",
    "node",
    "export",
    "trainer",
    "local",
    "cli",
    "__main__ swarmd",
))
@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import, relative ones resolved."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out.append((node.lineno, base))
            # "from swarmd.membership import view" imports the submodule too
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def check_source(source: str, module: str, *, core: bool,
                 known: frozenset[str] = frozenset()) -> list[Violation]:
    """The rules broken by ``source`` (the text of ``module``)."""
    tree = ast.parse(source)
    package = module if source and module.endswith("__init__") else module.rpartition(".")[0]
    found: list[Violation] = []
    aliases: dict[str, str] = {}  # local name -> module, for clock and random calls
    for line, name in imports(tree, package):
        top = name.split(".")[0]
        if module.startswith("transport") and top == "swarmd":
            found.append(Violation(module, line, f"transport imports {name}"))
        if not core:
            continue
        if top in IO_MODULES:
            found.append(Violation(module, line, f"a decision core imports {name}"))
        elif top in ("swarmd", "transport") and name not in CORES | CORE_MAY_IMPORT \
                and (not known or name in known):
            found.append(Violation(module, line, f"a decision core imports {name}, which is "
                                                 f"not a core"))
    if not core:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in CLOCK_CALLS | {"random": 0}:
            for alias in node.names:
                bad = CLOCK_CALLS.get(node.module)
                if (node.module == "random" and alias.name not in RANDOM_ALLOWED) or (
                        node.module != "random" and (bad is None or alias.name in bad)):
                    found.append(Violation(module, node.lineno,
                                           f"a decision core imports {node.module}.{alias.name} "
                                           f"(pass time and rng in)"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        owner = aliases.get(node.value.id)
        if owner == "random" and node.attr not in RANDOM_ALLOWED:
            found.append(Violation(module, node.lineno, f"a decision core uses the global random "
                                                        f"state (random.{node.attr})"))
        elif owner in CLOCK_CALLS:
            bad = CLOCK_CALLS[owner]
            if bad is None or node.attr in bad:
                found.append(Violation(module, node.lineno, f"a decision core reads the clock "
                                                            f"({owner}.{node.attr})"))
    return found


def tree_modules() -> dict[str, Path]:
    return {module_name(p): p for top in ("swarmd", "transport")
            for p in sorted((ROOT / top).rglob("*.py"))}


def test_every_core_exists():
    assert CORES <= set(tree_modules()), sorted(CORES - set(tree_modules()))


@pytest.mark.parametrize("module", sorted(tree_modules()))
def test_module_follows_the_import_rules(module: str):
    path = tree_modules()[module]
    known = frozenset(tree_modules())
    problems = check_source(path.read_text(encoding="utf-8"), module,
                            core=module in CORES, known=known)
    assert not problems, "\n".join(map(str, problems))


# ---- the checker itself catches what it must (a rule test that cannot fail is no test) -------

@pytest.mark.parametrize("source, what", [
    ("import asyncio\n", "imports asyncio"),
    ("from trio import sleep\n", "imports trio"),
    ("import libp2p.host\n", "imports libp2p"),
    ("import time\nx = time.time()\n", "reads the clock (time.time)"),
    ("import time as t\nx = t.monotonic()\n", "reads the clock (time.monotonic)"),
    ("from time import perf_counter\n", "imports time.perf_counter"),
    ("import random\nx = random.random()\n", "global random state (random.random)"),
    ("from random import choice\n", "imports random.choice"),
    ("from swarmd.pipeline import server\n", "swarmd.pipeline.server, which is not a core"),
])
def test_the_checker_finds_a_violation_in_a_core(source: str, what: str):
    problems = check_source(source, "swarmd.pipeline.wiring", core=True,
                            known=frozenset(tree_modules()))
    assert any(what in str(p) for p in problems), problems


def test_the_checker_finds_transport_importing_swarmd():
    problems = check_source("from swarmd.errors import SwarmdError\n", "transport.host",
                            core=False)
    assert "transport imports swarmd.errors" in [p.what for p in problems]


def test_the_checker_passes_what_a_core_may_do():
    source = ("import math\nimport random\nfrom swarmd.errors import BadPeerMessage\n"
              "def f(now: float, rng: random.Random) -> float:\n    return rng.random() + now\n")
    assert check_source(source, "swarmd.pipeline.wiring", core=True,
                        known=frozenset(tree_modules())) == []


# ---- the packages' order (LAYERS) -------------------------------------------------------------

def level_of(module: str) -> int:
    """The level in ``LAYERS`` of the package that holds ``module`` (a ``swarmd`` module)."""
    parts = module.split(".")
    package = ".".join(parts[:2])
    for level, packages in enumerate(LAYERS):
        if package in packages:
            return level
    return len(LAYERS) - 1 if parts == ["swarmd"] or package not in _packages() else -1


def _packages() -> frozenset[str]:
    return frozenset(".".join(m.split(".")[:2]) for m in tree_modules() if m.startswith("swarmd"))


def back_edges(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import in ``source`` (the text of ``module``) of a
    module on the same level as ``module``'s package or above it, other than its own package."""
    if not module.startswith("swarmd"):
        return []
    own = ".".join(module.split(".")[:2])
    package = module if module == "swarmd" else module.rpartition(".")[0]
    if source and tree_modules().get(module, Path()).name == "__init__.py":
        package = module
    known, found = tree_modules(), {}
    for line, name in imports(ast.parse(source), package):
        if name.split(".")[0] != "swarmd" or ".".join(name.split(".")[:2]) == own:
            continue
        while name not in known and "." in name:  # "swarmd.node.home.KEY_FILE": a name in it
            name = name.rpartition(".")[0]
        if level_of(name) >= level_of(module):
            found.setdefault(name, line)
    return [(line, name) for name, line in found.items()]


def test_every_package_has_a_level():
    placed = frozenset().union(*LAYERS)
    assert _packages() <= placed | {"swarmd"}, sorted(_packages() - placed)
    assert all(level_of(m) >= 0 for m in tree_modules() if m.startswith("swarmd"))


def test_packages_import_only_packages_below_them():
    found = sorted(f"{module}:{line} imports {name} (not below it in LAYERS)"
                   for module, path in tree_modules().items()
                   for line, name in back_edges(path.read_text(encoding="utf-8"), module))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, module", [
    ("from swarmd.node.home import load_identity\n", "swarmd.membership.service"),
    ("def f():\n    from swarmd.pipeline.server import StageServer\n", "swarmd.state.keeper"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from swarmd.config import Config\n",
     "swarmd.data.pipeline"),
    ("from swarmd.files import write_atomic\n", "swarmd.errors"),  # the same level
    ("from swarmd import train\n", "swarmd.cli.local"),  # the package's facade is on top
])
def test_the_checker_finds_an_import_against_the_order(source: str, module: str):
    assert back_edges(source, module), source


def test_the_checker_passes_imports_down_the_order():
    source = ("from swarmd.errors import ConfigError\nfrom swarmd.state import keeper\n"
              "from . import wiring\nfrom swarmd.pipeline.router import Router\n")
    assert back_edges(source, "swarmd.pipeline.server") == []
