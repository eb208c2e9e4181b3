"""Warm start of flow-run processes: a fork server beside the process worker and its thin client.

Opt-in per work pool: `pool_command()` is the `command` job variable that routes a pool's flow
runs through the thin client; the worker's environment names the server's socket
(`client.SOCKET_ENV`). Without a server the client cold-starts, so nothing breaks.
"""

from __future__ import annotations

import sys
from pathlib import Path

CLIENT = Path(__file__).with_name("client.py")


def pool_command(python: str = sys.executable) -> str:
    """The process worker's `command` for a warm-started flow run (absolute, so any cwd works)."""
    return f"{python} -S {CLIENT}"
