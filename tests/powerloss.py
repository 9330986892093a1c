"""A power cut of a tierfs daemon's hot dir, modelled: the daemon journals its writes and syncs
(tests/powerloss/sitecustomize.py); after a kill -9, `apply` zeroes every write no completed sync covers."""

from __future__ import annotations

import os
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "powerloss"


def env(hot: Path, journal: Path, slow_sync: float = 0.0) -> dict[str, str]:
    """The daemon's environment for a journaled hot dir (the shim first on its path)."""
    path = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TIERFS_TEST_POWERLOSS_ROOT": str(hot),
            "TIERFS_TEST_POWERLOSS_JOURNAL": str(journal), "TIERFS_TEST_POWERLOSS_SLOW_SYNC": str(slow_sync)}


def lines(journal: Path) -> list[list[str]]:
    """The journal's complete lines, split: `W n offset length path`, `S n path`, `D n n-of-its-S`."""
    text = journal.read_text("utf-8", "surrogateescape") if journal.exists() else ""
    return [ln.split(" ", 4 if ln.startswith("W") else 2) for ln in text.split("\n")[:-1]]


def lost_writes(journal: Path) -> list[tuple[str, int, int]]:
    """(path, offset, length) of every write that no sync of its file, started after it, completed."""
    started: dict[str, tuple[int, str]] = {}
    synced_upto: dict[str, int] = {}  # path -> the latest sync start whose sync completed
    writes: list[tuple[int, str, int, int]] = []
    for f in lines(journal):
        if f[0] == "W":
            writes.append((int(f[1]), f[4], int(f[2]), int(f[3])))
        elif f[0] == "S":
            started[f[1]] = (int(f[1]), f[2])
        elif f[0] == "D" and f[2] in started:
            n, path = started.pop(f[2])
            synced_upto[path] = max(synced_upto.get(path, 0), n)
    return [(p, off, ln) for n, p, off, ln in writes if n > synced_upto.get(p, 0)]


def apply(journal: Path) -> int:
    """The power cut: zero every lost write in the hot dir (the daemon must be dead). Returns the bytes lost."""
    lost = 0
    for path, off, ln in lost_writes(journal):
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            n = max(0, min(ln, size - off))
            if n:
                os.pwrite(fd, bytes(n), off)
                lost += n
            os.fsync(fd)
        finally:
            os.close(fd)
    return lost
