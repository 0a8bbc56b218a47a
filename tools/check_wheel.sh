#!/usr/bin/env bash
# Install swarmd the way a user does: build the wheel, install it (not editable) into a fresh
# virtualenv, and run it from a directory outside the checkout. Exits non-zero on any failure.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# the checkout's venv already holds the pinned torch and libp2p wheels in pip's cache
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check -c "$repo/constraints.txt" \
  setuptools wheel
"$work/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$work/dist" "$repo"
wheel=$(ls "$work"/dist/swarmd-*.whl)
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check -c "$repo/constraints.txt" "$wheel"
cd "$work"  # nothing of the checkout is importable from here
"$work/venv/bin/swarmd" --version
"$work/venv/bin/swarmd" init --home "$work/home" >/dev/null
test -f "$work/home/config.toml" && test -f "$work/home/identity.key"
"$work/venv/bin/python" - "$repo" <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("swarmd")
where = pathlib.Path(spec.origin).resolve()
assert pathlib.Path(sys.argv[1]).resolve() not in where.parents, f"imported from the checkout: {where}"
print("swarmd imported from", where.parent)
PY
"$work/venv/bin/swarmd" demo --steps 5 --json | tail -n 1
echo "wheel check: ok ($(basename "$wheel"))"
