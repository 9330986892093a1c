"""A real single-node Ceph cluster + radosgw (S3) on 127.0.0.1 for the test suite.

Pytest plugin-style module. Register it once in tests/conftest.py with

    pytest_plugins = ("ceph_rgw",)

(tests/ is on sys.path, as for `mountutil`). Test modules may also `from ceph_rgw import rgw`: every definition of
the fixture shares one process-wide cluster, started on first use and stopped when the last user is done.

    rgw -> RGW   (session scope)
        endpoint_url   'http://127.0.0.1:<free port>'
        access_key     'TESTKEY'
        secret_key     'TESTSECRET'
        region         'us-east-1'
        startup_seconds  how long the bring-up took
        run_dir        Path: ceph.conf, logs (log/*.log), data
        client(**config_kwargs) -> boto3 S3 client (path-style, short timeouts)
        make_bucket(name) -> name        (idempotent)
        stop_rgw(kill=False)             stop only the radosgw process (SIGTERM, or SIGKILL with kill=True)
        start_rgw()                      start it again on the same port and wait until it serves S3
        freeze_rgw() / thaw_rgw()        SIGSTOP / SIGCONT radosgw: a hung server (connects, never answers)
        pids() -> {name: pid}            the running daemons
        log_tail(name='client.rgw.a', lines=60) -> str

The cluster is one ceph-mon (v1+v2 on free ports, no auth), no ceph-mgr (NOMGR: RGW works without it), one
memstore OSD and one radosgw (beast frontend, tcp_nodelay=1), each started in the foreground by this module (so it
owns their PIDs) with PR_SET_PDEATHSIG so nothing survives a killed pytest. Teardown stops them by PID (SIGTERM,
wait, SIGKILL, wait). Bring-up takes about 2-4 s on 2 cores: the mon's paxos propose interval is cut from 1 s to
10 ms (every pool RGW creates is a mon commit), radosgw starts while the OSD boots, and readiness is polled
(mon port, HTTP answer, an authenticated ListBuckets) with a deadline (TIERFS_RGW_STARTUP_TIMEOUT, default 120 s);
a failure raises with the tails of the mon, OSD and RGW logs. A port taken between choosing and binding it is
retried with fresh ports (mon binds once, no 10 s retry loop). Without tcp_nodelay, beast + Nagle + delayed ACK
add ~40 ms to every small ranged GET.

Nothing is installed here. When a binary is missing the fixture skips with the reason, unless the environment
sets TIERFS_REQUIRE_RGW=1 or TIERFS_REQUIRE_ALL=1 (CI, tests/must_run.py), where it is an error. Debian/Ubuntu packages:
    apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common

Run `python tests/ceph_rgw.py` to bring a cluster up by hand (prints the endpoint; Ctrl-C stops it).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

import must_run

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool", "monmaptool")
APT_PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
ACCESS_KEY = "TESTKEY"
SECRET_KEY = "TESTSECRET"
REGION = "us-east-1"
STARTUP_TIMEOUT = float(os.environ.get("TIERFS_RGW_STARTUP_TIMEOUT", "120"))

_PR_SET_PDEATHSIG = 1


class RGWStartupError(RuntimeError):
    pass


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _free_port_pair() -> tuple[int, int]:
    """Two distinct free ports (mon msgr2 and msgr1)."""
    while True:
        a, b = free_port(), free_port()
        if a != b:
            return a, b


# Every daemon is forked from this one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that forked the
# child ends, so a restart made from a short-lived worker thread must not own the new radosgw.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ceph-rgw-spawner")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


_CONF = """\
[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_port2},v1:127.0.0.1:{mon_port1}]
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
run dir = {run}
log file = {run}/log/$name.log
admin socket = {run}/$name.asok
pid file = {run}/$name.pid
keyring = {run}/keyring
log to stderr = false
err to stderr = true
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
ms bind ipv6 = false
ms mon client mode = crc secure
ms bind retry count = 1
ms bind retry delay = 1
public addr = 127.0.0.1
client mount timeout = 30
rados mon op timeout = 30
debug ms = 0
paxos propose interval = 0.01
paxos min wait = 0.001
[mon]
mon data = {run}/mon/$name
[osd]
osd data = {run}/osd/$name
osd objectstore = memstore
memstore device bytes = 2147483648
osd max object name len = 460
osd max object namespace len = 64
osd heartbeat grace = 60
[client.rgw.a]
rgw data = {run}/rgw
rgw dns name = localhost
rgw enable usage log = false
rgw dynamic resharding = false
rgw thread pool size = 128
debug rgw = 1
"""


class RGW:
    """One cluster: ceph-mon + memstore ceph-osd + radosgw, all children of this process."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.mon_port2, self.mon_port1 = _free_port_pair()
        self.rgw_port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.rgw_port}"
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.region = REGION
        self.startup_seconds: float | None = None
        self.conf = self.run_dir / "ceph.conf"
        self._procs: dict[str, subprocess.Popen] = {}
        self._osd_id: str | None = None
        self._lock = threading.Lock()
        self.phases: list[tuple[str, float]] = []  # (phase, seconds since start) for startup diagnostics
        self._t0 = time.monotonic()

    def _phase(self, name: str) -> None:
        self.phases.append((name, round(time.monotonic() - self._t0, 2)))

    def __repr__(self) -> str:
        return f"RGW(endpoint_url={self.endpoint_url!r}, run_dir='{self.run_dir}')"

    # ------------------------------------------------------------------ process helpers

    def _cmd(self, *args: str, timeout: float = 60, check: bool = True, watch: tuple[str, ...] = ()) -> str:
        """Run a ceph tool to completion; fail fast if a watched daemon dies meanwhile (the tool would hang)."""
        cmd = [args[0], "-c", str(self.conf), *args[1:]]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            deadline = time.monotonic() + timeout
            try:
                while p.poll() is None:
                    for n in watch:
                        self._check_alive(n)
                    if time.monotonic() > deadline:
                        raise RGWStartupError(f"{' '.join(cmd)} timed out after {timeout:.0f}s\n{self._all_logs()}")
                    time.sleep(0.05)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if check and p.returncode != 0:
            raise RGWStartupError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{stdout}{stderr}\n"
                                  f"{self._all_logs()}")
        return stdout

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        def popen() -> subprocess.Popen:
            with open(self.run_dir / "log" / f"{name}.stdout", "ab") as out:
                return subprocess.Popen([args[0], "-c", str(self.conf), *args[1:]], stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with_parent)

        p = _spawner.submit(popen).result()
        self._procs[name] = p
        return p

    def _check_alive(self, name: str) -> None:
        p = self._procs.get(name)
        if p is not None and p.poll() is not None:
            raise RGWStartupError(f"{name} (pid {p.pid}) exited with status {p.returncode} during startup\n"
                                  f"{self.log_tail(name)}")

    def _stop(self, name: str, kill: bool = False, timeout: float = 20) -> None:
        p = self._procs.pop(name, None)
        if p is None:
            return
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL if kill else signal.SIGTERM)
                os.kill(p.pid, signal.SIGCONT)  # a frozen (SIGSTOPped) daemon must run to act on SIGTERM
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)

    def log_tail(self, name: str = "client.rgw.a", lines: int = 60) -> str:
        parts = []
        for f in (self.run_dir / "log" / f"{name}.log", self.run_dir / "log" / f"{name}.stdout"):
            try:
                text = f.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- tail of {f} ---\n" + "\n".join(text))
        return "\n".join(parts) or f"(no log for {name} in {self.run_dir / 'log'})"

    def _all_logs(self) -> str:
        names = ["mon.a"] + ([f"osd.{self._osd_id}"] if self._osd_id is not None else []) + ["client.rgw.a"]
        return "\n".join(self.log_tail(n, 40) for n in names)

    def _wait(self, what: str, probe, timeout: float, watch: tuple[str, ...] = ()) -> Any:
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            for n in watch:
                self._check_alive(n)
            result = probe()
            if result:
                return result
            if time.monotonic() > deadline:
                raise RGWStartupError(f"timed out after {timeout:.0f}s waiting for {what}\n{self._all_logs()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    # ------------------------------------------------------------------ bring-up

    def start(self) -> "RGW":
        """Bring the cluster up; retried (fresh ports, fresh dir) only when a port was taken meanwhile."""
        t0 = self._t0 = time.monotonic()
        base = self.run_dir
        for attempt in range(3):
            try:
                self._start(t0 + STARTUP_TIMEOUT)
                break
            except RGWStartupError as e:
                self.close()
                if attempt < 2 and "Address already in use" in str(e):
                    self._phase(f"port clash, retrying ({attempt + 1})")
                    self.mon_port2, self.mon_port1 = _free_port_pair()
                    self.rgw_port = free_port()
                    self.endpoint_url = f"http://127.0.0.1:{self.rgw_port}"
                    self.run_dir = base / f"retry{attempt + 1}"
                    self.conf = self.run_dir / "ceph.conf"
                    continue
                raise
            except BaseException:
                self.close()
                raise
        self.startup_seconds = time.monotonic() - t0
        atexit.register(self.close)
        return self

    def _start(self, deadline: float) -> None:
        run = self.run_dir
        for d in ("mon", "osd", "rgw", "log"):
            (run / d).mkdir(parents=True, exist_ok=True)
        fsid = str(uuid.uuid4())
        self.conf.write_text(_CONF.format(fsid=fsid, run=run, mon_port1=self.mon_port1, mon_port2=self.mon_port2))
        keyring = str(run / "keyring")
        subprocess.run(["ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.", "--cap", "mon",
                        "allow *"], check=True, capture_output=True)
        subprocess.run(["ceph-authtool", keyring, "--gen-key", "-n", "client.admin", "--cap", "mon", "allow *",
                        "--cap", "osd", "allow *", "--cap", "mgr", "allow *"], check=True, capture_output=True)
        monmap = str(run / "monmap")
        subprocess.run(["monmaptool", "--create", "--addv", "a",
                        f"[v2:127.0.0.1:{self.mon_port2},v1:127.0.0.1:{self.mon_port1}]", "--fsid", fsid, monmap],
                       check=True, capture_output=True)
        self._phase("keyring+monmap")
        self._cmd("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", keyring)
        self._spawn("mon.a", "ceph-mon", "-f", "-i", "a")
        self._wait("ceph-mon to listen", lambda: _port_open(self.mon_port2), 30, watch=("mon.a",))
        self._phase("mon listening")

        left = lambda: max(5.0, deadline - time.monotonic())  # noqa: E731
        self._osd_id = self._cmd("ceph", "--connect-timeout", str(int(left())), "osd", "create",
                                 timeout=left(), watch=("mon.a",)).strip()
        osd = f"osd.{self._osd_id}"
        self._phase("osd created")
        (run / "osd" / osd).mkdir(parents=True, exist_ok=True)
        self._cmd("ceph-osd", "-i", self._osd_id, "--mkfs", "--osd-uuid", str(uuid.uuid4()), timeout=left())
        self._phase("osd mkfs")
        self._spawn(osd, "ceph-osd", "-f", "-i", self._osd_id)
        self._cmd("ceph", "osd", "crush", "add", osd, "1.0", "host=localhost", "root=default", timeout=left(),
                  check=False, watch=("mon.a", osd))
        # radosgw waits for the OSD by itself (it creates its pools): start it now, in parallel with OSD boot.
        self._phase("osd started, crush")
        self._spawn_rgw()
        self._wait_rgw(left(), watch=("mon.a", osd, "client.rgw.a"))
        self._phase("rgw answers HTTP")
        self._cmd("radosgw-admin", "user", "create", "--uid=test", "--display-name=test",
                  f"--access-key={ACCESS_KEY}", f"--secret={SECRET_KEY}", timeout=left(),
                  watch=("mon.a", osd, "client.rgw.a"))
        # The S3 path is ready when an authenticated request succeeds (user metadata reached the gateway).
        self._phase("user created")
        self._wait("an authenticated S3 request", self._s3_ready, left(), watch=("client.rgw.a",))
        self._phase("S3 ready")

    def _spawn_rgw(self) -> None:
        self._spawn("client.rgw.a", "radosgw", "-f", "-n", "client.rgw.a",
                    f"--rgw-frontends=beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1")

    def _http_up(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url + "/", timeout=2) as r:
                r.read()
            return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer means the frontend serves requests
        except (OSError, ValueError):
            return False

    def _s3_ready(self) -> bool:
        try:
            self.client().list_buckets()
            return True
        except Exception:
            return False

    def _wait_rgw(self, timeout: float, watch: tuple[str, ...] = ("client.rgw.a",)) -> None:
        self._wait(f"radosgw to answer HTTP on {self.endpoint_url}", self._http_up, timeout, watch=watch)

    # ------------------------------------------------------------------ API for tests

    def client(self, **config_kwargs: Any):
        import boto3
        from botocore.config import Config

        kw: dict[str, Any] = dict(connect_timeout=5, read_timeout=30, retries={"total_max_attempts": 3},
                                  s3={"addressing_style": "path"}, signature_version="s3v4")
        kw.update(config_kwargs)
        try:
            cfg = Config(request_checksum_calculation="when_required",
                         response_checksum_validation="when_required", **kw)
        except TypeError:  # botocore < 1.36 has no such options (and sends no default checksums)
            cfg = Config(**kw)
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, config=cfg)

    def make_bucket(self, name: str) -> str:
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def stop_rgw(self, kill: bool = False) -> None:
        """Stop only the radosgw process (the object store goes down; the cluster keeps its data)."""
        with self._lock:
            self._stop("client.rgw.a", kill=kill)

    def start_rgw(self, timeout: float = 60) -> None:
        """Start radosgw again on the same port; returns when it serves authenticated S3 requests."""
        with self._lock:
            p = self._procs.get("client.rgw.a")
            if p is not None and p.poll() is None:
                return
            self._spawn_rgw()
            deadline = time.monotonic() + timeout
            self._wait_rgw(timeout)
            self._wait("an authenticated S3 request", self._s3_ready, max(1.0, deadline - time.monotonic()),
                       watch=("client.rgw.a",))

    def freeze_rgw(self) -> None:
        """SIGSTOP radosgw: connections are still accepted by the kernel but never answered (a hung server)."""
        with self._lock:
            p = self._procs.get("client.rgw.a")
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGSTOP)

    def thaw_rgw(self) -> None:
        """SIGCONT radosgw after freeze_rgw."""
        with self._lock:
            p = self._procs.get("client.rgw.a")
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)

    @property
    def rgw_running(self) -> bool:
        p = self._procs.get("client.rgw.a")
        return p is not None and p.poll() is None

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self._procs.items() if p.poll() is None}

    def close(self) -> None:
        """Stop every daemon by PID, radosgw first, and wait for each to exit."""
        with contextlib.suppress(Exception):
            self.thaw_rgw()
        for name in ["client.rgw.a"] + [n for n in list(self._procs) if n.startswith("osd.")] + ["mon.a"]:
            try:
                self._stop(name)
            except Exception:
                pass
        for name in list(self._procs):
            self._stop(name, kill=True)


# ---------------------------------------------------------------------------------------------- pytest fixture

_shared: dict[str, Any] = {"rgw": None, "users": 0, "error": None}
_shared_lock = threading.Lock()


def _short_run_dir(base: Path) -> Path:
    # unix socket paths (admin sockets) must stay under 108 bytes
    if len(str(base)) > 60:
        return Path(tempfile.mkdtemp(prefix="tierfs-ceph-"))
    return base


def _acquire(tmp_path_factory: pytest.TempPathFactory) -> RGW:
    with _shared_lock:
        if _shared["error"] is not None:
            raise RGWStartupError(f"ceph/radosgw failed to start earlier in this session: {_shared['error']}")
        if _shared["rgw"] is None:
            run_dir = _short_run_dir(tmp_path_factory.mktemp("ceph"))
            try:
                _shared["rgw"] = RGW(run_dir).start()
            except Exception as e:
                _shared["error"] = str(e).splitlines()[0] if str(e) else repr(e)
                raise
        _shared["users"] += 1
        return _shared["rgw"]


def _release() -> None:
    with _shared_lock:
        _shared["users"] -= 1
        if _shared["users"] <= 0 and _shared["rgw"] is not None:
            r, _shared["rgw"] = _shared["rgw"], None
            r.close()


@pytest.fixture(scope="session")
def rgw(tmp_path_factory: pytest.TempPathFactory):
    missing = missing_binaries()
    if missing:
        reason = (f"Ceph RGW binaries missing ({', '.join(missing)}); install with: apt-get install -y "
                  f"--no-install-recommends {' '.join(APT_PACKAGES)}")
        if must_run.rgw_required():
            pytest.fail(f"the S3 tests must run here (TIERFS_REQUIRE_RGW or TIERFS_REQUIRE_ALL) but {reason}",
                        pytrace=False)
        pytest.skip(reason)
    r = _acquire(tmp_path_factory)
    try:
        yield r
    finally:
        _release()


def main() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="tierfs-ceph-"))
    r = RGW(run_dir)
    print(f"starting ceph + radosgw in {run_dir} ...", flush=True)
    r.start()
    print(f"up in {r.startup_seconds:.1f}s: endpoint {r.endpoint_url} key {r.access_key} secret {r.secret_key} "
          f"pids {r.pids()}", flush=True)
    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        r.close()
        print("stopped", flush=True)


if __name__ == "__main__":
    if missing_binaries():
        sys.exit(f"missing: {', '.join(missing_binaries())}")
    main()
