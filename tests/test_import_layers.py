"""kvtier's import graph: no cycle, and no import that points up the layers (README, "Architecture").

Every ``import`` and ``from ... import`` in ``kvtier/`` counts, wherever it stands: at module
level, inside a function (a lazy import) or under ``if TYPE_CHECKING:`` (a typing-only one is
still a dependency of the code that names the type). A module that imports by string
(``importlib.import_module``) names its targets in string constants (``"kvtier.a.b"`` or
``"kvtier.a.b:attr"``): each such constant in that module counts as an import too, so a plug-in
table does not hide a dependency; ``import_module("kvtier...")`` with a literal is refused outright
(write the import).

The layers, lowest first; a module may import its own layer's modules (without a cycle) and
any lower layer's, never a higher one's. A module that matches no layer fails the test: a new
package must be placed.

The edges and cycles that remain (issue 25) are listed, each with why, in :data:`ALLOWED_UPWARD`
and :data:`ALLOWED_CYCLES`. The lists only shrink: a new upward edge or cycle fails the test, and so
does a listed one that is gone (remove its entry).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvtier"

#: Layer name -> the module prefixes in it, lowest layer first.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("kvtier.sizes", "kvtier.config_base", "kvtier.version", "kvtier.urls", "kvtier.ports", "kvtier.hosts",
              "kvtier.malloc_arenas", "kvtier.processes",
              "kvtier.errors")),
    ("index", ("kvtier.index",)),
    ("memory", ("kvtier.memory",)),
    ("serde", ("kvtier.serde",)),
    ("tiers", ("kvtier.tiers",)),
    ("config", ("kvtier.config", "kvtier.config_lmcache", "kvtier.config_lmcache_transfer",
                "kvtier.config_lmcache_values", "kvtier.config_checks", "kvtier.config_sources", "kvtier.config_urls")),
    ("storage", ("kvtier.storage",)),
    ("protocol", ("kvtier.protocol",)),
    ("planes", ("kvtier.transfer", "kvtier.fleet", "kvtier.controller", "kvtier.events", "kvtier.dashboard")),
    ("service", ("kvtier.service", "kvtier.router")),
    ("integrations", ("kvtier.integrations",)),
    ("runtime", ("kvtier.runtime",)),
    ("apps", ("kvtier.demo", "kvtier.bench", "kvtier.sim", "kvtier.cli", "kvtier.cli_bench", "kvtier.cli_fleet",
              "kvtier.cli_common",
              "kvtier.config_report", "kvtier.testing", "kvtier")),
]


#: A string constant naming a module, optionally ``:attribute`` (a plug-in table's entry).
STRING_TARGET = re.compile(r"^(kvtier(?:\.\w+)+)(?::[\w.]+)?$")

#: Upward imports that remain, ``"importer -> imported"`` -> why it is still there. Shrink only.
ALLOWED_UPWARD: dict[str, str] = {}

#: Import cycles that remain (the modules, sorted, joined by ``" <-> "``) -> why. Shrink only.
ALLOWED_CYCLES: dict[str, str] = {}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` lives in (``kvtier.a.b.C`` -> ``kvtier.a.b``), None outside kvtier."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {imported kvtier module: line of the first such import}.

    ``from kvtier.pkg import sub`` where ``sub`` is a module imports ``kvtier.pkg.sub`` (and the
    package ``kvtier.pkg`` only if another name comes from it).
    """
    edges: dict[str, dict[str, int]] = defaultdict(dict)
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        imports_by_string = any(
            isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) in ("import_module", "__import__")
            for n in ast.walk(tree)
        )
        for node in ast.walk(tree):
            targets: list[str] = []
            if imports_by_string and isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = STRING_TARGET.match(node.value)
                if m and m.group(1) in modules:
                    targets = [m.group(1)]
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = mod.split(".") if is_package else mod.split(".")[:-1]
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__"
            ):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("kvtier"):
                    raise AssertionError(f"{path}:{node.lineno}: import_module({arg.value!r}) hides a dependency; import it")
            for target in targets:
                owner = _owner(target, modules) if target.startswith("kvtier") else None
                if owner is not None and owner != mod:
                    edges[mod].setdefault(owner, node.lineno)
    return edges


def layer_of(mod: str) -> int:
    """Index into :data:`LAYERS` of the longest prefix that names ``mod``."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best < 0:
        raise AssertionError(f"{mod} is in no layer of tests/test_import_layers.py: place it")
    return best


def upward_edges(edges: dict[str, dict[str, int]]) -> list[str]:
    """``"importer:line imports imported (layer -> layer)"`` for every import that points up."""
    out = []
    for mod, targets in sorted(edges.items()):
        for target, line in sorted(targets.items()):
            if layer_of(target) > layer_of(mod):
                out.append(f"{mod}:{line} imports {target} ({LAYERS[layer_of(mod)][0]} -> {LAYERS[layer_of(target)][0]})")
    return out


def edge_name(found: str) -> str:
    """``"a:12 imports b (x -> y)"`` -> ``"a -> b"`` (the key of :data:`ALLOWED_UPWARD`)."""
    mod, _, rest = found.partition(" imports ")
    return f"{mod.rpartition(':')[0]} -> {rest.partition(' ')[0]}"


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, {})))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def edges() -> dict[str, dict[str, int]]:
    return import_edges(module_files())


def test_every_module_has_a_layer() -> None:
    for mod in module_files():
        layer_of(mod)


@pytest.mark.slow
def test_no_new_import_points_up_the_layers(edges: dict[str, dict[str, int]]) -> None:
    found = {edge_name(e): e for e in upward_edges(edges)}
    new = [e for name, e in found.items() if name not in ALLOWED_UPWARD]
    assert new == [], "imports pointing up the layers (move the primitive down, or invert the dependency):\n" + "\n".join(new)
    gone = sorted(ALLOWED_UPWARD.keys() - found.keys())
    assert gone == [], "fixed, so remove from ALLOWED_UPWARD:\n" + "\n".join(gone)


@pytest.mark.slow
def test_no_new_import_cycle(edges: dict[str, dict[str, int]]) -> None:
    found = {" <-> ".join(c) for c in cycles(edges)}
    new = sorted(found - ALLOWED_CYCLES.keys())
    assert new == [], "new import cycles:\n" + "\n".join(new)
    gone = sorted(ALLOWED_CYCLES.keys() - found)
    assert gone == [], "fixed, so remove from ALLOWED_CYCLES:\n" + "\n".join(gone)


def test_the_walk_sees_lazy_typing_only_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: an upward import hidden in a function, under TYPE_CHECKING or relative is found."""
    mods = {"kvtier.index.a": tmp_path / "a.py", "kvtier.storage.b": tmp_path / "b.py", "kvtier.storage": tmp_path / "__init__.py"}
    mods["kvtier.index.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtier.storage import b\n")
    mods["kvtier.storage.b"].write_text("def f():\n    from ..index import a\n")
    mods["kvtier.storage"].write_text("")
    got = import_edges(mods)
    assert got["kvtier.index.a"] == {"kvtier.storage.b": 3} and got["kvtier.storage.b"] == {"kvtier.index.a": 2}
    assert upward_edges(got) == ["kvtier.index.a:3 imports kvtier.storage.b (index -> storage)"]
    assert cycles(got) == [["kvtier.index.a", "kvtier.storage.b"]]


def test_the_walk_sees_a_plug_in_table_of_a_module_that_imports_by_string(tmp_path: Path) -> None:
    """A ``"module:attr"`` string in a module that calls ``import_module`` is an edge; elsewhere it is text."""
    mods = {"kvtier.tiers.reg": tmp_path / "reg.py", "kvtier.transfer.peer": tmp_path / "peer.py",
            "kvtier.tiers.doc": tmp_path / "doc.py"}
    mods["kvtier.tiers.reg"].write_text(
        "import importlib\nTABLE = {'peer': 'kvtier.transfer.peer:open_peer'}\n"
        "def load(n):\n    m, _, a = TABLE[n].partition(':')\n    return getattr(importlib.import_module(m), a)\n")
    mods["kvtier.transfer.peer"].write_text("def open_peer():\n    pass\n")
    mods["kvtier.tiers.doc"].write_text("CMD = ['python', '-m', 'kvtier.transfer.peer']\n")
    got = import_edges(mods)
    assert got["kvtier.tiers.reg"] == {"kvtier.transfer.peer": 2} and "kvtier.tiers.doc" not in got
    assert upward_edges(got) == ["kvtier.tiers.reg:2 imports kvtier.transfer.peer (tiers -> planes)"]
    mods["kvtier.tiers.doc"].write_text("import importlib\nimportlib.import_module('kvtier.transfer.peer')\n")
    with pytest.raises(AssertionError, match="hides a dependency"):
        import_edges(mods)
