#!/usr/bin/env bash
# Set up a fresh machine for swarmd.
#   bash tools/setup.sh          what `swarmd demo` (and every command) needs: a virtualenv in
#                                .venv with swarmd and its dependencies
#   bash tools/setup.sh --test   that, and what the tests need: the test tools, TensorBoard,
#                                chromium for the browser test on CI, and the WAN lab's system
#                                packages when run as root or on CI
# Idempotent: a second run installs nothing new. It says what it is doing as it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") tests=0 ;;
  --test) tests=1 ;;
  *) echo "usage: bash tools/setup.sh [--test]" >&2; exit 2 ;;
esac
started=$SECONDS
say() { echo "setup: $*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  say "installing system packages: $* (apt-get)"
  as_root apt-get update -qq && as_root apt-get install -y -qq "$@" >/dev/null
}
# What pip is doing, one short line each: the packages it takes, then the install.
pip_lines() {
  local line name words
  while IFS= read -r line; do
    case "$line" in
      "Collecting "*) name=${line#Collecting }; echo "  collecting ${name%% *}" ;;
      "Processing "*.whl*) name=${line#Processing }; name=${name%% *}; name=${name##*/}
                           echo "  collecting ${name%%-*} (a local file)" ;;
      "Installing collected packages: "*) read -ra words <<<"${line#*: }"
        echo "  installing ${#words[@]} packages" ;;
      "Successfully installed "*) read -ra words <<<"${line#Successfully installed }"
        echo "  installed ${#words[@]} packages" ;;
    esac
  done
}
# pip install into .venv, one line per package (pip_lines); pip's whole output is kept in a
# file and shown when it fails. --no-compile: Python compiles a module when it is first
# imported; compiling every file of torch and transformers up front took a minute of the set-up
pip_install() {
  local log
  log=$(mktemp "${TMPDIR:-/tmp}/swarmd-setup-pip.XXXXXX")
  # constraints.txt pins the CPU build of torch that lies on this machine's disk; on a GPU
  # machine, install torch for your CUDA first and drop the -c flag. python -u: pip's lines
  # come through as it writes them, not in blocks.
  if ! .venv/bin/python -u -m pip install --disable-pip-version-check --no-compile \
      -c constraints.txt "$@" 2>&1 | tee "$log" | pip_lines; then
    echo "setup: pip failed; its output:" >&2
    tail -n 40 "$log" >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
}

if ! [ -f /usr/include/gmp.h ] && ! [ -f /usr/include/x86_64-linux-gnu/gmp.h ] \
   && ! [ -f /usr/include/aarch64-linux-gnu/gmp.h ]; then
  apt_install libgmp-dev  # libp2p pins fastecdsa, which compiles against GMP
fi
if ! [ -x .venv/bin/python ]; then
  say "creating the virtualenv .venv"
  python3 -m venv .venv
fi
# swarmd and three of its dependencies build with setuptools: the virtualenv's own (new
# enough) builds them all, instead of a throw-away build environment for each
if ! .venv/bin/python -c 'import setuptools, sys
sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' 2>/dev/null; then
  say "updating setuptools in .venv (pip)"
  pip_install 'setuptools>=68'
fi
if [ "$tests" = 1 ]; then
  say "installing swarmd, its dependencies and the test tools into .venv (pip)"
  pip_install --no-build-isolation -e '.[test,tensorboard]'
else
  say "installing swarmd and its dependencies into .venv (pip; torch is the largest, then" \
      "transformers)"
  pip_install --no-build-isolation -e .
fi

if [ "$tests" = 1 ]; then
  # The status page's browser test (tests/test_page_browser.py) needs chromium: installed on
  # CI, or when asked for with SWARMD_BROWSER_TESTS=1 (elsewhere that test is skipped).
  if { [ -n "${CI:-}" ] || [ "${SWARMD_BROWSER_TESTS:-}" = 1 ]; } && ! [ -x /usr/bin/chromium ]
  then
    apt_install chromium
  fi
  # The WAN lab (tools/wanlab, tests/test_wanlab.py, tools/bench_wan.py) needs root: iproute2,
  # iptables-legacy and NFQUEUE (libnetfilter-queue-dev, the netfilterqueue package).
  # Installed when run as root or on CI (elsewhere the lab's tests are skipped, saying why).
  if [ "$(id -u)" = 0 ] || [ -n "${CI:-}" ]; then
    if ! command -v iptables-legacy >/dev/null || ! command -v tc >/dev/null \
       || ! [ -f /usr/include/libnetfilter_queue/libnetfilter_queue.h ]; then
      apt_install iptables iproute2 libnetfilter-queue-dev
    fi
    if ! .venv/bin/python -c 'import netfilterqueue' 2>/dev/null; then
      say "installing the WAN lab's netfilterqueue into .venv (pip)"
      pip_install -e '.[lab]'
    fi
  fi
fi
say "done in $((SECONDS - started)) s"
