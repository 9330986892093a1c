"""fsync files through a tierfs mount, in a process of its own (`python -m tierfs.tier.flusher MOUNTPOINT`).

The sealer uses this to make the kernel write back every page still dirty for a quiet segment (a broker under
ASYNC_FLUSH may never fsync its last pages). It must not run inside the daemon: a daemon thread blocked in a
request to its own mount keeps a SIGKILLed daemon from ever exiting (its /dev/fuse fd stays open, so the kernel
never aborts the connection that would wake the thread). A separate process just gets ENOTCONN then.

Paths (relative to the mountpoint) come NUL-separated on stdin; each one that fails is printed as
`path<TAB>error` on stdout. A path that no longer exists is not a failure.
"""

from __future__ import annotations

import os
import sys


def flush(mountpoint: str, rels: list[str]) -> list[tuple[str, str]]:
    failed = []
    for rel in rels:
        try:
            fd = os.open(os.path.join(mountpoint, rel), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            continue
        except OSError as err:
            failed.append((rel, err.strerror or str(err)))
    return failed


def main() -> None:
    rels = [r for r in sys.stdin.buffer.read().decode("utf-8", "surrogateescape").split("\0") if r]
    for rel, err in flush(sys.argv[1], rels):
        print(f"{rel}\t{err}", flush=True)


if __name__ == "__main__":
    main()
