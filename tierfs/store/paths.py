"""Classify store paths (format §1, §16.6): which files are segments of which log, and which are mutable.

Only segments are ever tiered. Everything else (checkpoint, lock, abort, config/**, timerwheel, RocksDB dirs)
stays local forever. The rules are by path shape, so classification needs no I/O.
"""

from __future__ import annotations

import enum
import re


class Kind(str, enum.Enum):
    COMMITLOG = "commitlog"
    CONSUMEQUEUE = "consumequeue"
    CONSUMEQUEUE_EXT = "consumequeue_ext"
    BATCHCONSUMEQUEUE = "batchconsumequeue"
    INDEX = "index"
    TIMERLOG = "timerlog"
    MUTABLE = "mutable"

    @property
    def is_segment(self) -> bool:
        return self is not Kind.MUTABLE


_OFFSET = re.compile(r"^\d{20}$")
_INDEX = re.compile(r"^\d{17}$")
_QUEUE_ID = re.compile(r"^-?\d+$")
_QUEUE_LOGS = {"consumequeue": Kind.CONSUMEQUEUE, "consumequeue_ext": Kind.CONSUMEQUEUE_EXT,
               "batchconsumequeue": Kind.BATCHCONSUMEQUEUE}


def classify(rel_path: str) -> Kind:
    """Kind of a path relative to the store root ('commitlog/00000000000000000000' -> COMMITLOG)."""
    parts = rel_path.split("/")
    name = parts[-1]
    if len(parts) == 2:
        top = parts[0]
        if top in ("commitlog", "timerlog") and _OFFSET.match(name):
            return Kind.COMMITLOG if top == "commitlog" else Kind.TIMERLOG
        if top == "index" and _INDEX.match(name):
            return Kind.INDEX
    elif len(parts) == 4 and parts[0] in _QUEUE_LOGS and _QUEUE_ID.match(parts[2]) and _OFFSET.match(name):
        return _QUEUE_LOGS[parts[0]]
    return Kind.MUTABLE


def segment_start_offset(rel_path: str) -> int | None:
    """The file's start offset encoded in its 20-digit name, or None for non-offset-named files."""
    name = rel_path.rsplit("/", 1)[-1]
    return int(name) if _OFFSET.match(name) else None
