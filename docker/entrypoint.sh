#!/bin/sh
# The image's entrypoint: treeserve with the container's arguments. When $MODEL_DIR is set
# (the compose files pass on the host path of a checkpoint they mount at /models), it adds
# --model /models; without it the binary serves its default, the tiny model. A --model among
# the arguments wins either way. $TREESERVE_BIN replaces the binary (tests/deploy).
set -e
bin=${TREESERVE_BIN:-/opt/treeserve/bin/treeserve}
if [ -n "${MODEL_DIR:-}" ]; then
  case " $* " in
    *" --model "* | *" --model="*) ;;
    *) set -- "$@" --model /models ;;
  esac
fi
exec "$bin" "$@"
