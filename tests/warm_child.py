"""A stand-in flow-run module for the warm-start protocol tests (`--module tests.warm_child`).

argv: `report` prints cwd, argv and `PINNED_EVAL_PROBE` from its environment, and `input()` echoed; `exit N`
exits N; `sleep` prints `ready` and sleeps until signalled (default SIGTERM disposition); `env K...`
prints a JSON object of those keys' values in its environment (null where unset); `modules M...`
prints a JSON list of those of M already imported (what the fork server preloaded).
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    command = sys.argv[1:]
    if command[0] == "report":
        probe = os.environ.get("PINNED_EVAL_PROBE")
        print(f"cwd={os.getcwd()} argv={command} probe={probe} stdin={input()}", flush=True)
        print("to-stderr", file=sys.stderr, flush=True)
    elif command[0] == "env":
        print(json.dumps({key: os.environ.get(key) for key in command[1:]}), flush=True)
    elif command[0] == "modules":
        print(json.dumps([m for m in command[1:] if m in sys.modules]), flush=True)
    elif command[0] == "exit":
        sys.exit(int(command[1]))
    elif command[0] == "sleep":
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(1)
