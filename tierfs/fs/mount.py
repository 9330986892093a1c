"""Mount lifecycle: refuse bad set-ups up front, mount, tune the kernel side, serve until unmount or a signal.

The daemon holds an fcntl lock on HOT_DIR/.tierfs/daemon.lock for its whole life, so a second daemon on the
same hot dir is refused instead of corrupting it. Its pid file is removed only on a clean exit, which is how
`tierfs umount` tells a clean shutdown from a crash. Once the mount is gone the daemon exits within
SHUTDOWN_DEADLINE_S, before `tierfs umount` stops waiting, whatever the object store does (ShutdownWatchdog).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import trio

from tierfs import __version__
from tierfs.config import Config
from tierfs.fs.operations import DAEMON_UMASK, STATE_DIR_NAME, TierOperations
from tierfs.fs.stats import FsStats
from tierfs.fs.supervisor import hand_fuse_fd_to_supervisor
from tierfs.tier.storewait import KEY as STORE_WAITERS_KEY

log = logging.getLogger("tierfs.mount")

HOT_BACKGROUND = 16  # background requests kept for hot files' writeback (hot_background_reserve)
UMOUNT_WAIT_S = 60.0  # how long `tierfs umount` waits for the daemon to exit after the unmount
SHUTDOWN_DEADLINE_S = UMOUNT_WAIT_S - 5.0
EXIT_SHUTDOWN_DEADLINE = 3


class MountError(RuntimeError):
    """A set-up the daemon refuses to mount, with the reason and the fix."""


@dataclass(frozen=True)
class MountPaths:
    hot: Path
    mountpoint: Path

    @property
    def state(self) -> Path:
        return self.hot / STATE_DIR_NAME

    @property
    def pid_file(self) -> Path:
        return self.state / "daemon.pid"

    @property
    def lock_file(self) -> Path:
        return self.state / "daemon.lock"

    def log_file(self, config: Config) -> Path:
        return Path(config["mount.log_file"] or self.state / "tierfs.log")


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_paths(hot_dir: str, mountpoint: str) -> MountPaths:
    """Validate the two directories before anything is mounted; every refusal says what to do instead."""
    hot = Path(hot_dir).resolve()
    mnt = Path(os.path.abspath(mountpoint))
    try:
        os.statvfs(mnt)  # unlike stat, always reaches the FUSE connection (no attribute cache)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise MountError(f"mountpoint {mnt} is a dead mount left by a crashed daemon; clear it with "
                             f"'fusermount3 -uz {mnt}' and mount again") from None
    mnt = mnt.resolve()
    if not hot.exists():
        raise MountError(f"hot dir {hot_dir!r} does not exist; create it first (mkdir -p {hot})")
    if not hot.is_dir():
        raise MountError(f"hot dir {hot_dir!r} is not a directory")
    if not mnt.exists():
        raise MountError(f"mountpoint {mountpoint!r} does not exist; create it first (mkdir -p {mnt})")
    if not mnt.is_dir():
        raise MountError(f"mountpoint {mountpoint!r} is not a directory")
    if _inside(mnt, hot):
        raise MountError(f"mountpoint {mnt} is inside the hot dir {hot}; use a directory outside it")
    if _inside(hot, mnt):
        raise MountError(f"hot dir {hot} is inside the mountpoint {mnt}; use a directory outside it")
    if is_mounted(mnt):
        raise MountError(f"mountpoint {mnt} is already a mount; unmount it first (tierfs umount {mnt})")
    if any(mnt.iterdir()):
        raise MountError(f"mountpoint {mnt} is not empty; mount on an empty directory")
    return MountPaths(hot, mnt)


def mount_table() -> list[tuple[str, str, str]]:
    """(source, mountpoint, fstype) of every mount, from /proc/self/mounts with octal escapes decoded."""
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                dec = [bytes(p, "ascii").decode("unicode_escape") for p in parts[:3]]
                out.append((dec[0], dec[1], dec[2]))
    return out


def is_mounted(mountpoint: Path | str, fstype_prefix: str = "") -> bool:
    mp = str(Path(mountpoint).resolve())
    return any(m == mp and t.startswith(fstype_prefix) for _, m, t in mount_table())


def hot_dir_of(mountpoint: Path | str) -> Path | None:
    """The hot dir a tierfs mount serves (our fsname), or None when it is not a tierfs mount."""
    mp = str(Path(mountpoint).resolve())
    for src, m, t in mount_table():
        if m == mp and t == "fuse.tierfs":
            return Path(src)
    return None


class NotServing(Exception):
    """The path is no tierfs mount that answers. `mounted` tells a tierfs mount whose daemon does not answer
    (crashed or hung: the CLI exits 1) from a path that is no tierfs mount at all (a usage error: exit 2)."""

    def __init__(self, message: str, mounted: bool) -> None:
        super().__init__(message)
        self.mounted = mounted


def live_mount(mountpoint: Path | str, control_file: str = "status.json") -> tuple[Path, Path, str]:
    """(mountpoint, hot dir, text of /.tierfs/`control_file`) of a tierfs mount whose daemon answers; NotServing
    otherwise. Every CLI command that talks to a running daemon starts here."""
    mnt = Path(mountpoint).resolve()
    hot = hot_dir_of(mnt)
    if hot is None:
        raise NotServing(f"{mnt} is not a tierfs mount", mounted=False)
    try:
        return mnt, hot, (mnt / ".tierfs" / control_file).read_text()
    except OSError as e:
        raise NotServing(f"{mnt} does not answer as a tierfs mount: {e.strerror}", mounted=True) from e


def _mount_dev(mountpoint: Path) -> tuple[int, int] | None:
    """major:minor of our mount, read from mountinfo (a stat of the mountpoint would call into ourselves)."""
    mp = str(mountpoint)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if bytes(parts[4], "ascii").decode("unicode_escape") == mp:
                major, minor = parts[2].split(":")
                found = (int(major), int(minor))  # the last one wins: the newest mount on that path
    return found


def hot_background_reserve(max_background: int) -> int:
    """Background requests (read-ahead READs, writeback WRITEs) the kernel must keep able to send while store
    waiters hold the rest: hot files' writeback, which their fsyncs and the broker's msyncs wait for."""
    return HOT_BACKGROUND if max_background >= 2 * HOT_BACKGROUND else max_background // 2


def store_waiter_limit(config: Config) -> int:
    """mount.max_store_waiters, checked against mount.max_background: a store waiter that is a read-ahead holds
    one of the kernel's background slots, which the writeback of hot files needs too."""
    waiters, bg = int(config[STORE_WAITERS_KEY]), int(config["mount.max_background"])
    if bg and waiters > bg - hot_background_reserve(bg):
        raise MountError(f"config key '{STORE_WAITERS_KEY}': {waiters} is too many for mount.max_background={bg}: "
                         f"at most {bg - hot_background_reserve(bg)}, so that {hot_background_reserve(bg)} of the "
                         f"kernel's background requests stay free for hot files' writeback; lower "
                         f"{STORE_WAITERS_KEY} or raise mount.max_background")
    return waiters


def tune_kernel(mountpoint: Path, config: Config) -> int | None:
    """Raise read-ahead (bdi) and max_background (fusectl) for the mount; best effort, logged. Returns the
    connection's max_background as the kernel has it now (None: unknown)."""
    dev = _mount_dev(mountpoint)
    if dev is None:
        return None
    major, minor = dev
    ra = int(config["mount.read_ahead_kb"])
    if ra:
        # The kernel sets the bdi's read-ahead when it processes our INIT reply, which can land after a write
        # made too early: a stat through the mount waits until INIT is done, and a re-check catches the rest.
        try:
            os.stat(mountpoint)
        except OSError:
            pass
        ra_file = f"/sys/class/bdi/{major}:{minor}/read_ahead_kb"
        for _ in range(3):
            _write_sys(ra_file, ra)
            time.sleep(0.5)
            if _read_sys(ra_file) in (ra, None):
                break
    bg = int(config["mount.max_background"])
    ctl = Path("/sys/fs/fuse/connections")
    if ctl.is_dir() and not any(ctl.iterdir()):
        os.system("mount -t fusectl none /sys/fs/fuse/connections >/dev/null 2>&1")
    conn = ctl / str(os.makedev(major, minor))
    if not conn.exists():
        conn = ctl / str(minor)
    if bg:
        _write_sys(str(conn / "max_background"), bg)
        _write_sys(str(conn / "congestion_threshold"), max(bg * 3 // 4, 1))
    return _read_sys(str(conn / "max_background"))


def _read_sys(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _write_sys(path: str, value: int) -> None:
    try:
        with open(path, "w") as f:
            f.write(str(value))
        log.info("set %s = %s", path, value)
    except OSError as e:
        log.info("could not set %s (%s); keeping the kernel default", path, e.strerror)


def setup_logging(log_file: Path, level: str, also_stderr: bool) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(log_file)]
    if also_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=level.upper(), handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _DaemonLock:
    """fcntl lock on the state dir: one daemon per hot dir."""

    def __init__(self, paths: MountPaths):
        paths.state.mkdir(mode=0o700, exist_ok=True)
        self.fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = "unknown"
            try:
                holder = paths.pid_file.read_text().strip()
            except OSError:
                pass
            os.close(self.fd)
            where = [m for src, m, t in mount_table() if t == "fuse.tierfs" and src == str(paths.hot)]
            at = f" at {where[-1]}" if where else ""
            raise MountError(f"another tierfs daemon (pid {holder}) already serves hot dir {paths.hot}{at}; "
                             f"unmount it first (tierfs umount {where[-1] if where else 'MOUNTPOINT'})") from None


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit: every file the broker holds open (thousands of segments
    and ConsumeQueue files) holds one backing fd here, and a soft limit of 1024 would turn that into EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # NOFILE cannot be unlimited: the kernel caps it at fs.nr_open
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = soft
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("could not raise the open-file limit from %d to %d (%s)", soft, target, e)
    return soft, hard


def serve(hot_dir: str, mountpoint: str, config: Config, foreground_log: bool = True,
          read_only: bool = False, takeover_force: str | None = None, takeover: bool = False,
          follow: bool = False) -> int:
    """Mount and serve until unmounted or signalled. Returns the process exit code. `read_only`: HOT_DIR is the
    cache of a mount from the bucket's newest catalog snapshot (objectstore.url and store.id name the store)."""

    paths = check_paths(hot_dir, mountpoint)
    store_waiter_limit(config)  # refused before anything is held
    os.chdir("/")  # every path is absolute from here: never keep the caller's directory busy
    # The daemon's own files (state, log, catalog, jobs, the embedded object store) are private to its user;
    # files created through the mount get exactly the caller's mode and umask (TierOperations sets them).
    os.umask(DAEMON_UMASK)
    # SIGUSR1 asks for an eviction pass (`tierfs evict`); until the loop listens for it, and after, it must not
    # kill the daemon (its default action) under a broker
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    lock = _DaemonLock(paths)
    secure_state_dir(paths.state)
    setup_logging(paths.log_file(config), config["mount.log_level"], foreground_log)
    log.info("open-file limit %d (hard %d)", *raise_fd_limit())
    warning = other_users_warning(paths, config, read_only)
    if warning:
        log.warning(warning)
    stats = FsStats()
    from tierfs.metrics import Metrics  # noqa: PLC0415

    metrics = Metrics(config)
    try:
        metrics.start_listener()  # before the engine: a taken port refuses the mount before anything is held
    except OSError as e:
        raise MountError(e.strerror) from None
    from tierfs.tier.engine import Engine  # noqa: PLC0415
    from tierfs.tier.lease import LeaseHeld  # noqa: PLC0415

    engine = None
    if config["tiering.enabled"] or read_only:
        try:
            from tierfs.tier.takeover import TakeoverSpec  # noqa: PLC0415

            spec = TakeoverSpec(takeover_force, str(paths.mountpoint)) if takeover else None
            engine = Engine(paths.hot, paths.state, config, read_only=read_only, takeover=spec, follow=follow)
            if not read_only:
                engine.take_lease(paths.mountpoint)  # one writable mount per store id
        except (ValueError, LeaseHeld) as e:  # ConfigError, bad store settings or snapshot, a lease held elsewhere
            raise MountError(str(e)) from None
        engine.mountpoint = paths.mountpoint  # the sealer flushes quiet segments through the mount
        engine.reconcile()
    ops = TierOperations(str(paths.hot), config, stats, engine)
    if engine is not None and engine.appendlog is not None:  # continuous tiering flushes only open files
        engine.appendlog.open_inodes = ops.open_inodes
    if engine is not None and engine.follower is not None:  # a refresh swaps and removes files behind the kernel
        engine.follower.name_gone = ops.name_gone
        engine.follower.replace_name = ops.hotdir.replace_pinned
        engine.follower.remove_name = ops.hotdir.remove_pinned
    from tierfs.fs.views import install_views  # noqa: PLC0415 (keeps the import graph one-way)

    install_views(ops, paths, config)
    metrics.install(ops)
    options = set(pyfuse3.default_options)
    options |= {f"fsname={paths.hot}", "subtype=tierfs"}
    if config["mount.allow_other"]:
        options.add("allow_other")
    if read_only:
        options |= {"ro", "nosuid", "nodev"}  # the kernel refuses writes too; nothing from a bucket is trusted
    log.info("tierfs %s mounting %s at %s (pid %d)", __version__, paths.hot, paths.mountpoint, os.getpid())
    pyfuse3.init(ops, str(paths.mountpoint), options)
    hand_fuse_fd_to_supervisor()  # before any request: a supervisor then holds the connection if we die
    paths.pid_file.write_text(f"{os.getpid()}\n")  # 0600 under DAEMON_UMASK
    clean = False
    try:
        trio.run(_run, ops, engine, paths, config)
        clean = True
    except BaseException:
        log.exception("daemon main loop failed")
        raise
    finally:
        pyfuse3.close(unmount=True)
        metrics.stop_listener()
        if clean:
            paths.pid_file.unlink(missing_ok=True)
            log.info("unmounted %s; clean exit", paths.mountpoint)
        os.close(lock.fd)
    return 0


def secure_state_dir(state: Path) -> None:
    """HOT_DIR/.tierfs holds the catalog, the log, job configs (Spark's log4j2 file) and, by default, the object
    store: only the daemon's user may enter it, whatever modes older versions (umask 0) gave what is inside."""
    os.chmod(state, 0o700)


def other_users_warning(paths: MountPaths, config: Config, read_only: bool = False) -> str | None:
    """A daemon without allow_other serves only its own user: a broker running as the hot dir's owner (the usual
    set-up for a non-root broker) would get EACCES on every access. Said at mount, not discovered by the broker."""
    owner = paths.hot.stat().st_uid
    if read_only or config["mount.allow_other"] or owner == os.geteuid():
        return None
    return (f"hot dir {paths.hot} belongs to uid {owner} but mount.allow_other is false: only uid "
            f"{os.geteuid()} can use {paths.mountpoint}; add -o mount.allow_other=true for a broker running as "
            f"another user")


class ShutdownWatchdog:
    """Once the mount is gone the daemon has `deadline_s` to exit. Its last steps (the end of the engine's tasks,
    the final upload round and snapshot, the lease release) call the object store from worker threads that no
    cancellation stops, and a store that accepts connections but answers nothing (a full Ceph cluster blocks
    writes so) holds each call for read_timeout x attempts. Past the deadline the daemon logs every thread's stack
    and exits as after a crash: nothing acknowledged is lost (the hot dir holds every byte, the catalog commits
    transactions) and the next mount recovers; the pid file stays, so `tierfs umount` says it was not clean."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._timer = threading.Timer(deadline_s, self._expired)
        self._timer.daemon = True

    def start(self) -> None:
        if not self._timer.is_alive() and not self._timer.finished.is_set():
            self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def _expired(self) -> None:
        frames = sys._current_frames()
        stacks = "".join(f"thread {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
                         for t in threading.enumerate() if t.ident in frames and t is not threading.current_thread())
        log.error("the shutdown did not finish within %.0f s of the unmount (an object store that does not "
                  "answer?); exiting as after a crash: nothing acknowledged is lost, the next mount recovers. "
                  "Threads:\n%s", self.deadline_s, stacks)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_SHUTDOWN_DEADLINE)


async def _run(ops: TierOperations, engine, paths: MountPaths, config: Config) -> None:
    watchdog = ShutdownWatchdog(SHUTDOWN_DEADLINE_S)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, nursery.cancel_scope,
                               engine.evictor.evict_now if engine is not None else None)
            nursery.start_soon(_tune_kernel, paths.mountpoint, config, engine)
            if engine is not None:
                await engine.run(nursery)
            # mount.max_tasks workers are always free for requests that do not wait on the store: those that do
            # are at most engine.cache.waiters.limit, and have workers of their own
            waiters = engine.cache.waiters.limit if engine is not None else 0
            try:
                await pyfuse3.main(min_tasks=4, max_tasks=int(config["mount.max_tasks"]) + waiters)
            finally:  # unmounted, signalled or failed: the engine's tasks end next, each may wait on the store
                watchdog.start()
            nursery.cancel_scope.cancel()
    finally:
        watchdog.start()  # the engine's own start may have failed before the loop ran
        try:
            if engine is not None:
                with trio.CancelScope(shield=True):
                    await engine.shutdown()
        finally:
            watchdog.cancel()  # done, or failed with a traceback: either way the daemon exits right after


async def _tune_kernel(mountpoint: Path, config: Config, engine) -> None:
    """tune_kernel off the loop; then, if the kernel kept fewer background slots than mount.max_background asked
    for (no fusectl, not root), fewer requests may wait on the store, so hot files' writeback keeps its own."""
    bg = await trio.to_thread.run_sync(tune_kernel, mountpoint, config)
    if engine is not None and bg:
        engine.cache.waiters.clamp(bg - hot_background_reserve(bg),
                                   f"the kernel sends at most {bg} background requests (max_background) and "
                                   f"{hot_background_reserve(bg)} of them stay for hot files' writeback")


async def _watch_signals(scope: trio.CancelScope, evict_now: Callable[[], None] | None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1) as signals:
        async for signum in signals:
            if signum == signal.SIGUSR1:
                if evict_now is not None:
                    log.info("signal SIGUSR1: evicting every idle tiered segment now")
                    evict_now()
                continue
            log.info("signal %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def wait_until_mounted(mountpoint: Path, pid: int, timeout: float = 30.0) -> bool:
    """True once the mount answers a stat through the kernel; False if the daemon died first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not pid_alive(pid):
            return False
        if is_mounted(mountpoint, "fuse.tierfs"):
            try:
                os.stat(mountpoint / ".tierfs" / "status")
                return True
            except OSError:
                pass
        time.sleep(0.05)
    return False


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] not in "ZX"
    except (OSError, IndexError):
        return False

