"""DLedger CommitLog codec: the data and index files of a broker with ``enableDLegerCommitLog=true``.

Pure functions over ``bytes``/``bytearray``/``memoryview``/``mmap``; nothing here does I/O. Decoders never raise
on garbage: they answer ``None`` where DLedger's own recovery (``DLedgerMmapFileStore.recover``) would stop.
Read from openmessaging/dledger 0.3.1.2 (RocketMQ 4.9.7) and 0.3.2 (5.5.0), whose formats are identical
(``DLedgerEntryCoder``, ``DLedgerMmapFileStore``, ``MmapFileList``), and checked against the files real
4.9.7 and 5.5.0 brokers wrote (tests/test_dledger.py).

Layout (all integers big-endian):

``<storePathRootDir>/dledger-<selfId>/`` holds ``data/`` and ``index/`` (segments named by the 20-digit offset
of their first byte, like a CommitLog), plus ``checkpoint`` (properties ``committedIndex``, ``endIndex``),
``checkpoint.bak`` and ``currterm`` (``currTerm``, ``voteLeader``): small mutable files, kept local. The broker
writes no ``commitlog/`` at all; its ``consumequeue/`` and ``index/`` are the usual RocketMQ ones, whose
CommitLog offsets point *into the DLedger data files* (at an entry's body).

Data file (``dledger-<id>/data/<offset>``, size = the broker's ``mappedFileSizeCommitLog``, DLedger's
``mappedFileSizeForEntryData``; default 1 GiB): entries packed from byte 0, an entry never straddles files:

====  ====  ==========  ==========================================================================
off   size  field       content
====  ====  ==========  ==========================================================================
0     4     magic       1 (``MAGIC_1``, the only one)
4     4     size        the whole entry, header included: 48 + body length
8     8     index       the Raft log index, consecutive from 0 across the whole log
16    8     term        the Raft term the entry was appended in (never decreases)
24    8     pos         the entry's global offset = file start + position in the file
32    4     channel     reserved, 0
36    4     chainCrc    0 in RocketMQ's use (not computed)
40    4     bodyCrc     0 in RocketMQ's use (not computed)
44    4     bodyLen     body length (``size - 48``)
48    n     body        one RocketMQ CommitLog record (format §4): its TOTALSIZE is ``bodyLen`` and
                        its PHYSICALOFFSET is ``pos + 48`` (RocketMQ's append hook writes it)
====  ====  ==========  ==========================================================================

An entry is appended only if ``size + 8 <= remaining``; otherwise the rest of the file is written as the
**blank**: int ``-1`` (``BLANK_MAGIC_CODE``) then int ``remaining`` (note: magic first, unlike RocketMQ's
BLANK), then zeros to the end of the file. A file with its blank is complete: nothing appends to it again,
except after a Raft truncation (a deposed leader rejoining: ``truncateOffset`` can cut back into it), which
tierfs handles as any write to a tiered segment (a new generation).

Index file (``dledger-<id>/index/<offset>``, size ``mappedFileSizeForEntryIndex`` = 32 x 5 MiB = 160 MiB, not
configurable from the broker's config): 32-byte units, unit *i* of the log at byte ``i * 32`` of the log of
index files, no blank (a unit never straddles files: 32 divides the file size):
int magic (1), long pos (the data entry's offset), int size (the entry's size), long index, long term.
A 160 MiB index file is full after 5,242,880 entries (about 1.5 GiB of data at 300-byte entries).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from tierfs.store import commitlog

__all__ = [
    "MAGIC",
    "BLANK_MAGIC",
    "MIN_BLANK_LEN",
    "HEADER_SIZE",
    "BODY_OFFSET",
    "INDEX_UNIT_SIZE",
    "INDEX_FILE_SIZE",
    "Entry",
    "IndexUnit",
    "encode_entry",
    "encode_blank",
    "encode_index_unit",
    "decode_entry",
    "decode_index_unit",
    "iter_entries",
    "sealed_data_end",
    "index_sealed",
]

MAGIC = 1  # DLedgerMmapFileStore.MAGIC_1 = CURRENT_MAGIC
BLANK_MAGIC = -1  # MmapFileList.BLANK_MAGIC_CODE
MIN_BLANK_LEN = 8  # MmapFileList.MIN_BLANK_LEN: an entry is appended only if size + 8 <= remaining
HEADER_SIZE = 44  # DLedgerEntry.HEADER_SIZE: magic .. bodyCrc
BODY_OFFSET = 48  # DLedgerEntry.BODY_OFFSET: header + bodyLen
INDEX_UNIT_SIZE = 32  # DLedgerMmapFileStore.INDEX_UNIT_SIZE
INDEX_FILE_SIZE = INDEX_UNIT_SIZE * 5 * 1024 * 1024  # DLedgerConfig.mappedFileSizeForEntryIndex default

_HEAD = struct.Struct(">iiqqqiiii")  # 48 bytes
_UNIT = struct.Struct(">iqiqq")  # 32 bytes
_II = struct.Struct(">ii")
_CHECK_BATCH = 1 << 16  # entries checked at once (vectorised), as commitlog does


@dataclass(frozen=True)
class Entry:
    """One data entry's header; its body is ``buf[offset + BODY_OFFSET : offset + size]``."""

    magic: int
    size: int
    index: int
    term: int
    pos: int
    channel: int
    chain_crc: int
    body_crc: int
    body_len: int


@dataclass(frozen=True)
class IndexUnit:
    magic: int
    pos: int
    size: int
    index: int
    term: int


def encode_entry(index: int, term: int, pos: int, body: bytes, channel: int = 0, chain_crc: int = 0,
                 body_crc: int = 0) -> bytes:
    """``DLedgerEntryCoder.encode`` (RocketMQ's append hook sets the body's PHYSICALOFFSET: the caller's job)."""
    return _HEAD.pack(MAGIC, BODY_OFFSET + len(body), index, term, pos, channel, chain_crc, body_crc,
                      len(body)) + bytes(body)


def encode_blank(remaining: int) -> bytes:
    """The end-of-file filler ``MmapFileList.preAppend`` writes: magic, remaining length, zeros."""
    if remaining < MIN_BLANK_LEN:
        raise ValueError(f"a blank needs at least {MIN_BLANK_LEN} bytes, not {remaining}")
    return _II.pack(BLANK_MAGIC, remaining) + bytes(remaining - MIN_BLANK_LEN)


def encode_index_unit(pos: int, size: int, index: int, term: int, magic: int = MAGIC) -> bytes:
    """``DLedgerEntryCoder.encodeIndex``."""
    return _UNIT.pack(magic, pos, size, index, term)


def decode_entry(buf, off: int = 0) -> Entry | None:
    """The entry header at `off`, or None for a blank, zeros or anything DLedger's recovery would stop at."""
    try:
        e = Entry(*_HEAD.unpack_from(buf, off))
    except struct.error:
        return None
    if e.magic != MAGIC or e.size <= HEADER_SIZE or e.body_len + BODY_OFFSET != e.size or e.pos < 0:
        return None
    try:
        if off + e.size > len(buf):
            return None
    except TypeError:
        return None
    return e


def decode_index_unit(buf, off: int = 0) -> IndexUnit | None:
    """The index unit at `off`, or None when it is not a written one."""
    try:
        u = IndexUnit(*_UNIT.unpack_from(buf, off))
    except struct.error:
        return None
    if u.magic != MAGIC or u.size <= HEADER_SIZE or u.pos < 0 or u.index < 0 or u.term < 0:
        return None
    return u


def iter_entries(buf, file_size: int | None = None) -> Iterator[tuple[int, Entry]]:
    """(position, entry) of each entry from 0 up to the blank, the first zero or the first invalid header."""
    size = len(buf) if file_size is None else min(file_size, len(buf))
    pos = 0
    while pos + MIN_BLANK_LEN <= size:
        e = decode_entry(buf, pos)
        if e is None or pos + e.size > size:
            return
        yield pos, e
        pos += e.size


def sealed_data_end(buf, file_size: int, *, file_start: int | None = None) -> int | None:
    """Seal test for a data file: the position of its terminal blank, or None.

    Complete = walking from 0 over valid entries reaches a blank whose length is ``file_size - pos``. Every
    entry's header must agree with its place (``pos`` = file start + position, the same start for all, a
    multiple of the file size as DLedger names files; index consecutive; term never decreasing) and its body
    must be one whole RocketMQ record whose PHYSICALOFFSET is ``pos + 48``. Only headers are read (a hop per
    entry, then vectorised checks), so this is cheap on a 1 GiB mapping. Garbage never raises."""
    mv = commitlog.byte_view(buf, file_size, MIN_BLANK_LEN)
    if mv is None:
        return None
    with mv:
        limit = file_size - MIN_BLANK_LEN  # an entry always leaves room for the blank
        unpack = _II.unpack_from
        pos = 0
        starts: list[int] = []
        prev: tuple[int, int, int] | None = None  # (start - pos, index, term) of the previous batch's last entry
        try:
            while pos <= limit:
                magic, n = unpack(mv, pos)
                if magic == BLANK_MAGIC:
                    if n != file_size - pos:
                        return None
                    if starts and _entries_ok(mv, file_size, starts, pos, file_start, prev) is None:
                        return None
                    return pos
                if magic != MAGIC or n <= BODY_OFFSET or pos + n > limit:
                    return None
                starts.append(pos)
                pos += n
                if len(starts) == _CHECK_BATCH:
                    prev = _entries_ok(mv, file_size, starts, pos, file_start, prev)
                    if prev is None:
                        return None
                    starts = []
        except struct.error:
            return None
        return None


def _entries_ok(mv: memoryview, file_size: int, starts: list[int], end: int, file_start: int | None,
                prev: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """Vectorised checks of a run of entries the hop found (the last one ends at `end`); the run's last
    (file start, index, term) for the next run, or None when any entry cannot be DLedger's."""
    a = np.frombuffer(mv, dtype=np.uint8, count=file_size)
    at = np.array(starts, dtype=np.int64)
    size = np.append(at[1:], end) - at
    be = commitlog.be_ints
    index, term, epos = be(a, at + 8, 8, True), be(a, at + 16, 8, True), be(a, at + 24, 8, True)
    if not np.array_equal(be(a, at + 44, 4, True), size - BODY_OFFSET):
        return None
    start = epos - at
    first = int(start[0])
    if first < 0 or first % file_size or (file_start is not None and first != file_start) \
            or not (start == first).all():
        return None
    if prev is not None and (prev[0] != first or prev[1] + 1 != int(index[0]) or prev[2] > int(term[0])):
        return None
    if (index < 0).any() or not (np.diff(index) == 1).all() or (term < 0).any() or (np.diff(term) < 0).any():
        return None
    body = at + BODY_OFFSET
    body_len = size - BODY_OFFSET
    magic = be(a, body + 4, 4, True)
    if not np.array_equal(be(a, body, 4, True), body_len) \
            or not np.isin(magic, (commitlog.MAGIC_V1, commitlog.MAGIC_V2)).all():
        return None
    if not np.array_equal(be(a, body + commitlog.PHYSICAL_OFFSET_POSITION, 8, True), epos + BODY_OFFSET):
        return None
    if commitlog.check_layouts(a, body, body_len, magic == commitlog.MAGIC_V2, False) is None:
        return None
    return first, int(index[-1]), int(term[-1])


def index_sealed(buf, file_size: int) -> tuple[bool, str]:
    """Seal test for an index file: (full?, why). Full = its size is a whole number of units and its first and
    last units are written and agree (the last one's index is the first's + units - 1, its data offset later).
    Units are appended in order and a file is never appended to once full, so a written last unit says so."""
    if file_size < INDEX_UNIT_SIZE or file_size % INDEX_UNIT_SIZE:
        return False, f"size {file_size} is not a multiple of {INDEX_UNIT_SIZE}"
    last = decode_index_unit(buf, file_size - INDEX_UNIT_SIZE)
    if last is None:
        return False, "last unit not written"
    first = decode_index_unit(buf, 0)
    n = file_size // INDEX_UNIT_SIZE
    if first is None or last.index != first.index + n - 1 or last.pos <= first.pos or last.term < first.term:
        return False, f"corrupt: first unit {first} and last unit {last} are not {n} units of one log apart"
    return True, "index full"
