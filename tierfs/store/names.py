"""Segment file names: 20-digit offsets and the 17-digit local-time index names.

The broker parses these names back (``Long.parseLong``) and sorts them lexicographically, so
the zero padding and the exact time format are part of the on-disk contract.
"""

from __future__ import annotations

import datetime as _dt

__all__ = [
    "OFFSET_NAME_LEN",
    "INDEX_NAME_LEN",
    "offset_to_name",
    "name_to_offset",
    "is_offset_name",
    "index_file_name",
    "index_name_to_ms",
    "is_index_name",
]

OFFSET_NAME_LEN = 20
INDEX_NAME_LEN = 17
_LONG_MAX = (1 << 63) - 1


def offset_to_name(offset: int) -> str:
    """``UtilAll.offset2FileName``: decimal offset left-padded with zeros to 20 digits."""
    if offset < 0 or offset > _LONG_MAX:
        raise ValueError(f"offset out of range: {offset}")
    return f"{offset:020d}"


def is_offset_name(name: str) -> bool:
    """True for names the broker would accept as a segment (all ASCII digits, fits a long)."""
    return 0 < len(name) <= 40 and name.isascii() and name.isdigit() and int(name) <= _LONG_MAX


def name_to_offset(name: str) -> int:
    """Start offset encoded in a segment name. Raises ValueError for anything but plain digits."""
    if not is_offset_name(name):
        raise ValueError(f"not a segment name: {name!r}")
    return int(name)


def index_file_name(ms: int, tz: _dt.tzinfo | None = None) -> str:
    """``UtilAll.timeMillisToHumanString``: ``yyyyMMddHHmmssSSS`` of *ms* in *tz* (None = local zone, like the JVM)."""
    seconds, millis = divmod(ms, 1000)
    t = _dt.datetime.fromtimestamp(seconds, tz=_dt.timezone.utc).astimezone(tz)
    return f"{t.year:04d}{t.month:02d}{t.day:02d}{t.hour:02d}{t.minute:02d}{t.second:02d}{millis:03d}"


def is_index_name(name: str) -> bool:
    """True for a 17-digit index file name."""
    return len(name) == INDEX_NAME_LEN and name.isascii() and name.isdigit()


def index_name_to_ms(name: str, tz: _dt.tzinfo | None = None) -> int:
    """Inverse of :func:`index_file_name` (ambiguous local times resolve to the first occurrence)."""
    if not is_index_name(name):
        raise ValueError(f"not an index file name: {name!r}")
    naive = _dt.datetime(
        int(name[0:4]), int(name[4:6]), int(name[6:8]), int(name[8:10]), int(name[10:12]), int(name[12:14])
    )
    aware = naive.replace(tzinfo=tz) if tz is not None else naive.astimezone()
    return int(aware.timestamp()) * 1000 + int(name[14:17])
