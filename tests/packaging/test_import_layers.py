"""The ktd package's imports go one way and in no circle (read from the source with ast, every
import counted, also those inside functions).

Layers, low to high: text, ops, model (what a model and its text are; operations) · server (the
daemon) · http, client, ctl (the gateway and the clients) · bench, commands, cli. A module may
import its own layer and the ones below; ``commands`` only ``cli`` imports."""

from __future__ import annotations

import ast

from paths import ROOT

PACKAGE = ROOT / "daemon" / "ktd"
LOW = ("ktd.text", "ktd.ops", "ktd.model")
# module prefix -> the prefixes it must not import
FORBIDDEN = {
    **{low: ("ktd.server", "ktd.http", "ktd.client", "ktd.ctl", "ktd.bench", "ktd.commands", "ktd.cli")
       for low in LOW},
    "ktd.server": ("ktd.http", "ktd.ctl", "ktd.bench", "ktd.commands", "ktd.cli"),
    "ktd.http": ("ktd.bench", "ktd.commands", "ktd.cli"),
    "ktd.client": ("ktd.bench", "ktd.commands", "ktd.cli"),
    "ktd.ctl": ("ktd.bench", "ktd.commands", "ktd.cli"),
    "ktd.bench": ("ktd.commands", "ktd.cli"),
}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("ktd", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports (``from ktd.x import y``: ktd.x.y when that is a
    module, else ktd.x)."""
    package = name if (PACKAGE / "/".join(name.split(".")[1:]) / "__init__.py").exists() else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = _graph()
    assert "ktd.server.scheduler" in graph["ktd.server.daemon"]  # a known edge: the reader works
    assert "ktd.text.tokenizer" in graph["ktd.server.engine"]


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_no_import_against_the_layers():
    wrong = [(a, b) for a, targets in _graph().items() for b in sorted(targets)
             for src, banned in FORBIDDEN.items() if _under(a, src) and any(_under(b, x) for x in banned)]
    wrong += [(a, b) for a, targets in _graph().items() for b in sorted(targets)
              if _under(b, "ktd.commands") and not (_under(a, "ktd.commands") or a == "ktd.cli")]
    assert wrong == []
