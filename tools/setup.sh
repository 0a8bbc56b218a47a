#!/usr/bin/env bash
# Set up a fresh machine for swarmd: system packages, a virtualenv in .venv, the package and
# its test tools. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! [ -f /usr/include/gmp.h ] && ! [ -f /usr/include/x86_64-linux-gnu/gmp.h ] \
   && ! [ -f /usr/include/aarch64-linux-gnu/gmp.h ]; then
  # libp2p pins fastecdsa, which compiles against GMP
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libgmp-dev >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq libgmp-dev >/dev/null; fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# constraints.txt pins the CPU build of torch that lies on this machine's disk; on a GPU
# machine, install torch for your CUDA first and drop the -c flag.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
# The status page's browser test (tests/test_page_browser.py) needs chromium: installed on CI,
# or when asked for with SWARMD_BROWSER_TESTS=1 (elsewhere that test is skipped).
if { [ -n "${CI:-}" ] || [ "${SWARMD_BROWSER_TESTS:-}" = 1 ]; } && ! [ -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi
fi
# The WAN lab (tools/wanlab, tests/test_wanlab.py, tools/bench_wan.py) needs root: iproute2,
# iptables-legacy and NFQUEUE (libnetfilter-queue-dev, the netfilterqueue package). Installed
# when run as root or on CI (elsewhere the lab's tests are skipped, saying why).
if [ "$(id -u)" = 0 ] || [ -n "${CI:-}" ]; then
  if ! command -v iptables-legacy >/dev/null || ! command -v tc >/dev/null \
     || ! [ -f /usr/include/libnetfilter_queue/libnetfilter_queue.h ]; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && apt-get install -y -qq iptables iproute2 libnetfilter-queue-dev >/dev/null
    else
      sudo apt-get update -qq && sudo apt-get install -y -qq iptables iproute2 \
        libnetfilter-queue-dev >/dev/null
    fi
  fi
  .venv/bin/python -c 'import netfilterqueue' 2>/dev/null \
    || .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[lab]'
fi
