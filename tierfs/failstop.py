"""`tierfs supervise`: fail-stop when the daemon dies, so no broker acknowledges a write that is not durable.

The supervisor starts the daemon (`tierfs mount --foreground`) and receives a duplicate of its FUSE device fd
before any request is served (tierfs.fs.supervisor). When the daemon dies with the store still mounted:
  1. the connection stays open (we hold the device): every msync/fsync/read through it waits, none fails;
  2. every process holding the store is SIGKILLed: the systemd units named by --kill-unit, then every pid with
     an fd or a mapping on the mount (through /proc; repeated until a scan finds no one new);
  3. only then the connection is aborted: the waiting syscalls fail, but in threads that die before user
     space, so no msync error is swallowed into a SEND_OK;
  4. the dead mount is detached and a new daemon mounts the same hot dir, which holds every byte a successful
     fsync/msync reported; the broker's service manager restarts the broker, which recovers as after a crash.
A daemon that exits after an unmount (tierfs umount, SIGTERM) ends the supervisor with the daemon's code.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tierfs.fs.mount import pid_alive, wait_until_mounted
from tierfs.fs.supervisor import (
    SUPERVISOR_FD_ENV,
    SUPERVISOR_FAILSTOPS_ENV,
    Holders,
    abort_connection,
    mount_dev,
    receive_fuse_fd,
)

log = logging.getLogger("tierfs.failstop")

REMOUNT_ATTEMPTS = 3
DYING_WAIT_S = 60.0  # how long the killed holders may take to exit once the connection is aborted


class SuperviseError(RuntimeError):
    """The daemon could not be (re)started under the supervisor."""


def state_file(hot: Path) -> Path:
    """HOT/.tierfs/supervisor.json: the supervisor's pid, its current daemon's pid and the remount count."""
    return hot / ".tierfs" / "supervisor.json"


class Supervisor:
    def __init__(self, hot: Path, mnt: Path, mount_args: Sequence[str], kill_units: Sequence[str]):
        self.hot, self.mnt = hot, mnt
        self.mount_args = list(mount_args)  # --config FILE / -o KEY=VALUE, as given to `tierfs mount`
        self.kill_units = list(kill_units)
        self.daemon: subprocess.Popen | None = None
        self.remounts = 0
        self.failstop_at = 0.0  # Unix time the last daemon death was seen (0: none yet)
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._stop)
        fuse_fd = self._start_daemon()
        _sd_notify("READY=1")
        while True:
            assert self.daemon is not None
            code = self.daemon.wait()
            if mount_dev(str(self.mnt)) is None:  # from mountinfo: a stat would wait on a dead daemon
                os.close(fuse_fd)  # unmounted: the connection is gone already
                state_file(self.hot).unlink(missing_ok=True)
                log.info("daemon pid %d exited %d after the unmount; supervisor done", self.daemon.pid, code)
                return code
            log.error("daemon pid %d died (exit %d) with %s mounted: fail-stop", self.daemon.pid, code, self.mnt)
            self.failstop_at = time.time()
            fail_stop(str(self.mnt), fuse_fd, self.kill_units)
            if self.stopping:  # asked to stop: the store stays unmounted
                state_file(self.hot).unlink(missing_ok=True)
                return code or 1
            fuse_fd = self._remount()

    def _stop(self, signum: int, _frame: object) -> None:
        """systemctl stop / SIGTERM: the daemon unmounts cleanly; we exit after it."""
        self.stopping = True
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)

    def _remount(self) -> int:
        for attempt in range(1, REMOUNT_ATTEMPTS + 1):
            if self.stopping:
                raise SuperviseError(f"stopped before {self.mnt} was remounted")
            try:
                fd = self._start_daemon(self.remounts + 1)
                self.remounts += 1
                self._write_state()
                log.warning("remounted %s with daemon pid %d (remount %d)", self.mnt, self.daemon.pid,
                            self.remounts)
                return fd
            except SuperviseError as e:
                log.error("remount attempt %d failed: %s", attempt, e)
                time.sleep(attempt)
        raise SuperviseError(f"could not remount {self.mnt} after {REMOUNT_ATTEMPTS} attempts")

    def _start_daemon(self, remounts: int = 0) -> int:
        """Start `tierfs mount --foreground`, take its FUSE device fd, wait until the mount answers. `remounts`:
        the fail-stops so far including the one this start follows (the daemon exports them and the time of the
        last: tierfs_supervisor_remounts_total, tierfs_supervisor_last_failstop_timestamp_seconds)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-P", "-m", "tierfs", "mount", str(self.hot), str(self.mnt), "--foreground",
               *self.mount_args]
        env = dict(os.environ, **{SUPERVISOR_FD_ENV: str(theirs.fileno()),
                                  SUPERVISOR_FAILSTOPS_ENV: f"{remounts} {self.failstop_at}"})
        with open(os.devnull, "rb") as devnull, open(self.hot / ".tierfs" / "daemon.stderr", "ab") as err:
            self.daemon = subprocess.Popen(cmd, stdin=devnull, stdout=err, stderr=err, pass_fds=[theirs.fileno()],
                                           env=env, cwd="/")
        theirs.close()
        with ours:
            try:
                fuse_fd = receive_fuse_fd(ours)  # EOF when the daemon dies first
            except (ConnectionError, OSError) as e:
                self.daemon.wait()
                if mount_dev(str(self.mnt)) is not None:  # it served nothing: no holder to stop, just clear it
                    subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True, timeout=60)
                raise SuperviseError(f"daemon exited {self.daemon.returncode} before mounting ({e}); see "
                                     f"{self.hot}/.tierfs/daemon.stderr") from None
        if not wait_until_mounted(self.mnt, self.daemon.pid, timeout=120):
            if self.daemon.poll() is None:
                self.daemon.kill()
            self.daemon.wait()
            if mount_dev(str(self.mnt)) is not None:  # it may have served a request: as for any death
                fail_stop(str(self.mnt), fuse_fd, self.kill_units)
            else:
                os.close(fuse_fd)
            raise SuperviseError(f"daemon exited {self.daemon.returncode} before its mount answered")
        self._write_state()
        return fuse_fd

    def _write_state(self) -> None:
        assert self.daemon is not None
        tmp = state_file(self.hot).with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "daemon": self.daemon.pid, "remounts": self.remounts}))
        os.replace(tmp, state_file(self.hot))


def fail_stop(mnt: str, fuse_fd: int, kill_units: Sequence[str]) -> None:
    """Stop every holder of the dead mount, then abort its connection and detach it (module doc, steps 2-4)."""
    dev = mount_dev(mnt)
    if dev is None:  # unmounted since we looked: the kernel aborted the connection when the last file went
        os.close(fuse_fd)
        return
    for unit in kill_units:  # best effort: the scan below finds whatever this missed
        try:
            r = subprocess.run(["systemctl", "kill", "--signal=SIGKILL", unit], capture_output=True, text=True,
                               timeout=60)
            log.warning("fail-stop: systemctl kill --signal=SIGKILL %s: exit %d %s", unit, r.returncode,
                        r.stderr.strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            log.error("fail-stop: systemctl kill --signal=SIGKILL %s failed: %s", unit, e)
    holders = Holders(*dev)
    try:
        killed = holders.kill_all()
        log.warning("fail-stop: %d processes killed; aborting the FUSE connection %d:%d", len(killed), *dev[:2])
        abort_connection(dev[0], dev[1], fuse_fd)
        subprocess.run(["fusermount3", "-uz", mnt], capture_output=True, timeout=60)
        deadline = time.monotonic() + DYING_WAIT_S
        while time.monotonic() < deadline and any(pid_alive(p) for p in killed):
            time.sleep(0.05)
        left = [p for p in killed if pid_alive(p)]
        if left:
            log.error("fail-stop: pids %s still alive %.0f s after the abort", left, DYING_WAIT_S)
    finally:
        holders.close()


def _sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) we are ready; nothing without NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(message.encode(), addr)


def supervise(hot: Path, mnt: Path, mount_args: Sequence[str], kill_units: Sequence[str]) -> int:
    """Run the supervisor in this process until the store is unmounted."""
    handler = logging.FileHandler(hot / ".tierfs" / "supervisor.log")
    logging.basicConfig(level=logging.INFO, handlers=[handler, logging.StreamHandler(sys.stderr)], force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return Supervisor(hot, mnt, mount_args, kill_units).run()
    except SuperviseError as e:
        log.error("%s", e)
        return 1


def running_pids(hot: Path) -> tuple[int, int] | None:
    """(supervisor pid, daemon pid) from the state file while both run: how `tierfs mount --supervise` knows
    the supervisor holds the connection and the mount answers."""
    try:
        st = json.loads(state_file(hot).read_text())
    except (OSError, ValueError):
        return None
    return (st["pid"], st["daemon"]) if pid_alive(st["pid"]) and pid_alive(st["daemon"]) else None
