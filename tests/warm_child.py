"""A stand-in flow-run module for the warm-start protocol tests (`--module tests.warm_child`).

argv: `report` prints cwd, argv and `WARM_PROBE` from its environment, and `input()` echoed; `exit N`
exits N; `sleep` prints `ready` and sleeps until signalled (default SIGTERM disposition).
"""

import os
import sys
import time

if __name__ == "__main__":
    command = sys.argv[1:]
    if command[0] == "report":
        print(f"cwd={os.getcwd()} argv={command} probe={os.environ.get('WARM_PROBE')} stdin={input()}", flush=True)
        print("to-stderr", file=sys.stderr, flush=True)
    elif command[0] == "exit":
        sys.exit(int(command[1]))
    elif command[0] == "sleep":
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(1)
