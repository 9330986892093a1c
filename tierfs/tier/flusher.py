"""fsync files through a tierfs mount, in a process of its own (`python -m tierfs.tier.flusher MOUNTPOINT`).

The sealer uses this to make the kernel write back every page still dirty for a quiet segment (a broker under
ASYNC_FLUSH may never fsync its last pages). It must not run inside the daemon: a daemon thread blocked in a
request to its own mount keeps a SIGKILLed daemon from ever exiting (its /dev/fuse fd stays open, so the kernel
never aborts the connection that would wake the thread). A separate process just gets ENOTCONN then.

Paths (relative to the mountpoint) come NUL-separated on stdin; each one that fails is printed as
`path<TAB>error` on stdout. A path that no longer exists is not a failure.

`run` is the daemon's side. The flusher's pid is in the set it is given while it runs: the FUSE front answers
an fsync from that pid without an fsync of the hot file. The kernel has written back (and waited for) every dirty
page of the file before it sends the FSYNC, which is all a flush is for: the sealer makes the hot file durable
itself before a segment is committed TIERED, and continuous tiering reads the hot file's pages. So a round does
not put a journal commit per active file on the disk the broker's own SYNC_FLUSH waits for.
"""

from __future__ import annotations

import os
import subprocess
import sys

import trio


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


async def run(mountpoint: os.PathLike | str, rels: list[str], pids: set[int]) -> tuple[list[str], int, str]:
    """Flush `rels` through the mount in a child process: (the `path<TAB>error` lines of those that failed, its
    exit code, the end of its stderr). OSError when it cannot start. Cancelling kills it."""
    paths = b"\0".join(r.encode("utf-8", "surrogateescape") for r in rels)
    proc = await trio.lowlevel.open_process([sys.executable, "-P", "-m", "tierfs.tier.flusher", str(mountpoint)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids.add(proc.pid)
    out: list[bytes] = []
    err: list[bytes] = []
    try:
        async def feed() -> None:
            assert proc.stdin is not None
            async with proc.stdin:
                await proc.stdin.send_all(paths)

        async def drain(stream: trio.abc.ReceiveStream | None, into: list[bytes]) -> None:
            assert stream is not None
            async with stream:
                async for chunk in stream:
                    into.append(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            nursery.start_soon(drain, proc.stdout, out)
            nursery.start_soon(drain, proc.stderr, err)
        code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
        pids.discard(proc.pid)
    return b"".join(out).decode("utf-8", "replace").splitlines(), code, b"".join(err).decode(errors="replace")[-500:]


def main() -> None:
    rels = [r for r in sys.stdin.buffer.read().decode("utf-8", "surrogateescape").split("\0") if r]
    for rel, err in flush(sys.argv[1], rels):
        print(f"{rel}\t{err}", flush=True)


if __name__ == "__main__":
    main()
