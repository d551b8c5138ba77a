"""tests/vllm: the vLLM connector (run in the vLLM venv only; see tests/conftest.py).

The parent ``tests`` folder holds ``hf_models`` (the tiny random Llama builder)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
