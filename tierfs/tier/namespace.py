"""The one namespace authority: every name change the kernel makes reaches the engine and the catalog here.

The FUSE front changes the hot dir first (it is the file system of record for names) and then tells this module,
with no await in between, what happened: unlink (of one of maybe several hard links), rename of a file or of a
directory (everything below it moves), RENAME_EXCHANGE (both sides move), a rename over another file (which loses
that name). Each change becomes one catalog transaction (`Catalog.apply_namespace`): rows whose file lost its last
name go with their objects queued for deletion, rows that follow a rename get their new path, pipeline artifacts
follow their file.

Files are found by identity (the hot inode: `Engine.by_ino`), never by the name the call mentions: a hard link
renamed or unlinked is the same file under another name. Paths are derived attributes, so the in-memory ones
follow the hot dir at once (before the commit: a worker opening a file by its path must see the name the hot dir
has now); a row's removal and its file's state change only after the commit. A crash between the hot-dir change
and the commit leaves a row with an old path, which the next mount's reconcile finds by identity.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from tierfs import failpoints
from tierfs.tier import identity
from tierfs.tier.catalog import NEVER, Entry, State

if TYPE_CHECKING:
    from tierfs.tier.engine import Engine

log = logging.getLogger("tierfs.tier")

RENAME_EXCHANGE = 2


def storable(*names: str) -> bool:
    """Can the catalog hold these names (UTF-8 text; a file system name may be any bytes)?"""
    try:
        for n in names:
            n.encode()
    except UnicodeEncodeError:
        return False
    return True


class Namespace:
    def __init__(self, engine: Engine):
        self.eng = engine

    async def unlinked(self, rel: str, ino: int, nlink: int, held_fd: int | None, other: str | None) -> None:
        """`rel` was removed; its inode had `nlink` links before. `held_fd`: an fd open on the inode (it may be
        read on after its last name is gone); `other`: another name the FUSE front knows it by, if any."""
        eng = self.eng
        eng.sealer.unlinked(rel, ino)
        e = eng.by_ino.get(ino)
        if e is None:
            return
        if nlink > 1:  # a hard link went: the file lives on under its other name(s)
            if e.path == rel:
                await self._rename_row(e, rel, other)
            return
        removes = [self._lose(e, rel, held_fd)]
        await eng.db(eng.catalog.apply_namespace, [], [r for r, _ in removes], [])
        failpoints.hit("tier.unlinked")
        self._lost(removes)

    async def renamed(self, old: str, new: str, flags: int, is_dir: bool,
                      replaced: tuple[int, int, int | None, str | None] | None) -> None:
        """`old` is now `new` (with RENAME_EXCHANGE, and `new` is now `old`). `replaced`: (inode, links before,
        an fd held on it, another known name) of the file a plain rename put `old` over, which lost that name."""
        eng = self.eng
        exchange = bool(flags & RENAME_EXCHANGE)

        def moved(p: str) -> str | None:
            if p == old or p.startswith(old + "/"):
                return new + p[len(old):]
            if exchange and (p == new or p.startswith(new + "/")):
                return old + p[len(new):]
            return None

        if is_dir or exchange:  # rare (a broker renames files only): a walk of the index is fine
            todo = [(p, e) for p, e in eng.entries.items() if moved(p) is not None]
        else:
            e = eng.entries.get(old)
            todo = [(old, e)] if e is not None else []
        removes: list[tuple[tuple, Entry | None]] = []
        stay: Entry | None = None  # a replaced file with other links: its row takes another of its names
        if replaced is not None and not exchange:
            r_ino, r_nlink, r_held, r_other = replaced
            gone = eng.by_ino.get(r_ino)
            if gone is not None and all(gone is not e for _, e in todo):
                if r_nlink > 1:
                    stay = gone if gone.path == new else None
                else:
                    removes.append(self._lose(gone, new, r_held))
        # names first, with no await: the hot dir has them already
        eng.rename([(e, moved(p)) for p, e in todo])  # type: ignore[misc]
        moves: list[tuple[int, str]] = []
        for _, e in todo:
            if storable(e.path):  # a name that is not UTF-8 stays in memory; the next mount finds the file again
                moves.append((e.file_id, e.path))
        eng.sealer.renamed(old, new, is_dir or exchange)
        # pipeline artifacts follow a file with a row, or anything below a directory; a name the catalog cannot
        # hold (not UTF-8) has none. A rename of a file with no row (a config .tmp) costs no transaction.
        pairs = [(old, new), (new, old)] if exchange else [(old, new)]
        if not (moves or ((is_dir or exchange) and storable(old, new))):
            pairs = []
        if moves or removes or pairs:
            await eng.db(eng.catalog.apply_namespace, moves, [r for r, _ in removes], pairs)
        self._lost(removes)
        if stay is not None:
            await self._rename_row(stay, new, replaced[3])  # type: ignore[index]

    # ------------------------------------------------------------------ helpers

    def _lose(self, e: Entry, rel: str, held_fd: int | None) -> tuple[tuple, Entry | None]:
        """`e` lost its last name `rel`: its row goes, in the caller's transaction. A tiered file that is still
        open keeps its entry (served through its fds) and its objects until the last close (NEVER)."""
        eng = self.eng
        keep = e.state is State.TIERED and held_fd is not None and eng.tiered.get(e.ino) is e
        if keep:
            eng.hold(e, held_fd)  # type: ignore[arg-type]
        eng.unname(e, rel)
        grace = float(eng.config["delete.grace_seconds"])
        return (e.file_id, e.path, e.all_objects(), NEVER if keep else time.time() + grace), e

    def _lost(self, removes: list[tuple[tuple, Entry | None]]) -> None:
        """After the commit: files that lost their last name are dropped, or kept as orphans while open."""
        eng = self.eng
        grace = float(eng.config["delete.grace_seconds"])
        for (_, rel, _, not_before), e in removes:
            if e is None:
                continue
            if not_before >= NEVER:
                eng.orphan(e)
                log.info("%s deleted while open: served through its open fds; %d objects go %.0f s after the "
                         "last close", rel, len(e.objects), grace)
                continue
            eng.drop(e)
            log.info("%s deleted: %d objects deleted after %.0f s", rel, len(e.objects), grace)

    async def _rename_row(self, e: Entry, rel: str, other: str | None) -> None:
        """`e`'s row named `rel`, which another of its hard links' names replaces (found by a walk when the FUSE
        front knows none). Nothing to do if the file lost every name meanwhile."""
        eng = self.eng
        if other is None:
            paths = await trio.to_thread.run_sync(identity.paths_of, eng.hot, eng.state_dir, {e.ino})
            other = min(paths.get(e.ino, ()), default=None)
        if not eng.is_live(e) or e.path != rel:
            return  # renamed, unlinked or replaced while we looked: that change moved the row
        if other is None or not storable(other):
            log.warning("%s: a hard link of file id %d went and no other name the catalog can hold was found (%r); "
                        "the next mount finds the file by its identity", rel, e.file_id, other)
            return
        eng.rename([(e, other)])
        await eng.db(eng.catalog.apply_namespace, [(e.file_id, other)], [], [(rel, other)])
