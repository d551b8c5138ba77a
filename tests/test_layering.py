"""The layering rules of ARCHITECTURE.md, checked on the source (no imports run).

1. ``kvcs_core`` is sans-I/O: nothing under it imports an I/O, clock, entropy,
   threading or tensor module (STYLE.md R6). Entropy, keys and the clock are
   passed in by the caller.
2. Dependencies point down: ``kvcs_core/wire`` (the codec) imports nothing from
   the layers above it (``moqt``, ``relay``, ``kvcs``, ``kvsp``).

Every ``import``/``from ... import`` anywhere in a module counts (top level, in
functions, under ``if TYPE_CHECKING``), and so does a literal
``__import__("x")`` / ``importlib.import_module("x")``. Relative imports are
resolved against the module's package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kvcs_core"

FORBIDDEN_IN_CORE = (
    "asyncio",
    "trio",
    "socket",
    "selectors",
    "time",
    "os",
    "random",
    "secrets",
    "threading",
    "subprocess",
    "aioquic",
    "numpy",
    "torch",
    "logging.handlers",
)

ABOVE_WIRE = ("kvcs_core.moqt", "kvcs_core.relay", "kvcs_core.kvcs", "kvcs_core.kvsp")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path, root: Path) -> str:
    name = _module_name(path, root)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_modules(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """Yield ``(line, dotted module name)`` for every import in ``path``.

    ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a submodule).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(path, root)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts)
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            first = node.args[0]
            if (
                name in ("__import__", "import_module")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                yield node.lineno, first.value


def _matches(module: str, banned: str) -> bool:
    return module == banned or module.startswith(banned + ".")


def _violations(paths: list[Path], banned: tuple[str, ...], root: Path = ROOT) -> list[str]:
    found: set[tuple[str, int, str]] = set()
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for line, module in imported_modules(path, root):
            if any(_matches(module, b) for b in banned):
                found.add((rel, line, module))
    return [f"{rel}:{line}: imports {module}" for rel, line, module in sorted(found)]


def _py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_files_exist() -> None:
    assert _py_files(CORE / "wire"), "kvcs_core/wire has no Python files: wrong ROOT?"


def test_core_imports_no_io_modules() -> None:
    bad = _violations(_py_files(CORE), FORBIDDEN_IN_CORE)
    assert not bad, "kvcs_core must stay sans-I/O (STYLE.md R6):\n" + "\n".join(bad)


def test_wire_depends_on_nothing_above_it() -> None:
    bad = _violations(_py_files(CORE / "wire"), ABOVE_WIRE)
    assert not bad, "kvcs_core/wire must not import the layers above it:\n" + "\n".join(bad)


def test_checker_sees_every_import_form(tmp_path: Path) -> None:
    """The walker itself: nested, from-, relative and dynamic imports are all seen."""
    pkg = tmp_path / "kvcs_core" / "wire"
    pkg.mkdir(parents=True)
    src = pkg / "probe.py"
    src.write_text(
        "import os.path\n"
        "from logging import handlers\n"
        "def f():\n"
        "    import time\n"
        "    from ..moqt import session\n"
        "    importlib.import_module('trio')\n"
        "import logging\n"
        "from . import varint\n",
        encoding="utf-8",
    )
    io_bad = _violations([src], FORBIDDEN_IN_CORE, tmp_path)
    up_bad = _violations([src], ABOVE_WIRE, tmp_path)
    assert [v.split(":")[1] for v in io_bad] == ["1", "2", "4", "6"], io_bad
    assert up_bad == [
        "kvcs_core/wire/probe.py:5: imports kvcs_core.moqt",
        "kvcs_core/wire/probe.py:5: imports kvcs_core.moqt.session",
    ]
