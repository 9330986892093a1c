"""Archive stage: CommitLog segments -> Parquet, one file per (segment, topic, UTC date), in the object store.

    <store-id>/archive/topic=<t>/date=<YYYY-MM-DD>/part-<segment file name>-g<generation>.parquet

Runs inside Spark executors (`archive_segment`) and on the driver (`sweep`: retention and superseded
generations). Files are named after their source segment so a re-run overwrites instead of duplicating; every
file of a segment is written locally first and uploaded only after the whole segment decoded cleanly, so a
failed segment leaves no partial archive behind. Partition values are Hive-escaped (Spark and pyarrow unescape
them), so topics such as ``%RETRY%group`` round-trip.

Decoding is strict: a tiered segment was sealed by its content (format §12: valid records, then a BLANK whose
TOTALSIZE reaches the end), so anything else — a bad record, a BODYCRC or PHYSICALOFFSET mismatch, content
ending before the BLANK — is corruption and fails the segment with the position, never archives garbage.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import ipaddress
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

from tierfs.objectstore import ObjectInfo, ObjectStore
from tierfs.store import commitlog as cl
from tierfs.store.names import name_to_offset
from tierfs.store.paths import split_root
from tierfs.tier import layout

__all__ = [
    "ArchiveError", "SCHEMA_FIELDS", "arrow_schema", "archive_prefix", "archive_key", "parse_archive_key", "part_name",
    "escape_partition_value", "unescape_partition_value", "iter_messages", "retention_days", "is_expired",
    "archive_segment", "sweep",
]

DAY_MS = 86_400_000
ROW_GROUP_BYTES = 64 << 20      # one Parquet row group per (topic, date) once this much is buffered ...
BUFFER_BYTES = 128 << 20        # ... and every group is flushed when all groups together hold this much
COMPRESSION = "zstd"
_II = struct.Struct(">ii")
_HEAD_MIN = 91                  # smallest possible message record (IPv4, v1, empty body/topic/properties)
_KEEP_TAIL = 8 << 20            # compact the decode buffer once this much has been consumed
_HIVE_DEFAULT = "__HIVE_DEFAULT_PARTITION__"
# Hive's FileUtils.escapePathName set (Spark's ExternalCatalogUtils uses the same): these become %XX.
_ESCAPE = set('"#%\'*/:=?\\\x7f{[]^') | {chr(c) for c in range(1, 0x20)}
_UNESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_PART_RE = re.compile(r"^part-(.+)-g(\d+)\.parquet$")

# (name, arrow type name) in file order. `topic` and `date` are not stored in the files: like Spark's own
# partitioned writes, they are the partition values in the key (a file's rows all share them).
SCHEMA_FIELDS = (
    ("queue_id", "int32"), ("queue_offset", "int64"), ("phys_offset", "int64"),
    ("store_timestamp", "timestamp[ms, UTC]"), ("born_timestamp", "timestamp[ms, UTC]"),
    ("keys", "list<string>"), ("tags", "string"), ("properties", "map<string, string>"), ("body", "binary"),
    ("body_crc", "int32"), ("sys_flag", "int32"), ("flag", "int32"), ("reconsume_times", "int32"),
    ("born_host", "string"), ("store_host", "string"), ("msg_id", "string"),
)


class ArchiveError(ValueError):
    """A segment cannot be archived; the message names the segment position or object that is wrong."""


def arrow_schema():
    """The Parquet schema (pyarrow is imported here so the driver does not need it)."""
    import pyarrow as pa

    ts = pa.timestamp("ms", tz="UTC")
    types = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(), "timestamp[ms, UTC]": ts,
             "list<string>": pa.list_(pa.string()), "map<string, string>": pa.map_(pa.string(), pa.string()),
             "binary": pa.binary()}
    return pa.schema([pa.field(n, types[t]) for n, t in SCHEMA_FIELDS])


# ---------------------------------------------------------------------------------------------------- keys


def escape_partition_value(value: str) -> str:
    """Hive path escaping of a partition value ('' -> Hive's default partition name)."""
    if value == "":
        return _HIVE_DEFAULT
    return "".join(f"%{ord(c):02X}" if c in _ESCAPE else c for c in value)


def unescape_partition_value(text: str) -> str:
    if text == _HIVE_DEFAULT:
        return ""
    return _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)


archive_prefix = layout.archive_prefix


def part_name(path: str) -> str:
    """The segment's name in archive keys: its file name, prefixed with its store root when that is below the
    mount root ('slave/commitlog/0000...' -> 'slave~0000...'), so two stores' same-named segments never share
    (or supersede) each other's Parquet files."""
    root, inner = split_root(path)
    name = inner.rsplit("/", 1)[-1]
    return f"{root.replace('/', '~')}~{name}" if root else name


def archive_key(store_id: str, topic: str, date: str, segment_name: str, generation: int) -> str:
    """layout.archive_key with the topic Hive-escaped ('%RETRY%g' -> 'topic=%25RETRY%25g')."""
    return layout.archive_key(store_id, escape_partition_value(topic), date, segment_name, generation)


@dataclass(frozen=True)
class ArchiveKey:
    topic: str
    date: _dt.date
    segment_name: str
    generation: int


def parse_archive_key(store_id: str, key: str) -> ArchiveKey | None:
    """The parts of an archive object key, or None for anything else under the prefix (left alone)."""
    prefix = archive_prefix(store_id)
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix):].split("/")
    if len(parts) != 3 or not parts[0].startswith("topic=") or not parts[1].startswith("date="):
        return None
    m = _PART_RE.match(parts[2])
    try:
        day = _dt.date.fromisoformat(parts[1][5:])
    except ValueError:
        return None
    if m is None:
        return None
    return ArchiveKey(unescape_partition_value(parts[0][6:]), day, m.group(1), int(m.group(2)))


# ---------------------------------------------------------------------------------------------------- retention


def retention_days(retention: Mapping[str, float], topic: str) -> float | None:
    """Days the archive of `topic` is kept after the message date: its own entry, else '*', else None (forever)."""
    if topic in retention:
        return float(retention[topic])
    if "*" in retention:
        return float(retention["*"])
    return None


def is_expired(day: _dt.date, days: float | None, today: _dt.date) -> bool:
    """A date partition is expired once all of it is older than today (00:00 UTC) minus `days`.

    With whole days this is `day < today - days`: a 7-day retention keeps today and the 7 dates before it.
    """
    if days is None:
        return False
    end = _dt.datetime.combine(day, _dt.time()) + _dt.timedelta(days=1)
    try:
        return end <= _dt.datetime.combine(today, _dt.time()) - _dt.timedelta(days=days)
    except OverflowError:  # retention reaching before the year 1: nothing is that old
        return False


# ---------------------------------------------------------------------------------------------------- decoding


def iter_messages(blocks: Iterable[bytes], segment_name: str, size: int) -> Iterator[tuple[int, cl.Message]]:
    """(position, message) for each message of a sealed CommitLog segment whose content arrives in `blocks`.

    Streams: at most _KEEP_TAIL bytes of decoded records plus one block and one record are held, whatever the
    segment size. Stops at the terminal BLANK
    and reads nothing after it. Raises ArchiveError naming the position of anything that is not a valid sealed
    segment. `size` is the segment size (the BLANK's TOTALSIZE must reach it).
    """
    base = name_to_offset(segment_name)
    it = iter(blocks)
    buf = bytearray()
    start = 0  # segment position of buf[0]
    pos = 0    # read position in buf
    eof = False

    def fill(need: int) -> bool:
        nonlocal buf, start, pos, eof
        while len(buf) - pos < need and not eof:
            if pos >= _KEEP_TAIL or (pos and pos == len(buf)):
                del buf[:pos]
                start += pos
                pos = 0
            try:
                buf += next(it)
            except StopIteration:
                eof = True
        return len(buf) - pos >= need

    while True:
        at = start + pos
        if len(buf) - pos < 8 and not fill(8):
            raise ArchiveError(f"commitlog/{segment_name}: content ends at position {start + len(buf)} before the "
                               f"terminal BLANK (the segment is not sealed, or its objects are truncated)")
        total, magic = _II.unpack_from(buf, pos)
        if magic == cl.BLANK_MAGIC:
            if total != size - at:
                raise ArchiveError(f"commitlog/{segment_name}: BLANK at position {at} has TOTALSIZE {total}, but "
                                   f"{size - at} bytes remain in the {size}-byte segment")
            return
        if magic not in (cl.MAGIC_V1, cl.MAGIC_V2):
            raise ArchiveError(f"commitlog/{segment_name}: no record at position {at} (magic {magic & 0xFFFFFFFF:#010x}"
                               f") before the terminal BLANK")
        if total < _HEAD_MIN or at + total > size - cl.BLANK_SIZE:
            raise ArchiveError(f"commitlog/{segment_name}: record at position {at} has an impossible TOTALSIZE "
                               f"{total} (segment size {size})")
        if len(buf) - pos < total and not fill(total):
            raise ArchiveError(f"commitlog/{segment_name}: content ends at position {start + len(buf)} inside the "
                               f"record at position {at} (TOTALSIZE {total})")
        rec = cl.decode_record(buf, pos, check_crc=True)
        if not isinstance(rec, cl.Message):
            raise ArchiveError(f"commitlog/{segment_name}: record at position {at} is invalid (field lengths "
                               f"disagree with TOTALSIZE {total}, or its BODYCRC does not match the body)")
        if rec.physical_offset != base + at:
            raise ArchiveError(f"commitlog/{segment_name}: record at position {at} says PHYSICALOFFSET "
                               f"{rec.physical_offset}, expected {base + at}")
        yield at, rec
        pos += total


def _host_text(h: cl.Host) -> tuple[str, str]:
    """("ip:port" or "[ipv6]:port", the hex msgId prefix of that host) as a store host (format §4.6)."""
    ip, port = h
    try:
        addr = ipaddress.ip_address(bytes(ip))
        text = f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"
    except ValueError:
        text = f"{bytes(ip).hex()}:{port}"
    return text, (bytes(ip) + struct.pack(">i", port)).hex().upper()


_COLS = tuple(n for n, _ in SCHEMA_FIELDS)


@dataclass
class _Group:
    """Buffered rows of one (topic, date) and its local Parquet file."""

    topic: str
    date: str
    path: str
    cols: dict[str, list] = field(default_factory=lambda: {c: [] for c in _COLS})
    buffered: int = 0
    rows: int = 0
    writer: object = None


class _Writer:
    """Groups rows by (topic, UTC date) into local Parquet files with bounded memory."""

    def __init__(self, tmpdir: str):
        import pyarrow as pa

        self._pa = pa
        self.schema = arrow_schema()
        self.tmpdir = tmpdir
        self.groups: dict[tuple[str, int], _Group] = {}
        self.buffered = 0
        self._dates: dict[int, str] = {}
        self._hosts: dict[cl.Host, tuple[str, str]] = {}  # a store has a handful of hosts: format them once

    def host(self, h: cl.Host) -> tuple[str, str]:
        t = self._hosts.get(h)
        if t is None:
            t = self._hosts[h] = _host_text(h)
        return t

    def date_of(self, store_ms: int) -> tuple[int, str]:
        day = store_ms // DAY_MS
        text = self._dates.get(day)
        if text is None:
            try:
                text = self._dates[day] = (_dt.date(1970, 1, 1) + _dt.timedelta(days=day)).isoformat()
            except OverflowError:
                raise ArchiveError(f"STORETIMESTAMP {store_ms} is outside the years 1-9999") from None
        return day, text

    def add(self, msg: cl.Message, phys: int, day: int, date: str) -> None:
        g = self.groups.get((msg.topic, day))
        if g is None:
            g = self.groups[(msg.topic, day)] = _Group(
                msg.topic, date, os.path.join(self.tmpdir, f"{len(self.groups)}.parquet"))
        c = g.cols
        props = msg.properties
        c["queue_id"].append(msg.queue_id)
        c["queue_offset"].append(msg.queue_offset)
        c["phys_offset"].append(phys)
        c["store_timestamp"].append(msg.store_timestamp)
        c["born_timestamp"].append(msg.born_timestamp)
        c["keys"].append(msg.keys)
        c["tags"].append(props.get(cl.PROPERTY_TAGS))
        c["properties"].append(list(props.items()))
        c["body"].append(msg.body)
        c["body_crc"].append(msg.body_crc)
        c["sys_flag"].append(msg.sys_flag)
        c["flag"].append(msg.flag)
        c["reconsume_times"].append(msg.reconsume_times)
        store_host, id_prefix = self.host(msg.store_host)
        c["born_host"].append(self.host(msg.born_host)[0])
        c["store_host"].append(store_host)
        c["msg_id"].append(f"{id_prefix}{phys:016X}")  # cl.message_id without re-packing the host
        g.rows += 1
        n = msg.total_size
        g.buffered += n
        self.buffered += n
        if g.buffered >= ROW_GROUP_BYTES:
            self._flush(g)
        elif self.buffered >= BUFFER_BYTES:
            for other in self.groups.values():
                self._flush(other)

    def _flush(self, g: _Group) -> None:
        if not g.cols["phys_offset"]:
            return
        pa = self._pa
        table = pa.Table.from_arrays([pa.array(g.cols[name], type=self.schema.field(name).type) for name in _COLS],
                                     schema=self.schema)
        if g.writer is None:
            import pyarrow.parquet as pq

            g.writer = pq.ParquetWriter(g.path, self.schema, compression=COMPRESSION)
        g.writer.write_table(table)
        self.buffered -= g.buffered
        g.buffered = 0
        g.cols = {name: [] for name in _COLS}

    def finish(self) -> list[_Group]:
        for g in self.groups.values():
            self._flush(g)
            g.writer.close()
        return sorted(self.groups.values(), key=lambda g: (g.topic, g.date))

    def abort(self) -> None:
        """Close the open files after a failure (the temporary directory goes with them; errors are moot)."""
        for g in self.groups.values():
            if g.writer is not None:
                with contextlib.suppress(Exception):
                    g.writer.close()


# ---------------------------------------------------------------------------------------------------- executor task


def archive_segment(store: ObjectStore, store_id: str, seg: dict, retention: Mapping[str, float],
                    today: _dt.date, read: Callable[[ObjectStore, dict], Iterable[bytes]] | None = None) -> dict:
    """Archive one tiered CommitLog segment; returns its archive[] result row.

    Rows of partitions that retention already expired are skipped (counted in `expired_rows`), so the sweep
    does not delete what was just written. `read` defaults to tasks.read_segment (raw chunks or lz4c, crc-checked).
    """
    if read is None:
        from tierfs.spark.tasks import read_segment as read
    path, gen, size = seg["path"], int(seg["generation"]), int(seg["size"])
    name = path.rsplit("/", 1)[-1]
    consumed = 0

    def counted(blocks: Iterable[bytes]) -> Iterator[bytes]:
        nonlocal consumed
        for b in blocks:
            consumed += len(b)
            yield b

    expired_rows = 0
    expired: dict[tuple[str, int], bool] = {}
    with tempfile.TemporaryDirectory(prefix="tierfs-archive-") as tmp:
        w = _Writer(tmp)
        try:
            for _, msg in iter_messages(counted(read(store, seg)), name, size):
                day, date = w.date_of(msg.store_timestamp)
                gone = expired.get((msg.topic, day))
                if gone is None:
                    gone = expired[(msg.topic, day)] = is_expired(
                        _dt.date.fromisoformat(date), retention_days(retention, msg.topic), today)
                if gone:
                    expired_rows += 1
                    continue
                w.add(msg, msg.physical_offset, day, date)
            groups = w.finish()
        except BaseException:
            w.abort()
            raise
        keys, nbytes, rows = [], 0, 0
        for g in groups:
            key = archive_key(store_id, g.topic, g.date, part_name(path), gen)
            info = store.put_file(key, g.path)
            keys.append(key)
            nbytes += info.size
            rows += g.rows
    return {"path": path, "generation": gen, "rows": rows, "keys": keys, "bytes": nbytes,
            "expired_rows": expired_rows, "bytes_read": consumed}


# ---------------------------------------------------------------------------------------------------- driver sweep


@dataclass
class SweepResult:
    expired: list[str]      # removed by retention
    superseded: list[str]   # files of another generation of a segment archived in this run


def plan_sweep(infos: Iterable[ObjectInfo], store_id: str, retention: Mapping[str, float], today: _dt.date,
               archived: Mapping[str, int]) -> SweepResult:
    """Which archive objects to delete. Pure. `archived`: part_name(path) -> generation archived in this run.

    A file is superseded when its segment was archived in this run under another generation (the catalog's
    generation is authoritative), so a rewritten segment never leaves duplicate rows behind.
    """
    expired, superseded = [], []
    for info in infos:
        k = parse_archive_key(store_id, info.key)
        if k is None:
            continue
        if is_expired(k.date, retention_days(retention, k.topic), today):
            expired.append(info.key)
        elif k.segment_name in archived and archived[k.segment_name] != k.generation:
            superseded.append(info.key)
    return SweepResult(expired, superseded)


def sweep(store: ObjectStore, store_id: str, retention: Mapping[str, float], today: _dt.date,
          archived: Mapping[str, int]) -> SweepResult:
    """List the archive once, delete expired and superseded files, and say which."""
    plan = plan_sweep(store.list(archive_prefix(store_id)), store_id, retention, today, archived)
    store.delete_many(plan.expired + plan.superseded)
    return plan
