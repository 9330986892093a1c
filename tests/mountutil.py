"""Test harness for real tierfs mounts: everything goes through the real CLI and real syscalls.

* `Mount`     one store mounted with `python -m tierfs mount HOT MNT ...` (the daemonising path an operator
              uses); knows its hot dir, mountpoint, daemon pid and log file; `umount()` (CLI, must exit 0),
              `kill(sig)` (by pid, then `fusermount3 -uz` if the mount is left behind), `remount()`, `cleanup()`,
              `daemon_exit_code()`.
              The CLI runs under a tiny reaper process (PR_SET_CHILD_SUBREAPER) that adopts the daemonised
              tierfs when the CLI exits and reaps it the moment it exits, recording its exit status. Without it
              the orphaned daemon would sit as a zombie until PID 1 reaps it (seconds in some containers), and
              its exit code would be lost.
* `run()`     a subprocess with a hard timeout; on expiry its whole session is killed by the child's pid
              (never by name), so a test blocked on a wedged mount fails instead of hanging the suite.
* `evict()`   drop one file's clean pages (fsync + POSIX_FADV_DONTNEED on that file only). Tests never touch the
              global page cache (no drop_caches).

The fixtures in `conftest.py` (`mount_store`, `mounted`) wrap these and always clean up.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pytest

TIERFS_CMD = [sys.executable, "-m", "tierfs"]
FSTYPE = "fuse.tierfs"
# Variables of the test runner that must not leak into a daemon unless a test asks for them.
_SCRUBBED_ENV = ("TIERFS_FAILPOINTS",)


# ------------------------------------------------------------------------------------------ environment


def fuse_unavailable_reason() -> str | None:
    """Why real FUSE mounts cannot run here, or None when they can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: this machine/container has no FUSE device (run with --device /dev/fuse)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return f"/dev/fuse is not readable and writable by uid {os.getuid()}"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


FUSE_SKIP_REASON = fuse_unavailable_reason()
requires_fuse = pytest.mark.skipif(FUSE_SKIP_REASON is not None, reason=FUSE_SKIP_REASON or "")


def is_root() -> bool:
    return os.geteuid() == 0


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for tests that need one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The runner's environment without test-only tierfs variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------------------ processes


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL a child we started in its own session: its process group (pgid == its pid), then itself."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: proc.kill()):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def run(cmd: Sequence[str | os.PathLike], timeout: float = 60, *, check: bool = False,
        env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
        input: str | bytes | None = None, text: bool = True) -> subprocess.CompletedProcess:
    """Run `cmd` in a new session with stdout/stderr captured. On timeout, kill that session by the child's pid
    and raise subprocess.TimeoutExpired carrying what it printed. `check=True` raises on a non-zero exit."""
    cmd = [os.fspath(c) for c in cmd]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(env) if env is not None else None,
                            cwd=cwd, text=text, start_new_session=True)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # something in D state; do not hang the suite on it
            out, err = "", ""
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    except BaseException:
        _kill_session(proc)
        proc.wait()
        raise
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}\nstdout:\n{out}\nstderr:\n{err}")
    return res


def run_python(code: str, *args: Any, timeout: float = 60, check: bool = True, cwd: str | os.PathLike | None = None,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a Python snippet in a separate process (argv[1:] = args) with `run()`'s timeout handling."""
    return run([sys.executable, "-c", code, *[str(a) for a in args]], timeout=timeout, check=check, cwd=cwd, env=env)


def spawn_python(code: str, *args: Any, cwd: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start a long-lived Python helper (own session, stdin/stdout pipes, line-buffered text) for tests that need
    a process to *hold* something (a lock, a mapping). Stop it with `stop_process()`."""
    return subprocess.Popen([sys.executable, "-u", "-c", code, *[str(a) for a in args]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, bufsize=1)


def read_line(proc: subprocess.Popen, timeout: float = 30) -> str:
    """One line from a helper's stdout, failing (and killing it) instead of blocking past `timeout`. Reads the
    pipe unbuffered, so lines a helper printed together are all returned, one per call."""
    import selectors

    buf: bytearray = proc.__dict__.setdefault("_line_buf", bytearray())
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                stop_process(proc)
                raise AssertionError(f"helper pid {proc.pid} printed no line within {timeout}s; "
                                     f"stderr: {proc.stderr.read() if proc.stderr else ''}")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                proc.wait(timeout=timeout)
                raise AssertionError(f"helper pid {proc.pid} exited {proc.returncode} early; "
                                     f"stderr: {proc.stderr.read() if proc.stderr else ''}")
            buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode()


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> int:
    """Close a helper's stdin (its cue to finish), wait, SIGKILL its session by pid if it does not."""
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    except OSError:
        pass
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        return proc.wait(timeout=timeout)


def fd_targets(pid: int) -> list[str]:
    """What each open fd of `pid` points to (/proc/PID/fd links; fds closed while we look are skipped)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return targets


def pid_alive(pid: int | None) -> bool:
    """True while `pid` exists and is not a zombie (a reaped-later daemon counts as gone)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def helper_children(daemon: int, module: str) -> list[int]:
    """Live (not zombie) `python -m MODULE` processes whose parent is the daemon (tierfs.tier.helperproc)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(") ", 1)[1].split()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == daemon and fields[0] not in ("Z", "X") and module.encode() in cmdline.split(b"\0"):
            found.append(int(name))
    return found


def wait_for(pred, timeout: float = 30, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------ mounts and files


def files_under(root: str | os.PathLike) -> list[Path]:
    """Files below root, for polling a tree the daemon is deleting from: a directory that goes away between listing
    and reading it is skipped (os.walk ignores it), where Path.rglob raises FileNotFoundError."""
    return [Path(d) / f for d, _, names in os.walk(root) for f in names]


def mount_table() -> list[tuple[str, str, str]]:
    """(source, mountpoint, fstype) from /proc/self/mounts with octal escapes decoded."""
    out = []
    with open("/proc/self/mounts", "rb") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                dec = [re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), p).decode() for p in parts[:3]]
                out.append((dec[0], dec[1], dec[2]))
    return out


def lazy_unmount(mountpoint: str | os.PathLike, timeout: float = 30) -> None:
    """`fusermount3 -uz` until nothing is mounted at `mountpoint` (clears a mount whose daemon died)."""
    mp = os.path.abspath(mountpoint)
    for _ in range(5):
        if not any(m == mp for _, m, _t in mount_table()):
            return
        run(["fusermount3", "-uz", mp], timeout=timeout)


@contextmanager
def tmpfs(mp: Path, size: str, name: str = "tmpfs") -> Iterator[Path]:
    """A tmpfs of `size` (mount's size=, e.g. "64m") mounted at `mp` (created) for the block, then unmounted
    (lazily if busy). Needs root. As a fixture, request it before mount_store so it is torn down after the mount."""
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    mp.mkdir(parents=True, exist_ok=True)
    run(["mount", "-t", "tmpfs", "-o", f"size={size}", name, mp], check=True)
    try:
        yield mp
    finally:
        run(["umount", mp], timeout=30)
        if os.path.ismount(mp):
            run(["umount", "-l", mp], timeout=30)


def evict(path: str | os.PathLike) -> None:
    """Drop this one file's cached pages so the next read goes to the filesystem (fsync first: only clean pages
    can be dropped). Never touches the global page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def allocated_bytes(path: str | os.PathLike) -> int:
    return os.stat(path).st_blocks * 512


class MountError(AssertionError):
    pass


# Runs `tierfs mount ...` as a subreaper: prints the CLI's result as one JSON line, then reaps every orphan it
# adopts (the daemon) and prints "pid exitcode" for each, and exits when it has no children left.
_REAPER = r"""
import ctypes, json, os, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed")
r = subprocess.run(sys.argv[1:], capture_output=True, text=True, stdin=subprocess.DEVNULL)
print(json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}), flush=True)
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    print(pid, os.waitstatus_to_exitcode(status), flush=True)
"""


class Mount:
    """A tierfs store mounted through the real CLI (`python -m tierfs mount HOT MNT [--config F] [-o ...]`)."""

    def __init__(self, hot: str | os.PathLike, mnt: str | os.PathLike, *, options: Iterable[str] = (),
                 config: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                 mount_timeout: float = 60):
        self.hot = Path(hot).resolve()
        self.mnt = Path(mnt).resolve()
        self.options = tuple(options)
        self.config = Path(config) if config is not None else None
        self.env = daemon_env(env)
        self.mount_timeout = mount_timeout
        self.pid: int | None = None
        self.log: Path = self.state_dir / "tierfs.log"
        self.last_result: subprocess.CompletedProcess | None = None
        self._reaper: subprocess.Popen | None = None
        self._reapers: list[subprocess.Popen] = []
        self._exit_codes: dict[int, int] = {}

    def __repr__(self) -> str:
        return f"Mount(hot={self.hot}, mnt={self.mnt}, pid={self.pid})"

    # ------------------------------------------------------------------ paths

    @property
    def state_dir(self) -> Path:
        """HOT/.tierfs: lock, pid file, log (never visible through the mount)."""
        return self.hot / ".tierfs"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "daemon.pid"

    @property
    def ctl(self) -> Path:
        """MNT/.tierfs: the read-only control directory."""
        return self.mnt / ".tierfs"

    def path(self, *parts: str) -> Path:
        return self.mnt.joinpath(*parts)

    def hot_path(self, *parts: str) -> Path:
        return self.hot.joinpath(*parts)

    # ------------------------------------------------------------------ CLI

    def cli(self, *args: str | os.PathLike, timeout: float = 60, env: Mapping[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """Run `python -m tierfs ARGS` with this mount's environment."""
        return run([*TIERFS_CMD, *args], timeout=timeout, env=env if env is not None else self.env)

    def mount_args(self) -> list[str]:
        cmd = ["mount", str(self.hot), str(self.mnt)]
        if self.config is not None:
            cmd += ["--config", str(self.config)]
        for o in self.options:
            cmd += ["-o", o]
        return cmd

    def _cli_mount(self) -> subprocess.CompletedProcess:
        """`tierfs mount ...` under a reaper process (see module doc); returns the CLI's CompletedProcess."""
        import json
        import selectors

        cmd = [*TIERFS_CMD, *self.mount_args()]
        proc = subprocess.Popen([sys.executable, "-c", _REAPER, *cmd], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, text=True,
                                start_new_session=True)
        self._reapers.append(proc)
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(self.mount_timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            _kill_session(proc)  # the CLI and the reaper; the daemon has its own session
            err = proc.stderr.read() if proc.poll() is not None else ""
            raise subprocess.TimeoutExpired(cmd, self.mount_timeout, output="", stderr=err)
        r = json.loads(line)
        self._reaper = proc
        return subprocess.CompletedProcess(cmd, r["returncode"], r["stdout"], r["stderr"])

    def mount(self) -> "Mount":
        """Mount through the CLI; fails the test (with the CLI output and log tail) unless it exits 0."""
        res = self._cli_mount()
        self.last_result = res
        if res.returncode != 0:
            raise MountError(f"tierfs mount exited {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}\n"
                             f"log tail:\n{self.log_tail()}")
        m = re.search(r"\(pid (\d+), log (.+)\)\s*$", res.stdout.strip())
        if m:
            self.pid, self.log = int(m.group(1)), Path(m.group(2))
        else:
            self.pid = int(self.pid_file.read_text())
        if not self.is_mounted():
            raise MountError(f"tierfs mount exited 0 but {self.mnt} is not a {FSTYPE} mount: {res.stdout}")
        return self

    def umount(self, timeout: float = 60) -> subprocess.CompletedProcess:
        """`tierfs umount MNT`; asserts exit 0, the mount gone and the daemon gone."""
        res = self.cli("umount", str(self.mnt), timeout=timeout)
        self.last_result = res
        assert res.returncode == 0, f"tierfs umount exited {res.returncode}: {res.stderr}{res.stdout}"
        assert not self.is_mounted(), f"{self.mnt} still mounted after tierfs umount"
        assert not pid_alive(self.pid), f"daemon pid {self.pid} still alive after tierfs umount"
        return res

    def remount(self) -> "Mount":
        """Unmount (if mounted) and mount the same hot dir again with the same options and environment."""
        if self.is_mounted():
            self.umount()
        return self.mount()

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30) -> None:
        """Signal the daemon by pid and wait for it to exit; then `fusermount3 -uz` whatever mount it left."""
        if self.pid is not None and pid_alive(self.pid):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            self.wait_exit(timeout)
        if self.is_mounted(any_state=True):
            lazy_unmount(self.mnt)

    def daemon_exit_code(self, timeout: float = 30) -> int:
        """The exit code of the daemon this Mount last started (-N: killed by signal N); waits for its exit."""
        assert self.pid is not None, "never mounted"
        if self.pid not in self._exit_codes:
            self.wait_exit(timeout)
            for proc in self._reapers:
                self._drain(proc, timeout)
        if self.pid not in self._exit_codes:
            raise AssertionError(f"exit status of daemon pid {self.pid} was not recorded")
        return self._exit_codes[self.pid]

    def _drain(self, proc: subprocess.Popen, timeout: float) -> None:
        """Wait for a reaper (its daemon must be gone) and record the exit codes it printed."""
        if proc.returncode is not None:
            return
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # its daemon should be gone, so it should be too; do not leak it
            _kill_session(proc)
            out, _ = proc.communicate()
        for line in (out or "").splitlines():
            pid, _, code = line.partition(" ")
            if pid.isdigit() and code.lstrip("-").isdigit():
                self._exit_codes[int(pid)] = int(code)

    # ------------------------------------------------------------------ state

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def wait_exit(self, timeout: float = 30) -> None:
        wait_for(lambda: not pid_alive(self.pid), timeout, what=f"daemon pid {self.pid} to exit")

    def is_mounted(self, any_state: bool = False) -> bool:
        """A tierfs mount is at MNT (any_state: anything at all, including a dead FUSE connection)."""
        mp = str(self.mnt)
        return any(m == mp and (any_state or t == FSTYPE) for _, m, t in mount_table())

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def status(self) -> dict:
        import json

        return json.loads((self.ctl / "status.json").read_text())

    def cleanup(self) -> None:
        """Leave nothing behind whatever state the test left: CLI umount when possible, else kill by pid and
        lazy-unmount. Raises only if the mount could not be cleared at all."""
        if self.pid is None and self.is_mounted(any_state=True):  # mounted by a test's own CLI call
            try:
                self.pid = int(self.pid_file.read_text())
            except (OSError, ValueError):
                pass
        if self.is_mounted() and self.alive():
            try:
                res = self.cli("umount", str(self.mnt), timeout=30)
                if res.returncode == 0 and not self.is_mounted(any_state=True):
                    self.wait_exit(30)
                    self._close_reapers()
                    return
            except (subprocess.TimeoutExpired, AssertionError):
                pass
        try:
            self.kill(signal.SIGKILL)
            if self.is_mounted(any_state=True):
                raise MountError(f"could not clear the mount at {self.mnt}")
        finally:
            self._close_reapers()

    def _close_reapers(self) -> None:
        for proc in self._reapers:
            self._drain(proc, 10)
