"""Unix sockets of the worker's local companions (warm-start fork server, backend host): private by construction.

Both companions run code as the worker for whoever talks to them, so on a shared node only the
worker's own uid may. Three layers, each enough on its own against another local user:

- `listen_private(path)`: the socket's directory is the worker's own. A missing one is created
  mode 0700; an existing one must be a real directory (not a symlink), owned by this uid, with no
  group or other permission bits, else `UnsafeSocketDir` names the path and the problem.
- The socket file is bound under umask 0o177, so it is mode 0600 from its creation (no window).
  An existing file at the path is probed first: nobody answers (a crashed server's leftover) →
  it is removed and replaced; someone answers → `SocketInUse` (a live server is never stolen);
  something other than a socket → `UnsafeSocketDir`.
- `foreign_peer(conn)`: the connecting process's uid from the kernel (SO_PEERCRED). Servers call
  it on every accepted connection and close any other uid's, logging the message (uid and pid),
  so loosened permissions (a chmod, an ACL) still let nobody else in.
- Clients check the other way before they send anything (a request carries the worker's
  environment, backend options): `check_server_socket(path)` (the socket is this uid's, in a
  private directory, so nobody else can have put it there), or SO_PEERCRED after connecting
  (the warm start's stdlib client). A squatted socket is refused, never talked to.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Protocol

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class UnsafeSocketDir(RuntimeError):
    """The socket's directory (or the path itself) is not the worker's own and private."""


class SocketInUse(RuntimeError):
    """A live server already answers on the socket path."""


class _HasSockopt(Protocol):  # socket.socket and asyncio's TransportSocket
    def getsockopt(self, level: int, optname: int, buflen: int) -> bytes: ...


def private_dir(path: Path) -> Path:
    """Create `path` mode 0700 (parents as needed) or verify an existing one is this uid's and private."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    _check_private_dir(path)
    return path


def _check_private_dir(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketDir(f"socket directory {path}: is a symlink; use a real directory of your own")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDir(f"socket directory {path}: is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeSocketDir(f"socket directory {path}: owned by uid {st.st_uid}, not by this uid {os.geteuid()}")
    if st.st_mode & 0o077:
        raise UnsafeSocketDir(
            f"socket directory {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group/others in; it must be 0700"
        )


def check_server_socket(path: Path) -> None:
    """Before connecting: an existing `path` must be a socket of this uid in a private directory
    (`UnsafeSocketDir` otherwise); a missing one is left to the connection error."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _check_private_dir(path.parent)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafeSocketDir(f"socket path {path}: not a socket of this uid {os.geteuid()} (uid {st.st_uid})")


def answers(path: Path) -> bool:
    """True when a server accepts a connection on `path` (a live socket); False for a stale one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except TimeoutError:  # alive, its backlog full
            return True
        return True


def listen_private(path: Path, backlog: int = 64) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 in a private directory (see the module contract)."""
    private_dir(path.parent)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise UnsafeSocketDir(f"socket path {path}: exists and is not a socket; refusing to replace it")
        if answers(path):
            raise SocketInUse(f"socket path {path}: a server is already listening there; stop it first")
        path.unlink()  # stale: its server died without removing it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(old_umask)
    listener.listen(backlog)
    return listener


def peer_credentials(conn: _HasSockopt) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, from the kernel."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def foreign_peer(conn: _HasSockopt, what: str) -> str | None:
    """None when the peer runs as this uid; else the refusal to log (the caller closes `conn`)."""
    pid, uid, _gid = peer_credentials(conn)
    if uid == os.geteuid():
        return None
    return f"{what}: refused a connection from uid {uid} (pid {pid}); only uid {os.geteuid()} may connect"


__all__ = [
    "SocketInUse",
    "UnsafeSocketDir",
    "answers",
    "check_server_socket",
    "foreign_peer",
    "listen_private",
    "peer_credentials",
    "private_dir",
]
