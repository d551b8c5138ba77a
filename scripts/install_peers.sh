#!/usr/bin/env bash
# Install the independent MOQT peers used by the interop tests into .peers/
# (a Python >= 3.12 virtual environment in the repository root):
#   aiomoqt==0.13.3  moq-rs==0.5.1  caprid-moq-core==0.1.0
# See tests/peers/README.md and ../shared/peers/INTEROP.md.
#
#   bash scripts/install_peers.sh            # create or complete .peers
#   PEERS_PYTHON=/path/to/python3.13 bash scripts/install_peers.sh
#   PEERS_INSTALL_TIMEOUT=600 (seconds pip may take, default 600)
#
# Idempotent: when .peers already holds the pinned versions it does nothing.
# It never fails the caller: when no suitable Python or no package can be
# found it prints why and exits 0; the interop tests then skip with a reason.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=.peers
PKGS=(aiomoqt==0.13.3 moq-rs==0.5.1 caprid-moq-core==0.1.0)
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_ROOT_USER_ACTION=ignore

say() { printf 'install_peers: %s\n' "$*"; }
give_up() {
    say "SKIPPED: $*"
    say "interop tests that need the peers will skip"
    exit 0
}

# True when the interpreter $1 runs and is Python >= 3.12.
py_ok() {
    [ -x "$1" ] && "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' \
        >/dev/null 2>&1
}

# True when the venv already holds exactly the pinned versions.
venv_complete() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "${PKGS[@]}" >/dev/null 2>&1 <<'EOF'
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    if version(name) != want:
        sys.exit(1)
import aiomoqt, moq, moq_core  # noqa: F401,E401  (the imports must work too)
EOF
}

if venv_complete; then
    say "$VENV already has ${PKGS[*]}: nothing to do"
    exit 0
fi

# Find a Python >= 3.12: $PEERS_PYTHON, pyenv 3.13.0, any pyenv 3.13.x/3.12.x, PATH.
PY=""
candidates=()
[ -n "${PEERS_PYTHON:-}" ] && candidates+=("$PEERS_PYTHON")
if command -v pyenv >/dev/null 2>&1; then
    ROOT="$(pyenv root 2>/dev/null || true)"
    if [ -n "$ROOT" ]; then
        candidates+=("$ROOT/versions/3.13.0/bin/python3.13")
        while read -r v; do
            v="${v#\* }"; v="${v%% *}"
            case "$v" in
                3.13*|3.12*|3.14*)
                    candidates+=("$ROOT/versions/$v/bin/python${v%.*}" "$ROOT/versions/$v/bin/python3")
                    ;;
            esac
        done < <(pyenv versions --bare 2>/dev/null | sort -rV)
    fi
fi
for name in python3.13 python3.12 python3.14 python3; do
    p="$(command -v "$name" 2>/dev/null || true)"
    [ -n "$p" ] && candidates+=("$p")
done
for c in "${candidates[@]}"; do
    if py_ok "$c"; then PY="$c"; break; fi
done
[ -n "$PY" ] || give_up "no Python >= 3.12 found (tried: ${candidates[*]:-none})"
say "using $PY ($("$PY" -V 2>&1))"

# A venv that exists but runs an unusable interpreter is rebuilt.
if [ -d "$VENV" ] && ! py_ok "$VENV/bin/python"; then
    say "$VENV is broken or too old: recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" || give_up "could not create the venv $VENV"
fi

# Bounded: an offline machine must not stall CI in pip's retries.
PIP_TIMEOUT=(timeout "${PEERS_INSTALL_TIMEOUT:-600}")
command -v timeout >/dev/null 2>&1 || PIP_TIMEOUT=()
if ! "${PIP_TIMEOUT[@]}" "$VENV/bin/python" -m pip install -q --retries 2 "${PKGS[@]}"; then
    give_up "pip could not install ${PKGS[*]} into $VENV"
fi
if ! venv_complete; then
    give_up "$VENV was installed but the packages do not import"
fi
say "OK: $VENV has ${PKGS[*]}"
exit 0
