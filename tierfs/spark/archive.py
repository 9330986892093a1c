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
_Q = struct.Struct(">q")
_FIXED = struct.Struct(">iiiiiqqiq")   # TOTALSIZE .. BORNTIMESTAMP (commitlog format, 48 bytes)
_RECONSUME = struct.Struct(">i")
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
    segment size. Stops at the terminal BLANK and reads nothing after it. Raises ArchiveError naming the position
    of anything that is not a valid sealed segment. `size` is the segment size (the BLANK's TOTALSIZE must reach
    it).
    """
    for buf, pos, at, _ in _records(blocks, segment_name, size):
        rec = cl.decode_record(buf, pos, check_crc=True)
        if not isinstance(rec, cl.Message):  # _records checked the layout and the CRC: cannot happen
            raise ArchiveError(f"commitlog/{segment_name}: record at position {at} is invalid")
        yield at, rec


def _records(blocks: Iterable[bytes], segment_name: str, size: int) -> Iterator[tuple[bytearray, int, int, tuple]]:
    """(buffer, position in it, segment position, layout) of each message record, checked as iter_messages says:
    lengths against TOTALSIZE, BODYCRC, PHYSICALOFFSET against the segment name; the layout is
    commitlog._message_layout's. The buffer is only valid until the next item."""
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
        lay = cl._message_layout(buf, pos, total, 2 if magic == cl.MAGIC_V2 else 1, len(buf))
        if lay is None or not cl._crc_ok(memoryview(buf), pos, lay[3], lay[4]):
            raise ArchiveError(f"commitlog/{segment_name}: record at position {at} is invalid (field lengths "
                               f"disagree with TOTALSIZE {total}, or its BODYCRC does not match the body)")
        phys = _Q.unpack_from(buf, pos + 28)[0]
        if phys != base + at:
            raise ArchiveError(f"commitlog/{segment_name}: record at position {at} says PHYSICALOFFSET "
                               f"{phys}, expected {base + at}")
        yield buf, pos, at, lay
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
_EXPIRED = object()  # the group of a (topic, date) that retention already expired: rows are counted, not kept
# RE2 patterns over a record's raw PROPERTIES string (MessageDecoder.string2messageProperties: entries NAME\1VALUE
# split by \2, kept when name and value are non-empty, the last of a name wins).
_ENTRY_RE = "(?s)^(?P<k>[^\x01]+)\x01(?P<v>.+)$"


def _last_value_re(name: str) -> str:
    return f"(?s)^.*(?:^|\x02){name}\x01(?P<v>[^\x02]+)"


@dataclass
class _Group:
    """Buffered records of one (topic, date) and its local Parquet file. A row is the record's fixed fields (one
    struct unpack), its body, its raw properties string, and the texts of its hosts and message id."""

    topic: str
    date: str
    path: str
    rows: list = field(default_factory=list)
    buffered: int = 0
    count: int = 0
    writer: object = None


class _Writer:
    """Groups records by (topic, UTC date) into local Parquet files with bounded memory. Columns are built from
    the buffered rows at flush time; PROPERTIES, KEYS and TAGS are parsed there column-wise by Arrow compute."""

    def __init__(self, tmpdir: str):
        import pyarrow as pa
        import pyarrow.compute as pc

        self._pa, self._pc = pa, pc
        self.schema = arrow_schema()
        self.tmpdir = tmpdir
        self.groups: dict[tuple[bytes, int], _Group | object] = {}
        self.buffered = 0
        self._hosts: dict[tuple[bytes, int], tuple[str, str]] = {}  # a store has a handful of hosts

    def host(self, h: tuple[bytes, int]) -> tuple[str, str]:
        t = self._hosts.get(h)
        if t is None:
            t = self._hosts[h] = _host_text(h)
        return t

    def group(self, topic: bytes, day: int, retention: Mapping[str, float], today: _dt.date) -> _Group | object:
        """The group of (topic, day), made on first use: _EXPIRED when retention already dropped that date."""
        t = topic.decode("utf-8", "replace")
        try:
            date = _dt.date(1970, 1, 1) + _dt.timedelta(days=day)
        except OverflowError:
            raise ArchiveError(f"STORETIMESTAMP of a {t!r} message is outside the years 1-9999") from None
        if is_expired(date, retention_days(retention, t), today):
            g: _Group | object = _EXPIRED
        else:
            g = _Group(t, date.isoformat(), os.path.join(self.tmpdir, f"{len(self.groups)}.parquet"))
        self.groups[(topic, day)] = g
        return g

    def add(self, g: _Group, buf: bytearray, pos: int, lay: tuple, f: tuple) -> None:
        """f: commitlog._fixed_struct(SYSFLAG) unpacked at pos (TOTALSIZE .. BODY length)."""
        body_at = pos + lay[3]
        props_at = pos + lay[7]
        born, store = self.host((f[9], f[10])), self.host((f[12], f[13]))
        g.rows.append((f, bytes(buf[body_at:body_at + lay[4]]),
                       buf[props_at:props_at + lay[8]].decode("utf-8", "replace"),
                       born[0], store[0], f"{store[1]}{f[6]:016X}"))  # msg_id: cl.message_id, host packed once
        g.count += 1
        n = f[0]
        g.buffered += n
        self.buffered += n
        if g.buffered >= ROW_GROUP_BYTES:
            self._flush(g)
        elif self.buffered >= BUFFER_BYTES:
            for other in self.groups.values():
                if other is not _EXPIRED:
                    self._flush(other)

    def _filter_lists(self, offsets, keep, *values):
        """Drop the elements where `keep` is false from list columns sharing `offsets`: (new offsets, values)."""
        pa, pc = self._pa, self._pc
        kept = pc.cumulative_sum(pc.cast(keep, pa.int32()))
        starts = pa.concat_arrays([pa.array([0], pa.int32()), kept])
        return (pc.take(starts, offsets), *(pc.filter(v, keep) for v in values))

    def _property_columns(self, raw: list[str]):
        """(properties map, keys list, tags) of each record from its raw PROPERTIES string, column-wise."""
        pa, pc = self._pa, self._pc
        arr = pa.array(raw, pa.string())
        entries = pc.split_pattern(arr, "\x02")
        kv = pc.extract_regex(entries.flatten(), _ENTRY_RE)
        keep = pc.fill_null(pc.is_valid(kv), False)
        offsets, names, values = self._filter_lists(entries.offsets, keep, kv.field(0), kv.field(1))
        props = pa.MapArray.from_arrays(offsets, names, values, type=self.schema.field("properties").type)
        tags = pc.struct_field(pc.extract_regex(arr, _last_value_re(cl.PROPERTY_TAGS)), [0])
        keys_text = pc.fill_null(pc.struct_field(pc.extract_regex(arr, _last_value_re(cl.PROPERTY_KEYS)), [0]), "")
        tokens = pc.split_pattern(keys_text, cl.KEY_SEPARATOR)
        flat = tokens.flatten()
        koff, kvals = self._filter_lists(tokens.offsets, pc.greater(pc.utf8_length(flat), 0), flat)
        keys = pa.ListArray.from_arrays(koff, kvals, type=self.schema.field("keys").type)
        return props, keys, tags

    def _flush(self, g: _Group) -> None:
        if not g.rows:
            return
        pa = self._pa
        fixed, bodies, props_raw, born, store, ids = zip(*g.rows)
        props, keys, tags = self._property_columns(props_raw)
        cols = {
            "queue_id": [x[3] for x in fixed], "queue_offset": [x[5] for x in fixed],
            "phys_offset": [x[6] for x in fixed], "store_timestamp": [x[11] for x in fixed],
            "born_timestamp": [x[8] for x in fixed], "keys": keys, "tags": tags, "properties": props,
            "body": bodies, "body_crc": [x[2] for x in fixed], "sys_flag": [x[7] for x in fixed],
            "flag": [x[4] for x in fixed], "reconsume_times": [x[14] for x in fixed], "born_host": born,
            "store_host": store, "msg_id": ids,
        }
        table = pa.Table.from_arrays(
            [c if isinstance(c, (pa.Array, pa.ChunkedArray)) else pa.array(c, type=self.schema.field(n).type)
             for n, c in ((n, cols[n]) for n in _COLS)], schema=self.schema)
        if g.writer is None:
            import pyarrow.parquet as pq

            g.writer = pq.ParquetWriter(g.path, self.schema, compression=COMPRESSION)
        g.writer.write_table(table)
        self.buffered -= g.buffered
        g.buffered = 0
        g.rows = []

    def finish(self) -> list[_Group]:
        live = [g for g in self.groups.values() if g is not _EXPIRED]
        for g in live:
            self._flush(g)
            g.writer.close()
        return sorted(live, key=lambda g: (g.topic, g.date))

    def abort(self) -> None:
        """Close the open files after a failure (the temporary directory goes with them; errors are moot)."""
        for g in self.groups.values():
            if g is not _EXPIRED and g.writer is not None:
                with contextlib.suppress(Exception):
                    g.writer.close()


# ---------------------------------------------------------------------------------------------------- executor task


def archive_segment(store: ObjectStore, store_id: str, seg: dict, retention: Mapping[str, float],
                    today: _dt.date, read: Callable[[ObjectStore, dict], Iterable[bytes]] | None = None) -> dict:
    """Archive one tiered CommitLog segment; returns its archive[] result row.

    Rows of partitions that retention already expired are skipped (counted in `expired_rows`), so the sweep
    does not delete what was just written. `read` defaults to tasks.read_segment (raw chunks or lz4c, crc-checked).
    Records are not decoded into message objects: each is one struct unpack of its fixed fields plus slices,
    buffered per (topic, date); the properties are parsed column-wise when a group is written.
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
    fixed_struct = cl._fixed_struct
    with tempfile.TemporaryDirectory(prefix="tierfs-archive-") as tmp:
        w = _Writer(tmp)
        groups = w.groups
        try:
            for buf, pos, _, lay in _records(counted(read(store, seg)), name, size):
                f = fixed_struct(lay[0]).unpack_from(buf, pos)
                topic_at = pos + lay[5]
                topic = bytes(buf[topic_at:topic_at + lay[6]])
                day = f[11] // DAY_MS
                g = groups.get((topic, day))
                if g is None:
                    g = w.group(topic, day, retention, today)
                if g is _EXPIRED:
                    expired_rows += 1
                    continue
                w.add(g, buf, pos, lay, f)
            done = w.finish()
        except BaseException:
            w.abort()
            raise
        keys, nbytes, rows = [], 0, 0
        for g in done:
            key = archive_key(store_id, g.topic, g.date, part_name(path), gen)
            info = store.put_file(key, g.path)
            keys.append(key)
            nbytes += info.size
            rows += g.count
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
