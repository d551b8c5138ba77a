"""Locate and load the shared byte vectors (``shared/`` sits beside the clone).

``SHARED`` is ``<clone>/../shared``: ``/work/shared`` for the clone ``/work/main``,
and the same layout in CI (``.ci/run``: "../shared beside it").
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SHARED = Path(__file__).resolve().parents[2] / "shared"
"""The shared directory beside the repository clone."""


def shared_path(*parts: str) -> Path:
    """A path under ``shared/``."""
    return SHARED.joinpath(*parts)


@cache
def load_vectors(name: str = "moqt22-vectors.json") -> dict[str, Any]:
    """The parsed vector file ``shared/spec/<name>``."""
    with shared_path("spec", name).open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def vectors_of_kind(kind: str, name: str = "moqt22-vectors.json") -> list[dict[str, Any]]:
    """Every vector of ``kind`` ("control", "data-stream", "datagram", ...)."""
    return [v for v in load_vectors(name)["vectors"] if v["kind"] == kind]
