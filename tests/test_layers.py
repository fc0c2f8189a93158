"""The architecture's layers, checked on the sources: which part of agentkv may import which.

    server: entry (app, cli) -> api -> pipeline -> engine | kv -> base (config, options, errors, ...)
    server -> compaction, compaction.log, and of the connector only its ``params``
    compaction.log -> compaction (the prompt); compaction -> nothing of agentkv's but itself
    kernels.connector -> kernels, connector.params; kernels -> nothing; params -> the standard library

Every import counts, also one inside a function (a lazy import is still a dependency), except
those under ``if TYPE_CHECKING``. No module-level import circles either.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPS = ("server", "kernels", "compaction", "benchmarks")

# module prefix -> part (the longest prefix wins)
PARTS = {
    "agentkv.server.app": "server.entry", "agentkv.server.cli": "server.entry",
    "agentkv.server.api": "server.api", "agentkv.server.pipeline": "server.pipeline",
    "agentkv.server.engine": "server.engine", "agentkv.server.kv": "server.kv",
    "agentkv.server": "server.base",
    "agentkv.kernels.connector.params": "connector.params", "agentkv.kernels.connector": "connector",
    "agentkv.kernels": "kernels",
    "agentkv.compaction.log": "compaction.log", "agentkv.compaction": "compaction",
    "agentkv.benchmarks": "benchmarks",
}
_BELOW_SERVER = {"compaction", "compaction.log", "connector.params"}
ALLOWED = {   # part -> the other parts it may import
    "benchmarks": set(PARTS.values()),
    "server.entry": {"server.api", "server.pipeline", "server.engine", "server.kv", "server.base", *_BELOW_SERVER},
    "server.api": {"server.pipeline", "server.engine", "server.kv", "server.base", *_BELOW_SERVER},
    "server.pipeline": {"server.engine", "server.kv", "server.base", *_BELOW_SERVER},
    "server.engine": {"server.base", *_BELOW_SERVER},
    "server.kv": {"server.base", *_BELOW_SERVER},
    "server.base": set(_BELOW_SERVER),
    "compaction.log": {"compaction"},
    "compaction": set(),
    "connector": {"kernels", "connector.params"},
    "kernels": set(),
    "connector.params": set(),
}
STDLIB_ONLY = {"connector.params"}


def part_of(module: str) -> str | None:
    best = max((p for p in PARTS if module == p or module.startswith(p + ".")), key=len, default=None)
    return PARTS[best] if best else None


def sources() -> dict[str, tuple[str, bool]]:
    """module name -> (source, is a package's __init__), for every module of agentkv."""
    out = {}
    for top in TOPS:
        for path in (REPO / top).rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("").parts
            is_pkg = rel[-1] == "__init__"
            out[".".join(("agentkv",) + (rel[:-1] if is_pkg else rel))] = (path.read_text(), is_pkg)
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(module: str, source: str, is_pkg: bool) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of a module's imports; relative ones resolved."""
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    top_level = {id(n) for n in tree.body}
    package = module if is_pkg else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if node.__class__ not in (ast.Import, ast.ImportFrom) or node.lineno in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            out.append((name, node.lineno, id(node) in top_level))
    return out


def violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    known = set(modules)
    found = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (source, is_pkg) in modules.items():
        here = part_of(module)
        for name, line, top in imports(module, source, is_pkg):
            if here in STDLIB_ONLY and not name.startswith("agentkv.") and name != "__future__" \
                    and name.split(".")[0] not in sys.stdlib_module_names:
                found.append(f"{module}:{line} imports {name}, which is not the standard library")
            if not name.startswith("agentkv."):
                continue
            target = name if name in known else name.rpartition(".")[0]   # `from pkg import name`
            if target not in known:
                continue
            there = part_of(target)
            if there != here and there not in ALLOWED[here]:
                found.append(f"{module}:{line} ({here}) imports {target} ({there})")
            if top and target != module and not module.startswith(target + "."):   # a package's own parents
                graph[module].add(target)
    found += [f"import circle: {' -> '.join(c)}" for c in _circles(graph)]
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                out.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return out


def test_every_module_has_a_part():
    assert [m for m in sources() if part_of(m) is None] == []


def test_the_layers_hold():
    assert violations(sources()) == []


def _with(module: str, line: str) -> dict[str, tuple[str, bool]]:
    mods = sources()
    source, is_pkg = mods[module]
    return {**mods, module: (source + "\n" + line + "\n", is_pkg)}


def test_a_forbidden_import_is_caught():
    """The check fails for each kind of forbidden import, added to today's sources."""
    cases = [
        ("agentkv.compaction.policy", "from ..server import config", "compaction) imports agentkv.server.config"),
        ("agentkv.compaction.log.session_log", "from ...server.pipeline import sessions", "(server.pipeline)"),
        ("agentkv.kernels.rope", "from .connector import scheduler", "(kernels) imports agentkv.kernels.connector"),
        ("agentkv.server.kv.reuse", "from ...kernels.connector import scheduler", "(connector)"),
        ("agentkv.server.pipeline.turn", "from ...kernels import evict", "(kernels)"),
        ("agentkv.server.engine.process", "from ..api import deps", "(server.engine) imports agentkv.server.api"),
        ("agentkv.server.engine.process", "from ..kv import reuse", "(server.engine) imports agentkv.server.kv"),
        ("agentkv.kernels.connector.scheduler", "from ...compaction import prompt", "(compaction)"),
        ("agentkv.kernels.connector.params", "import numpy", "numpy, which is not the standard library"),
    ]
    for module, line, expect in cases:
        found = violations(_with(module, line))
        assert any(expect in v for v in found), (module, line, found)


def test_a_circle_is_caught():
    found = violations(_with("agentkv.compaction.prompt_segments", "from . import prompt"))
    assert any(v.startswith("import circle:") and "agentkv.compaction.prompt" in v for v in found), found
