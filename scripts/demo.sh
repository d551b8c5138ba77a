#!/usr/bin/env bash
# Install the package and run the README's first quick-start command: `kvcs demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1
python3 -m pip install -q -e .
if command -v kvcs >/dev/null 2>&1; then
    exec kvcs demo "$@"
fi
# pip put the console script in a directory that is not on PATH (e.g. ~/.local/bin)
echo "note: 'kvcs' is not on PATH; running python3 -m kvcs demo" >&2
exec python3 -m kvcs demo "$@"
