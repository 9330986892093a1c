"""Classify store paths (format §1, §16.6): which files are segments of which log, and which are mutable.

Only segments are ever tiered. Everything else (checkpoint, lock, abort, config/**, timerwheel, RocksDB dirs)
stays local forever. The rules are by path shape, so classification needs no I/O.

A mount may hold several stores below its root (a master's and a slave's `storePathRootDir` under one mount):
the shape is matched at the end of the path, and what comes before it is the segment's store root ("" for the
mount root). A store root never has a segment directory name (commitlog, consumequeue, ...) as a component.
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
    DLEDGER_DATA = "dledger_data"  # dledger-<selfId>/data/<offset>: a DLedger CommitLog (tierfs.store.dledger)
    DLEDGER_INDEX = "dledger_index"  # dledger-<selfId>/index/<offset>
    MUTABLE = "mutable"

    @property
    def is_segment(self) -> bool:
        return self is not Kind.MUTABLE


# ASCII digits and fullmatch: `\d` also takes other scripts' digits, and `$` matches before a trailing newline
# the logs whose files hold the message records (ConsumeQueue units point into them; the archive reads them)
MESSAGE_LOGS = frozenset((Kind.COMMITLOG, Kind.DLEDGER_DATA))
_OFFSET = re.compile(r"[0-9]{20}")
_INDEX = re.compile(r"[0-9]{17}")
_QUEUE_ID = re.compile(r"-?[0-9]+")
# DLedgerConfig.getDefaultPath: "dledger-" + selfId (RocketMQ parses selfId[1:] as an int: n0, n1, ...)
_DLEDGER_DIR = re.compile(r"dledger-[A-Za-z0-9_]+")
_DLEDGER_LOGS = {"data": Kind.DLEDGER_DATA, "index": Kind.DLEDGER_INDEX}
# A topic dir name the broker cannot have made (it allows [%|a-zA-Z0-9_-]) and an object key cannot carry:
# control characters, and bytes that are not UTF-8 (surrogate escapes). Such a tree stays local.
_BAD_TOPIC = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
_QUEUE_LOGS = {"consumequeue": Kind.CONSUMEQUEUE, "consumequeue_ext": Kind.CONSUMEQUEUE_EXT,
               "batchconsumequeue": Kind.BATCHCONSUMEQUEUE}


SEGMENT_TOPS = frozenset(("commitlog", "timerlog", "index", *_QUEUE_LOGS))


def _root_ok(parts: list[str]) -> bool:
    return all(p and p not in SEGMENT_TOPS and not p.startswith(".") and not _DLEDGER_DIR.fullmatch(p)
               for p in parts)


def is_dledger_dir(name: str) -> bool:
    """True for a DLedger store's directory name (`dledger-<selfId>`), which sits in a store root."""
    return _DLEDGER_DIR.fullmatch(name) is not None


def split_root(rel_path: str) -> tuple[str, str]:
    """(store root, path inside that store) of a segment path: 'slave/commitlog/0000...' -> ('slave',
    'commitlog/0000...'); ('', rel_path) for anything that is not a segment below a sub-root."""
    parts = rel_path.split("/")
    for depth in (4, 3, 2):  # queue logs first: a topic may be named like a log dir
        if len(parts) > depth and _classify_tail(parts[-depth:]) is not Kind.MUTABLE and _root_ok(parts[:-depth]):
            return "/".join(parts[:-depth]), "/".join(parts[-depth:])
    return "", rel_path


def _classify_tail(parts: list[str]) -> Kind:
    name = parts[-1]
    if len(parts) == 2:
        top = parts[0]
        if top in ("commitlog", "timerlog") and _OFFSET.fullmatch(name):
            return Kind.COMMITLOG if top == "commitlog" else Kind.TIMERLOG
        if top == "index" and _INDEX.fullmatch(name):
            return Kind.INDEX
    elif len(parts) == 3:
        if parts[1] in _DLEDGER_LOGS and _DLEDGER_DIR.fullmatch(parts[0]) and _OFFSET.fullmatch(name):
            return _DLEDGER_LOGS[parts[1]]
    elif (len(parts) == 4 and parts[0] in _QUEUE_LOGS and _QUEUE_ID.fullmatch(parts[2]) and _OFFSET.fullmatch(name)
          and parts[1] and not _BAD_TOPIC.search(parts[1])):
        return _QUEUE_LOGS[parts[0]]
    return Kind.MUTABLE


def classify(rel_path: str) -> Kind:
    """Kind of a path relative to the mount root ('commitlog/00000000000000000000' -> COMMITLOG, and so is
    'slave/commitlog/00000000000000000000': a store whose root is below the mount's)."""
    parts = rel_path.split("/")
    kind = _classify_tail(parts)
    if kind is not Kind.MUTABLE or len(parts) <= 2:
        return kind
    for depth in (4, 3, 2):
        if len(parts) > depth and _root_ok(parts[:-depth]):
            kind = _classify_tail(parts[-depth:])
            if kind is not Kind.MUTABLE:
                return kind
    return Kind.MUTABLE


def segment_start_offset(rel_path: str) -> int | None:
    """The file's start offset encoded in its 20-digit name, or None for non-offset-named files."""
    name = rel_path.rsplit("/", 1)[-1]
    return int(name) if _OFFSET.fullmatch(name) else None
