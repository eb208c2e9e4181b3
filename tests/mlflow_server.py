"""A real MLflow tracking server for tests and the sink bench: `mlflow server` on 127.0.0.1.

SQLite backend store and a local artifact root under the given directory, one worker; started in
its own process group, ready once `/health` answers 200, killed by its group id. Start it once per
module (`served`, in a module-scoped fixture): it takes seconds to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pinned_eval.polling import poll_until
from tests.conftest import free_port


class MlflowServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "mlflow-server.log"
        cli = Path(sys.executable).parent / "mlflow"
        args = [str(cli), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                "--default-artifact-root", str(root / "artifacts")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                         start_new_session=True)
        try:
            poll_until(self._healthy, timeout_s=120, interval_s=0.2, what=f"{self.url}/health")
        except BaseException:
            self.kill()
            raise

    def _healthy(self) -> bool | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200 or None
        except httpx.TransportError:
            return None

    def kill(self) -> None:
        """SIGKILL its process group (the server and its workers) and reap it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """For a module-scoped fixture: `yield from served(tmp_path_factory)`."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        server.kill()
