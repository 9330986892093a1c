"""The FUSE-connection side of fail-stop (tierfs.failstop runs the supervisor process).

A FUSE connection is aborted when the last reference to its /dev/fuse file is dropped (fuse_dev_release). The
daemon hands a duplicate of that fd to its supervisor (SCM_RIGHTS over an inherited unix socket) before it serves
a single request, so a daemon that dies leaves the connection open: every request on it, a broker's msync or
fsync included, then waits instead of failing. The supervisor SIGKILLs every process holding a file or a mapping
of the store (found through /proc, never through the mount, which would wait as well) and only then aborts the
connection: a thread that sees the failed msync can no longer return to user space, so nothing acknowledges it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

log = logging.getLogger("tierfs.supervisor")

SUPERVISOR_FD_ENV = "TIERFS_SUPERVISOR_FD"
# the supervisor's fail-stops before it started this daemon ("COUNT LAST_UNIX_TIME", "0 0.0" for its first daemon),
# so the daemon's metrics carry the deaths of the daemons before it
SUPERVISOR_FAILSTOPS_ENV = "TIERFS_SUPERVISOR_FAILSTOPS"
FUSE_DEVICE = "/dev/fuse"
FUSECTL = "/sys/fs/fuse/connections"


def supervisor_failstops() -> tuple[int, float] | None:
    """(fail-stops, Unix time of the last one) of this daemon's supervisor before it started this daemon; None
    when not supervised."""
    try:
        count, at = os.environ[SUPERVISOR_FAILSTOPS_ENV].split()
        return int(count), float(at)
    except (KeyError, ValueError):
        return None


def fuse_device_fd() -> int:
    """This process's /dev/fuse fd (pyfuse3 keeps its session fd private; the daemon has exactly one)."""
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == FUSE_DEVICE:
                return int(name)
    raise RuntimeError("no /dev/fuse fd in this process: the FUSE session is not mounted")


def hand_fuse_fd_to_supervisor() -> None:
    """When started by a supervisor (TIERFS_SUPERVISOR_FD names an inherited unix socket), send it a duplicate
    of the FUSE device fd and wait for its receipt, so the connection outlives this process before any request
    is served. A no-op otherwise."""
    sock_fd = os.environ.pop(SUPERVISOR_FD_ENV, None)
    if not sock_fd:
        return
    with socket.socket(fileno=int(sock_fd)) as sock:
        socket.send_fds(sock, [b"F"], [fuse_device_fd()])
        if sock.recv(1) != b"K":
            raise RuntimeError("the tierfs supervisor did not confirm it holds the FUSE device fd")


def receive_fuse_fd(sock: socket.socket) -> int:
    """The supervisor's end of the hand-off: the FUSE device fd, confirmed to the daemon once held."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    if msg != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the daemon exited before handing over its FUSE device fd")
    if os.readlink(f"/proc/self/fd/{fds[0]}") != FUSE_DEVICE:
        os.close(fds[0])
        raise ConnectionError("the daemon handed over an fd that is not /dev/fuse")
    sock.sendall(b"K")
    return fds[0]


def mount_dev(mountpoint: str, fstype: str = "fuse.tierfs") -> tuple[int, int, set[int]] | None:
    """(major, minor, mount ids of that superblock in this namespace) of the newest `fstype` mount at
    `mountpoint` (a resolved path), from /proc/self/mountinfo alone: any stat, even of the mountpoint, would
    wait on a daemon that may be dead."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            major, minor = (int(x) for x in parts[2].split(":"))
            kind = parts[parts.index("-") + 1]
            rows.append((int(parts[0]), major, minor, bytes(parts[4], "ascii").decode("unicode_escape"), kind))
    mine = [r for r in rows if r[3] == mountpoint and r[4] == fstype]
    if not mine:
        return None
    major, minor = mine[-1][1:3]
    return major, minor, {r[0] for r in rows if (r[1], r[2]) == (major, minor)}


@dataclass
class Holders:
    """Processes holding an fd or a mapping on one FUSE superblock; each is signalled through a pidfd, so a pid
    reused between the scan and the signal is never hit."""

    major: int
    minor: int
    mount_ids: set[int]
    killed: dict[int, int] = field(default_factory=dict)  # pid -> pidfd

    def scan(self) -> set[int]:
        """Pids (not this one, none already killed) with an fd on one of the mount ids, then those with a mapping
        of a file on the device. The fds first: reading /proc/PID/maps takes the process's mmap lock, which a
        thread faulting on the dead mount can hold, and a process that maps the store (a broker keeps its
        FileChannels open) is found by its fds without it."""
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != os.getpid()]
        pids = [p for p in pids if p not in self.killed]
        found = {p for p in pids if self._has_fd_on(p)}
        return found or {p for p in pids if self._maps_device(p)}

    def holds(self, pid: int) -> bool:
        return self._has_fd_on(pid) or self._maps_device(pid)

    def _maps_device(self, pid: int) -> bool:
        dev = f"{self.major:02x}:{self.minor:02x}"
        try:
            with open(f"/proc/{pid}/maps") as f:
                return any(line.split(maxsplit=4)[3:4] == [dev] for line in f)
        except OSError:  # gone, or a kernel thread
            return False

    def _has_fd_on(self, pid: int) -> bool:
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            return False
        for fd in fds:
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    for line in f:
                        if line.startswith("mnt_id:"):
                            if int(line.split()[1]) in self.mount_ids:
                                return True
                            break
            except OSError:
                continue
        return False

    def kill_all(self) -> set[int]:
        """SIGKILL every holder until a scan finds none not yet killed. New holders cannot appear meanwhile:
        an open through a dead daemon waits. A killed process may stay (its threads wait on the connection)
        until the abort, but a pending SIGKILL lets none of its threads run user code again. A holder we may
        not signal (EPERM: the supervisor runs as another user) keeps us here, the connection open and that
        holder waiting, until someone else stops it: aborting would let it see the failed msync."""
        refused: set[int] = set()
        while True:
            new = self.scan()
            if not new:
                return set(self.killed)
            for pid in sorted(new):
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:  # exited since the scan
                    continue
                if not self.holds(pid):  # exited and its pid reused since the scan: the pidfd names the new one
                    os.close(pidfd)
                    continue
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except OSError as e:
                    os.close(pidfd)
                    if isinstance(e, ProcessLookupError):
                        continue
                    if pid not in refused:
                        log.critical("fail-stop: cannot SIGKILL pid %d (%s), which holds files of the store: %s; "
                                     "the connection stays open (its I/O waits) until it is stopped", pid,
                                     _comm(pid), e.strerror)
                    refused.add(pid)
                    continue
                self.killed[pid] = pidfd
                log.warning("fail-stop: SIGKILL to pid %d (%s), which holds files of the store", pid, _comm(pid))
            if new <= refused:
                time.sleep(1.0)

    def close(self) -> None:
        for pidfd in self.killed.values():
            os.close(pidfd)
        self.killed.clear()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def abort_connection(major: int, minor: int, fuse_fd: int) -> None:
    """Abort the FUSE connection: every waiting request fails (ECONNABORTED) and new ones get ENOTCONN. Through
    fusectl when mounted, then by dropping the last reference to the device fd (which aborts it too)."""
    conn = os.path.join(FUSECTL, str(os.makedev(major, minor)))
    if not os.path.isdir(conn):
        conn = os.path.join(FUSECTL, str(minor))
    try:
        with open(os.path.join(conn, "abort"), "w") as f:
            f.write("1")
    except OSError as e:
        log.info("fusectl abort of %s unavailable (%s); closing the last device fd aborts it", conn, e.strerror)
    os.close(fuse_fd)
