"""ConsumeQueue unit codec and file arithmetic (format doc §2, §5, §6.1).

A queue is a sequence of fixed 20-byte units ``(commitlog offset, record size, tags code)``
split over files of ``mappedFileSizeConsumeQueue`` bytes named by the byte offset of their
first unit. A unit is valid when ``offset >= 0 and size > 0``; readers stop at the first
invalid one (normally zeros), so that rule is also the end-of-data rule.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from .names import offset_to_name

__all__ = [
    "UNIT_SIZE",
    "DEFAULT_FILE_SIZE",
    "CqUnit",
    "PRE_BLANK",
    "PRE_BLANK_BYTES",
    "encode_unit",
    "decode_unit",
    "is_valid",
    "is_pre_blank",
    "round_cq_file_size",
    "file_offset_for",
    "file_name_for",
    "position_for",
    "count_valid_units",
    "is_full_and_valid",
]

UNIT_SIZE = 20  # ConsumeQueue.CQ_STORE_UNIT_SIZE
DEFAULT_FILE_SIZE = 300_000 * UNIT_SIZE  # 6000000

_UNIT = struct.Struct(">qiq")
_INT_MAX = (1 << 31) - 1


class CqUnit(NamedTuple):
    phys_offset: int
    size: int
    tags_code: int


PRE_BLANK = CqUnit(0, _INT_MAX, 0)
"""``fillPreBlank`` unit: pads a queue's first file when its first entry is not at a file boundary."""
PRE_BLANK_BYTES = _UNIT.pack(*PRE_BLANK)


def encode_unit(phys_offset: int, size: int, tags_code: int) -> bytes:
    """The 20 bytes of one unit (big-endian long, int, long)."""
    return _UNIT.pack(phys_offset, size, tags_code)


def decode_unit(buf, pos: int = 0) -> CqUnit:
    """Unit at byte *pos*. Raises ``ValueError`` if fewer than 20 bytes remain (a caller bug, not data)."""
    if pos < 0 or pos + UNIT_SIZE > len(buf):
        raise ValueError(f"no complete unit at {pos}")
    return CqUnit._make(_UNIT.unpack_from(buf, pos))


def is_valid(unit: CqUnit) -> bool:
    """Broker validity rule (recovery, getLastOffset): ``offset >= 0 and size > 0``. Pre-blank units count as valid."""
    return unit.phys_offset >= 0 and unit.size > 0


def is_pre_blank(unit: CqUnit) -> bool:
    return unit == PRE_BLANK


def round_cq_file_size(n: int) -> int:
    """``getMappedFileSizeConsumeQueue``: the configured size rounded up to a multiple of 20."""
    return -(-n // UNIT_SIZE) * UNIT_SIZE


def file_offset_for(index: int, file_size: int) -> int:
    """Start offset (= file name value) of the file holding entry *index*."""
    logical = index * UNIT_SIZE
    return logical - logical % file_size


def file_name_for(index: int, file_size: int) -> str:
    """20-digit name of the file holding entry *index*."""
    return offset_to_name(file_offset_for(index, file_size))


def position_for(index: int, file_size: int) -> int:
    """Byte position of entry *index* inside its file."""
    return (index * UNIT_SIZE) % file_size


def count_valid_units(buf) -> int:
    """Number of consecutive valid units from the start of *buf* (what recovery would keep)."""
    n = len(buf) // UNIT_SIZE
    with memoryview(buf) as mv:
        for i, (off, size, _) in enumerate(_UNIT.iter_unpack(mv[:n * UNIT_SIZE])):
            if off < 0 or size <= 0:
                return i
    return n


def is_full_and_valid(buf, file_size: int) -> bool:
    """Seal rule for a CQ file (§12): exactly *file_size* bytes, a whole number of units, and the last unit valid.

    CQ files get no filler, so a full file's last unit is the last entry ever appended to it.
    Never raises on garbage.
    """
    try:
        if (
            not isinstance(file_size, int)
            or file_size < UNIT_SIZE
            or file_size % UNIT_SIZE
            or len(buf) != file_size
        ):
            return False
        off, size, _ = _UNIT.unpack_from(buf, file_size - UNIT_SIZE)
    except (TypeError, ValueError, struct.error):
        return False
    return off >= 0 and size > 0
