#!/usr/bin/env python3
"""Container health check: is JupyterLab's server answering on its port?

Requests ``GET /api`` (the server's version endpoint, which needs no token) on
``JUPYTER_PORT`` (default 8888) at ``JUPYTER_IP`` when that names one address, else at
127.0.0.1, and checks that the answer is JSON with a ``version``. Exit status 0: healthy,
1: not. It does not check the token, the kernels or the GPUs. Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

WILDCARD_ADDRESSES = {"", "0.0.0.0", "::", "*"}


def server_url() -> str:
    """The URL of the server's version endpoint, from the container's environment."""
    port = os.environ.get("JUPYTER_PORT", "8888")
    host = os.environ.get("JUPYTER_IP", "")
    if host in WILDCARD_ADDRESSES:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/api"


def main() -> int:
    url = server_url()
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.load(response)
    except (OSError, ValueError) as error:
        print(f"unhealthy: {url}: {error}", file=sys.stderr)
        return 1
    if not isinstance(answer, dict) or "version" not in answer:
        print(f"unhealthy: {url} answered {answer!r}, not a Jupyter server", file=sys.stderr)
        return 1
    print(f"healthy: Jupyter server {answer['version']} at {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
