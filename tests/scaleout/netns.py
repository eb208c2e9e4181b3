"""Hosts as Linux network namespaces on a private bridge, and processes started inside them.

Contract:
- `Network.create(roles)` makes a bridge in the root namespace holding `<prefix>.1/24` (the
  operator: the test process itself) and one namespace per role, each joined to the bridge by a
  veth pair and given `<prefix>.<n>/24` plus its own loopback. No default route, no forwarding:
  traffic stays between these namespaces (and each one's loopback). The /24 is one of
  10.77.1-250.0/24 not already on an interface here.
- `Network.start(host, argv, ...)` runs `ip netns exec <ns> argv` in a new session (the command
  is exec'd, so the PID is the command's) and records it; `Network.close()` stops every
  recorded process group (SIGTERM to all at once, then SIGKILL) and deletes the namespaces and the bridge, on
  any exit path. Names carry a random tag, so two harnesses never share a device.
- `require_netns()` raises `NetnsUnavailableError` (with the reason) when this process cannot
  create namespaces (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pinned_eval.processes import pid_alive, stop_groups


class NetnsUnavailableError(RuntimeError):
    """Network namespaces cannot be created here; the message says why."""


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise NetnsUnavailableError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


def require_netns() -> None:
    """Raise `NetnsUnavailableError` unless this process can create and delete a namespace."""
    if os.geteuid() != 0:
        raise NetnsUnavailableError("network namespaces need root (CI runs as root)")
    if shutil.which("ip") is None:
        raise NetnsUnavailableError("`ip` (iproute2) is not installed")
    probe = f"pe-probe-{uuid.uuid4().hex[:6]}"
    _ip("netns", "add", probe)
    _ip("netns", "del", probe)


def _free_subnet() -> str:
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    free = [n for n in range(1, 251) if f" 10.77.{n}." not in used]
    if not free:
        raise NetnsUnavailableError("no free 10.77.N.0/24 subnet")
    return f"10.77.{random.choice(free)}"


@dataclass(frozen=True)
class Host:
    role: str
    netns: str
    addr: str

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Proc:
    host: str
    role: str
    pid: int
    log: Path
    popen: subprocess.Popen[bytes] = field(repr=False)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


@dataclass
class Network:
    tag: str
    prefix: str  # e.g. "10.77.42"
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"pe{self.tag}br"

    @property
    def operator_addr(self) -> str:
        return f"{self.prefix}.1"

    @classmethod
    def create(cls, roles: Sequence[str]) -> Network:
        """Bridge + one namespace per role (see the module contract); half-built ones are removed."""
        require_netns()
        net = cls(uuid.uuid4().hex[:5], _free_subnet())
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            net._links.append(net.bridge)
            _ip("addr", "add", f"{net.operator_addr}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            for i, role in enumerate(roles, start=2):
                net._add_host(role, i)
        except BaseException:
            net.close()
            raise
        return net

    def _add_host(self, role: str, n: int) -> None:
        ns, veth = f"pe-{self.tag}-{role}", f"pe{self.tag}{n:02d}"
        _ip("netns", "add", ns)
        self.hosts[role] = Host(role, ns, f"{self.prefix}.{n}")
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._links.append(veth)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        for args in (("addr", "add", f"{self.prefix}.{n}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("link", "set", "lo", "up")):
            _ip("-n", ns, *args)

    def start(
        self, host: str, role: str, argv: Sequence[str], *, env: dict[str, str], log: Path, cwd: str | None = None
    ) -> Proc:
        """Start `argv` in `host`'s namespace, output to `log`; recorded for `close()`."""
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                self.hosts[host].wrap(argv), env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        proc = Proc(host, role, popen.pid, log, popen)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, *, grace_s: float = 15.0) -> None:
        if pid_alive(proc.pid):
            stop_groups([proc.pid], grace_s=grace_s)
        proc.popen.wait(10)

    def stop_all(self, *, grace_s: float = 10.0) -> None:
        """Stop every recorded process group at once: SIGTERM all, SIGKILL what is left after `grace_s`."""
        live = [p for p in self.procs if pid_alive(p.pid)]
        try:
            stop_groups([p.pid for p in live], grace_s=grace_s)
        finally:
            for p in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(10)

    def close(self) -> None:
        """Stop every recorded process (all groups at once), then delete namespaces and links."""
        error: Exception | None = None
        try:
            self.stop_all()
        except Exception as exc:  # teardown goes on; the failure is re-raised below
            error = exc
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        if error is not None:
            raise RuntimeError(f"harness teardown: {error!r}") from error
