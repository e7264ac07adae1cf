"""The package layering: no import cycle between top-level packages, and the contract imports
none of its producers or consumers. Every import counts, also those inside functions."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tqexport", "trt_plugins")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _unit(module: str) -> str | None:
    """The top-level package a module belongs to: ``trt_plugins``, or ``tqexport.X``."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    return parts[0] if parts[0] == "trt_plugins" or len(parts) == 1 else ".".join(parts[:2])


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of import nodes under ``if TYPE_CHECKING:`` (never run, so never an edge)."""
    return {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Fully qualified modules that ``module`` imports, inside functions too (``from a import
    b`` counts ``a.b`` when ``b`` is a module; ``if TYPE_CHECKING:`` imports do not count)."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            out |= subs or {target}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        src = _unit(module)
        for target in _imports(module, path, modules):
            dst = _unit(target)
            if dst is not None and dst != src and src != "tqexport":
                graph.setdefault(src, set()).add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_top_level_packages():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def _module_graph() -> dict[str, set[str]]:
    """Every module's imports of other modules (packages included, as their ``__init__``),
    less a module's import of a package it lives in: Python has run that package first."""
    modules = _modules()
    return {
        m: {t for t in _imports(m, p, modules) if t in modules and not m.startswith(f"{t}.")}
        for m, p in modules.items()
    }


def test_no_import_cycle_between_any_two_modules():
    """Module by module, lazy imports included: a module never needs one that needs it."""
    cycle = _cycle(_module_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize(
    "unit, forbidden",
    [
        ("tqexport.contract", {"tqexport.export", "tqexport.runtime", "tqexport.verify"}),
        ("tqexport.contract", {"trt_plugins", "tqexport.serve", "tqexport.cli", "tqexport.bench"}),
        ("tqexport.runtime", {"tqexport.export", "tqexport.verify", "tqexport.cli"}),
        ("tqexport.export", {"tqexport.runtime", "tqexport.verify", "tqexport.cli"}),
        ("trt_plugins", {"tqexport.export", "tqexport.runtime", "tqexport.contract"}),
        ("tqexport.spec", {"tqexport.kvplan", "tqexport.export", "tqexport.runtime"}),
    ],
)
def test_layering(unit, forbidden):
    assert not _graph().get(unit, set()) & forbidden


def test_the_walk_sees_imports_inside_functions():
    """The checker itself: a lazy import inside a function is an edge, and a cycle is found."""
    assert "tqexport.verify" in _graph()["tqexport.cli"]  # only ``parity`` imports it, lazily
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_hook_registers_the_torch_ops_it_calls():
    """A fresh interpreter that only imports the hook can call torch.ops.tqexport.* (the torch
    backend's inplace mode; nothing else may be relied on to register them)."""
    import subprocess
    import sys

    code = (
        "import torch, tqexport.models.hook\n"
        "print(torch.ops.tqexport.cache_write, torch.ops.tqexport.paged_attention)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
