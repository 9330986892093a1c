"""Helpers shared by the tierfs benchmarks (bench/*.py): a mount that always cleans up, child-process workloads,
page-cache eviction and residency checks, FUSE stats deltas, py-spy capture and ratio tables.

Nothing here imports tierfs: the benchmarks drive the real CLI (`python -m tierfs mount/umount`) exactly as an
operator would, and talk to the daemon only through its mount (`MNT/.tierfs/...`) and its pid file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

PY = sys.executable
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ signals / temp dirs


class Interrupted(BaseException):
    """SIGTERM/SIGHUP turned into an exception so every `finally` (unmount, kill, rm) still runs."""


def install_signal_handlers() -> None:
    def _raise(signum: int, _frame: Any) -> None:
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _raise)


@contextlib.contextmanager
def temp_base(parent: str | None, prefix: str = "tierfs-bench-", keep: bool = False) -> Iterator[Path]:
    """A fresh temp dir under `parent` (default: $TMPDIR), removed on exit unless keep=True."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=parent)).resolve()
    try:
        yield base
    finally:
        if keep:
            log(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ page cache


def syncfs(path: str | os.PathLike) -> None:
    """Flush one filesystem's dirty data (never drops caches)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _libc.syncfs(fd)
    finally:
        os.close(fd)


def evict(path: str | os.PathLike, sync: bool = False) -> None:
    """Drop one file's clean pages from the page cache (sync=True: fdatasync first so dirty pages can go too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if sync:
            with contextlib.suppress(OSError):
                os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_map(path: str | os.PathLike, first: int = 0, n: int | None = None) -> bytes | None:
    """One byte per page of [first, first + n) (n None: to the end of the file), bit 0 set where the page is in the
    page cache: mincore over a PROT_READ mapping that is never touched, so nothing is read or faulted in. None if the
    mapping or mincore fails."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if n is None:
            n = max(0, (os.fstat(fd).st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE - first)
        if not n:
            return b""
        length = (first + n) * mmap.PAGESIZE
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            vec = ctypes.create_string_buffer(first + n)
            if _libc.mincore(ctypes.c_void_p(addr), length, vec) != 0:
                return None
            return vec.raw[first:first + n]
        finally:
            _libc.munmap(ctypes.c_void_p(addr), length)
    finally:
        os.close(fd)


def resident_pages(path: str | os.PathLike, first: int, n: int) -> int:
    """How many of pages [first, first + n) of `path` are in the page cache (see resident_map)."""
    vec = resident_map(path, first, n)
    if vec is None:
        raise OSError(ctypes.get_errno(), f"mincore of {path}")
    return sum(b & 1 for b in vec)


def resident_fraction(path: str | os.PathLike) -> float:
    """Share of the file's pages in the page cache (nan if it cannot be told; 0.0 for an empty file)."""
    vec = resident_map(path)
    if vec is None:
        return float("nan")
    return sum(b & 1 for b in vec) / len(vec) if vec else 0.0


def write_data_file(path: Path, size: int, chunk: int = 1 << 20) -> None:
    """A non-sparse file of `size` bytes of incompressible data, fsynced and evicted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = bytearray(os.urandom(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < size:
            block[0:8] = off.to_bytes(8, "little")
            n = min(chunk, size - off)
            os.pwrite(fd, memoryview(block)[:n], off)
            off += n
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def copy_tree_in(src_root: Path, mnt: Path, chunk: int = 1 << 20) -> None:
    """Write a tree through a mount like a writer that flushes (1 MiB writes, fsync per file)."""
    for p in sorted(src_root.rglob("*")):
        dst = mnt / p.relative_to(src_root)
        if p.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        with open(p, "rb") as src, open(dst, "wb") as out:
            shutil.copyfileobj(src, out, chunk)
            out.flush()
            os.fsync(out.fileno())


def read_file_once(path: Path, chunk: int = 1 << 20) -> int:
    """Read a whole file sequentially (warm-up of lower layers); returns the bytes read."""
    buf = bytearray(chunk)
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while (n := os.readv(fd, [buf])) > 0:
            total += n
    finally:
        os.close(fd)
    return total


# ------------------------------------------------------------------------------------------------ statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (q in 0..1)."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(q * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def median(values: Iterable[float]) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


# ------------------------------------------------------------------------------------------------ child workloads


def run_child(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run one workload in its own interpreter; it must print one JSON object as its last stdout line."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"workload child failed (rc {proc.returncode}): {' '.join(argv[-2:])}\n{err.strip()}")
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"workload child printed nothing\n{err.strip()}")
    return json.loads(lines[-1])


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name (field 3, the state, is index 0), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_cpu_seconds(pid: int) -> float:
    """user+system CPU of a whole process (all threads) so far, from /proc/PID/stat."""
    fields = stat_fields(pid)
    return float("nan") if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    """ppid -> live child pids, from one scan of /proc (this kernel may lack /proc/PID/task/TID/children)."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = stat_fields(int(name))
            if f is not None:
                kids.setdefault(int(f[1]), []).append(int(name))
    return kids


def _children_of(pid: int, scan: dict[int, list[int]] | None) -> list[int]:
    """Live children of `pid`: /proc/PID/task/*/children where the kernel has it, else the /proc scan."""
    if scan is not None:
        return scan.get(pid, [])
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


_HAS_CHILDREN_FILE = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


class TreeCpu(NamedTuple):
    """CPU seconds of a process tree: `own` (the root's threads), `helpers` (its descendants: the live ones' own
    CPU plus, through cutime/cstime, every descendant already reaped), and `processes` (live ones counted)."""

    own: float
    helpers: float
    processes: int

    @property
    def total(self) -> float:
        return self.own + self.helpers


def tree_cpu(pid: int | None, same_session: bool = False) -> TreeCpu:
    """user+system CPU of `pid` and every descendant, so far (all nan if `pid` is gone or None).

    A live process's own time is its utime+stime; a descendant that exited and was waited for shows only in its
    parent's cutime+cstime (which holds the whole reaped subtree). So the sum over the live tree of
    utime+stime+cutime+cstime counts each process once. A child reaped while the tree is being read would be
    counted twice or not at all: the walk is repeated until no cutime moved during it. same_session=True leaves
    out descendants that started their own session (the daemon's pipeline job, which benches count apart) and,
    since a reaped one cannot be told apart, everything reaped: only live same-session helpers are counted then.
    """
    nan = float("nan")
    if pid is None:
        return TreeCpu(nan, nan, 0)
    tick = os.sysconf("SC_CLK_TCK")
    for _ in range(5):
        root = stat_fields(pid)
        if root is None:
            return TreeCpu(nan, nan, 0)
        scan = None if _HAS_CHILDREN_FILE else _children_map()
        stats: dict[int, list[str]] = {pid: root}
        todo = [pid]
        while todo:
            for c in _children_of(todo.pop(), scan):
                f = stat_fields(c)
                if f is None or c in stats or (same_session and f[3] != root[3]):
                    continue
                stats[c] = f
                todo.append(c)
        own = int(root[11]) + int(root[12])
        helpers = sum(int(f[11]) + int(f[12]) for p, f in stats.items() if p != pid)
        if not same_session:
            helpers += sum(int(f[13]) + int(f[14]) for f in stats.values())
        moved = any((g := stat_fields(p)) is not None and g[13:15] != f[13:15] for p, f in stats.items())
        if not moved:
            break
    return TreeCpu(own / tick, helpers / tick, len(stats))


def daemon_cpu_seconds(pid: int | None) -> float:
    """CPU of a FUSE daemon with its helper processes (tierfs's flusher and write primer, the C floor's primer),
    live or reaped: what every benchmark reports as "daemon CPU"."""
    return tree_cpu(pid).total


DAEMON_CPU_NOTE = "daemon CPU = the daemon + its helper processes (flusher, write primer; live and reaped)"


def children_cpu_seconds() -> float:
    """user+system CPU of all reaped children of this process so far."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ------------------------------------------------------------------------------------------------ the mount


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


def _mounted(mnt: Path) -> bool:
    mp = str(mnt)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and bytes(parts[1], "ascii").decode("unicode_escape") == mp:
                return True
    return False


def mount_dev(mnt: Path) -> tuple[int, int] | None:
    mp = str(mnt)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if bytes(parts[4], "ascii").decode("unicode_escape") == mp:
                a, b = parts[2].split(":")
                found = (int(a), int(b))
    return found


class FuseMount:
    """What every benchmark mount shares: its daemon's pid, its device (for the kernel knobs), a teardown that
    always leaves nothing behind (lazy unmount, abort of the FUSE connection, SIGTERM/SIGKILL by pid, never by
    name)."""

    mnt: Path
    pid: int | None = None
    dev: tuple[int, int] | None = None

    def _force_gone(self) -> None:
        if _mounted(self.mnt.resolve()):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        if self.pid is not None and _alive(self.pid):
            self._kill(self.pid)
        if self.dev is not None and _mounted(self.mnt.resolve()):  # last resort: abort the connection
            with contextlib.suppress(OSError):
                Path(f"/sys/fs/fuse/connections/{os.makedev(*self.dev)}/abort").write_text("1")
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)

    @staticmethod
    def _kill(pid: int) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if not _alive(pid):
                return
        log(f"daemon pid {pid} survived SIGKILL")

    def stats(self) -> dict:
        """FUSE request stats; a daemon without a control dir has none."""
        return {"ops": {}}

    def knob_paths(self) -> dict[str, Path]:
        """The mount's kernel knobs: its bdi's (read-ahead, dirty limits) and its FUSE connection's (fusectl)."""
        if self.dev is None:
            return {}
        bdi = Path(f"/sys/class/bdi/{self.dev[0]}:{self.dev[1]}")
        conn = Path(f"/sys/fs/fuse/connections/{os.makedev(*self.dev)}")
        return {**{k: bdi / k for k in ("read_ahead_kb", "max_ratio", "strict_limit", "max_bytes")},
                **{k: conn / k for k in ("max_background", "congestion_threshold")}}

    def kernel_tuning(self) -> dict:
        """What the kernel really uses for this mount (bdi read-ahead, fusectl knobs)."""
        out: dict[str, Any] = {}
        for k, p in self.knob_paths().items():
            with contextlib.suppress(OSError, ValueError):
                out[k] = int(p.read_text())
        return out


class TierfsMount(FuseMount):
    """`tierfs mount HOT MNT -o ...` that always goes away: clean umount first, then FuseMount's teardown."""

    def __init__(self, hot: Path, mnt: Path, options: Sequence[str] = (), tierfs_src: str | None = None):
        self.hot, self.mnt = Path(hot).resolve(), Path(mnt).resolve()
        self.options = list(options)
        self.env = dict(os.environ)
        # cwd is "/" for the CLI so `python -m tierfs` never picks up a tierfs/ from the caller's cwd
        if tierfs_src:  # run the daemon (and umount) from another source tree
            src = str(Path(tierfs_src).resolve())
            self.env["PYTHONPATH"] = src + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.pid: int | None = None
        self.dev: tuple[int, int] | None = None

    def __enter__(self) -> "TierfsMount":
        self.hot.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        cmd = [PY, "-m", "tierfs", "mount", str(self.hot), str(self.mnt)]
        for o in self.options:
            cmd += ["-o", o]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=self.env, cwd="/")
            if r.returncode != 0:
                raise RuntimeError(f"tierfs mount failed: {r.stderr.strip() or r.stdout.strip()}")
            self.pid = int((self.hot / ".tierfs" / "daemon.pid").read_text())
            self.dev = mount_dev(self.mnt.resolve())
        except BaseException:
            self._teardown(clean=False)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._teardown(clean=True)

    def _teardown(self, clean: bool) -> None:
        if self.pid is None:
            with contextlib.suppress(OSError, ValueError):
                self.pid = int((self.hot / ".tierfs" / "daemon.pid").read_text())
        if clean and _mounted(self.mnt.resolve()):
            try:
                r = subprocess.run([PY, "-m", "tierfs", "umount", str(self.mnt)], capture_output=True, text=True,
                                   timeout=120, env=self.env, cwd="/")
                if r.returncode != 0:
                    log(f"tierfs umount failed: {r.stderr.strip()}")
            except subprocess.TimeoutExpired:
                log("tierfs umount timed out")
        self._force_gone()

    # -------------------------------------------------------------------------------- inspection

    def stats(self) -> dict:
        """Parsed MNT/.tierfs/stats: {'bytes_read', 'bytes_written', 'ops': {op: {count, mean_us, ...}}}."""
        out: dict[str, Any] = {"ops": {}}
        try:
            text = (self.mnt / ".tierfs" / "stats").read_text()
        except OSError:
            return out
        header: list[str] | None = None
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in ("bytes_read", "bytes_written", "uptime_s"):
                out[parts[0]] = float(parts[1]) if "." in parts[1] else int(parts[1])
            elif parts and parts[0] == "op":
                header = parts
            elif header and len(parts) == len(header):
                out["ops"][parts[0]] = {h: (int(v) if v.isdigit() else float(v)) for h, v in zip(header[1:], parts[1:])}
        return out

    def wait_tuned(self, timeout: float = 30) -> dict:
        """The kernel knobs once the daemon has set them (it does so after `tierfs mount` returns)."""
        cfg = self.config()
        want = {k: int(cfg.get(f"mount.{k}", 0)) for k in ("read_ahead_kb", "max_background")}
        with contextlib.suppress(RuntimeError):  # a knob the kernel refuses stays as it is; the caller logs it
            wait_until(lambda: all(self.kernel_tuning().get(k) == v for k, v in want.items() if v), timeout,
                       f"the daemon to set {want}", poll=0.1)
        return self.kernel_tuning()

    def status(self) -> dict:
        """Parsed MNT/.tierfs/status.json: {'files': [...], 'totals': {..., 'engine': {counters}}}."""
        return json.loads((self.mnt / ".tierfs" / "status.json").read_text())

    def config(self) -> dict:
        """The daemon's effective configuration from MNT/.tierfs/config (TOML, secrets redacted), as dotted keys."""
        import tomllib

        def flat(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
            for k, v in tree.items():
                yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else ((f"{prefix}{k}", v),)

        return dict(flat(tomllib.loads((self.mnt / ".tierfs" / "config").read_text())))


class FloorMount(FuseMount):
    """bench/fuse_floor.c, built into `build_dir` and mounted over `src`: a passthrough in C with tierfs's kernel
    settings (`tuning`: the tierfs mount's kernel_tuning(), written to this mount's bdi and fusectl). It is the
    baseline for what FUSE itself costs, apart from what tierfs's Python request loop and engine add.
    `write_prime_kb` and `hole_reads` give it tierfs's write primer and its hole answer for large READs (see the
    top of fuse_floor.c), so that what tierfs adds over it is only what Python costs."""

    SOURCE = Path(__file__).resolve().parent / "fuse_floor.c"

    def __init__(self, src: Path, mnt: Path, build_dir: Path, tuning: dict | None = None, splice: bool = False,
                 attr_timeout: float = 1.0, write_prime_kb: int = 0, hole_reads: bool = False):
        self.src, self.mnt = Path(src).resolve(), Path(mnt).resolve()
        self.build_dir, self.tuning, self.splice, self.attr_timeout = Path(build_dir), tuning or {}, splice, attr_timeout
        self.write_prime_kb, self.hole_reads = write_prime_kb, hole_reads
        self.log_path = self.build_dir / "fuse_floor.log"
        self._proc: subprocess.Popen | None = None

    def build(self) -> Path:
        """Compile the floor daemon (a C compiler and libfuse3-dev, which the install scripts provide)."""
        exe = self.build_dir / "fuse_floor"
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
        if flags.returncode != 0:
            raise RuntimeError(f"pkg-config fuse3 failed (install libfuse3-dev pkg-config): {flags.stderr.strip()}")
        r = subprocess.run(["cc", "-O2", "-Wall", "-o", str(exe), str(self.SOURCE), *flags.stdout.split()],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"building {self.SOURCE.name} failed: {r.stderr.strip()}")
        return exe

    def __enter__(self) -> "FloorMount":
        self.build_dir.mkdir(parents=True, exist_ok=True)
        self.src.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        cmd = [str(self.build()), "--timeout", str(self.attr_timeout), *(["--splice"] if self.splice else []),
               *(["--write-prime", str(self.write_prime_kb)] if self.write_prime_kb else []),
               *(["--hole-reads"] if self.hole_reads else []), str(self.src), str(self.mnt)]
        try:
            with open(self.log_path, "wb") as logf:
                self._proc = proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                                     start_new_session=True)
            self.pid = proc.pid
            wait_until(lambda: _mounted(self.mnt) or proc.poll() is not None, 30, "the floor mount")
            if not _mounted(self.mnt):
                raise RuntimeError(f"fuse_floor exited {proc.returncode}: {self.log_path.read_text()[-2000:]}")
            self.dev = mount_dev(self.mnt)
            os.stat(self.mnt)  # INIT done: the kernel has set the bdi from our reply, so ours below stays
            self._apply_tuning()
        except BaseException:
            self._force_gone()
            raise
        return self

    def _apply_tuning(self) -> None:
        paths = self.knob_paths()
        for key in ("read_ahead_kb", "max_background", "congestion_threshold"):  # what tierfs sets for itself
            if key in self.tuning:
                try:
                    paths[key].write_text(str(self.tuning[key]))
                except OSError as e:
                    log(f"could not set {paths[key]} = {self.tuning[key]}: {e.strerror}")

    def __exit__(self, *exc: Any) -> None:
        if _mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
            with contextlib.suppress(RuntimeError):  # the daemon's loop ends at the unmount
                wait_until(lambda: self.pid is None or not _alive(self.pid), 10, "fuse_floor to exit", poll=0.05)
        self._force_gone()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)


def set_bdi(mount: "FuseMount", settings: Sequence[str]) -> dict:
    """Write KEY=VALUE pairs to /sys/class/bdi/<mount dev>/KEY (e.g. max_ratio=20, strict_limit=0)."""
    done: dict[str, Any] = {}
    if mount.dev is None:
        return done
    for item in settings:
        for part in filter(None, (p.strip() for p in item.split(","))):
            key, _, value = part.partition("=")
            path = Path(f"/sys/class/bdi/{mount.dev[0]}:{mount.dev[1]}/{key.strip()}")
            try:
                path.write_text(value.strip())
                done[key.strip()] = path.read_text().strip()
            except OSError as e:
                log(f"could not set {path} = {value.strip()}: {e.strerror}")
    return done


def stats_delta(before: dict, after: dict) -> dict:
    """Requests served between two stats snapshots: count per op, and bytes per READ/WRITE request."""
    ops: dict[str, Any] = {}
    for name, a in after.get("ops", {}).items():
        b = before.get("ops", {}).get(name, {})
        n = a.get("count", 0) - b.get("count", 0)
        if n > 0:
            # mean over the interval from the two cumulative means
            tot = a.get("mean_us", 0) * a.get("count", 0) - b.get("mean_us", 0) * b.get("count", 0)
            # (the stats file rounds means to 0.1 us, so with few requests this is approximate; never negative)
            ops[name] = {"count": n, "mean_us": round(max(tot / n, 0.0), 1), "p50_us_cum": a.get("p50_us"),
                         "p99_us_cum": a.get("p99_us")}
    rd = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    wr = after.get("bytes_written", 0) - before.get("bytes_written", 0)
    out = {"ops": ops, "bytes_read": rd, "bytes_written": wr}
    if ops.get("read", {}).get("count"):
        out["read_bytes_per_op"] = rd // ops["read"]["count"]
    if ops.get("write", {}).get("count"):
        out["write_bytes_per_op"] = wr // ops["write"]["count"]
    return out


def format_stats_delta(d: dict) -> str:
    parts = []
    for name, s in sorted(d["ops"].items(), key=lambda kv: -kv[1]["count"]):
        if name in ("lookup", "getattr", "open", "release", "flush", "opendir", "readdir", "releasedir", "forget",
                    "access", "statfs") and s["count"] < 20:
            continue
        extra = ""
        if name == "read" and "read_bytes_per_op" in d:
            extra = f", {d['read_bytes_per_op'] / 1024:.0f} KiB/op"
        if name == "write" and "write_bytes_per_op" in d:
            extra = f", {d['write_bytes_per_op'] / 1024:.0f} KiB/op"
        parts.append(f"{name} {s['count']} (mean {s['mean_us']} us{extra})")
    return "; ".join(parts) or "-"


# ------------------------------------------------------------------------------------------------ Ceph RGW


@contextlib.contextmanager
def ceph_rgw(memstore_bytes: int | None = None, keep: bool = False) -> Iterator[Any]:
    """A throwaway single-node Ceph + radosgw on 127.0.0.1 (tests/ceph_rgw.py's RGW), stopped by PID on exit.

    The OSD is a memstore (objects live in RAM) capped at 2 GiB for the tests; `memstore_bytes` raises that cap
    for benchmarks that store more (only what is stored uses memory)."""
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import ceph_rgw as cr

    missing = cr.missing_binaries()
    if missing:
        raise SystemExit(f"Ceph binaries missing ({', '.join(missing)}); apt-get install -y "
                         f"--no-install-recommends {' '.join(cr.APT_PACKAGES)}")
    if memstore_bytes:
        conf, n = re.subn(r"memstore device bytes = \d+", f"memstore device bytes = {int(memstore_bytes)}",
                          cr._CONF)
        if n != 1:
            raise RuntimeError("tests/ceph_rgw.py no longer sets 'memstore device bytes'; update bench/_common.py")
        cr._CONF = conf
    run_dir = Path(tempfile.mkdtemp(prefix="tierfs-bench-ceph-"))
    r = cr.RGW(run_dir)
    log(f"starting ceph + radosgw in {run_dir}")
    r.start()
    log(f"radosgw up in {r.startup_seconds:.1f}s at {r.endpoint_url}")
    try:
        yield r
    finally:
        r.close()
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def rgw_store_options(rgw: Any, bucket: str, prefix: str) -> str:
    """`tierfs mount -o` value that puts the mount's objects under s3://BUCKET/PREFIX on a ceph_rgw()."""
    return (f"objectstore.url=s3://{bucket}/{prefix},objectstore.endpoint_url={rgw.endpoint_url},"
            f"objectstore.access_key_id={rgw.access_key},objectstore.secret_access_key={rgw.secret_key},"
            f"objectstore.addressing=path")


def rgw_cpu_seconds(rgw: Any) -> float:
    """CPU of the RGW's processes so far (ceph-mon, the OSD, radosgw): what an object store costs this machine."""
    return sum(proc_cpu_seconds(pid) for pid in rgw.pids().values())


def delete_prefix(rgw: Any, bucket: str, prefix: str) -> int:
    """Delete every object under s3://BUCKET/PREFIX/ (a memstore OSD keeps them in RAM); how many went."""
    client, n = rgw.client(), 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            n += len(keys)
    return n


# ------------------------------------------------------------------------------------------------ py-spy


def py_spy_path() -> str | None:
    cand = Path(PY).with_name("py-spy")
    return str(cand) if cand.exists() else shutil.which("py-spy")


@contextlib.contextmanager
def py_spy_record(pid: int, out: Path, fmt: str = "speedscope", rate: int = 200) -> Iterator[None]:
    """Sample `pid` (all threads, GIL and idle excluded, non-blocking) while the block runs."""
    exe = py_spy_path()
    if exe is None:
        log("py-spy not found; install it with: .venv/bin/pip install py-spy")
        yield
        return
    cmd = [exe, "record", "-p", str(pid), "-o", str(out), "--format", fmt, "--rate", str(rate), "--nonblocking",
           "--threads"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not out.exists():
            log(f"py-spy wrote no profile: {err.strip()[-500:]}")


@contextlib.contextmanager
def perf_record(pid: int, out: Path, freq: int = 999) -> Iterator[None]:
    """`perf record -g` of one process (all its threads, kernel + user) while the block runs."""
    exe = shutil.which("perf")
    if exe is None:
        log("perf not found")
        yield
        return
    proc = subprocess.Popen([exe, "record", "-g", "-F", str(freq), "-p", str(pid), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def perf_top_symbols(data: Path, top: int = 25) -> list[str]:
    """Self-time share per (dso, symbol) from a perf.data file."""
    r = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio",
                        "-g", "none", "--percent-limit", "0.5"], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    return lines[:top]


def summarize_speedscope(path: Path, top: int = 15) -> dict:
    """Self and inclusive sample shares per function from a py-spy speedscope file."""
    doc = json.loads(Path(path).read_text())
    frames = doc["shared"]["frames"]
    self_w: dict[int, float] = {}
    incl_w: dict[int, float] = {}
    total = 0.0
    for prof in doc["profiles"]:
        if prof.get("type") != "sampled":
            continue
        for stack, w in zip(prof["samples"], prof["weights"]):
            total += w
            if stack:
                self_w[stack[-1]] = self_w.get(stack[-1], 0) + w
            for fi in set(stack):
                incl_w[fi] = incl_w.get(fi, 0) + w

    def name(fi: int) -> str:
        f = frames[fi]
        file = f.get("file") or ""
        short = "/".join(file.split("/")[-2:]) if file else ""
        return f"{f['name']} ({short}:{f.get('line', '?')})"

    def top_of(d: dict[int, float]) -> list[tuple[str, float]]:
        return [(name(fi), round(100 * w / total, 1)) for fi, w in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    nsamples = sum(len(p.get("samples", ())) for p in doc["profiles"])
    return {"samples": nsamples, "self_pct": top_of(self_w), "inclusive_pct": top_of(incl_w)} if total else \
        {"samples": 0, "self_pct": [], "inclusive_pct": []}


# ------------------------------------------------------------------------------------------------ tables


def fmt_num(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file: Any = None) -> None:
    cells = [[fmt_num(c) if not isinstance(c, str) else c for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    out = file or sys.stdout
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    print(line, file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))), file=out)
    out.flush()


def write_json(dest: str, doc: dict) -> None:
    """--json [FILE]: the results document to FILE, or to stdout for '-'."""
    text = json.dumps(doc, indent=1, default=str)
    if dest == "-":
        print(text)
    else:
        Path(dest).write_text(text + "\n")
        log(f"wrote {dest}")


def wait_until(pred: Callable[[], bool], timeout: float, what: str, progress: Callable[[], str] | None = None,
               poll: float = 0.25) -> float:
    """Poll `pred` until it holds; seconds taken. Logs `progress()` every 10 s; RuntimeError on timeout."""
    t0 = last = time.monotonic()
    while not pred():
        now = time.monotonic()
        if now - t0 > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}"
                               + (f" ({progress()})" if progress else ""))
        if progress and now - last >= 10:
            log(f"  waiting for {what}: {progress()}")
            last = now
        time.sleep(poll)
    return time.monotonic() - t0
