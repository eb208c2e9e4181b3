"""A multi-host pinned-eval cluster on one machine: each host a network namespace (`tests.scaleout.netns`).

Hosts (addresses `<prefix>.N` on a private bridge; the operator, this process, is `<prefix>.1`):
- `db`: PostgreSQL (password login over TCP from the cluster's /24 only);
- `redis`: `redis-server` with a password (config file 0600, never argv), no persistence;
- `s3`: moto's S3 server; one bucket holds the staging root;
- `api1`, `api2`: `prefect server start --no-services` on the same database, Redis messaging,
  causal ordering and lease storage (`prefect_redis`), the same API credential;
- `services`: `prefect server services start` (triggers, event persister, task-run recorder, ...);
- `lb`: a TCP load balancer (`tests.scaleout.lb`) in front of the two replicas: every client's
  `PREFECT_API_URL`;
- `worker-a`, `worker-b`: each a 1-engine CPU fleet on the host's own loopback (reachable from
  that host only), the warm-start fork server, and a process worker polling the host's own work
  queue (and `default`, for the janitor); a node-local snapshot cache under the host's directory;
- `trainer`: trainer processes (`tests.scaleout.trainer`) dispatching points through `lb`.

The credential is generated into the operator's `<home>/api-auth` (`app.prefect_server.
ensure_auth_file`), handed to servers as `PREFECT_SERVER_API_AUTH_STRING`, to workers as
`PREFECT_API_AUTH_STRING`, to trainers as a 0600 copy named by `PINNED_EVAL_API_AUTH_FILE`.
Routing (docs/scale-out.md, node-local cache): one `eval-point-<node>` deployment per worker
host on work queue `<node>`; a run's trainer dispatches to the deployment of the host of its fleet.

`cluster(root, model)` builds it all and tears it down (every process by PID, every namespace),
whatever happens; `NetnsUnavailableError` / `ServiceUnavailableError` say what is missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.prefect_server import ensure_auth_file, private_dir, use_server
from app.warm_start import server_command, write_job_template
from bench.burst import LocalPostgres, running_postgres, tiny_suite
from pinned_eval.polling import poll_until
from pinned_eval.settings import AUTH_FILE_NAME, PrefectApiSettings
from tests.scaleout.netns import Network, Proc

REPO = Path(__file__).resolve().parents[2]
ROLES = ("db", "redis", "s3", "api1", "api2", "services", "lb", "worker-a", "worker-b", "trainer")
NODES = ("worker-a", "worker-b")
API_PORT, LB_PORT, PG_PORT, REDIS_PORT, S3_PORT = 4200, 4200, 5432, 6379, 5000
S3_KEY = S3_SECRET = "testing"


class ServiceUnavailableError(RuntimeError):
    """A service binary the harness needs is not installed (`scripts/ci-services.sh`)."""


def require_services() -> None:
    """Raise `ServiceUnavailableError` naming what is missing: redis-server, prefect_redis, moto."""
    if shutil.which("redis-server") is None:
        raise ServiceUnavailableError("redis-server not found: run scripts/ci-services.sh (Debian `redis-server`)")
    for mod in ("prefect_redis", "moto"):
        try:
            __import__(mod)
        except ImportError as exc:
            raise ServiceUnavailableError(f"python package {mod} missing: {exc}") from exc


@dataclass
class Cluster:
    net: Network
    root: Path
    pg: LocalPostgres
    auth_string: str = field(repr=False)
    redis_password: str = field(repr=False)
    bucket: str
    model: Path
    api: dict[str, Proc] = field(default_factory=dict)  # replica host -> its server process
    workers: dict[str, Proc] = field(default_factory=dict)  # node -> its prefect worker
    warm: dict[str, Proc] = field(default_factory=dict)  # node -> its warm-start fork server
    fleets: dict[str, Path] = field(default_factory=dict)  # node -> fleet state file
    timeline: list[tuple[str, float]] = field(default_factory=list)  # (phase done, seconds since start)
    t0: float = field(default_factory=time.monotonic)

    def mark(self, phase: str) -> None:
        """Record that `phase` is done (`timeline.txt` under the root: where the start-up time goes)."""
        self.timeline.append((phase, round(time.monotonic() - self.t0, 1)))
        (self.root / "timeline.txt").write_text("".join(f"{t:7.1f}s {p}\n" for p, t in self.timeline))

    def addr(self, host: str) -> str:
        return self.net.hosts[host].addr

    @property
    def api_url(self) -> str:
        """The load balancer: what every client uses."""
        return f"http://{self.addr('lb')}:{LB_PORT}/api"

    def replica_url(self, host: str) -> str:
        return f"http://{self.addr(host)}:{API_PORT}/api"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.addr('s3')}:{S3_PORT}"

    def host_dir(self, host: str) -> Path:
        return private_dir(self.root / host)

    def client_env(self, home: Path) -> dict[str, str]:
        """Environment of a Prefect client process (worker, CLI) talking to the cluster."""
        return dict(
            os.environ, PREFECT_API_URL=self.api_url, PREFECT_API_AUTH_STRING=self.auth_string,
            PREFECT_HOME=str(private_dir(home)), PINNED_EVAL_PROJECT_DIR=str(REPO), PYTHONPATH=str(REPO),
            PREFECT_LOGGING_LEVEL="INFO", PREFECT_SERVER_ANALYTICS_ENABLED="false",
        )

    def server_env(self, host: str, *, migrate: bool) -> dict[str, str]:
        return dict(
            self.client_env(self.host_dir(host) / "home"),
            PREFECT_API_URL=self.replica_url(host) if host.startswith("api") else self.api_url,
            PREFECT_API_DATABASE_CONNECTION_URL=self.pg.url,
            PREFECT_API_DATABASE_MIGRATE_ON_START=str(migrate).lower(),
            PREFECT_SERVER_API_AUTH_STRING=self.auth_string,
            PREFECT_MESSAGING_BROKER="prefect_redis.messaging",
            PREFECT_MESSAGING_CACHE="prefect_redis.messaging",
            PREFECT_SERVER_EVENTS_CAUSAL_ORDERING="prefect_redis.ordering",
            PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE="prefect_redis.lease_storage",
            PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS="1",
            PREFECT_REDIS_MESSAGING_HOST=self.addr("redis"),
            PREFECT_REDIS_MESSAGING_PORT=str(REDIS_PORT),
            PREFECT_REDIS_MESSAGING_DB="0",
            PREFECT_REDIS_MESSAGING_PASSWORD=self.redis_password,
            PREFECT_LOGGING_LEVEL="WARNING",
        )

    def auth_headers(self) -> dict[str, str]:
        return PrefectApiSettings.from_environ({"PREFECT_API_AUTH_STRING": self.auth_string}).auth_headers()

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, headers=self.auth_headers(), timeout=30)

    def run_in(self, host: str, argv: list[str], *, env: dict[str, str] | None = None,
               timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Run `argv` to completion on `host` (output captured)."""
        return subprocess.run(self.net.hosts[host].wrap(argv), env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)

    # ---- starting pieces ------------------------------------------------------------------

    def start_replica(self, host: str, *, migrate: bool) -> Proc:
        argv = [sys.executable, "-m", "prefect", "server", "start", "--no-services", "--host", self.addr(host),
                "--port", str(API_PORT)]
        proc = self.net.start(host, "api", argv, env=self.server_env(host, migrate=migrate),
                              log=self.host_dir(host) / "server.log")
        self.api[host] = proc
        return proc

    def wait_healthy(self, url: str, proc: Proc, timeout_s: float = 240) -> None:
        def ok() -> bool:
            if not proc.alive():
                raise RuntimeError(f"{proc.host} {proc.role} exited:\n{proc.tail()}")
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        poll_until(ok, timeout_s=timeout_s, interval_s=0.5, what=f"{proc.host} {proc.role} healthy at {url}")

    def start_fleet(self, node: str) -> Proc:
        """`pinned-eval fleet up` (1 CPU engine + router) on the host; the command exits once ready."""
        hd = self.host_dir(node)
        self.fleets[node] = hd / "fleet.json"
        argv = [sys.executable, "-m", "app.cli", "fleet", "up", "--model-path", str(self.model), "--engines", "1",
                "--state-file", str(self.fleets[node]), "--ready-timeout", "300"]
        return self.net.start(node, "fleet-up", argv, env=self.client_env(hd / "home"), log=hd / "fleet-up.log",
                              cwd=str(REPO))

    def worker_env(self, node: str) -> dict[str, str]:
        hd = self.host_dir(node)
        sock = private_dir(hd / "sockets") / "warm.sock"
        return dict(self.client_env(hd / "home"), PINNED_EVAL_WARM_SOCKET=str(sock),
                    PREFECT_WORKER_QUERY_SECONDS="0.5", PREFECT_WORKER_PREFETCH_SECONDS="0.5")

    def start_warm(self, node: str) -> Proc:
        """The host's warm-start fork server (what the pool's command connects to)."""
        env = self.worker_env(node)
        sock = Path(env["PINNED_EVAL_WARM_SOCKET"])
        self.warm[node] = self.net.start(node, "warm-start", server_command(sock), env=env,
                                         log=self.host_dir(node) / "warm.log", cwd=str(REPO))
        return self.warm[node]

    def start_worker(self, node: str) -> Proc:
        """The host's process worker: its own queue, and `default` (the janitor)."""
        env = self.worker_env(node)
        argv = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "pinned-eval", "--type", "process",
                "--name", node, "--work-queue", node, "--work-queue", "default", "--limit", "2"]
        self.workers[node] = self.net.start(node, "worker", argv, env=env, log=self.host_dir(node) / "worker.log",
                                            cwd=str(REPO))
        return self.workers[node]

    def deploy(self) -> None:
        """Block types, the pool (warm-start command), one `eval-point-<node>` deployment per worker host."""
        op = self.host_dir("operator")
        env = self.client_env(op / "home")
        spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
        by_name = {d["name"]: d for d in spec["deployments"]}
        deployments = []
        for node in NODES:
            d = dict(by_name["eval-point"], name=f"eval-point-{node}")
            d["work_pool"] = {"name": "pinned-eval", "work_queue_name": node, "job_variables": {}}
            d.pop("triggers")  # trainers create runs on their node's deployment directly
            deployments.append(d)
        deployments.append(by_name["janitor"])
        spec.pop("definitions", None)
        spec["deployments"] = deployments
        (op / "prefect.yaml").write_text(yaml.safe_dump(spec))
        template = write_job_template(op / "warm-job-template.json")

        def prefect(*args: str) -> subprocess.Popen[str]:
            return subprocess.Popen([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        pool = ("work-pool", "create", "pinned-eval", "--type", "process", "--overwrite", "--base-job-template",
                str(template))
        # block types and the pool are independent; the deployments need the pool (its template)
        for batch in ((("block", "register", "-m", "blocks"), pool),
                      (("--no-prompt", "deploy", "--all", "--prefect-file", str(op / "prefect.yaml")),)):
            procs = [(args, prefect(*args)) for args in batch]
            for args, proc in procs:
                out, _ = proc.communicate(timeout=300)
                if proc.returncode != 0:
                    raise RuntimeError(f"prefect {' '.join(args)} failed:\n{out}")

    def save_run_blocks(self, run: str, node: str, *, keep_snapshots: int = 1) -> dict[str, str]:
        """Blocks of training run `run` measured on `node`'s fleet (tiny suite), staged on S3 under
        `s3://<bucket>/<run>`, cached on `node`, JSONL at `<root>/sinks/<run>.jsonl`; returns the
        point parameter -> block name map."""
        from pydantic import SecretStr

        from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock

        hd = self.host_dir(node)
        names = {k: f"{k}-{run}" for k in ("suite", "fleet", "staging", "sinks")}
        with use_server(self.api_url, self.host_dir("operator") / "home", auth_string=self.auth_string):
            EvalSuiteBlock(suite=tiny_suite()).save(names["suite"])
            FleetBlock(name=node, mode="launch", state_file=str(self.fleets[node])).save(names["fleet"], overwrite=True)
            StagingBlock(
                root=f"s3://{self.bucket}/{run}", keep_snapshots=keep_snapshots, endpoint_url=self.s3_endpoint,
                region_name="us-east-1", aws_access_key_id=SecretStr(S3_KEY),
                aws_secret_access_key=SecretStr(S3_SECRET), cache_dir=str(private_dir(hd / "cache")),
                cache_max_bytes=50_000_000, source_roots=[str(self.model.parent)],
            ).save(names["staging"])
            sinks = private_dir(self.root / "sinks")
            SinksBlock(jsonl_path=str(sinks / f"{run}.jsonl")).save(names["sinks"])
        return names

    def trainer_auth_file(self) -> Path:
        """A 0600 copy of the credential on the trainer host (`PINNED_EVAL_API_AUTH_FILE`)."""
        path = self.host_dir("trainer") / AUTH_FILE_NAME
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.auth_string + "\n")
        return path

    def start_trainer(self, name: str, config: dict[str, Any]) -> Proc:
        """`python -m tests.scaleout.trainer <config.json>` on the trainer host."""
        hd = self.host_dir("trainer")
        cfg = hd / f"{name}.json"
        cfg.write_text(json.dumps(config))
        env = dict(os.environ, PREFECT_API_URL=self.api_url, PINNED_EVAL_API_AUTH_FILE=str(self.trainer_auth_file()),
                   PINNED_EVAL_HOME=str(private_dir(hd / "home")), PYTHONPATH=str(REPO))
        env.pop("PREFECT_API_AUTH_STRING", None)
        return self.net.start("trainer", name, [sys.executable, "-m", "tests.scaleout.trainer", str(cfg)],
                              env=env, log=hd / f"{name}.log", cwd=str(REPO))

    def stop_fleets(self) -> list[subprocess.Popen[bytes]]:
        """Start `pinned-eval fleet down` for every fleet (all at once); the caller waits for them."""
        downs = []
        for node, state in self.fleets.items():
            argv = [sys.executable, "-m", "app.cli", "fleet", "down", "--state-file", str(state)]
            env = self.client_env(self.host_dir(node) / "home")
            downs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return downs


def _teardown(net: Network, c: Cluster | None) -> None:
    """Fleets down and every process stopped, side by side; then the namespaces go."""
    downs = c.stop_fleets() if c is not None else []
    try:
        net.close()
    finally:
        for d in downs:
            d.wait(120)


def _alive_or_raise(proc: Proc) -> bool:
    if not proc.alive():
        raise RuntimeError(f"{proc.host} {proc.role} exited:\n{proc.tail()}")
    return True


def _start_redis(net: Network, root: Path, password: str) -> Proc:
    host = net.hosts["redis"]
    conf = root / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"bind {host.addr}\nport {REDIS_PORT}\nrequirepass {password}\nsave \"\"\nappendonly no\n"
                f"dir {root}\nprotected-mode yes\n")
    proc = net.start("redis", "redis", ["redis-server", str(conf)], env=dict(os.environ), log=root / "redis.log")

    def pong() -> bool:
        import redis

        _alive_or_raise(proc)
        try:
            return bool(redis.Redis(host=host.addr, port=REDIS_PORT, password=password, socket_timeout=2).ping())
        except redis.exceptions.ConnectionError:
            return False

    poll_until(pong, timeout_s=60, what="redis PING")
    return proc


def _start_s3(net: Network, root: Path) -> str:
    import boto3

    host = net.hosts["s3"]
    proc = net.start("s3", "moto", [sys.executable, "-m", "moto.server", "-H", host.addr, "-p", str(S3_PORT)],
                     env=dict(os.environ), log=root / "moto.log")
    endpoint = f"http://{host.addr}:{S3_PORT}"

    def up() -> bool:
        _alive_or_raise(proc)
        try:
            return httpx.get(endpoint, timeout=5).status_code < 500
        except httpx.HTTPError:
            return False

    poll_until(up, timeout_s=120, interval_s=0.5, what="moto S3 server")
    bucket = f"staging-{net.tag}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


@contextmanager
def cluster(root: Path, model: Path) -> Iterator[Cluster]:
    """The whole cluster (module docstring), up and healthy; torn down at exit, even on failure."""
    require_services()
    net = Network.create(ROLES)
    c: Cluster | None = None
    try:
        private_dir(root)
        pg_cm = running_postgres(PG_PORT, host=net.hosts["db"].addr, password=secrets.token_urlsafe(16),
                                 clients=f"{net.prefix}.0/24", wrap=net.hosts["db"].wrap)
        with pg_cm as pg:
            redis_password = secrets.token_urlsafe(24)
            auth = ensure_auth_file(private_dir(root / "operator") / AUTH_FILE_NAME)
            c = Cluster(net, root, pg, auth, redis_password, "", model)
            fleet_ups = {node: c.start_fleet(node) for node in NODES}  # slowest: start first
            _start_redis(net, private_dir(root / "redis"), redis_password)
            c.mark("postgres, redis")
            c.bucket = _start_s3(net, private_dir(root / "s3"))
            c.mark("s3")
            first = c.start_replica("api1", migrate=True)  # one process migrates the schema
            c.wait_healthy(c.replica_url("api1"), first)
            c.mark("api1 (migrations)")
            second = c.start_replica("api2", migrate=False)
            services = net.start("services", "services", [sys.executable, "-m", "prefect", "server", "services",
                                 "start"], env=c.server_env("services", migrate=False),
                                 log=c.host_dir("services") / "services.log")
            ups = [arg for h in ("api1", "api2") for arg in ("--upstream", f"{c.addr(h)}:{API_PORT}")]
            lb = [sys.executable, "-m", "tests.scaleout.lb", "--listen", f"{c.addr('lb')}:{LB_PORT}", *ups]
            net.start("lb", "lb", lb, env=dict(os.environ, PYTHONPATH=str(REPO)), log=c.host_dir("lb") / "lb.log",
                      cwd=str(REPO))
            c.deploy()  # through the balancer, while api2 may still be starting
            c.mark("deploy")
            for node, up in fleet_ups.items():
                poll_until(lambda up=up: up.popen.poll() is not None, timeout_s=400, what=f"{node} fleet up")
                if up.popen.returncode != 0:
                    raise RuntimeError(f"{node}: fleet up failed:\n{up.tail()}")
            c.mark("fleets")
            warm = {node: c.start_warm(node) for node in NODES}
            for node, proc in warm.items():
                sock = Path(c.worker_env(node)["PINNED_EVAL_WARM_SOCKET"])
                poll_until(lambda p=proc, s=sock: _alive_or_raise(p) and s.exists(), timeout_s=180,
                           what=f"{node} fork server socket")
                c.start_worker(node)
            c.wait_healthy(c.replica_url("api2"), second)
            _alive_or_raise(services)
            c.mark("workers, api2")
            yield c
            c.mark("used")
            _teardown(net, c)
            c.mark("torn down")
    except BaseException:
        _teardown(net, c)
        raise
