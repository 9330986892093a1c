"""The 4096-byte ``checkpoint`` file (format doc §8.1).

Big-endian longs at 0/8/16 (all versions) and 24/32 (5.x only); the rest of the page is zero.
Abnormal recovery picks its start segment from :meth:`Checkpoint.min_timestamp`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["CHECKPOINT_SIZE", "Checkpoint", "encode_checkpoint", "encode_checkpoint_into", "decode_checkpoint"]

CHECKPOINT_SIZE = 4096  # OS_PAGE_SIZE; the file is mapped over exactly this much
_FIELDS5 = struct.Struct(">qqqqq")
_FIELDS3 = struct.Struct(">qqq")


@dataclass
class Checkpoint:
    physic_msg_timestamp: int = 0
    logics_msg_timestamp: int = 0
    index_msg_timestamp: int = 0
    master_flushed_offset: int = 0  # 5.x
    confirm_phy_offset: int = 0  # 5.x

    def min_timestamp(self) -> int:
        """``getMinTimestamp``: ``min(physic, logics) - 3000`` floored at 0."""
        return max(min(self.physic_msg_timestamp, self.logics_msg_timestamp) - 3000, 0)

    def min_timestamp_index(self) -> int:
        """``getMinTimestampIndex``: ``min(min_timestamp(), index)`` (used when ``messageIndexSafe``)."""
        return min(self.min_timestamp(), self.index_msg_timestamp)


def encode_checkpoint_into(buf, cp: Checkpoint, fields: int = 5) -> None:
    """Write the fields into a mapped checkpoint the way ``StoreCheckpoint.flush`` does (no other bytes touched).

    *fields* = 3 for 4.9.x brokers, 5 for 5.x. One slice assignment of the packed fields: ``Struct.pack_into``
    zeroes its target first, so a writer killed inside it would leave zero timestamps in a shared mapping.
    """
    if fields == 5:
        buf[0:_FIELDS5.size] = _FIELDS5.pack(cp.physic_msg_timestamp, cp.logics_msg_timestamp,
                                             cp.index_msg_timestamp, cp.master_flushed_offset, cp.confirm_phy_offset)
    elif fields == 3:
        buf[0:_FIELDS3.size] = _FIELDS3.pack(cp.physic_msg_timestamp, cp.logics_msg_timestamp,
                                             cp.index_msg_timestamp)
    else:
        raise ValueError("fields must be 3 (4.9.x) or 5 (5.x)")


def encode_checkpoint(cp: Checkpoint, fields: int = 5) -> bytes:
    """Full 4096-byte file image."""
    out = bytearray(CHECKPOINT_SIZE)
    encode_checkpoint_into(out, cp, fields)
    return bytes(out)


def decode_checkpoint(buf) -> Checkpoint:
    """Read all five fields; a 4.9.x file simply has zeros at 24 and 32. Needs at least 40 bytes."""
    if len(buf) < _FIELDS5.size:
        raise ValueError("checkpoint shorter than 40 bytes")
    return Checkpoint(*_FIELDS5.unpack_from(buf, 0))
