"""Seal rules per segment kind (format §12), on content alone. Pure: a buffer in, a verdict out.

The engine adds the other two conditions (a flush after the last write, and a quiet period); this module
answers only "does the content say this segment is complete and will not be appended to again". Garbage
never raises and never seals: the file simply stays hot.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tierfs.store import consumequeue, indexfile
from tierfs.store.commitlog import BLANK_MAGIC, sealed_commitlog_end
from tierfs.store.paths import Kind

TIMERLOG_UNIT = 52
TIMERLOG_BLANK = 16
_TIMER_HEAD = struct.Struct(">iqi")  # size, prevPos/0, magic


@dataclass(frozen=True)
class SealParams:
    max_index_num: int = indexfile.MAX_INDEX_NUM
    max_hash_slot_num: int = indexfile.MAX_HASH_SLOT_NUM


def is_sealed(kind: Kind, buf, size: int, params: SealParams = SealParams()) -> tuple[bool, str]:
    """(sealed, reason). The reason says why not, for the log and /.tierfs/segments."""
    try:
        if kind is Kind.COMMITLOG:
            end = sealed_commitlog_end(buf, size)
            return (True, f"BLANK at {end}") if end is not None else (False, "no valid terminal BLANK")
        if kind in (Kind.CONSUMEQUEUE, Kind.BATCHCONSUMEQUEUE):
            unit = consumequeue.UNIT_SIZE if kind is Kind.CONSUMEQUEUE else 46
            if size < unit or size % unit:
                return False, f"size {size} is not a multiple of {unit}"
            off, usize = struct.unpack_from(">qi", buf, size - unit)
            ok = off >= 0 and usize > 0
            return (ok, "last unit valid") if ok else (False, "last unit not written")
        if kind is Kind.INDEX:
            want = indexfile.index_file_size(params.max_hash_slot_num, params.max_index_num)
            if size != want:
                return False, f"size {size} != {want} (broker.max_hash_slot_num/max_index_num)"
            h = indexfile.decode_header(buf)
            if h.index_count >= params.max_index_num:
                return True, "index full"
            return False, f"index count {h.index_count} < {params.max_index_num}"
        if kind is Kind.TIMERLOG:
            return _timerlog_sealed(buf, size)
        if kind is Kind.CONSUMEQUEUE_EXT:
            return False, "consumequeue_ext is kept local"
        return False, "mutable file"
    except (struct.error, ValueError, IndexError, TypeError) as e:
        return False, f"unreadable: {e}"


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
