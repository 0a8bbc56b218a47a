#!/bin/sh
# The container's entry point: create the home on first start (identity and config; kept on
# later starts), then run swarmd with the given arguments (default: join).
set -eu
home=${SWARMD_HOME:-/home/swarmd/.swarmd}
swarmd init --home "$home" >/dev/null
if [ "$#" -eq 0 ]; then set -- join; fi
case "$1" in
  join|status|peers|swarm|stop|id|doctor) cmd=$1; shift; exec swarmd "$cmd" --home "$home" "$@" ;;
  *) exec swarmd "$@" ;;
esac
