"""`python -m pinned_eval.fleet.router_main <sglang-router flags>`: sglang-router with its API key
taken from the environment (`ROUTER_API_KEY_ENV`), never from the command line.

sglang-router 0.3.2 reads its key only from `--api-key` (no env var, no config file), which any
local user sees in `ps`; this wrapper parses the flags with the router's own parser, sets
`api_key` on the parsed `RouterArgs` and starts the router in this process. A key flag on the
command line is refused (exit 2).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from pinned_eval.fleet.keys import ROUTER_API_KEY_ENV, refuse_key_flags


def main(argv: list[str]) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args  # heavy: only in the router

    try:
        refuse_key_flags(argv, "router argv")
    except ValueError as exc:
        print(f"router_main: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    args = parse_router_args(argv)
    key = os.environ.pop(ROUTER_API_KEY_ENV, None)
    if key:
        args = dataclasses.replace(args, api_key=key)
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
