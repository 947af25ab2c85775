"""The import direction of src/: which package may import which, read from the source with `ast` (nothing is
imported), so that the shape of the tree stays as docs/architecture.md draws it.

trainer/ composes everything; models/, optim/, data/, kernels/, parallel/ and tools/ never import trainer/;
the runtime data path (data/) never imports the offline tools (tools/ may read the shard format from data/);
config.py imports only openclip_architectures.py (its resolver reads open_clip's model configs), which, like
jsonl.py, imports nothing of ours. Every import counts, also one inside a function.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# package -> the packages it may import (besides itself). A top-level module (src/config.py) is a package of
# its own name. Two pairs import each other, each module in one direction only (the cycle test below keeps it
# so): models/cross_attention.py runs parallel/xattn while parallel/parallelize.py wraps the model's blocks,
# and kernels/ applies its kernels to a built model's modules.
ALLOWED = {
    "config": {"openclip_architectures"},
    "openclip_architectures": set(),
    "jsonl": set(),
    "compose": {"config"},
    "kernels": {"config", "models"},
    "parallel": {"config", "kernels", "models"},
    "models": {"config", "parallel"},
    "optim": {"config", "kernels", "parallel"},
    "data": {"config"},
    "tools": {"config", "data", "jsonl"},
    "trainer": {"config", "data", "jsonl", "kernels", "models", "openclip_architectures", "optim", "parallel", "tools"},
}


def package_of(path: Path) -> str:
    """src/models/clip.py -> "models"; src/config.py -> "config"."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[0]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["src", *parts])


def imported_modules(path: Path, modules: set[str] = frozenset()) -> Iterator[tuple[str, int, bool]]:
    """(module, line, at module level) for every `src.` import of the file, relative imports resolved. With
    the set of all `modules`, `from package import name` names the submodule when `name` is one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == "src" or name.startswith("src."):
                yield name, node.lineno, id(node) in top_level


def source_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_package_is_in_the_table():
    packages = {package_of(path) for path in source_files() if path.parent != SRC or path.name != "__init__.py"}
    assert packages == set(ALLOWED), (
        f"packages without a row in ALLOWED: {sorted(packages - set(ALLOWED))}; rows without a package: "
        f"{sorted(set(ALLOWED) - packages)}. Give a new package a row listing the packages it may import")


def test_imports_follow_the_allowed_direction():
    bad = []
    for path in source_files():
        source = package_of(path)
        for name, line, _ in imported_modules(path):
            parts = name.split(".")
            if len(parts) < 2:
                bad.append(f"src/{path.relative_to(SRC)}:{line} imports the bare `src` package")
                continue
            target = parts[1]
            if target != source and target not in ALLOWED.get(source, set()):
                bad.append(f"src/{path.relative_to(SRC)}:{line} imports {name} ({source} -> {target})")
    assert not bad, ("imports against the package direction (tests/test_imports.py ALLOWED):\n  " + "\n  ".join(bad)
                     + "\nmove the shared code to the package both may import, or pass it in from the caller")


def ancestors(module: str) -> list[str]:
    """src.parallel.xattn.lv -> [src.parallel.xattn, src.parallel] (src itself is empty)."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(len(parts) - 1, 1, -1)]


def test_no_import_cycle_between_modules():
    """Module-level imports form no cycle (an import inside a function runs later and may close one).
    Importing a module first runs the __init__ of each of its packages that is not already running."""
    files = {module_of(path): path for path in source_files()}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name, _, top_level in imported_modules(path, set(files)):
            if not top_level:
                continue
            while name not in files and "." in name:  # `import src.a.b.name` of a name, not a module
                name = name.rpartition(".")[0]
            own = set(ancestors(module))
            targets |= {m for m in [name, *ancestors(name)] if m in files and m != module
                        and (m == name or m not in own)}
        graph[module] = targets

    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return visiting[visiting.index(module):] + [module]
        if module in done:
            return None
        visiting.append(module)
        for target in sorted(graph[module]):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        assert cycle is None, (f"module-level import cycle: {' -> '.join(cycle)}: move the shared code into a "
                               "module both import, or import it inside the function that needs it")
