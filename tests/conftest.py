"""Shared pytest setup: one Hypothesis profile for the whole suite.

``kvcs`` (the default): no per-example deadline (CI machines are slow and
shared) and a reproduction blob printed with every failure. When the ``CI``
environment variable is set, examples are also derandomized, so a CI run is
the same run every time; locally Hypothesis keeps exploring new examples.
Choose another profile with ``HYPOTHESIS_PROFILE=<name>``.
"""

from __future__ import annotations

import importlib.util
import os

from hypothesis import settings

settings.register_profile(
    "kvcs",
    deadline=None,
    print_blob=True,
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvcs"))

# tests/vllm needs vLLM (its own venv, .venvs/vllm; see scripts/test.sh): elsewhere those
# files are not collected at all (never counted as passing, never skipped one by one)
# (tests/ is on sys.path, so tests/vllm itself looks like a namespace package "vllm":
# only a real one, with a file of its own, counts)
_VLLM = importlib.util.find_spec("vllm")
collect_ignore = [] if _VLLM is not None and _VLLM.origin is not None else ["vllm"]
