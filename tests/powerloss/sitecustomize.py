"""Power-loss model for tests: loaded into a tierfs daemon through PYTHONPATH (tests/powerloss.py sets it up).

No fixture here can cut a disk's power, so the daemon journals what a power cut would lose instead: every
`os.pwrite`/`os.pwritev`/`os.write` to a file under $TIERFS_TEST_POWERLOSS_ROOT (its own state dir excepted:
SQLite syncs itself) as `W <n> <offset> <length> <path>`, and every `os.fsync`/`os.fdatasync` of such a file as
`S <n> <path>` when it starts and `D <n> <n of its S>` when it returned. After a kill -9 the test zeroes every write that no
completed sync of its file started after (tests/powerloss.py `apply`). With $TIERFS_TEST_POWERLOSS_SLOW_SYNC
seconds a sync waits that long after its `S` line, holding open the window in which a daemon could mark bytes
durable that its sync did not cover.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

_ROOT = os.environ.get("TIERFS_TEST_POWERLOSS_ROOT", "")
_JOURNAL = os.environ.get("TIERFS_TEST_POWERLOSS_JOURNAL", "")
_SLOW = float(os.environ.get("TIERFS_TEST_POWERLOSS_SLOW_SYNC", "0") or 0)


def _install() -> None:
    root = os.path.realpath(_ROOT) + "/"
    out = os.open(_JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    seq = itertools.count(1)
    lock = threading.Lock()
    real = {name: getattr(os, name) for name in ("pwrite", "pwritev", "write", "fsync", "fdatasync")}

    def watched(fd: int) -> str | None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        if not path.startswith(root) or path[len(root):].startswith(".tierfs"):
            return None
        return path

    def note(fmt: str, *args: object) -> int:
        with lock:
            n = next(seq)
            real["write"](out, (fmt % (n, *args) + "\n").encode("utf-8", "surrogateescape"))
            return n

    def pwrite(fd, data, offset):
        path = watched(fd)
        n = real["pwrite"](fd, data, offset)
        if path:
            note("W %d %d %d %s", offset, n, path)
        return n

    def pwritev(fd, buffers, offset, *flags):
        path = watched(fd)
        n = real["pwritev"](fd, buffers, offset, *flags)
        if path:
            note("W %d %d %d %s", offset, n, path)
        return n

    def write(fd, data):
        path = watched(fd) if fd != out else None
        pos = os.lseek(fd, 0, os.SEEK_CUR) if path else 0
        n = real["write"](fd, data)
        if path:
            note("W %d %d %d %s", pos, n, path)
        return n

    def syncer(name: str):
        def sync(fd):
            path = watched(fd)
            if not path:
                return real[name](fd)
            n = note("S %d %s", path)
            if _SLOW:
                time.sleep(_SLOW)
            real[name](fd)
            note("D %d %s", n)
        return sync

    os.pwrite, os.pwritev, os.write = pwrite, pwritev, write
    os.fsync, os.fdatasync = syncer("fsync"), syncer("fdatasync")


if _ROOT and _JOURNAL:
    _install()
