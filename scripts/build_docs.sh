#!/usr/bin/env bash
# The API reference: HTML built from the docstrings by pdoc, into docs/api/ (git-ignored).
#
#   pip install -e '.[docs]'       # pdoc
#   bash scripts/build_docs.sh     # then open docs/api/index.html
#
# PYTHON chooses the interpreter (default: python3 on PATH, e.g. the active virtual
# environment); KVCS_DOCS_OUT another output folder. It documents kvcs (the public
# API), kvcs.trio, kvcs.transports, kvcs.adapters and kvcs_core, with their submodules.
#
# Warnings are errors, so the reference cannot silently rot:
#   - pdoc runs under `python -W error`: a type annotation it cannot resolve (or any
#     other warning while importing or rendering) fails the build;
#   - scripts/check_doc_refs.py first fails on a docstring reference (:class:`...`,
#     :func:`...`, :mod:`...`, ...) that names nothing: pdoc renders those as plain text
#     without a warning.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${KVCS_DOCS_OUT:-docs/api}"
MODULES=(kvcs kvcs.trio kvcs.transports kvcs.adapters kvcs_core)

"$PY" -c 'import pdoc' 2>/dev/null || {
    echo "build_docs.sh: pdoc is not installed: pip install -e '.[docs]'" >&2
    exit 2
}
# modules of an optional extra are documented where the extra is installed, and left
# out (with a note) where it is not: "module:the import it needs"
OPTIONAL=(kvcs.adapters.torch_kv:torch kvcs.adapters.transformers_kv:transformers kvcs.vllm:vllm)
EXCLUDE=()
IGNORE=()  # pdoc warns when a submodule does not import: expected for these alone
for entry in "${OPTIONAL[@]}"; do
    module="${entry%%:*}" needs="${entry##*:}"
    if ! "$PY" -c "import $needs" 2>/dev/null; then
        echo "build_docs.sh: $needs is not installed: $module is left out of the reference" >&2
        EXCLUDE+=("!$module")
        IGNORE+=(-W "ignore:Couldn't import $module:")
    fi
done
"$PY" -W error scripts/check_doc_refs.py "${MODULES[@]}"
rm -rf "$OUT"
"$PY" -W error "${IGNORE[@]}" -m pdoc --docformat google --output-directory "$OUT" "${MODULES[@]}" "${EXCLUDE[@]}"
echo "API reference: $OUT/index.html ($(find "$OUT" -name '*.html' | wc -l) pages)"
