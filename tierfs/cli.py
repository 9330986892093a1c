"""`tierfs` command line: mount, umount, status, fsck, config-doc.

`tierfs mount` daemonises by re-running itself with --foreground in a new session (no fork after threads),
then returns once the mount answers a stat through the kernel, or prints the daemon's log tail if it died.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tierfs.config import Config, ConfigError, schema_markdown

if TYPE_CHECKING:
    from tierfs.fs.mount import MountPaths


def _fail(msg: str, code: int = 2) -> int:
    print(f"tierfs: {msg}", file=sys.stderr)
    return code


def _mount_dirs(args: argparse.Namespace, config: Config) -> tuple[str, str]:
    """(hot dir, mountpoint) of a mount. `--read-only --from URL MOUNTPOINT`: the store comes from the bucket's
    newest catalog snapshot, and the hot dir is a local cache of it (CACHE_DIR/tree); config gets the store."""
    if args.follow and not args.read_only:
        raise ValueError("--follow goes with --read-only (a reader that refreshes from the bucket)")
    if args.force and not args.takeover:
        raise ValueError("--force goes with --takeover (it names the lease holder a takeover overrides)")
    if args.takeover:
        if args.read_only or args.cache_dir:
            raise ValueError("--takeover makes a writable mount: no --read-only or --cache-dir")
        if not args.from_url:
            raise ValueError("--takeover needs --from file:///PATH/STORE_ID or s3://BUCKET[/PREFIX]/STORE_ID")
        if args.mountpoint is None:
            args.parser.error("--takeover needs HOT_DIR (new and empty) and MOUNTPOINT")
        _store_from_url(args.from_url, config)
        return args.hot_dir, args.mountpoint
    if not args.read_only:
        if args.from_url or args.cache_dir:
            raise ValueError("--from and --cache-dir go with --read-only or --takeover (a writable mount has its "
                             "own HOT_DIR)")
        if args.mountpoint is None:
            args.parser.error("the following arguments are required: MOUNTPOINT")
        return args.hot_dir, args.mountpoint
    if not args.from_url:
        raise ValueError("--read-only needs --from file:///PATH/STORE_ID or s3://BUCKET[/PREFIX]/STORE_ID")
    if args.mountpoint is not None:
        raise ValueError("a read-only mount takes one directory, the MOUNTPOINT: the store comes from --from, "
                         "and --cache-dir holds what was fetched")
    from tierfs.tier.snapshot import default_cache_dir  # noqa: PLC0415

    _store_from_url(args.from_url, config)
    cache = Path(args.cache_dir or default_cache_dir(args.from_url)).absolute()
    try:
        (cache / "tree").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the read-only cache {cache / 'tree'} ({e.strerror}); "
                         f"choose a directory with --cache-dir") from None
    return str(cache / "tree"), args.hot_dir


def _store_from_url(from_url: str, config: Config) -> None:
    """--from URL sets objectstore.url and store.id (a config that says otherwise is refused)."""
    from tierfs.tier.snapshot import split_from_url  # noqa: PLC0415

    url, sid = split_from_url(from_url)
    for key, value in (("objectstore.url", url), ("store.id", sid)):
        if config[key] and config[key].rstrip("/") != value:
            raise ValueError(f"config key '{key}' is {config[key]!r} but --from names {value!r}; drop one of them")
        config.set(key, value)
    if url.startswith("file://") and not os.path.isdir(url[len("file://"):]):
        raise ValueError(f"--from {from_url}: {url[len('file://'):]} is not a directory")


def cmd_mount(args: argparse.Namespace) -> int:
    from tierfs.fs.mount import MountError, check_paths, other_users_warning, serve, wait_until_mounted

    try:
        config = Config.load(args.config, args.options or ())
        hot_dir, mountpoint = _mount_dirs(args, config)
        paths = check_paths(hot_dir, mountpoint)
    except (ConfigError, ValueError, MountError) as e:  # ValueError: a bad --from URL or cache dir
        return _fail(str(e))
    warning = other_users_warning(paths, config, args.read_only)
    if warning and not args.foreground:  # in the foreground the daemon's log line shows on stderr
        print(f"tierfs: warning: {warning}", file=sys.stderr)
    if args.supervise:
        if args.foreground or args.read_only or args.takeover:
            return _fail("--supervise goes with a plain writable mount (no --foreground, --read-only, --takeover)")
        return _start_supervisor(args, paths, config)
    if args.kill_units:
        return _fail("--kill-unit goes with --supervise")
    if args.foreground:
        try:
            return serve(str(paths.hot), str(paths.mountpoint), config, foreground_log=True,
                         read_only=args.read_only, takeover=args.takeover, takeover_force=args.force,
                         follow=args.follow)
        except MountError as e:
            return _fail(str(e))
    log_file = paths.log_file(config)
    paths.state.mkdir(mode=0o700, exist_ok=True)
    # -P and cwd "/": the caller's directory may hold a `tierfs/` folder (the clone itself) that would shadow the
    # installed package, and a daemon must not keep the caller's directory busy.
    cmd = [sys.executable, "-P", "-m", "tierfs", "mount", str(paths.hot), str(paths.mountpoint), "--foreground"]
    if args.read_only:
        cmd[5:6] = ["--read-only", "--from", args.from_url, "--cache-dir", str(paths.hot.parent)]
        if args.follow:
            cmd.append("--follow")
    if args.takeover:
        cmd += ["--takeover", "--from", args.from_url] + (["--force", args.force] if args.force else [])
    if args.config:
        cmd += ["--config", os.path.abspath(args.config)]
    for o in args.options or ():
        cmd += ["-o", o]
    # A fresh file per attempt: a mount refused because a daemon already serves this hot dir must not clobber
    # that daemon's daemon.stderr. It takes the name once the new daemon serves (and so holds the hot dir).
    fd, tmp = tempfile.mkstemp(prefix="daemon.stderr.", dir=paths.state)
    err_file = Path(tmp)
    with open(os.devnull, "rb") as devnull, os.fdopen(fd, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=err, stderr=err, start_new_session=True, close_fds=True,
                                cwd="/")
    if not wait_until_mounted(paths.mountpoint, proc.pid):
        # the daemon's own lines start with "tierfs: " too: say it once
        tail = [line.removeprefix("tierfs: ")
                for line in err_file.read_text(errors="replace").strip().splitlines()[-15:]]
        if proc.poll() is None:
            proc.terminate()
        err_file.unlink(missing_ok=True)
        what = args.from_url if args.read_only else paths.hot
        return _fail(f"mounting {what} at {paths.mountpoint} failed:\n  " + "\n  ".join(tail or ["(no output)"])
                     + f"\nlog: {log_file}", 1)
    os.replace(err_file, paths.state / "daemon.stderr")
    src = f"{args.from_url} read-only (cache {paths.hot.parent})" if args.read_only else \
        f"{args.from_url} taken over into {paths.hot}" if args.takeover else paths.hot
    print(f"tierfs: mounted {src} at {paths.mountpoint} (pid {proc.pid}, log {log_file})")
    return 0


def _mount_options(args: argparse.Namespace) -> list[str]:
    """--config/-o of a command line, for the daemon a supervisor starts."""
    out = ["--config", os.path.abspath(args.config)] if args.config else []
    for o in args.options or ():
        out += ["-o", o]
    return out


def _start_supervisor(args: argparse.Namespace, paths: MountPaths, config: Config) -> int:
    """`tierfs mount --supervise`: run `tierfs supervise` in its own session; return once it serves."""
    from tierfs.failstop import running_pids, state_file  # noqa: PLC0415

    paths.state.mkdir(mode=0o700, exist_ok=True)
    state_file(paths.hot).unlink(missing_ok=True)
    cmd = [sys.executable, "-P", "-m", "tierfs", "supervise", str(paths.hot), str(paths.mountpoint),
           *_mount_options(args), *[a for unit in args.kill_units or () for a in ("--kill-unit", unit)]]
    log = paths.state / "supervisor.stderr"
    with open(os.devnull, "rb") as devnull, open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=err, stderr=err, start_new_session=True, cwd="/")
    deadline = time.monotonic() + 180
    while (running := running_pids(paths.hot)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            return _fail(f"supervised mount of {paths.hot} at {paths.mountpoint} failed:\n  " +
                         "\n  ".join(tail or ["(no output)"]), 1)
        time.sleep(0.05)
    print(f"tierfs: supervisor pid {running[0]} (log {paths.state / 'supervisor.log'})")
    print(f"tierfs: mounted {paths.hot} at {paths.mountpoint} (pid {running[1]}, log {paths.log_file(config)})")
    return 0


def cmd_supervise(args: argparse.Namespace) -> int:
    from tierfs.failstop import supervise  # noqa: PLC0415
    from tierfs.fs.mount import MountError, check_paths  # noqa: PLC0415

    try:
        Config.load(args.config, args.options or ())
        paths = check_paths(args.hot_dir, args.mountpoint)
    except (ConfigError, MountError) as e:
        return _fail(str(e))
    paths.state.mkdir(mode=0o700, exist_ok=True)
    return supervise(paths.hot, paths.mountpoint, _mount_options(args), args.kill_units or ())


def _syncfs(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc.syncfs(fd)
    finally:
        os.close(fd)


def cmd_umount(args: argparse.Namespace) -> int:
    from tierfs.fs.mount import hot_dir_of

    mnt = Path(args.mountpoint).resolve()
    hot = hot_dir_of(mnt)
    if hot is None:
        return _fail(f"{mnt} is not a tierfs mount")
    pid_file = hot / ".tierfs" / "daemon.pid"
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        pid = None
    try:
        _syncfs(mnt)  # flush dirty pages while the daemon can still take them
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            raise
        r = subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            return _fail(f"{mnt} is a dead mount (its daemon crashed) and could not be cleared: "
                         f"{r.stderr.strip()}; run 'fusermount3 -uz {mnt}'", 1)
        return _fail(f"the daemon of {mnt} had crashed; cleared the dead mount (fusermount3 -uz). "
                     f"Acknowledged data is safe; see {hot}/.tierfs/tierfs.log", 1)
    # the daemon's helpers (tierfs.tier.flusher, tierfs.tier.primer) open files through the mount for a moment
    # after a writer's last request: "busy" is retried for a few seconds before it counts as files still open
    deadline = time.monotonic() + 5
    while True:
        r = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True)
        if r.returncode == 0 or "busy" not in r.stderr.lower() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if r.returncode != 0:
        return _fail(f"could not unmount {mnt}: {r.stderr.strip() or r.stdout.strip()} "
                     f"(files still open? see fuser -m {mnt})", 1)
    if pid is not None:
        from tierfs.fs.mount import UMOUNT_WAIT_S, pid_alive  # noqa: PLC0415

        deadline = time.monotonic() + UMOUNT_WAIT_S
        while time.monotonic() < deadline and pid_alive(pid):  # a zombie has exited: do not wait for its reaping
            time.sleep(0.05)
        if pid_alive(pid):
            return _fail(f"daemon pid {pid} did not exit within {UMOUNT_WAIT_S:.0f} s after unmount", 1)
        if pid_file.exists():
            return _fail(f"daemon pid {pid} exited without a clean shutdown; see {hot}/.tierfs/tierfs.log", 1)
    print(f"tierfs: unmounted {mnt}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from tierfs.fs.mount import NotServing, live_mount  # noqa: PLC0415

    try:
        _, _, text = live_mount(args.mountpoint, "status.json" if args.json else "status")
    except NotServing as e:
        return _fail(str(e), 1 if e.mounted else 2)
    if args.json:
        print(json.dumps(json.loads(text), indent=1))
    else:
        print(text, end="")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    """Ask the daemon (SIGUSR1) to evict every idle tiered segment's local copy now, and wait for that pass."""
    import signal  # noqa: PLC0415

    from tierfs.fs.mount import NotServing, live_mount  # noqa: PLC0415
    from tierfs.fs.views import human_bytes  # noqa: PLC0415

    try:
        mnt, hot, text = live_mount(args.mountpoint)
    except NotServing as e:
        return _fail(str(e), 1 if e.mounted else 2)
    status_file = mnt / ".tierfs" / "status.json"

    def status() -> dict:
        return json.loads(status_file.read_text())

    def local_bytes(st: dict) -> int:
        return sum(f.get("resident_bytes", 0) for f in st.get("files", []) if f.get("state") == "tiered")

    try:
        st = json.loads(text)
    except ValueError as e:
        return _fail(f"{mnt} does not answer as a tierfs mount: its status.json is not JSON ({e})", 1)
    if not st.get("evict_now"):
        return _fail(f"{mnt} has tiering off (tiering.enabled=false): it has no tiered segments to evict", 1)
    before, asked = local_bytes(st), st["evict_now"]["requested"]
    deadline = time.monotonic() + args.timeout
    target, sent = None, 0.0
    while time.monotonic() < deadline:  # the request is counted when the daemon takes the signal, then served
        if target is None and time.monotonic() - sent > 5:  # again if a daemon still starting ignored it
            try:
                os.kill(int(st["pid"]), signal.SIGUSR1)
            except PermissionError:
                return _fail(f"only root or the daemon's user may ask daemon pid {st['pid']} to evict", 1)
            except ProcessLookupError:
                return _fail(f"daemon pid {st['pid']} of {mnt} is gone", 1)
            sent = time.monotonic()
        try:
            now = status()["evict_now"]
        except (OSError, ValueError) as e:
            return _fail(f"{mnt} stopped answering during the eviction pass: {e}", 1)
        if target is None and now["requested"] > asked:
            target = now["requested"]
        if target is not None and now["done"] >= target:
            after = local_bytes(status())
            print(f"tierfs: evicted {human_bytes(max(before - after, 0))} of tiered segments' local copies; "
                  f"{human_bytes(after)} stays local (segments read in the last second or being fetched; the "
                  f"first page of each segment always stays)")
            return 0
        time.sleep(0.1)
    return _fail(f"the daemon did not finish the eviction pass within {args.timeout:g} s; "
                 f"see {hot}/.tierfs/tierfs.log", 1)


def cmd_fsck(args: argparse.Namespace) -> int:
    from tierfs.fsck import run  # noqa: PLC0415

    return run(args.target, deep=args.deep, repair=args.repair, as_json=args.json, stale_after=args.stale_after,
               jobs=args.jobs)


def cmd_config_doc(args: argparse.Namespace) -> int:
    print(schema_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierfs", description="Tiered FUSE store for Apache RocketMQ.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount a store backed by HOT_DIR at MOUNTPOINT",
                       description="tierfs mount HOT_DIR MOUNTPOINT, or read-only from a bucket: "
                                   "tierfs mount --read-only --from URL MOUNTPOINT, or a takeover of a lost "
                                   "writer's store: tierfs mount --takeover [--force HOLDER] --from URL HOT_DIR "
                                   "MOUNTPOINT")
    m.add_argument("hot_dir", metavar="HOT_DIR", help="the local hot dir (with --read-only: the MOUNTPOINT)")
    m.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?")
    m.add_argument("--read-only", action="store_true",
                   help="serve the newest catalog snapshot of a store from the object store alone (EROFS on writes)")
    m.add_argument("--from", dest="from_url", metavar="URL",
                   help="with --read-only or --takeover: file:///PATH/STORE_ID or s3://BUCKET[/PREFIX]/STORE_ID")
    m.add_argument("--follow", action="store_true",
                   help="with --read-only: refresh from the bucket's newest consistent point every "
                        "tiering.rpo_seconds")
    m.add_argument("--takeover", action="store_true",
                   help="with --from: a writable mount of a lost writer's store on a new, empty HOT_DIR, from the "
                        "bucket's newest consistent point (takes the writer lease once it expired)")
    m.add_argument("--force", metavar="HOLDER",
                   help="with --takeover: take the lease now, overriding HOLDER (the holder id the refusal names, "
                        "or host:hot dir); that writer is fenced")
    m.add_argument("--cache-dir", metavar="DIR",
                   help="with --read-only: local cache (default /var/cache/tierfs/<store id>-<hash>)")
    m.add_argument("--config", metavar="FILE", help="TOML configuration file")
    m.add_argument("-o", dest="options", action="append", metavar="KEY=VALUE[,...]",
                   help="override configuration keys, e.g. -o mount.log_level=debug")
    m.add_argument("--foreground", "-f", action="store_true", help="serve in this process (do not daemonise)")
    m.add_argument("--supervise", action="store_true",
                   help="run the daemon under `tierfs supervise`: fail-stop and remount when it dies")
    m.add_argument("--kill-unit", dest="kill_units", action="append", metavar="UNIT",
                   help="with --supervise: systemd unit to SIGKILL when the daemon dies (besides every process "
                        "holding files of the store)")
    m.set_defaults(func=cmd_mount, parser=m)
    v = sub.add_parser("supervise", help="mount HOT_DIR at MOUNTPOINT and supervise the daemon (foreground): "
                                         "when it dies, stop every process holding the store, remount",
                       description="Fail-stop supervisor (README: When the tierfs daemon dies). For a systemd "
                                   "unit of Type=notify.")
    v.add_argument("hot_dir", metavar="HOT_DIR")
    v.add_argument("mountpoint", metavar="MOUNTPOINT")
    v.add_argument("--config", metavar="FILE", help="TOML configuration file")
    v.add_argument("-o", dest="options", action="append", metavar="KEY=VALUE[,...]",
                   help="override configuration keys")
    v.add_argument("--kill-unit", dest="kill_units", action="append", metavar="UNIT",
                   help="systemd unit to SIGKILL when the daemon dies (besides every process holding the store)")
    v.set_defaults(func=cmd_supervise)
    u = sub.add_parser("umount", help="flush and unmount; waits for the daemon to exit")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.set_defaults(func=cmd_umount)
    e = sub.add_parser("evict", help="drop the local copies of every idle tiered segment now, whatever the "
                                     "cache watermarks (before maintenance of the hot disk)")
    e.add_argument("mountpoint", metavar="MOUNTPOINT")
    e.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for the daemon's eviction pass (default 300)")
    e.set_defaults(func=cmd_evict)
    s = sub.add_parser("status", help="show the state of a mounted store")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    from tierfs.pipeline_cli import add_parsers as add_pipeline_parsers  # noqa: PLC0415

    add_pipeline_parsers(sub)
    f = sub.add_parser("fsck", help="compare catalog, hot dir and object store; --repair fixes what is safe",
                       description="Exit codes: 0 clean, 1 damage found, 2 usage error, 3 check incomplete "
                                   "(object store unreachable).")
    f.add_argument("target", metavar="HOT_DIR_OR_MOUNTPOINT")
    f.add_argument("--deep", action="store_true", help="also verify the crc32c of every object and resident block")
    f.add_argument("--repair", action="store_true", help="fix what is safe (the store must be unmounted)")
    f.add_argument("--json", action="store_true", help="print the report as JSON (no progress bar)")
    f.add_argument("--stale-after", type=float, metavar="SECONDS", default=None,
                   help="multipart uploads older than this are stale (default: any when unmounted, 3600 mounted)")
    f.add_argument("--jobs", type=int, default=4, metavar="N", help="objects verified in parallel with --deep")
    f.set_defaults(func=cmd_fsck)
    c = sub.add_parser("config-doc", help="print every configuration key with its default (Markdown)")
    c.set_defaults(func=cmd_config_doc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
