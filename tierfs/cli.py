"""`tierfs` command line: mount, umount, status, config-doc.

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
import time
from pathlib import Path

from tierfs.config import Config, ConfigError, schema_markdown


def _fail(msg: str, code: int = 2) -> int:
    print(f"tierfs: {msg}", file=sys.stderr)
    return code


def cmd_mount(args: argparse.Namespace) -> int:
    from tierfs.fs.mount import MountError, check_paths, serve, wait_until_mounted

    try:
        config = Config.load(args.config, args.options or ())
        paths = check_paths(args.hot_dir, args.mountpoint)
    except (ConfigError, MountError) as e:
        return _fail(str(e))
    if args.foreground:
        try:
            return serve(str(paths.hot), str(paths.mountpoint), config, foreground_log=True)
        except MountError as e:
            return _fail(str(e))
    log_file = paths.log_file(config)
    paths.state.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "tierfs", "mount", str(paths.hot), str(paths.mountpoint), "--foreground"]
    if args.config:
        cmd += ["--config", os.path.abspath(args.config)]
    for o in args.options or ():
        cmd += ["-o", o]
    err_file = paths.state / "daemon.stderr"
    with open(os.devnull, "rb") as devnull, open(err_file, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=err, stderr=err, start_new_session=True, close_fds=True)
    if not wait_until_mounted(paths.mountpoint, proc.pid):
        tail = err_file.read_text(errors="replace").strip().splitlines()[-15:]
        if proc.poll() is None:
            proc.terminate()
        return _fail("mount failed:\n  " + "\n  ".join(tail or ["(no output)"]) + f"\nlog: {log_file}", 1)
    print(f"tierfs: mounted {paths.hot} at {paths.mountpoint} (pid {proc.pid}, log {log_file})")
    return 0


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
    r = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        return _fail(f"could not unmount {mnt}: {r.stderr.strip() or r.stdout.strip()} "
                     f"(files still open? see fuser -m {mnt})", 1)
    if pid is not None:
        from tierfs.fs.mount import pid_alive  # noqa: PLC0415

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and pid_alive(pid):  # a zombie has exited: do not wait for its reaping
            time.sleep(0.05)
        if pid_alive(pid):
            return _fail(f"daemon pid {pid} did not exit within 60 s after unmount", 1)
        if pid_file.exists():
            return _fail(f"daemon pid {pid} exited without a clean shutdown; see {hot}/.tierfs/tierfs.log", 1)
    print(f"tierfs: unmounted {mnt}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from tierfs.fs.mount import hot_dir_of  # noqa: PLC0415

    mnt = Path(args.mountpoint).resolve()
    if hot_dir_of(mnt) is None:
        return _fail(f"{mnt} is not a tierfs mount")
    ctl = mnt / ".tierfs"
    try:
        text = (ctl / ("status.json" if args.json else "status")).read_text()
    except OSError as e:
        return _fail(f"{mnt} does not answer as a tierfs mount: {e.strerror}", 1)
    if args.json:
        print(json.dumps(json.loads(text), indent=1))
    else:
        print(text, end="")
    return 0


def cmd_config_doc(args: argparse.Namespace) -> int:
    print(schema_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierfs", description="Tiered FUSE store for Apache RocketMQ.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount a store backed by HOT_DIR at MOUNTPOINT")
    m.add_argument("hot_dir", metavar="HOT_DIR")
    m.add_argument("mountpoint", metavar="MOUNTPOINT")
    m.add_argument("--config", metavar="FILE", help="TOML configuration file")
    m.add_argument("-o", dest="options", action="append", metavar="KEY=VALUE[,...]",
                   help="override configuration keys, e.g. -o mount.log_level=debug")
    m.add_argument("--foreground", "-f", action="store_true", help="serve in this process (do not daemonise)")
    m.set_defaults(func=cmd_mount)
    u = sub.add_parser("umount", help="flush and unmount; waits for the daemon to exit")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.set_defaults(func=cmd_umount)
    s = sub.add_parser("status", help="show the state of a mounted store")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    c = sub.add_parser("config-doc", help="print every configuration key with its default (Markdown)")
    c.set_defaults(func=cmd_config_doc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
