"""Every cross-reference in the docstrings of the documented modules names something real.

Usage: ``python scripts/check_doc_refs.py MODULE...`` (``scripts/build_docs.sh`` runs it
on the modules of the API reference). Exits 1 and lists each broken reference.

Theory of operation
-------------------
pdoc turns a reference role (``:class:`~.api.MoqtClient```, ``:func:`connect```,
``:mod:`.udp```, ...) into a link when it finds the target and into plain code when it
does not, silently; under ``python -W error`` it fails on broken annotations, never on a
broken reference. This check closes that gap. It imports every module under the
given ones (``__main__`` modules excepted), reads the docstrings of each module and of
each class, function, method and property defined there, and resolves each role's
target as pdoc does:

* a leading ``~`` and a trailing ``()`` are ignored;
* leading dots are relative: ``.x`` is a sibling module of a leaf module (a child of a
  package), each further dot one package up;
* otherwise the target is looked up in the enclosing class, then in the module's
  namespace (names it imports included), then as an absolute dotted name.

An attribute exists when the class (or a base) has it, declares it (an annotation, an
attrs field, ``__slots__``) or assigns ``self.<name>`` in one of its methods.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

OPTIONAL = ("torch", "transformers", "vllm")
"""Optional extras: a module that imports one is skipped (with a note) where it is missing."""
SKIPPED: set[str] = set()
"""Modules left unchecked because their optional extra is missing: references into them
cannot be checked here either (they are, where the extra is installed)."""
ROLE = re.compile(r"(?::py)?:(mod|func|data|const|class|meth|attr|exc|obj):`([^`]+)`")


def walk(roots: list[str]) -> Iterator[types.ModuleType]:
    """Each module under ``roots`` once (submodules of packages included)."""
    seen: set[str] = set()
    for root in roots:
        top = importlib.import_module(root)
        found = [top]
        if hasattr(top, "__path__"):
            for info in pkgutil.walk_packages(top.__path__, root + "."):
                if not info.name.endswith(".__main__"):
                    try:
                        found.append(importlib.import_module(info.name))
                    except ModuleNotFoundError as e:
                        if e.name not in OPTIONAL:
                            raise
                        SKIPPED.add(info.name)
                        print(
                            f"check_doc_refs: {info.name} not checked: {e.name} (an optional "
                            f"extra) is not installed",
                            file=sys.stderr,
                        )
        for mod in found:
            if mod.__name__ not in seen:
                seen.add(mod.__name__)
                yield mod


def docstrings(mod: types.ModuleType) -> Iterator[tuple[str, str, list[Any]]]:
    """``(where, docstring, namespaces to look in first)`` of ``mod`` and what it defines."""
    yield mod.__name__, mod.__doc__ or "", []
    for name, obj in list(vars(mod).items()):
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj):
            yield f"{mod.__name__}.{name}", obj.__doc__ or "", [obj]
            for member_name, member in list(vars(obj).items()):
                fn = member.fget if isinstance(member, property) else member
                if isinstance(fn, (classmethod, staticmethod)):
                    fn = fn.__func__
                if inspect.isfunction(fn) and fn.__doc__:
                    yield f"{mod.__name__}.{name}.{member_name}", fn.__doc__, [obj]
        elif inspect.isfunction(obj) and obj.__doc__:
            yield f"{mod.__name__}.{name}", obj.__doc__, []


def _assigned_on_self(cls: type) -> set[str]:
    """Names a class's methods assign as ``self.<name>`` (instance attributes)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                    names.update([t.attr] if t.value.id == "self" else [])
    return names


def _declared(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        names |= set(getattr(klass, "__slots__", ()))
        names |= {a.name for a in getattr(klass, "__attrs_attrs__", ())}
    return names | _assigned_on_self(cls)


def _lookup(parts: list[str], start: Any) -> bool:
    obj = start
    for i, part in enumerate(parts):
        if isinstance(obj, types.ModuleType) and not hasattr(obj, part):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                return False
            continue
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        # an instance attribute: it exists, but nothing can be looked up inside it
        return inspect.isclass(obj) and part in _declared(obj) and i == len(parts) - 1
    return True


def resolves(target: str, spaces: list[Any], mod: types.ModuleType) -> bool:
    """Whether the role target ``target`` in a docstring of ``mod`` names something."""
    target = target.strip().lstrip("~").removesuffix("()")
    if "<" in target and target.endswith(">"):  # "text <target>"
        target = target[target.index("<") + 1 : -1]
    if any(target == s or target.startswith(s + ".") for s in SKIPPED):
        return True  # into a module whose optional extra is missing (SKIPPED)
    if target.startswith("."):
        package = mod.__name__ if hasattr(mod, "__path__") else mod.__name__.rpartition(".")[0]
        rest = target[1:]
        while rest.startswith("."):
            package, rest = package.rpartition(".")[0], rest[1:]
        return _lookup(rest.split("."), importlib.import_module(package))
    parts = target.split(".")
    if any(_lookup(parts, space) for space in [*spaces, mod]):
        return True
    with contextlib.suppress(ImportError, ValueError):
        return _lookup(parts[1:], importlib.import_module(parts[0]))
    return False


def main(roots: list[str]) -> int:
    broken = [
        f"{where}: {m.group(0)}"
        for mod in walk(roots)
        for where, doc, spaces in docstrings(mod)
        for m in ROLE.finditer(doc)
        if not resolves(m.group(2), spaces, mod)
    ]
    for line in broken:
        print(f"broken reference in {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/check_doc_refs.py MODULE...")
    sys.exit(main(sys.argv[1:]))
