#!/usr/bin/env bash
# Entrypoint of the fsdp-interactive images: JupyterLab on the tutorial notebooks.
#
# With no arguments, or arguments that start with '-', it starts
#   fsdp-interactive lab --ip "$JUPYTER_IP" --port "$JUPYTER_PORT" --no-browser
#                        --notebook-dir "$FSDP_INTERACTIVE_NOTEBOOK_DIR" [-- ARGS...]
# (ARGS go to JupyterLab unchanged, e.g. --ServerApp.base_url=/lab/). Any other first
# argument is a command to run instead (`docker run IMAGE bash`, `... fsdp-interactive demo`).
#
# Environment:
#   JUPYTER_PORT   port JupyterLab listens on inside the container (default 8888)
#   JUPYTER_IP     address it listens on (default 0.0.0.0: reachable through published ports)
#   JUPYTER_TOKEN  access token; when unset or empty a random one is generated and printed
#   FSDP_INTERACTIVE_NOTEBOOK_DIR  folder JupyterLab opens (default $HOME/notebooks)
#
# Bad settings exit with status 2 and a message naming the variable. Nothing is started
# in the background: the server replaces this script (exec), under the image's init.
set -euo pipefail

die() {
    echo "fsdp-interactive entrypoint: $*" >&2
    exit 2
}

if [[ $# -gt 0 && $1 != -* ]]; then
    exec "$@"
fi

port="${JUPYTER_PORT:-8888}"
ip="${JUPYTER_IP:-0.0.0.0}"
notebook_dir="${FSDP_INTERACTIVE_NOTEBOOK_DIR:-${HOME}/notebooks}"

if [[ ! $port =~ ^[0-9]{1,5}$ ]] || ((10#$port < 1 || 10#$port > 65535)); then
    die "JUPYTER_PORT: expected a TCP port number in 1..65535, got '${port}'"
fi
port=$((10#$port))
if [[ ! -d $notebook_dir ]]; then
    die "FSDP_INTERACTIVE_NOTEBOOK_DIR: expected an existing directory, got '${notebook_dir}'"
fi

if [[ -z ${JUPYTER_TOKEN:-} ]]; then
    JUPYTER_TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(24))')"
    echo "JupyterLab token (generated): ${JUPYTER_TOKEN}"
    echo "Open http://127.0.0.1:${port}/lab?token=${JUPYTER_TOKEN}" \
        "(use the host port you published if it differs from ${port})"
else
    echo "JupyterLab token: taken from JUPYTER_TOKEN"
fi
# The server reads its token from the environment, which keeps it off the command line.
export JUPYTER_TOKEN

lab=(fsdp-interactive lab --ip "$ip" --port "$port" --no-browser --notebook-dir "$notebook_dir")
if [[ $# -gt 0 ]]; then
    lab+=(-- "$@")
fi
exec "${lab[@]}"
