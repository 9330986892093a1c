"""Archive stage: CommitLog segments -> Parquet, one file per (segment, topic, UTC date), in the object store.

    <store-id>/archive/topic=<t>/date=<YYYY-MM-DD>/part-<segment file name>-g<generation>.parquet

With archive.format = "delta" (the default) the same writer makes the data files of the archive table instead
(archive_segment_table: four more columns, microsecond timestamps, under tables/messages/), which the driver
commits (tierfs.spark.table).

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

import numpy as np

from tierfs.objectstore import ObjectInfo, ObjectStore
from tierfs.spark.walk import ArchiveError, Batch, batches, records
from tierfs.store import commitlog as cl
from tierfs.store.paths import Kind, classify, split_root
from tierfs.tier import layout

__all__ = [
    "ArchiveError", "SCHEMA_FIELDS", "arrow_schema", "archive_prefix", "archive_key", "parse_archive_key", "part_name",
    "escape_partition_value", "unescape_partition_value", "iter_messages", "retention_days", "is_expired",
    "archive_segment", "sweep", "TABLE_FIELDS", "safe_name", "table_file", "parse_table_file",
    "archive_segment_table", "broker_group", "segment_base", "content_digest",
]

DAY_MS = 86_400_000
_INLINE = np.arange(12)  # Arrow binary_view: values of up to 12 bytes sit in the view itself
ROW_GROUP_BYTES = 64 << 20      # one Parquet row group per (topic, date) once this much is buffered ...
BUFFER_BYTES = 128 << 20        # ... and every group is flushed when all groups together hold this much
COMPRESSION = "zstd"
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


# Columns a table file adds after SCHEMA_FIELDS (archive.format "delta"): the same value in every row of a file.
TABLE_FIELDS = (("broker", "string"), ("store_id", "string"), ("segment", "string"), ("segment_generation", "int64"))


def arrow_schema(table: bool = False):
    """The Parquet schema (pyarrow is imported here so the driver does not need it). *table*: the files of the
    table format, with TABLE_FIELDS and microsecond timestamps (Delta's timestamp type)."""
    import pyarrow as pa

    ts = pa.timestamp("us" if table else "ms", tz="UTC")
    types = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(), "timestamp[ms, UTC]": ts,
             "list<string>": pa.list_(pa.string()), "map<string, string>": pa.map_(pa.string(), pa.string()),
             "binary": pa.binary()}
    return pa.schema([pa.field(n, types[t]) for n, t in SCHEMA_FIELDS + (TABLE_FIELDS if table else ())])


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
    if classify(path) is Kind.DLEDGER_DATA:  # 'dledger-n0/data/0000...' -> 'dledger-n0~0000...'
        name = f"{inner.split('/', 1)[0]}~{name}"
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

    Streams: at most walk.KEEP_TAIL bytes of decoded records plus one block and one record are held, whatever the
    segment size. Stops at the terminal BLANK and reads nothing after it. Raises ArchiveError naming the position
    of anything that is not a valid sealed segment. `size` is the segment size (the BLANK's TOTALSIZE must reach
    it).
    """
    for buf, pos, at, _ in records(blocks, segment_name, size):
        rec = cl.decode_record(buf, pos, check_crc=True)
        if not isinstance(rec, cl.Message):  # records() checked the layout and the CRC: cannot happen
            raise ArchiveError(f"commitlog/{segment_name}: record at position {at} is invalid")
        yield at, rec


def _host_text(h: cl.Host) -> tuple[str, str]:
    """("ip:port" or "[ipv6]:port", the hex msgId prefix of that host) as a store host (format §4.6)."""
    ip, port = h
    try:
        addr = ipaddress.ip_address(bytes(ip))
        text = f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"
    except ValueError:
        text = f"{bytes(ip).hex()}:{port}"
    return text, (bytes(ip) + struct.pack(">i", port)).hex().upper()


_ALL = object()  # _Writer.add: write every group
_EXPIRED = object()  # the group of a (topic, date) that retention already expired: rows are counted, not kept
_HEX = np.frombuffer(b"0123456789ABCDEF", np.uint8)
_NIBBLES = np.arange(60, -4, -4, dtype=np.uint64)  # shifts of the 16 hex digits of a u64, most significant first


@dataclass
class _Group:
    """Buffered records of one (topic, date) and its local Parquet file: pieces of batch tables (the columns of
    the file except keys/tags/properties, plus the raw PROPERTIES string), written as one row group."""

    topic: str
    date: str
    path: str
    pieces: list = field(default_factory=list)
    buffered: int = 0
    count: int = 0
    writer: object = None


class _Writer:
    """Groups records by (topic, UTC date) into local Parquet files with bounded memory. Columns are built per
    batch from the walk's arrays; PROPERTIES, KEYS and TAGS are parsed when a group is written, column-wise by
    Arrow compute. Row groups end where a record-by-record writer would end them: a group is written once it
    buffers ROW_GROUP_BYTES of records (TOTALSIZE), else every group once all together buffer BUFFER_BYTES."""

    def __init__(self, tmpdir: str, constants: Mapping[str, object] | None = None):
        """*constants*: the TABLE_FIELDS values of every row (table files), or None (plain archive files)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self._pa, self._pc = pa, pc
        self.schema = arrow_schema(table=constants is not None)
        self.constants = dict(constants or {})
        self.tmpdir = tmpdir
        self.groups: dict[tuple[bytes, int], _Group | object] = {}
        self.buffered = 0
        self.expired_rows = 0

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

    # ------------------------------------------------------------------ batches in

    def add(self, b: Batch, retention: Mapping[str, float], today: _dt.date) -> None:
        """Route the records of a batch to their groups (made in order of first appearance)."""
        pa, pc = self._pa, self._pc
        mv = memoryview(b.data)
        topics = pc.dictionary_encode(self._binary(mv, b.topic_at, b.topic_len))
        tidx = topics.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        names = topics.dictionary.to_pylist()
        day = b.store_ts // DAY_MS
        key = (tidx << 32) + (day - int(day.min()))
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        gs: list = [None] * len(first)
        for u in order.tolist():
            i = int(first[u])
            topic, d = names[int(tidx[i])], int(day[i])
            g = self.groups.get((topic, d))
            gs[u] = self.group(topic, d, retention, today) if g is None else g
        live = np.array([g is not _EXPIRED for g in gs], bool)
        keep = live[inv]
        rows = np.flatnonzero(keep)
        self.expired_rows += b.n - len(rows)
        if not len(rows):
            return
        table = self._table(b, mv)
        gid = inv[rows]
        totals = b.total[rows]
        i, m = 0, len(rows)
        while i < m:
            end, flush = m, None  # flush: the group to write after record end-1, or "all"
            cum = np.cumsum(totals[i:])
            r = int(np.searchsorted(cum, BUFFER_BYTES - self.buffered))
            for k in np.unique(gid[i:]).tolist():
                sel = np.flatnonzero(gid[i:] == k)
                j = int(np.searchsorted(np.cumsum(totals[i:][sel]), ROW_GROUP_BYTES - gs[k].buffered))
                if j < len(sel) and i + int(sel[j]) + 1 <= end:
                    end, flush = i + int(sel[j]) + 1, gs[k]
            if r < len(cum) and (flush is None or i + r + 1 < end):  # a group's own limit is checked first
                end, flush = i + r + 1, _ALL
            part = gid[i:end]
            for k in np.unique(part).tolist():
                idx = rows[i:end][part == k]
                g = gs[k]
                n = len(idx)
                first_row, last_row = int(idx[0]), int(idx[-1])
                g.pieces.append(table.slice(first_row, n) if last_row - first_row + 1 == n
                                else table.take(pa.array(idx)))
                nbytes = int(b.total[idx].sum())
                g.count += n
                g.buffered += nbytes
                self.buffered += nbytes
            if flush is _ALL:
                for other in self.groups.values():
                    if other is not _EXPIRED:
                        self._flush(other)
            elif flush is not None:
                self._flush(flush)
            i = end

    def _binary(self, mv: memoryview, at: np.ndarray, length: np.ndarray, kind=None):
        """One Arrow binary (or *kind*) array of the byte ranges [at, at+length) of mv: one copy, made by Arrow's
        cast from a binary_view array whose views numpy builds (no Python step per record)."""
        pa = self._pa
        n = len(at)
        views = np.zeros((n, 16), np.uint8)  # Arrow's view: length i32, then 12 inline bytes or prefix, 0, offset
        words = views.view(np.int32)
        words[:, 0] = length
        u8 = np.frombuffer(mv, np.uint8)
        if len(u8) and n:
            idx = at[:, None] + _INLINE
            np.minimum(idx, len(u8) - 1, out=idx)
            head = u8[idx]
            head[_INLINE[None, :] >= length[:, None]] = 0
            views[:, 4:] = head
        long = length > 12
        words[long, 2] = 0
        words[long, 3] = at[long]
        arr = pa.Array.from_buffers(pa.binary_view(), n, [None, pa.py_buffer(views), pa.py_buffer(mv)])
        arr = arr.cast(pa.binary())
        return arr if kind is None else arr.view(kind)

    def _text(self, mv: memoryview, at: np.ndarray, length: np.ndarray):
        """A string array of byte ranges decoded as UTF-8, invalid sequences replaced (as bytes.decode does)."""
        pa = self._pa
        arr = self._binary(mv, at, length, pa.string())
        try:
            arr.validate(full=True)
        except pa.ArrowInvalid:
            arr = pa.array([bytes(mv[a:a + n]).decode("utf-8", "replace") for a, n in zip(at.tolist(),
                                                                                          length.tolist())],
                           pa.string())
        return arr

    def _hosts(self, mv: memoryview, at: np.ndarray, length: np.ndarray) -> tuple[list[tuple[str, str]], np.ndarray]:
        """(unique hosts as (text, msgId hex), index of each record's host) for host fields at *at*."""
        u8 = np.frombuffer(mv, np.uint8)
        hosts: list[tuple[str, str]] = []
        inv = np.zeros(len(at), np.int64)
        for width in np.unique(length).tolist():
            sel = np.flatnonzero(length == width)
            raw = np.ascontiguousarray(u8[at[sel, None] + np.arange(width)]).view(f"V{width}").ravel()
            uniq, back = np.unique(raw, return_inverse=True)
            inv[sel] = back.ravel() + len(hosts)
            for h in uniq:
                h = bytes(h)
                hosts.append(_host_text((h[:-4], int.from_bytes(h[-4:], "big", signed=True))))
        return hosts, inv

    def _table(self, b: Batch, mv: memoryview):
        """The batch's columns in file order, with raw PROPERTIES in place of keys/tags/properties."""
        pa, pc = self._pa, self._pc
        ts = pa.timestamp("ms", tz="UTC")  # STORETIMESTAMP, BORNTIMESTAMP: ms (table files: cast to us in _flush)
        born, born_i = self._hosts(mv, b.born_at, b.born_len)
        store, store_i = self._hosts(mv, b.store_at, b.store_len)
        born_text = pc.take(pa.array([h[0] for h in born], pa.string()), pa.array(born_i))
        store_text = pc.take(pa.array([h[0] for h in store], pa.string()), pa.array(store_i))
        # msg_id: the store host's hex, then PHYSICALOFFSET as 16 hex digits (cl.message_id)
        digits = _HEX[(b.phys.astype(np.uint64)[:, None] >> _NIBBLES) & np.uint64(15)]
        widths = {len(h[1]) for h in store}
        if len(widths) == 1:
            w = widths.pop() + 16
            pre = np.stack([np.frombuffer(h[1].encode(), np.uint8) for h in store])
            chars = np.concatenate([pre[store_i], digits], axis=1)
            offsets = np.arange(b.n + 1, dtype=np.int32) * w
            msg_id = pa.Array.from_buffers(pa.string(), b.n, [None, pa.py_buffer(offsets),
                                                               pa.py_buffer(np.ascontiguousarray(chars))])
        else:
            msg_id = pa.array([f"{store[s][1]}{p:016X}" for s, p in zip(store_i.tolist(), b.phys.tolist())],
                              pa.string())
        cols = {
            "queue_id": pa.array(b.queue_id.astype(np.int32)), "queue_offset": pa.array(b.queue_offset),
            "phys_offset": pa.array(b.phys), "store_timestamp": pa.array(b.store_ts).view(ts),
            "born_timestamp": pa.array(b.born_ts).view(ts), "props_raw": self._text(mv, b.props_at, b.props_len),
            "body": self._binary(mv, b.body_at, b.body_len), "body_crc": pa.array(b.body_crc.astype(np.int32)),
            "sys_flag": pa.array(b.sys_flag.astype(np.int32)), "flag": pa.array(b.flag.astype(np.int32)),
            "reconsume_times": pa.array(b.reconsume.astype(np.int32)), "born_host": born_text,
            "store_host": store_text, "msg_id": msg_id,
        }
        return pa.table(cols)

    # ------------------------------------------------------------------ files out

    def _filter_lists(self, offsets, keep, *values):
        """Drop the elements where `keep` is false from list columns sharing `offsets`: (new offsets, values)."""
        pa, pc = self._pa, self._pc
        kept = pc.cumulative_sum(pc.cast(keep, pa.int32()))
        starts = pa.concat_arrays([pa.array([0], pa.int32()), kept])
        return (pc.take(starts, offsets), *(pc.filter(v, keep) for v in values))

    def _property_columns(self, raw):
        """(properties map, keys list, tags) of each record from its raw PROPERTIES string, column-wise.

        MessageDecoder.string2messageProperties: entries NAME\\1VALUE split by \\2, kept when name and value are
        non-empty (the value is everything after the first \\1), the last of a name wins; TAGS is the last kept
        TAGS value (null without one), KEYS the last kept KEYS value split on single spaces, empty tokens dropped.
        """
        pa, pc = self._pa, self._pc
        arr = raw if isinstance(raw, pa.Array) else pa.array(raw, pa.string())
        entries = pc.split_pattern(arr, "\x02")
        parts = pc.split_pattern(entries.flatten(), "\x01", max_splits=1)
        po = parts.offsets.to_numpy()
        two = np.diff(po) == 2
        flat = parts.flatten()
        names = pc.take(flat, pa.array(po[:-1]))
        values = pc.take(flat, pa.array(np.where(two, po[:-1] + 1, po[:-1])))
        keep = two & (pc.binary_length(names).to_numpy(zero_copy_only=False) > 0) \
            & (pc.binary_length(values).to_numpy(zero_copy_only=False) > 0)
        offsets, kept_names, kept_values = self._filter_lists(entries.offsets, pa.array(keep), names, values)
        props = pa.MapArray.from_arrays(offsets, kept_names, kept_values, type=self.schema.field("properties").type)
        parent = pc.list_parent_indices(entries).to_numpy()

        def last(name: str):
            """Per record: the value of its last kept entry called *name*, or null."""
            hit = np.flatnonzero(keep & pc.equal(names, name).to_numpy(zero_copy_only=False))
            par = parent[hit]
            end = np.append(par[1:] != par[:-1], True) if len(hit) else np.zeros(0, bool)
            pick = np.full(len(arr), -1, np.int64)
            pick[par[end]] = hit[end]
            return pc.take(values, pa.array(pick, mask=pick < 0))

        tags = last(cl.PROPERTY_TAGS)
        tokens = pc.split_pattern(pc.fill_null(last(cl.PROPERTY_KEYS), ""), cl.KEY_SEPARATOR)
        tflat = tokens.flatten()
        koff, kvals = self._filter_lists(tokens.offsets, pc.greater(pc.binary_length(tflat), 0), tflat)
        keys = pa.ListArray.from_arrays(koff, kvals, type=self.schema.field("keys").type)
        return props, keys, tags

    def _flush(self, g: _Group) -> None:
        if not g.pieces:
            return
        pa = self._pa
        t = pa.concat_tables(g.pieces).combine_chunks()
        cols = {n: t.column(n).chunk(0) for n in t.column_names}
        cols["properties"], cols["keys"], cols["tags"] = self._property_columns(cols.pop("props_raw"))
        n = t.num_rows
        for name, value in self.constants.items():
            cols[name] = pa.repeat(pa.scalar(value, self.schema.field(name).type), n)
        for name in ("store_timestamp", "born_timestamp"):
            cols[name] = cols[name].cast(self.schema.field(name).type)
        table = pa.Table.from_arrays([cols[f.name] for f in self.schema], schema=self.schema)
        if g.writer is None:
            import pyarrow.parquet as pq

            g.writer = pq.ParquetWriter(g.path, self.schema, compression=COMPRESSION)
        g.writer.write_table(table)
        self.buffered -= g.buffered
        g.buffered = 0
        g.pieces = []

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


def _default_read(store: ObjectStore, seg: dict) -> Iterable[bytes]:
    """tasks.read_segment (raw chunks or lz4c, crc-checked); the walk copies each block as it arrives, so reads
    may reuse their buffers."""
    from tierfs.spark.tasks import read_segment

    return read_segment(store, seg, transient=True)


@contextlib.contextmanager
def _decoded(store: ObjectStore, seg: dict, retention: Mapping[str, float], today: _dt.date,
             read: Callable[[ObjectStore, dict], Iterable[bytes]] | None, constants: Mapping[str, object] | None
             ) -> Iterator[tuple[_Writer, list[_Group], Callable[[], int]]]:
    """Decode a whole segment into local Parquet files (one per topic and date) in a temporary directory that
    lives as long as the context: (writer, its finished groups, bytes read so far)."""
    read = read or _default_read
    name, size = seg["path"].rsplit("/", 1)[-1], int(seg["size"])
    consumed = 0

    def counted(blocks: Iterable[bytes]) -> Iterator[bytes]:
        nonlocal consumed
        for b in blocks:
            consumed += len(b)
            yield b

    with tempfile.TemporaryDirectory(prefix="tierfs-archive-") as tmp:
        w = _Writer(tmp, constants)
        try:
            for batch in batches(counted(read(store, seg)), name, size, classify(seg["path"]) is Kind.DLEDGER_DATA):
                w.add(batch, retention, today)
            done = w.finish()
        except BaseException:
            w.abort()
            raise
        yield w, done, lambda: consumed


def archive_segment(store: ObjectStore, store_id: str, seg: dict, retention: Mapping[str, float],
                    today: _dt.date, read: Callable[[ObjectStore, dict], Iterable[bytes]] | None = None) -> dict:
    """Archive one tiered CommitLog segment; returns its archive[] result row.

    Rows of partitions that retention already expired are skipped (counted in `expired_rows`), so the sweep
    does not delete what was just written. `read` defaults to tasks.read_segment (raw chunks or lz4c, crc-checked).
    Records are never decoded one by one: the walk (tierfs.spark.walk.batches) hands over batches of records as
    arrays, and each becomes Arrow columns.
    """
    path, gen = seg["path"], int(seg["generation"])
    with _decoded(store, seg, retention, today, read, None) as (w, done, consumed):
        keys, nbytes, rows = [], 0, 0
        for g in done:
            key = archive_key(store_id, g.topic, g.date, part_name(path), gen)
            info = store.put_file(key, g.path)
            keys.append(key)
            nbytes += info.size
            rows += g.count
        return {"path": path, "generation": gen, "rows": rows, "keys": keys, "bytes": nbytes,
                "expired_rows": w.expired_rows, "bytes_read": consumed()}


# ---------------------------------------------------------------------------------------------------- table files

_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")


def safe_name(text: str) -> str:
    """An injective spelling of *text* in [A-Za-z0-9.-_]: any other byte of its UTF-8 becomes _XX. Table file
    paths need no URI escaping (the Delta log stores paths as URIs; every reader then agrees on them)."""
    return "".join(chr(b) if chr(b) in _SAFE else f"_{b:02X}" for b in text.encode("utf-8"))


def broker_group(broker: str, store_id: str, path: str) -> tuple[str, str]:
    """(broker column, broker group) of a segment's rows. A named broker (archive.broker_name, or the brokerName
    the daemon read from the store root's brokerIdentity) is its own group: the stores of its master and slaves
    hold byte-identical segments, archived once. Unnamed, the rows carry the store id and each store root is a
    group of its own (two unnamed masters' segments of the same name are different messages: never merged)."""
    if broker:
        return broker, broker
    root = split_root(path)[0]
    return store_id, f"{store_id}/{root}" if root else store_id


def segment_base(path: str) -> str:
    """The name a segment has on every replica of its group: its log and its file name (the base offset), without
    the store root or the DLedger member ('slave/commitlog/0000...' -> 'commitlog~0000...')."""
    tag = "dledger" if classify(path) is Kind.DLEDGER_DATA else "commitlog"
    return f"{tag}~{path.rsplit('/', 1)[-1]}"


def content_digest(seg: Mapping) -> int:
    """A 62-bit digest of a segment's content from its catalog entry (size, crc32c, every block's crc32c): equal on
    every replica holding the same bytes, different (but for a 2^-62 chance) once any block differs, with no byte
    read. It is the table's `txn` version of the segment (tierfs.spark.table)."""
    import hashlib

    try:
        parts = [int(seg["size"]), int(seg["crc32c"]), *(int(c) for c in seg.get("block_crcs") or ())]
    except (KeyError, TypeError, ValueError):
        raise ArchiveError(f"{seg.get('path')}: the segment entry has no crc32c (the archive table keys a segment "
                           f"by its content)") from None
    h = hashlib.blake2b(struct.pack(f">{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 2


def table_file(group: str, path: str, digest: int, store_id: str, topic: str, date: str) -> str:
    """A table data file's path below the table root, in directories of its partition: named by the segment's
    group and base name (the files of one segment are found by that prefix, whichever replica wrote them), its
    content digest, and the store and segment path that wrote it (a re-run overwrites the same file; two writers
    never share one)."""
    return (f"topic={safe_name(topic)}/date={date}/part-{safe_name(group)}~{safe_name(segment_base(path))}"
            f"~{digest:016x}~{safe_name(store_id)}~{safe_name(part_name(path))}.parquet")


_TABLE_FILE_RE = re.compile(r"(?:^|/)part-([A-Za-z0-9.\-_]+)~([A-Za-z0-9.\-_]+)~([0-9a-f]{16})~[A-Za-z0-9.\-_]+"
                            r"~[A-Za-z0-9.\-_]+\.parquet$")


def parse_table_file(rel: str) -> tuple[str, str, int] | None:
    """(safe group, safe segment base, content digest) of a table file path, None for a file not written here."""
    m = _TABLE_FILE_RE.search(rel)
    return (m.group(1), m.group(2), int(m.group(3), 16)) if m else None


def archive_segment_table(store: ObjectStore, store_id: str, seg: dict, table_prefix: str, broker: str,
                          read: Callable[[ObjectStore, dict], Iterable[bytes]] | None = None) -> dict:
    """Write one tiered CommitLog segment's rows as data files of the archive table (not yet committed: the
    driver commits every segment of a job in one table transaction, tierfs.spark.table). `broker`: the broker
    name ("" -> unnamed, broker_group). Returns its archive[] row with `group`, `digest` and `files`: path below
    the table root, size, partition values, row count, stats of each file."""
    path, gen = seg["path"], int(seg["generation"])
    column, group = broker_group(broker, store_id, path)
    digest = content_digest(seg)
    constants = {"broker": column, "store_id": store_id, "segment": path, "segment_generation": gen}
    with _decoded(store, seg, {}, _dt.date.today(), read, constants) as (w, done, consumed):
        files, nbytes, rows = [], 0, 0
        for g in done:
            rel = table_file(group, path, digest, store_id, g.topic, g.date)
            info = store.put_file(table_prefix + rel, g.path)
            stats = {"numRecords": g.count, "minValues": {"segment_generation": gen},
                     "maxValues": {"segment_generation": gen}, "nullCount": {}}
            files.append({"path": rel, "size": info.size, "topic": g.topic, "date": g.date, "rows": g.count,
                          "stats": stats})
            nbytes += info.size
            rows += g.count
        return {"path": path, "generation": gen, "group": group, "digest": digest, "rows": rows, "keys": [],
                "files": files, "bytes": nbytes, "expired_rows": 0, "bytes_read": consumed()}


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
    """List the archive once, delete expired and superseded files, and say which. The deletes go through the
    store's fence: the job's driver sets one that refuses them once the writer lease moved (tierfs.spark.job)."""
    plan = plan_sweep(store.list(archive_prefix(store_id)), store_id, retention, today, archived)
    store.delete_many(plan.expired + plan.superseded)
    return plan
