#!/usr/bin/env bash
# kvcs installed beside AdapterHub's `adapters` (PyPI `adapters`, imported as
# `adapters`) in one environment: issue #12 ("import kvcs").
#
#   bash scripts/check_beside_adapterhub.sh
#
# KVCS_CHECK_PYTHON: the interpreter (default python3). KVCS_TORCH_REQ: the torch
# requirement pip installs (default "torch"; e.g. "torch==2.13.0+cpu" where a CPU
# build is at hand: the default PyPI build brings the CUDA libraries, gigabytes).
#
# Why: kvcs's own folders `adapters/` and `transports/` are generic names that exist
# on PyPI. Installed, kvcs must provide them only as `kvcs.adapters` and
# `kvcs.transports` (README "Layout"), so that a user's `import adapters` stays
# AdapterHub's. What it does, in a temporary directory that is removed at the end:
#   1. a fresh virtual environment; a kvcs wheel built from this checkout
#      (non-editable); the wheel must hold kvcs/py.typed and kvcs_core/py.typed and no
#      top-level `adapters`/`transports` package;
#   2. pip installs the wheel and AdapterHub's `adapters` (which brings transformers)
#      together, with torch (`import adapters` imports torch: adapters/utils.py does,
#      as of adapters 1.3.0) and mypy;
#   3. from that directory, with `python -I` (neither the repository nor the current
#      directory is on sys.path): `import adapters` is AdapterHub's (adapter
#      configurations are built and turned into dicts, and a LoRA adapter added to a
#      tiny BERT built from a config, no download, changes its output), `import
#      transports` fails, and
#      `import kvcs` runs the README's asyncio example, a real retrieval over QUIC on
#      127.0.0.1;
#   4. mypy --strict on tests/typecheck/user_program.py against the installed wheel
#      (kvcs is found in site-packages, so this needs its py.typed).
# Needs network access to PyPI (pip). Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${KVCS_CHECK_PYTHON:-python3}"
START=$SECONDS
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONDONTWRITEBYTECODE=1

step() {
    printf '==== %s  [%ss]\n' "$*" "$((SECONDS - START))"
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvcs-beside-adapterhub.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

step "fresh virtual environment ($("$PY" --version)) in $WORK"
"$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin/python"
"$V" -m pip install -q --upgrade pip

step "kvcs wheel from $REPO (non-editable)"
"$V" -m pip wheel -q --no-deps -w "$WORK/wheel" "$REPO"
WHEEL="$(ls "$WORK"/wheel/kvcs-*.whl)"
"$V" - "$WHEEL" <<'PYEOF'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")})
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files, top-level: {', '.join(tops)}")
assert tops == ["kvcs", "kvcs_core"], tops
for marker in ("kvcs/py.typed", "kvcs_core/py.typed"):
    assert marker in names, f"{marker} is not in the wheel"
    print(f"  {marker}: present")
for module in ("kvcs/transports/quic/api.py", "kvcs/adapters/cachefile.py", "kvcs/trio.py"):
    assert module in names, f"{module} is not in the wheel"
PYEOF

TORCH_REQ="${KVCS_TORCH_REQ:-torch}"
step "pip install the wheel, AdapterHub's adapters, $TORCH_REQ, mypy"
"$V" -m pip install -q "$WHEEL" adapters "$TORCH_REQ" mypy
"$V" -m pip list 2>/dev/null | grep -iE '^(kvcs|adapters|transformers|torch|numpy|mypy) ' \
    | tr -s ' ' | paste -sd ',' - | sed 's/,/, /g'

step "checks outside the repository (python -I, cwd $WORK)"
cat >"$WORK/check.py" <<'PYEOF'
import re
import sys
import sysconfig
from pathlib import Path

readme = Path(sys.argv[1])
repo = readme.parent.resolve()
site = Path(sysconfig.get_paths()["purelib"]).resolve()
for entry in sys.path:
    assert not Path(entry or ".").resolve().is_relative_to(repo), f"{entry} is on sys.path"

import adapters  # AdapterHub's
import torch
from adapters import AdapterConfig, LoRAConfig
from transformers import BertConfig, BertModel

assert Path(adapters.__file__).resolve().is_relative_to(site), adapters.__file__
lora = LoRAConfig(r=4, alpha=8).to_dict()
assert lora["architecture"] == "lora" and lora["r"] == 4 and lora["alpha"] == 8, lora
seq_bn = AdapterConfig.load("seq_bn").to_dict()
assert seq_bn["reduction_factor"] == 16, seq_bn
print(f"import adapters: AdapterHub {adapters.__version__} from {adapters.__file__}")
print(f"  LoRAConfig(r=4, alpha=8).to_dict(): architecture={lora['architecture']} r={lora['r']}")
print(f"  AdapterConfig.load('seq_bn').to_dict(): reduction_factor={seq_bn['reduction_factor']}")
torch.manual_seed(0)
tiny = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, vocab_size=100))
adapters.init(tiny)
tiny.add_adapter("kvcs_check", config=LoRAConfig(r=4, alpha=8))
tiny.train_adapter("kvcs_check")  # activates it; only its parameters train
trainable = sum(p.numel() for p in tiny.parameters() if p.requires_grad)
active = str(tiny.active_adapters)
ids = torch.tensor([[1, 2, 3, 4]])
tiny.eval()
with torch.no_grad():
    for name, param in tiny.named_parameters():
        if "lora_B" in name:  # zero at first: give the adapter an effect to see
            param.fill_(0.01)
    with_lora = tiny(input_ids=ids).last_hidden_state
    tiny.set_active_adapters(None)
    without = tiny(input_ids=ids).last_hidden_state
assert with_lora.shape == (1, 4, 32) and trainable > 0, (with_lora.shape, trainable)
assert not torch.allclose(with_lora, without), "the LoRA adapter changed nothing"
print(f"  tiny BERT + LoRA adapter (torch {torch.__version__}): active {active}, "
      f"{trainable} trainable parameters, output {tuple(with_lora.shape)} differs "
      "from the base model's")

import kvcs
import kvcs.adapters
import kvcs.trio

assert Path(kvcs.__file__).resolve().is_relative_to(site), kvcs.__file__
assert kvcs.adapters is not adapters and kvcs.adapters.__name__ == "kvcs.adapters"
print(f"import kvcs: from {kvcs.__file__} ({len(kvcs.__all__)} public names)")

try:
    import transports  # noqa: F401
except ModuleNotFoundError as exc:
    print(f"import transports: {type(exc).__name__}: {exc}")
else:
    raise SystemExit("kvcs must not install a top-level `transports`")

blocks = re.findall(r"```python\n(.*?)```", readme.read_text(encoding="utf-8"), re.S)
example = next(b for b in blocks if "asyncio.run(" in b and "kvcs.connect(" in b)
print("README asyncio example (relay, producer, consumer over QUIC on 127.0.0.1):")
exec(compile(example, f"{readme} (asyncio example)", "exec"), {"__name__": "readme_example"})
assert Path(adapters.__file__).resolve().is_relative_to(site)  # still AdapterHub's
print("beside AdapterHub: OK")
PYEOF
(cd "$WORK" && "$V" -I check.py "$REPO/README.md")

step "mypy --strict on tests/typecheck/user_program.py against the installed wheel"
cp "$REPO/tests/typecheck/user_program.py" "$WORK/user_program.py"
printf '[mypy]\n' >"$WORK/mypy.ini"  # no user or repository configuration
strict() {
    (cd "$WORK" && "$V" -I -m mypy --strict --config-file mypy.ini --no-incremental user_program.py)
}
strict
step "the same without kvcs/py.typed in site-packages must fail (the check depends on it)"
TYPED="$("$V" -I -c 'import kvcs, pathlib; print(pathlib.Path(kvcs.__file__).with_name("py.typed"))')"
rm "$TYPED"
if out="$(strict 2>&1)"; then
    echo "!! mypy passed without py.typed: the check above proves nothing" >&2
    exit 1
fi
grep -m1 'import-untyped' <<<"$out"

step "done"
