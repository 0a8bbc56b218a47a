#!/bin/sh
# Install the torch build for a CUDA version inside the Docker image (Dockerfile's CUDA build
# argument): "cpu", or a CUDA version torch publishes wheels for. An unknown one stops the
# build with the list of known ones. --dry-run prints the pip command instead of running it.
set -eu
cuda=${1:-cpu}
dry=${2:-}
case "$cuda" in
  cpu)  tag=cpu ;;
  11.8) tag=cu118 ;;
  12.1) tag=cu121 ;;
  12.4) tag=cu124 ;;
  12.6) tag=cu126 ;;
  12.8) tag=cu128 ;;
  *)
    echo "error: build argument CUDA=$cuda is not a CUDA version torch publishes wheels for;" \
         "use one of: cpu 11.8 12.1 12.4 12.6 12.8 (docker build --build-arg CUDA=12.4 .)" >&2
    exit 2 ;;
esac
cmd="pip install --no-cache-dir torch>=2.2,<3 --index-url https://download.pytorch.org/whl/$tag"
if [ "$dry" = "--dry-run" ]; then echo "$cmd"; exit 0; fi
# shellcheck disable=SC2086
exec $cmd
