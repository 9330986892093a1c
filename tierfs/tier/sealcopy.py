"""Sealing adopts the append objects: a segment's chunk objects are composed inside the object store from the
append objects continuous tiering already uploaded (tierfs.tier.appendlog), instead of being sent again.

For each chunk [lo, hi) of the sealed segment, `plan` lays the tail's append objects over it in upload order (a
later object wins where two overlap, as on read) and returns the ranges that make the chunk, when they cover all
of it and every range but the last is at least the store's `compose_min_part` (S3: 5 MiB). Each object used must
hold exactly the sealed file's bytes: `matches` compares the crc32c recorded when it was put with the crc32c of
the same range of the local file, so the composed chunk is the local chunk, whose crc32c the catalog records as
for a chunk that was put. Otherwise the chunk is put as ever.
"""

from __future__ import annotations

from tierfs.objectstore import crc32c_fd
from tierfs.tier.appendlog import TailObject

_READ = 8 << 20


def plan(objects: tuple[TailObject, ...], lo: int, hi: int, min_part: int
         ) -> list[tuple[TailObject, int, int]] | None:
    """(object, offset in it, length) ranges that make [lo, hi) from the objects, or None."""
    pieces: list[tuple[int, int, TailObject]] = []
    for o in objects:
        a, b = max(o.start, lo), min(o.end, hi)
        if a >= b:
            continue
        keep = []
        for s, e, x in pieces:
            if e <= a or s >= b:
                keep.append((s, e, x))
                continue
            if s < a:
                keep.append((s, a, x))
            if e > b:
                keep.append((b, e, x))
        pieces = sorted(keep + [(a, b, o)], key=lambda p: p[0])
    out: list[tuple[TailObject, int, int]] = []
    pos = lo
    for s, e, o in pieces:
        if s != pos:
            return None  # a gap no object covers
        if out and out[-1][0] is o and out[-1][1] + out[-1][2] == s - o.start:
            out[-1] = (o, out[-1][1], out[-1][2] + e - s)
        else:
            out.append((o, s - o.start, e - s))
        pos = e
    if pos != hi or not out or any(n < min_part for _, _, n in out[:-1]):
        return None
    return out


def matches(fd: int, o: TailObject, cache: dict[str, bool]) -> bool:
    """Does the local file hold exactly the object's bytes (its recorded crc32c over the same range)?"""
    if o.key not in cache:
        try:
            cache[o.key] = crc32c_fd(fd, o.start, o.length, _READ) == o.crc
        except ValueError:  # the file ends before the object does
            cache[o.key] = False
    return cache[o.key]
