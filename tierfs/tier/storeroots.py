"""Where the stores are below the mount root: the directories the sealer's scan walks.

A broker's `storePathRootDir` may be a subdirectory of the mount (a master's and a slave's stores under one
mount on one host). Such a store root is either configured (`store.roots`) or found by its layout: a directory
holding `commitlog/`, `consumequeue/`, `index/` or a DLedger CommitLog's `dledger-<selfId>/`. The search stops at a store root (a store never nests another)
and goes at most MAX_DEPTH levels down, skipping hidden directories (the daemon's own `.tierfs`).
"""

from __future__ import annotations

import os

from tierfs.store.paths import is_dledger_dir

SEGMENT_DIRS = ("commitlog", "consumequeue", "batchconsumequeue", "index", "timerlog")
_MARKERS = frozenset(("commitlog", "consumequeue", "index"))
MAX_DEPTH = 3


def parse_roots(text: str) -> list[str]:
    """'master, slave/' -> ['master', 'slave']; '.' or '/' is the mount root ('')."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            root = part.strip("/")
            out.append("" if root in ("", ".") else root)
    return list(dict.fromkeys(out))


def check_roots(text: str) -> str | None:
    """Why a `store.roots` value is invalid, or None."""
    for root in parse_roots(text):
        parts = root.split("/") if root else []
        if any(p in ("..", ".") or p.startswith(".") or p in SEGMENT_DIRS for p in parts) or "\0" in root:
            return f"{root!r} is not a relative directory below the mount root (no '..', hidden or segment dirs)"
    return None


def find_roots(hot: str, configured: str = "") -> list[str]:
    """Store roots relative to the hot dir ('' = the mount root). Configured ones as given; otherwise every
    directory with a store layout, or [''] while there is none yet (a broker about to create its first files)."""
    if configured.strip():
        return parse_roots(configured)
    roots: list[str] = []
    stack: list[tuple[str, int]] = [("", 0)]
    while stack:
        rel, depth = stack.pop()
        try:
            with os.scandir(f"{hot}/{rel}" if rel else hot) as it:
                dirs = [de.name for de in it if de.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        if _MARKERS.intersection(dirs) or any(is_dledger_dir(d) for d in dirs):
            roots.append(rel)
            continue
        if depth < MAX_DEPTH:
            stack += [(f"{rel}/{d}" if rel else d, depth + 1) for d in dirs if not d.startswith(".")]
    return sorted(roots) or [""]


def segment_dirs(hot: str, configured: str = "", roots: list[str] | None = None) -> list[str]:
    """The segment directories of every store root (`roots`, or found: find_roots), relative to the hot dir, for
    the sealer's walk: the RocketMQ logs, and the `data/` and `index/` of each DLedger store (`dledger-<selfId>/`)
    in the root."""
    out = []
    for r in find_roots(hot, configured) if roots is None else roots:
        out += [f"{r}/{d}" if r else d for d in SEGMENT_DIRS]
        try:
            with os.scandir(f"{hot}/{r}" if r else hot) as it:
                ledgers = sorted(de.name for de in it if is_dledger_dir(de.name) and de.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        out += [f"{r}/{ld}/{d}" if r else f"{ld}/{d}" for ld in ledgers for d in ("data", "index")]
    return out
