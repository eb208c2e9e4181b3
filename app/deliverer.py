"""`python -m app.deliverer OUTBOX`: the worker's tracker deliverer, a process beside the worker.

It serves the outbox its flow runs post W&B and MLflow exports into
(`pinned_eval.sinks.outbox`, `pinned_eval.sinks.delivery`), holding each exporter's declared lock
through Prefect (`tasks.admission.exclusive`, as a point would), so a deliverer and a point run
outside the worker never write one W&B eval run at once. The stack starts it with the worker's
environment and stops it by PID after the worker (`app.stack.LocalStack.deliverer_up`). SIGTERM
or SIGINT: it sends what is waiting for up to `--drain-s` seconds more, then exits 0; what is left
waits in the outbox for the next deliverer. Exit 2: the outbox directory is refused (one line).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time

import pinned_eval.sinks  # noqa: F401 - registers the deferrable exporters (W&B, MLflow)
from pinned_eval.sinks.delivery import Deliverer
from pinned_eval.sinks.outbox import Outbox
from pinned_eval.trusted_paths import UntrustedPathError

DRAIN_S = 20.0  # after SIGTERM: how long it keeps sending what waits
READY_TIMEOUT_S = 60.0


def command(outbox: str) -> list[str]:
    return [sys.executable, "-m", "app.deliverer", outbox]


def wait_serving(outbox: Outbox, proc: subprocess.Popen[bytes], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until the deliverer `proc` holds `outbox` (`RuntimeError` when it exits or times out first)."""
    deadline = time.monotonic() + timeout_s
    while not outbox.served():
        if proc.poll() is not None:
            raise RuntimeError(f"the deliverer exited with {proc.returncode} before serving {outbox.root}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the deliverer did not serve {outbox.root} within {timeout_s:.0f} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.deliverer")
    parser.add_argument("outbox")
    parser.add_argument("--drain-s", type=float, default=DRAIN_S)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        outbox = Outbox(args.outbox)
    except (UntrustedPathError, OSError) as exc:
        print(f"deliverer: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    from tasks.admission import exclusive  # prefect: imported once the outbox is accepted

    Deliverer(outbox, hold=exclusive, drain_s=args.drain_s).run(stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
