"""Seal rules per segment kind (format §12), on content alone. Pure: a buffer in, a verdict out.

The engine adds the other two conditions (a flush after the last write, and a quiet period); this module
answers only "does the content say this segment is complete and will not be appended to again". Garbage
never raises and never seals: the file simply stays hot.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tierfs.store import consumequeue, dledger, indexfile
from tierfs.store.commitlog import BLANK_MAGIC, MAGIC_V1, MAGIC_V2, sealed_commitlog_end
from tierfs.store.paths import Kind

TIMERLOG_UNIT = 52
TIMERLOG_BLANK = 16
_TIMER_HEAD = struct.Struct(">iqi")  # size, prevPos/0, magic
_CQ_UNIT = struct.Struct(">qiq")  # commitlog offset, size, tags code


@dataclass(frozen=True)
class SealParams:
    max_index_num: int = indexfile.MAX_INDEX_NUM
    max_hash_slot_num: int = indexfile.MAX_HASH_SLOT_NUM


def is_sealed(kind: Kind, buf, size: int, params: SealParams = SealParams()) -> tuple[bool, str]:
    """(sealed, reason). The reason says why not, for the log and /.tierfs/segments."""
    try:
        if kind is Kind.COMMITLOG:
            end = sealed_commitlog_end(buf, size)
            if end is not None:
                return True, f"BLANK at {end}"
            magic = struct.unpack_from(">i", buf, 4)[0] if size >= 8 else 0
            if magic not in (0, MAGIC_V1, MAGIC_V2, BLANK_MAGIC):
                return False, f"corrupt: unknown magic {magic & 0xFFFFFFFF:#010x} at 0"
            return False, "no valid terminal BLANK"
        if kind in (Kind.CONSUMEQUEUE, Kind.BATCHCONSUMEQUEUE):
            unit = consumequeue.UNIT_SIZE if kind is Kind.CONSUMEQUEUE else 46
            if size < unit or size % unit:
                return False, f"size {size} is not a multiple of {unit}"
            off, usize = struct.unpack_from(">qi", buf, size - unit)
            if off == 0 and usize == 0:
                return False, "last unit not written"
            if not (off >= 0 and usize > 0):
                return False, f"corrupt: last unit (offset {off}, size {usize}) is neither valid nor empty"
            if kind is Kind.CONSUMEQUEUE:
                bad = _consumequeue_corruption(buf, size)
                if bad:
                    return False, f"corrupt: {bad}"
            return True, "last unit valid"
        if kind is Kind.INDEX:
            want = indexfile.index_file_size(params.max_hash_slot_num, params.max_index_num)
            if size != want:
                return False, f"size {size} != {want} (broker.max_hash_slot_num/max_index_num)"
            h = indexfile.decode_header(buf, raw=True)
            bad = _index_header_corruption(h, params)
            if bad:
                return False, f"corrupt header: {bad}"
            if h.index_count < params.max_index_num:
                return False, f"index count {h.index_count} < {params.max_index_num}"
            last = indexfile.decode_item(buf, params.max_index_num - 1, params.max_hash_slot_num)
            if last.key_hash < 0 or last.time_diff < 0 or not 0 <= last.prev_index < params.max_index_num - 1:
                return False, f"corrupt: last item {tuple(last)} cannot have been written by the broker"
            return True, "index full"
        if kind is Kind.TIMERLOG:
            return _timerlog_sealed(buf, size)
        if kind is Kind.DLEDGER_DATA:
            end = dledger.sealed_data_end(buf, size)
            if end is not None:
                return True, f"blank at {end}"
            magic = struct.unpack_from(">i", buf, 0)[0] if size >= 4 else 0
            if magic not in (0, dledger.MAGIC, dledger.BLANK_MAGIC):
                return False, f"corrupt: unknown DLedger magic {magic & 0xFFFFFFFF:#010x} at 0"
            return False, "no valid terminal blank"
        if kind is Kind.DLEDGER_INDEX:
            return dledger.index_sealed(buf, size)
        if kind is Kind.CONSUMEQUEUE_EXT:
            return False, "consumequeue_ext is kept local"
        return False, "mutable file"
    except (struct.error, ValueError, IndexError, TypeError) as e:
        return False, f"unreadable: {e}"


def checked_ranges(kind: Kind, size: int, params: SealParams = SealParams()) -> list[tuple[int, int]]:
    """(offset, length) of the bytes `is_sealed` reads of a `size`-byte file of `kind`: what a caller faults in
    before the check (a hole of a mapping on a full tmpfs is a SIGBUS when touched). An IndexFile's
    rule reads its header and last item only (hundreds of MiB in a broker's default config), a DLedger index file
    its first and last units; the others walk their whole content."""
    if kind is Kind.INDEX:
        last = indexfile.item_position(params.max_index_num - 1, params.max_hash_slot_num)
        return [(0, indexfile.HEADER_SIZE), (last, indexfile.ITEM_SIZE)]
    if kind is Kind.DLEDGER_INDEX and size >= dledger.INDEX_UNIT_SIZE:  # a sparse 160 MiB file: two units
        return [(0, dledger.INDEX_UNIT_SIZE), (size - dledger.INDEX_UNIT_SIZE, dledger.INDEX_UNIT_SIZE)]
    return [(0, size)]


def _consumequeue_corruption(buf, size: int) -> str | None:
    """Why a full ConsumeQueue file cannot be the broker's, or None. The broker appends units in CommitLog order
    and skips any unit whose end (offset + size) is not past the queue's last one (`putMessagePositionInfo`), so
    every unit is valid and unit ends strictly increase, after an optional prefix of pre-blank units."""
    prev_end = -1
    pre_blank = True
    with memoryview(buf) as mv:
        for i, (off, usize, tags) in enumerate(_CQ_UNIT.iter_unpack(mv[:size])):
            if pre_blank and (off, usize, tags) == consumequeue.PRE_BLANK:
                continue
            pre_blank = False
            if off < 0 or usize <= 0:
                return f"unit {i} (offset {off}, size {usize}) is not valid before the last written unit"
            if off + usize <= prev_end:
                return f"unit {i} (offset {off}, size {usize}) does not end after the unit before it"
            prev_end = off + usize
    return None


def _index_header_corruption(h: indexfile.IndexHeader, params: SealParams) -> str | None:
    """Why an IndexFile header cannot be the broker's, or None (the counters never pass their maxima)."""
    if not 0 <= h.index_count <= params.max_index_num:
        return f"index count {h.index_count} is outside 0..{params.max_index_num} (broker.max_index_num)"
    if not 0 <= h.hash_slot_count <= params.max_hash_slot_num:
        return (f"hash slot count {h.hash_slot_count} is outside 0..{params.max_hash_slot_num} "
                "(broker.max_hash_slot_num)")
    if h.begin_phy_offset < 0 or h.end_phy_offset < h.begin_phy_offset:
        return f"phy offsets {h.begin_phy_offset}..{h.end_phy_offset} are not an increasing range"
    if h.begin_timestamp < 0 or h.end_timestamp < h.begin_timestamp:
        return f"timestamps {h.begin_timestamp}..{h.end_timestamp} are not an increasing range"
    return None


def _timerlog_sealed(buf, size: int) -> tuple[bool, str]:
    """TimerLog: 52-byte units from 0, ended by the 16-byte roll blank (int remaining, long 0, int magic)."""
    pos = 0
    while pos + TIMERLOG_BLANK <= size:
        n, _, magic = _TIMER_HEAD.unpack_from(buf, pos)
        if magic == BLANK_MAGIC and n == size - pos:
            return True, f"blank at {pos}"
        if n != TIMERLOG_UNIT:
            return False, f"no unit at {pos}"
        pos += n
    return False, "no terminal blank"
