"""``import kvcs``: the public API is explicit, documented and the only import root.

* ``kvcs.__all__`` is pinned (a name added or removed is a decision, made here),
  sorted, and every name in it resolves; ``kvcs.trio`` offers the same two entry
  points on trio.
* Every public name, and every public method and property its class defines,
  has a docstring.
* ``connect``/``serve_relay`` (asyncio and trio) and the client's
  ``publish_cache``/``retrieve_cache`` spell out every option: no ``**kwargs``,
  options keyword-only, each one named in the docstring, the same on both loops.
* Nothing in the repository imports ``transports`` or ``adapters`` as a top-level
  name (they are ``kvcs.transports`` / ``kvcs.adapters``; generic names like these
  exist on PyPI, e.g. AdapterHub's ``adapters``): every Python file and every
  Python block of the README is parsed, imports in functions included.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kvcs
import kvcs.trio
from kvcs.transports.quic import asyncio_binding, trio_binding
from kvcs.transports.quic.api import MoqtClient
from kvcs_core.kvcs.consumer import KvcsConsumer

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = [
    "Backoff",
    "CacheFile",
    "CacheFileError",
    "CachePublication",
    "CacheRetrieval",
    "CompatibilityDescriptor",
    "ConnectError",
    "ConsumerConfig",
    "DescriptorError",
    "IndexOptions",
    "KvDestination",
    "LayerReady",
    "LayerSections",
    "LocalProtocolError",
    "ManifestSigner",
    "MoqtClient",
    "PublisherError",
    "RecomputeNeeded",
    "RelayConfig",
    "RelayServer",
    "RetrievalComplete",
    "RetrievalFailed",
    "StackUnavailable",
    "TlsConfig",
    "TlsError",
    "TrackOffer",
    "TrackSelection",
    "UrlError",
    "connect",
    "layer_sections",
    "llama_descriptor",
    "load",
    "save",
    "self_signed",
    "serve_relay",
    "synthetic",
]

ERRORS = [
    "CacheFileError",
    "ConnectError",
    "DescriptorError",
    "LocalProtocolError",
    "PublisherError",
    "RetrievalFailed",
    "StackUnavailable",
    "TlsError",
    "UrlError",
]


def test_all_is_pinned_and_sorted() -> None:
    assert kvcs.__all__ == PUBLIC
    assert sorted(kvcs.__all__) == kvcs.__all__
    assert kvcs.trio.__all__ == ["connect", "serve_relay"]


def test_every_name_resolves_and_star_import_gives_exactly_all() -> None:
    for name in kvcs.__all__:
        assert getattr(kvcs, name, None) is not None, name
    namespace: dict[str, Any] = {}
    exec("from kvcs import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(PUBLIC)


def test_errors_are_exceptions() -> None:
    for name in ERRORS:
        assert issubclass(getattr(kvcs, name), Exception), name


def test_the_entry_points_are_the_bindings() -> None:
    assert kvcs.connect is asyncio_binding.connect
    assert kvcs.serve_relay is asyncio_binding.serve_relay
    assert kvcs.trio.connect is trio_binding.connect
    assert kvcs.trio.serve_relay is trio_binding.serve_relay


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties ``cls`` itself defines (not attrs' generated ones)."""
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__aiter__":
            continue
        if isinstance(value, property) or inspect.isfunction(value):
            yield name, value


def test_every_public_name_and_member_has_a_docstring() -> None:
    missing = []
    for module in (kvcs, kvcs.trio):
        assert (module.__doc__ or "").strip(), module.__name__
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(obj):
                for member, value in _members(obj):
                    if not (value.__doc__ or "").strip():
                        missing.append(f"{module.__name__}.{name}.{member}")
    assert not missing, "without a docstring: " + ", ".join(missing)


def _options(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _check_explicit(fn: Callable[..., Any], positional: int) -> None:
    params = _options(fn)
    kinds = {p.name: p.kind for p in params}
    assert inspect.Parameter.VAR_KEYWORD not in kinds.values(), f"{fn.__qualname__}: **kwargs"
    assert inspect.Parameter.VAR_POSITIONAL not in kinds.values(), f"{fn.__qualname__}: *args"
    for p in params[positional:]:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"{fn.__qualname__}: {p.name}"
        assert p.annotation is not inspect.Parameter.empty, f"{fn.__qualname__}: {p.name}"
    doc = inspect.getdoc(fn) or ""
    assert "Args:" in doc and "Raises:" in doc, fn.__qualname__
    for p in params:
        documented = re.search(rf"^\s+{p.name}: \S", doc, re.M)
        assert documented, f"{fn.__qualname__}: {p.name} undocumented"


def test_entry_points_spell_out_every_option() -> None:
    _check_explicit(kvcs.connect, 1)
    _check_explicit(kvcs.serve_relay, 1)
    _check_explicit(kvcs.trio.connect, 1)
    _check_explicit(kvcs.trio.serve_relay, 1)
    _check_explicit(MoqtClient.retrieve_cache, 3)
    _check_explicit(MoqtClient.publish_cache, 3)


def test_both_loops_take_the_same_options() -> None:
    for a, b in ((kvcs.connect, kvcs.trio.connect), (kvcs.serve_relay, kvcs.trio.serve_relay)):
        assert inspect.signature(a) == inspect.signature(b), a.__name__


def test_retrieve_cache_offers_every_consumer_option() -> None:
    """Each option of the consumer machine is a parameter of ``retrieve_cache``."""
    consumer = {p.name for p in _options(KvcsConsumer.__init__)}
    client = {p.name for p in _options(MoqtClient.retrieve_cache)}
    assert consumer <= client, consumer - client
    assert client - consumer == {"also"}


# --- one import root ----------------------------------------------------------------------

GENERIC = ("transports", "adapters")
SKIP_DIRS = {".venvs", ".venv", ".peers", ".git", "build", "dist", "__pycache__", "docs"}


def _sources() -> Iterator[tuple[str, str]]:
    """``(label, source)`` of every Python file (each once: the links under ``kvcs/``
    are not followed) and of every Python block in the README."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts) or rel.parts[:2] in (
            ("kvcs", "transports"),
            ("kvcs", "adapters"),
        ):
            continue
        yield rel.as_posix(), path.read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S)):
        yield f"README.md python block {i}", block


def _generic_imports(label: str, source: str) -> Iterator[str]:
    tree = ast.parse(source, filename=label)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = getattr(func, "id", None) or getattr(func, "attr", None)
            first = node.args[0]
            if called in ("__import__", "import_module") and isinstance(first, ast.Constant):
                names = [str(first.value)]
        for name in names:
            if name.split(".")[0] in GENERIC:
                yield f"{label}:{node.lineno}: imports {name}"


def test_nothing_imports_a_generic_top_level_name() -> None:
    sources = list(_sources())
    labels = {label for label, _ in sources}
    assert "transports/quic/api.py" in labels and "tests/test_public_api.py" in labels
    bad = [hit for label, source in sources for hit in _generic_imports(label, source)]
    assert not bad, "import kvcs.transports / kvcs.adapters instead:\n" + "\n".join(bad)


def test_the_generic_import_check_sees_every_form() -> None:
    probe = (
        "import transports.quic\n"
        "from adapters.cachefile import load\n"
        "def f():\n"
        "    import adapters\n"
        "    importlib.import_module('transports.cli')\n"
        "from . import transports\n"
        "from kvcs.adapters import numpy_kv\n"
        "import kvcs.transports\n"
    )
    hits = list(_generic_imports("probe.py", probe))
    assert [h.split(":")[1] for h in hits] == ["1", "2", "4", "5"], hits
