#!/usr/bin/env bash
# Install swarmd the way a user does: build the wheel, install it (not editable) into a fresh
# virtualenv, and run it from a directory outside the checkout. Exits non-zero on any failure.
#   bash tools/check_wheel.sh              both phases, in a temporary directory
#   bash tools/check_wheel.sh install DIR  build and install into DIR (CI runs this beside the
#                                          tests, at the lowest CPU and I/O priority)
#   bash tools/check_wheel.sh run DIR      run what `install DIR` installed
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

install() {
  local work=$1
  python3 -m venv "$work/venv"
  # the checkout's venv already holds the pinned torch and libp2p wheels in pip's cache;
  # --no-compile: byte-compiling torch and transformers up front is most of an install's time
  "$work/venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile \
    -c "$repo/constraints.txt" setuptools wheel
  "$work/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps \
    --no-build-isolation -w "$work/dist" "$repo"
  "$work/venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile \
    -c "$repo/constraints.txt" "$work"/dist/swarmd-*.whl
  echo "wheel check: installed $(basename "$work"/dist/swarmd-*.whl)"
}

run() {
  local work=$1
  [ -x "$work/venv/bin/swarmd" ] || { echo "wheel check: nothing installed in $work" >&2; exit 1; }
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
  echo "wheel check: ok ($(basename "$work"/dist/swarmd-*.whl))"
}

case "${1:-}" in
  "") work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; install "$work"; run "$work" ;;
  install|run) [ -n "${2:-}" ] || { echo "usage: bash tools/check_wheel.sh [install|run DIR]" >&2; exit 2; }
               mkdir -p "$2"; "$1" "$(cd "$2" && pwd)" ;;
  *) echo "usage: bash tools/check_wheel.sh [install|run DIR]" >&2; exit 2 ;;
esac
