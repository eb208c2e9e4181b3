"""Burst of eval-point dispatches: throughput, staging high-water mark, server responsiveness.

A trainer stub dispatches one eval point per step (`policy="skip"`), exporting a tiny snapshot
in-loop into staging for every admitted point, while two sampler threads watch the staging root
(step directories of the run) and the server's `/api/health` latency. Points that find
`max_in_flight` points in flight are recorded by the trainer as skipped `busy` (a Completed /
"Skipped" flow run, no export); admitted ones run as real flow runs on the worker and the fleet.

Invariants checked by `tests/reliability/test_burst.py` with `run_burst`: every step ends with
exactly one terminal record; staging never holds more than `keep_snapshots + max_in_flight`
snapshots of the run; the server answers every health probe during the burst.

`main()` (`python -m bench burst [--steps N]`): the same burst against a SQLite and a Postgres
server side by side, on its own local stack (deployment, worker, 2-engine CPU fleet, tiny model).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from app.prefect_server import env_set
from trainer_integration.client import EvalClient
from trainer_integration.results import DispatchResult, PointOutcome

if TYPE_CHECKING:
    from pinned_eval.suite import EvalSuite

Exporter = Callable[[int, str], object]


class Sampler:
    """Calls `probe()` every `interval_s` on a daemon thread until stopped; keeps every value."""

    def __init__(self, probe: Callable[[], float], interval_s: float, name: str) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.values: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _sample(self) -> None:
        try:
            self.values.append(self.probe())
        except (httpx.HTTPError, OSError) as exc:
            self.errors.append(repr(exc))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sample()  # one last reading after the burst


def staged_snapshots(staging_root: Path, run: str) -> int:
    """Snapshot directories of `run` under a local staging root right now (complete or not)."""
    run_dir = staging_root / run
    try:
        return sum(1 for p in run_dir.iterdir() if p.name.startswith("step_"))
    except FileNotFoundError:
        return 0


def health_latency(api_url: str, http: httpx.Client) -> float:
    """Seconds one `GET /api/health` took; raises on a non-200 answer."""
    t0 = time.perf_counter()
    resp = http.get(f"{api_url}/health")
    resp.raise_for_status()
    return time.perf_counter() - t0


@dataclass
class BurstReport:
    steps: int
    max_in_flight: int
    keep_snapshots: int
    dispatched: list[DispatchResult]
    outcomes: list[PointOutcome]
    loop_seconds: float  # the training loop, dispatches included
    total_seconds: float  # loop + drain: until every point was terminal
    staging_samples: list[int]
    health_latencies: list[float]
    health_errors: list[str] = field(default_factory=list)

    @property
    def staging_high_water(self) -> int:
        return max(self.staging_samples, default=0)

    @property
    def staging_bound(self) -> int:
        return self.keep_snapshots + self.max_in_flight

    def count(self, state: str) -> int:
        return sum(1 for o in self.outcomes if o.state == state)

    @property
    def records_per_minute(self) -> float:
        return 60.0 * sum(1 for o in self.outcomes if o.state != "pending") / self.total_seconds

    @property
    def measured_per_minute(self) -> float:
        return 60.0 * self.count("measured") / self.total_seconds

    def dispatch_p50_ms(self) -> float:
        quick = [r.stall_seconds - (r.export_time_seconds or 0.0) for r in self.dispatched if r.waited_seconds == 0]
        return 1000 * statistics.median(quick) if quick else float("nan")

    def summary(self) -> dict[str, float | int]:
        lat = sorted(self.health_latencies)
        return {
            "steps": self.steps,
            "max_in_flight": self.max_in_flight,
            "measured": self.count("measured"),
            "skipped": self.count("skipped"),
            "other": len(self.outcomes) - self.count("measured") - self.count("skipped"),
            "loop_s": round(self.loop_seconds, 1),
            "total_s": round(self.total_seconds, 1),
            "records_per_min": round(self.records_per_minute, 1),
            "measured_per_min": round(self.measured_per_minute, 2),
            "staging_high_water": self.staging_high_water,
            "staging_bound": self.staging_bound,
            "health_probes": len(lat),
            "health_p50_ms": round(1000 * statistics.median(lat), 1) if lat else float("nan"),
            "health_max_ms": round(1000 * lat[-1], 1) if lat else float("nan"),
            "dispatch_p50_ms": round(self.dispatch_p50_ms(), 1),
            "admission_in_flight_max": self.admission_in_flight_max,
        }

    @property
    def admission_in_flight_max(self) -> int:
        """Most points the trainer's admission counted in flight (besides the one it admitted)."""
        return max((r.in_flight for r in self.dispatched), default=0)


def run_burst(
    client: EvalClient,
    *,
    api_url: str,
    staging_root: Path,
    keep_snapshots: int,
    steps: int = 200,
    step_seconds: float = 0.1,
    drain_timeout_s: float = 240.0,
    sample_interval_s: float = 0.05,
) -> BurstReport:
    """Dispatch `steps` points from `client` (the last one final), then drain; sample throughout."""
    http = httpx.Client(timeout=30)
    dispatched: list[DispatchResult] = []
    staging = Sampler(lambda: staged_snapshots(staging_root, client.run), sample_interval_s, "burst-staging")
    health = Sampler(lambda: health_latency(api_url, http), 0.25, "burst-health")
    t0 = time.monotonic()
    try:
        with staging, health:
            for step in range(steps):
                time.sleep(step_seconds)  # "training"
                client.report_progress(step)
                dispatched.append(client.dispatch(step, final=step == steps - 1))
            loop_s = time.monotonic() - t0
            outcomes = client.drain(timeout=drain_timeout_s)
            total_s = time.monotonic() - t0
    finally:
        http.close()
    return BurstReport(
        steps=steps,
        max_in_flight=client.max_in_flight,
        keep_snapshots=keep_snapshots,
        dispatched=dispatched,
        outcomes=outcomes,
        loop_seconds=loop_s,
        total_seconds=total_s,
        staging_samples=[int(v) for v in staging.values],
        health_latencies=health.values,
        health_errors=staging.errors + health.errors,
    )


def snapshot_exporter(base: Path) -> Exporter:
    """In-loop export of the base model's weights (read once) as a complete snapshot at `dest`."""
    from safetensors.torch import load_file

    from pinned_eval.snapshot.writer import write_snapshot

    tensors: dict = {}
    for shard in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(shard))
    named = sorted(tensors.items())

    def export(step: int, dest: str) -> None:
        write_snapshot(named, dest, base_hf_dir=str(base), max_shard_bytes=64 * 1024)

    return export


def tiny_suite() -> EvalSuite:
    """One dataset, two prompts, one new token: the fleet's work per point is close to nothing."""
    from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

    return EvalSuite(
        datasets=(DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=2),),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=1, n_samples_per_prompt=1, reward="exact_match"),
    )


# ---- a throwaway Postgres on loopback (the scale-out test and the benchmark) ------------------


class PostgresUnavailableError(RuntimeError):
    """No PostgreSQL server binaries here (`scripts/ci-services.sh` installs them)."""


def postgres_bin() -> Path:
    """The directory holding `initdb`, `pg_ctl`, `createdb` (PATH first, then Debian's layout)."""
    found = shutil.which("pg_ctl")
    candidates = [Path(os.path.realpath(found)).parent] if found else []
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for d in candidates:
        if all((d / exe).is_file() for exe in ("initdb", "pg_ctl", "createdb", "postgres")):
            return d
    raise PostgresUnavailableError("initdb/pg_ctl not found: run scripts/ci-services.sh (Debian `postgresql`)")


@dataclass(frozen=True)
class LocalPostgres:
    bin_dir: Path
    root: Path  # data dir, socket dir and log live here
    port: int
    database: str = "prefect"
    user: str = "prefect"
    host: str = "127.0.0.1"
    password: str | None = field(default=None, repr=False)  # required over TCP when set

    @property
    def url(self) -> str:
        """SQLAlchemy URL for `PREFECT_API_DATABASE_CONNECTION_URL` (holds the password: an env value, never argv)."""
        cred = f"{self.user}:{self.password}" if self.password else self.user
        return f"postgresql+asyncpg://{cred}@{self.host}:{self.port}/{self.database}"

    def client_env(self) -> dict[str, str]:
        return dict(os.environ, PGPASSWORD=self.password) if self.password else dict(os.environ)

    def psql(self, sql: str) -> str:
        out = subprocess.run(
            [str(self.bin_dir / "psql"), "-h", self.host, "-p", str(self.port), "-U", self.user,
             "-d", self.database, "-tAc", sql],
            capture_output=True, text=True, timeout=30, check=True, env=self.client_env(),
        )
        return out.stdout.strip()


def _as_owner(cmd: list[str]) -> list[str]:
    """Postgres refuses to run as root: run its tools as the `postgres` user then."""
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if runuser is None:
        raise PostgresUnavailableError("running as root and `runuser` is missing: cannot start Postgres")
    return [runuser, "-u", "postgres", "--", *cmd]


@contextmanager
def running_postgres(
    port: int,
    *,
    host: str = "127.0.0.1",
    password: str | None = None,
    clients: str | None = None,
    wrap: Callable[[list[str]], list[str]] = lambda cmd: cmd,
) -> Iterator[LocalPostgres]:
    """initdb into a fresh temp dir, start on `host`:`port` (socket in that dir), stop and remove at exit.

    With `password`, TCP logins need it (scram-sha-256) and `clients` (a CIDR) may log in over
    TCP besides loopback; `wrap` prefixes the server's commands (e.g. `ip netns exec <ns>`)."""
    import pwd

    bin_dir = postgres_bin()
    root = Path(tempfile.mkdtemp(prefix="pinned-eval-pg-"))  # short path: the socket name must fit
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError as exc:
            shutil.rmtree(root)
            raise PostgresUnavailableError("running as root and there is no `postgres` user") from exc
        os.chown(root, owner.pw_uid, owner.pw_gid)
    pg = LocalPostgres(bin_dir, root, port, host=host, password=password)
    data = root / "data"
    started = False
    try:
        auth = ["--auth=trust"]
        if password:
            pwfile = root / "pwfile"
            pwfile.write_text(password + "\n")
            pwfile.chmod(0o600)
            if os.geteuid() == 0:
                os.chown(pwfile, owner.pw_uid, owner.pw_gid)
            auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        subprocess.run(
            _as_owner([str(bin_dir / "initdb"), "-D", str(data), "-U", pg.user, *auth, "-E", "UTF8", "--no-sync"]),
            capture_output=True, text=True, timeout=120, check=True,
        )
        if password and clients:
            with open(data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {clients} scram-sha-256\n")
        opts = f"-k {root} -h {host} -p {port} -c fsync=off -c max_connections=200"
        subprocess.run(
            wrap(_as_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "postgres.log"), "-w",
                            "-t", "60", "-o", opts, "start"])),
            capture_output=True, text=True, timeout=90, check=True,
        )
        started = True
        subprocess.run(
            [str(bin_dir / "createdb"), "-h", host, "-p", str(port), "-U", pg.user, pg.database],
            capture_output=True, text=True, timeout=30, check=True, env=pg.client_env(),
        )
        yield pg
    finally:
        if started:
            subprocess.run(
                _as_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"]),
                capture_output=True, timeout=60,
            )
        shutil.rmtree(root, ignore_errors=True)


# ---- standalone benchmark ----------------------------------------------------------------------


def _burst_on(stack_home: Path, db_url: str | None, model: Path, fleet_state: Path, steps: int) -> BurstReport:
    """Server (SQLite, or Postgres at `db_url`) + deployment + worker, then one burst at max_in_flight 2."""
    from app.prefect_server import use_server
    from app.stack import LocalStack
    from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
    from pinned_eval.events import BlockNames

    stack = LocalStack(stack_home)
    try:
        with env_set(**({"PREFECT_API_DATABASE_CONNECTION_URL": db_url} if db_url else {})):
            server = stack.server_up(port=0)
        stack.deploy()
        stack.worker_up(query_seconds=1)
        with use_server(server.api_url, server.home, auth_string=server.auth_string):
            tag, keep = uuid.uuid4().hex[:8], 2
            root = stack_home / "staging"
            root.mkdir()
            names = BlockNames(suite=f"s-{tag}", fleet=f"f-{tag}", staging=f"st-{tag}", sinks=f"k-{tag}")
            EvalSuiteBlock(suite=tiny_suite()).save(names.suite)
            FleetBlock(name=f"b{tag}", mode="launch", state_file=str(fleet_state)).save(names.fleet)
            StagingBlock(root=str(root), keep_snapshots=keep).save(names.staging)
            SinksBlock(jsonl_path=str(stack_home / "metrics.jsonl")).save(names.sinks)
            with EvalClient(
                f"burst-{tag}", server.api_url, blocks=names, policy="skip", max_in_flight=2,
                staging_root=root, exporter=snapshot_exporter(model), spool_dir=stack_home / "spool",
            ) as client:
                return run_burst(client, api_url=server.api_url, staging_root=root, keep_snapshots=keep, steps=steps)
    finally:
        stack.down()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench burst", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="dispatches in the burst (default 200)")
    steps = ap.parse_args(argv or []).steps
    from app.prefect_server import free_port
    from engine.tiny_model import make_tiny_model
    from pinned_eval.fleet.launcher import launch_cpu_fleet

    reports: dict[str, BurstReport] = {}
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model")
        fleet = launch_cpu_fleet(model, 2, state_file=work / "fleet.json", ready_timeout_s=180)
        try:
            reports["sqlite"] = _burst_on(work / "sqlite", None, model, work / "fleet.json", steps)
            try:
                with running_postgres(free_port()) as pg:
                    reports["postgres"] = _burst_on(work / "postgres", pg.url, model, work / "fleet.json", steps)
            except PostgresUnavailableError as exc:
                print(f"postgres variant skipped: {exc}")
        finally:
            fleet.stop()
    for name, r in reports.items():  # anything but a measurement or a busy skip is worth a look
        for o in r.outcomes:
            if o.state != "measured" and not (o.state == "skipped" and o.reason == "busy"):
                print(f"{name}: step {o.step} {o.state} {o.reason}: {(o.message or '')[:300]}")
        if r.staging_high_water > r.staging_bound:
            print(f"{name}: staging over its bound: {r.staging_samples}")
    rows = {name: r.summary() for name, r in reports.items()}
    print(f"burst: {steps} dispatches (skip, max_in_flight 2, 0.1 s steps), tiny suite: 1 dataset, 2 prompts, 1 token")
    names = list(rows)
    ratio = len(names) == 2
    print("| metric | " + " | ".join(names) + (" | postgres / sqlite |" if ratio else " |"))
    print("|" + "---|" * (len(names) + 1 + ratio))
    for key in rows[names[0]]:
        vals = [rows[n][key] for n in names]
        cells = " | ".join(str(v) for v in vals)
        if ratio:
            a, b = vals
            cells += f" | {b / a:.2f}" if a else " | -"
        print(f"| {key} | {cells} |")


if __name__ == "__main__":
    main(sys.argv[1:])
