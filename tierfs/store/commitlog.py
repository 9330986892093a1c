"""CommitLog record codec (format doc §4) and the content-based seal rule (§12).

Pure functions over ``bytes``/``bytearray``/``memoryview``/``mmap``: nothing here does I/O.
All integers are big-endian. Decoders never raise on garbage; they answer ``None``, which
means "end of valid data" exactly where the broker's ``checkMessageAndReturnSize`` would stop.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Union

import numpy as np

__all__ = [
    "MAGIC_V1",
    "MAGIC_V2",
    "BLANK_MAGIC",
    "BLANK_SIZE",
    "COMPRESSED_FLAG",
    "MULTI_TAGS_FLAG",
    "TRANSACTION_NOT_TYPE",
    "TRANSACTION_PREPARED_TYPE",
    "TRANSACTION_COMMIT_TYPE",
    "TRANSACTION_ROLLBACK_TYPE",
    "TRANSACTION_MASK",
    "BORNHOST_V6_FLAG",
    "STOREHOSTADDRESS_V6_FLAG",
    "NEED_UNWRAP_FLAG",
    "INNER_BATCH_FLAG",
    "COMPRESSION_TYPE_MASK",
    "COMPRESSION_LZ4",
    "COMPRESSION_ZSTD",
    "COMPRESSION_ZLIB",
    "NAME_VALUE_SEPARATOR",
    "PROPERTY_SEPARATOR",
    "PROPERTY_KEYS",
    "PROPERTY_TAGS",
    "PROPERTY_UNIQ_KEY",
    "PROPERTY_DELAY",
    "KEY_SEPARATOR",
    "QUEUE_OFFSET_POSITION",
    "PHYSICAL_OFFSET_POSITION",
    "SYSFLAG_POSITION",
    "Host",
    "Message",
    "Blank",
    "host_length",
    "message_length",
    "body_crc",
    "RecordPacker",
    "pack_record_into",
    "encode_message",
    "encode_blank",
    "decode_record",
    "iter_records",
    "torn_record",
    "properties_to_string",
    "string_to_properties",
    "message_id",
    "sealed_commitlog_end",
    "complete_records_end",
    "be_ints",
    "byte_view",
    "check_layouts",
]

# --- constants (MessageDecoder, MessageSysFlag, MessageConst) -------------------------------------
MAGIC_V1 = -626843481  # 0xDAA320A7
MAGIC_V2 = -626843477  # 0xDAA320AB, 2-byte topic length (5.1+, topics longer than 127 chars)
BLANK_MAGIC = -875286124  # 0xCBD43194, end-of-file filler
BLANK_SIZE = 8  # END_FILE_MIN_BLANK_LENGTH: a message is appended only if len + 8 <= remaining

COMPRESSED_FLAG = 0x1
MULTI_TAGS_FLAG = 0x2
TRANSACTION_NOT_TYPE = 0x0
TRANSACTION_PREPARED_TYPE = 0x4
TRANSACTION_COMMIT_TYPE = 0x8
TRANSACTION_ROLLBACK_TYPE = 0xC
TRANSACTION_MASK = 0xC
BORNHOST_V6_FLAG = 0x10
STOREHOSTADDRESS_V6_FLAG = 0x20
NEED_UNWRAP_FLAG = 0x40
INNER_BATCH_FLAG = 0x80
COMPRESSION_TYPE_MASK = 0x700
COMPRESSION_LZ4 = 0x100
COMPRESSION_ZSTD = 0x200
COMPRESSION_ZLIB = 0x300

NAME_VALUE_SEPARATOR = "\u0001"
PROPERTY_SEPARATOR = "\u0002"
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_UNIQ_KEY = "UNIQ_KEY"
PROPERTY_DELAY = "DELAY"
KEY_SEPARATOR = " "

QUEUE_OFFSET_POSITION = 20
PHYSICAL_OFFSET_POSITION = 28
SYSFLAG_POSITION = 36

_INT_MAX = (1 << 31) - 1
_SHORT_MAX = (1 << 15) - 1

# TOTALSIZE..BORNTIMESTAMP: the part before the first host, identical for every variant.
_HEAD = struct.Struct(">iiiiiqqiq")  # 48 bytes
_II = struct.Struct(">ii")
_I = struct.Struct(">i")
_Q = struct.Struct(">q")
_H = struct.Struct(">h")
_B = struct.Struct(">b")

Host = tuple[bytes, int]
"""(ip address bytes — 4 for IPv4, 16 for IPv6 — , port)."""

_LOCALHOST: Host = (b"\x7f\x00\x00\x01", 0)


@dataclass
class Message:
    """One CommitLog message record (§4.1).

    ``total_size`` and ``body_crc`` hold what a decoded record says; the encoder ignores them
    and recomputes both, as the broker does. Host address widths follow the SYSFLAG v6 bits.
    """

    topic: str
    body: bytes = b""
    queue_id: int = 0
    flag: int = 0
    queue_offset: int = 0
    physical_offset: int = 0
    sys_flag: int = 0
    born_timestamp: int = 0
    born_host: Host = _LOCALHOST
    store_timestamp: int = 0
    store_host: Host = _LOCALHOST
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0
    properties: dict[str, str] = field(default_factory=dict)
    version: int = 1
    trailing_separator: bool = True
    total_size: int = 0
    body_crc: int = 0

    @property
    def magic(self) -> int:
        return MAGIC_V2 if self.version == 2 else MAGIC_V1

    @property
    def keys(self) -> list[str]:
        """Non-empty tokens of the ``KEYS`` property."""
        return [k for k in self.properties.get(PROPERTY_KEYS, "").split(KEY_SEPARATOR) if k]

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def uniq_key(self) -> str | None:
        return self.properties.get(PROPERTY_UNIQ_KEY)


@dataclass(frozen=True)
class Blank:
    """End-of-file filler: 8 bytes, ``total_size`` = bytes from its position to the end of the segment."""

    total_size: int


def host_length(sys_flag: int, store: bool) -> int:
    """Bytes taken by BORNHOST (store=False) or STOREHOSTADDRESS (store=True) for *sys_flag*."""
    bit = STOREHOSTADDRESS_V6_FLAG if store else BORNHOST_V6_FLAG
    return 20 if sys_flag & bit else 8


def message_length(sys_flag: int, body_len: int, topic_len: int, props_len: int, version: int = 1) -> int:
    """``MessageExtEncoder.calMsgLength``: TOTALSIZE for the given field lengths (topic/props in UTF-8 bytes)."""
    return (
        56 + host_length(sys_flag, False) + host_length(sys_flag, True) + 16
        + body_len + (2 if version == 2 else 1) + topic_len + 2 + props_len
    )


def body_crc(body: bytes | memoryview) -> int:
    """BODYCRC as java.util.zip.CRC32 with the sign bit cleared."""
    return zlib.crc32(body) & 0x7FFFFFFF


def _java_utf8(s: str) -> bytes:
    # Java's String.getBytes(UTF_8) replaces unpaired surrogates with '?', as Python's "replace" does.
    return s.encode("utf-8", "replace")


def properties_to_string(properties: dict[str, str | None], trailing_separator: bool = True) -> str:
    """``MessageDecoder.messageProperties2String``.

    ``None`` values are skipped. The trailing ``\\u0002`` exists in <=4.9.0 and >=5.2.0 and was
    dropped in 4.9.1-5.1.x; readers must accept both, writers pick via *trailing_separator*.
    """
    parts = [f"{k}{NAME_VALUE_SEPARATOR}{v}{PROPERTY_SEPARATOR}" for k, v in properties.items() if v is not None]
    s = "".join(parts)
    if s and not trailing_separator:
        s = s[:-1]
    return s


def string_to_properties(s: str) -> dict[str, str]:
    """``MessageDecoder.string2messageProperties``, including its quirks.

    An entry is kept only if its name and value are both non-empty; later duplicates win.
    Works with and without the trailing separator.
    """
    result: dict[str, str] = {}
    n = len(s)
    index = 0
    while index < n:
        end = s.find(PROPERTY_SEPARATOR, index)
        if end < 0:
            end = n
        if end - index >= 3:
            kv = s.find(NAME_VALUE_SEPARATOR, index)
            if index < kv < end - 1:
                result[s[index:kv]] = s[kv + 1:end]
        index = end + 1
    return result


_FIXED_CACHE: dict[int, struct.Struct] = {}


def _fixed_struct(sys_flag: int) -> struct.Struct:
    """Struct for TOTALSIZE..BODY length (everything before the body) for the host widths of *sys_flag*."""
    key = sys_flag & (BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG)
    st = _FIXED_CACHE.get(key)
    if st is None:
        bh = host_length(sys_flag, False) - 4
        sh = host_length(sys_flag, True) - 4
        st = _FIXED_CACHE[key] = struct.Struct(f">iiiiiqqiq{bh}siq{sh}siiqi")
    return st


class RecordPacker:
    """Encoder for many records sharing topic, version, SYSFLAG and hosts (producers, test generators).

    All per-topic validation and layout work happens once here; :meth:`pack_into` is one struct call plus
    slice copies, which is what lets a Python producer reach ~100k records/s.
    """

    __slots__ = ("sys_flag", "version", "born_host", "store_host", "_fixed", "_tail", "_base", "_magic")

    def __init__(
        self,
        topic: bytes,
        sys_flag: int = 0,
        version: int = 1,
        born_host: Host = _LOCALHOST,
        store_host: Host = _LOCALHOST,
    ) -> None:
        if len(born_host[0]) != host_length(sys_flag, False) - 4 or len(store_host[0]) != host_length(sys_flag, True) - 4:
            raise ValueError("host address length does not match the SYSFLAG v6 bits")
        if version == 1:
            if len(topic) > 127:
                raise ValueError("v1 records hold topics of at most 127 bytes; use version 2")
            tail = _B.pack(len(topic)) + topic
        elif version == 2:
            if len(topic) > _SHORT_MAX:
                raise ValueError("topic longer than 32767 bytes")
            tail = _H.pack(len(topic)) + topic
        else:
            raise ValueError(f"unknown message version {version}")
        self.sys_flag = sys_flag
        self.version = version
        self.born_host = (bytes(born_host[0]), born_host[1])
        self.store_host = (bytes(store_host[0]), store_host[1])
        self._fixed = _fixed_struct(sys_flag)
        self._tail = tail
        self._base = self._fixed.size + len(tail) + 2
        self._magic = MAGIC_V2 if version == 2 else MAGIC_V1

    def size(self, body_len: int, props_len: int) -> int:
        """TOTALSIZE of a record with this body and (encoded) properties length."""
        return self._base + body_len + props_len

    def pack_into(
        self,
        buf,
        pos: int,
        body: bytes | memoryview,
        properties: bytes,
        queue_id: int = 0,
        queue_offset: int = 0,
        physical_offset: int = 0,
        store_timestamp: int = 0,
        born_timestamp: int = 0,
        flag: int = 0,
        reconsume_times: int = 0,
        prepared_transaction_offset: int = 0,
        crc: int | None = None,
    ) -> int:
        """Write one record at ``buf[pos:]``; return TOTALSIZE. *crc* (= ``body_crc(body)``) may be precomputed."""
        body_len = len(body)
        props_len = len(properties)
        if props_len > _SHORT_MAX:
            raise ValueError("properties longer than 32767 bytes")
        total = self._base + body_len + props_len
        if total > _INT_MAX:
            raise ValueError("record too large")
        if crc is None:
            crc = zlib.crc32(body) & 0x7FFFFFFF
        fixed = self._fixed
        born_ip, born_port = self.born_host
        store_ip, store_port = self.store_host
        fixed.pack_into(
            buf, pos, total, self._magic, crc, queue_id, flag, queue_offset, physical_offset,
            self.sys_flag, born_timestamp, born_ip, born_port, store_timestamp, store_ip, store_port,
            reconsume_times, prepared_transaction_offset, body_len,
        )
        p = pos + fixed.size
        buf[p:p + body_len] = body
        p += body_len
        tail = self._tail
        buf[p:p + len(tail)] = tail
        p += len(tail)
        _H.pack_into(buf, p, props_len)
        buf[p + 2:p + 2 + props_len] = properties
        return total


def pack_record_into(
    buf,
    pos: int,
    *,
    queue_id: int,
    flag: int,
    queue_offset: int,
    physical_offset: int,
    sys_flag: int,
    born_timestamp: int,
    born_host: Host,
    store_timestamp: int,
    store_host: Host,
    reconsume_times: int,
    prepared_transaction_offset: int,
    body: bytes | memoryview,
    topic: bytes,
    properties: bytes,
    version: int = 1,
    crc: int | None = None,
) -> int:
    """Write one record at ``buf[pos:]``; return TOTALSIZE. *topic*/*properties* are UTF-8 bytes.

    One-off form of :class:`RecordPacker`; raises ``ValueError`` for unencodable input
    (v1 topic > 127 bytes, host width not matching the SYSFLAG v6 bits, oversize fields).
    """
    return RecordPacker(topic, sys_flag, version, born_host, store_host).pack_into(
        buf, pos, body, properties, queue_id, queue_offset, physical_offset, store_timestamp,
        born_timestamp, flag, reconsume_times, prepared_transaction_offset, crc,
    )


def encode_message(msg: Message) -> bytes:
    """Serialize *msg*; TOTALSIZE and BODYCRC are computed, host widths follow ``msg.sys_flag``."""
    topic = _java_utf8(msg.topic)
    props = _java_utf8(properties_to_string(msg.properties, msg.trailing_separator))
    size = message_length(msg.sys_flag, len(msg.body), len(topic), len(props), msg.version)
    out = bytearray(size)
    pack_record_into(
        out, 0,
        queue_id=msg.queue_id, flag=msg.flag, queue_offset=msg.queue_offset,
        physical_offset=msg.physical_offset, sys_flag=msg.sys_flag,
        born_timestamp=msg.born_timestamp, born_host=msg.born_host,
        store_timestamp=msg.store_timestamp, store_host=msg.store_host,
        reconsume_times=msg.reconsume_times, prepared_transaction_offset=msg.prepared_transaction_offset,
        body=msg.body, topic=topic, properties=props, version=msg.version,
    )
    return bytes(out)


def encode_blank(remaining: int) -> bytes:
    """The 8-byte end-of-file filler for a segment with *remaining* bytes left at the write position."""
    if remaining < BLANK_SIZE or remaining > _INT_MAX:
        raise ValueError(f"invalid blank length {remaining}")
    return _II.pack(remaining, BLANK_MAGIC)


# --- decoding ---------------------------------------------------------------------------------------

def _message_layout(buf, pos: int, total: int, tl_size: int, end: int):
    """Check the lengths of the message record at *pos* whose TOTALSIZE and magic were already read.

    *tl_size* is the width of the topic length: 1 for MAGIC_V1, 2 for MAGIC_V2 (equal to the version).
    Reads only SYSFLAG and the three length fields (never the body). Returns None if the record is
    truncated or its TOTALSIZE disagrees with ``calMsgLength``, else
    ``(sys_flag, bh, sh, body_off, body_len, topic_off, topic_len, props_off, props_len)`` relative to *pos*.
    """
    if total < 91 or pos + total > end:
        return None
    sys_flag = _I.unpack_from(buf, pos + SYSFLAG_POSITION)[0]
    bh = 20 if sys_flag & BORNHOST_V6_FLAG else 8
    sh = 20 if sys_flag & STOREHOSTADDRESS_V6_FLAG else 8
    body_off = 72 + bh + sh
    if total < body_off + tl_size + 2:
        return None
    body_len = _I.unpack_from(buf, pos + body_off - 4)[0]
    tl_off = body_off + body_len
    if body_len < 0 or tl_off + tl_size + 2 > total:
        return None
    topic_len = (_H if tl_size == 2 else _B).unpack_from(buf, pos + tl_off)[0]
    topic_off = tl_off + tl_size
    pl_off = topic_off + topic_len
    if topic_len < 0 or pl_off + 2 > total:
        return None
    props_len = _H.unpack_from(buf, pos + pl_off)[0]
    if props_len < 0 or pl_off + 2 + props_len != total:
        return None
    return sys_flag, bh, sh, body_off, body_len, topic_off, topic_len, pl_off + 2, props_len


def _crc_ok(mv: memoryview, pos: int, body_off: int, body_len: int) -> bool:
    start = pos + body_off
    return zlib.crc32(mv[start:start + body_len]) & 0x7FFFFFFF == _I.unpack_from(mv, pos + 8)[0]


def decode_record(buf, pos: int = 0, *, check_crc: bool = False) -> Union[Message, Blank, None]:
    """Decode the record at *pos*.

    Returns a :class:`Message`, a :class:`Blank`, or ``None`` for anything that is not a complete,
    self-consistent record: zero or unknown magic, truncated buffer, TOTALSIZE disagreeing with the
    field lengths, negative lengths, or (with *check_crc*) a BODYCRC mismatch. Never raises on garbage.
    *buf* must extend at least to the end of the record.
    """
    try:
        end = len(buf)
        if pos < 0 or pos + 8 > end:
            return None
        total, magic = _II.unpack_from(buf, pos)
        if magic == BLANK_MAGIC:
            return Blank(total) if total >= BLANK_SIZE else None
        if magic == MAGIC_V1:
            version = 1
        elif magic == MAGIC_V2:
            version = 2
        else:
            return None
        lay = _message_layout(buf, pos, total, version, end)
        if lay is None:
            return None
        sys_flag, bh, sh, body_off, body_len, topic_off, topic_len, props_off, props_len = lay
        if check_crc:
            with memoryview(buf) as mv:
                if not _crc_ok(mv.cast("B") if mv.format != "B" else mv, pos, body_off, body_len):
                    return None
    except (struct.error, TypeError, ValueError, IndexError):
        return None
    (_, _, crc, queue_id, flag, queue_offset, phys, _, born_ts) = _HEAD.unpack_from(buf, pos)
    p = pos + 48
    born_host = (bytes(buf[p:p + bh - 4]), _I.unpack_from(buf, p + bh - 4)[0])
    p += bh
    store_ts = _Q.unpack_from(buf, p)[0]
    p += 8
    store_host = (bytes(buf[p:p + sh - 4]), _I.unpack_from(buf, p + sh - 4)[0])
    p += sh
    reconsume, prepared = struct.unpack_from(">iq", buf, p)
    body = bytes(buf[pos + body_off:pos + body_off + body_len])
    topic = bytes(buf[pos + topic_off:pos + topic_off + topic_len]).decode("utf-8", "replace")
    props_raw = bytes(buf[pos + props_off:pos + props_off + props_len]).decode("utf-8", "replace")
    return Message(
        topic=topic, body=body, queue_id=queue_id, flag=flag, queue_offset=queue_offset,
        physical_offset=phys, sys_flag=sys_flag, born_timestamp=born_ts, born_host=born_host,
        store_timestamp=store_ts, store_host=store_host, reconsume_times=reconsume,
        prepared_transaction_offset=prepared, properties=string_to_properties(props_raw),
        version=version, trailing_separator=props_raw.endswith(PROPERTY_SEPARATOR),
        total_size=total, body_crc=crc,
    )


def torn_record(buf, pos: int) -> bool:
    """Does the message record at *pos* (one `decode_record` accepts) hold a NUL byte in its topic or
    properties? A broker never writes one there; a copy cut short does (a kill -9 in the middle of an append, a
    page not written back yet). The broker's recovery checks only lengths and the body crc, so it keeps such a
    record; `complete_records_end` does not."""
    total, magic = _II.unpack_from(buf, pos)
    lay = _message_layout(buf, pos, total, 2 if magic == MAGIC_V2 else 1, len(buf))
    if lay is None:
        return False
    with memoryview(buf) as mv:
        return _nul_in_text(mv.cast("B") if mv.format != "B" else mv, pos, lay)


def _nul_in_text(mv: memoryview, pos: int, lay) -> bool:
    """Does the topic or the properties of the record at *pos* (its `_message_layout`) hold a NUL byte?"""
    topic_off, topic_len, props_off, props_len = lay[5], lay[6], lay[7], lay[8]
    return 0 in mv[pos + topic_off:pos + topic_off + topic_len] or 0 in mv[pos + props_off:pos + props_off + props_len]


def iter_records(buf, start_offset: int = 0, *, check_crc: bool = False) -> Iterator[tuple[int, Union[Message, Blank]]]:
    """Walk records from position *start_offset* of *buf* (a record boundary), yielding ``(pos, record)``.

    The walk ends after yielding a :class:`Blank` (end of segment) or silently at the first
    invalid position (end of valid data), exactly like broker recovery.
    """
    pos = start_offset
    while True:
        rec = decode_record(buf, pos, check_crc=check_crc)
        if rec is None:
            return
        yield pos, rec
        if isinstance(rec, Blank):
            return
        pos += rec.total_size


def message_id(store_host: Host, phys_offset: int) -> str:
    """Offset message id: uppercase hex of store IP + port int + PHYSICALOFFSET long (32 or 56 hex chars)."""
    ip, port = store_host
    return (bytes(ip) + _I.pack(port) + _Q.pack(phys_offset)).hex().upper()


def byte_view(buf, file_size: int, min_size: int) -> memoryview | None:
    """A flat byte view of `buf` holding at least `file_size` >= `min_size` bytes, or None (never raises)."""
    try:
        if not isinstance(file_size, int) or file_size < min_size or len(buf) < file_size:
            return None
        mv = memoryview(buf)
    except TypeError:
        return None
    if mv.ndim != 1 or mv.itemsize != 1:
        try:
            return mv.cast("B")
        except (TypeError, ValueError):
            return None
    return mv


def sealed_commitlog_end(buf, file_size: int, *, check_crc: bool = False, file_start: int | None = None) -> int | None:
    """Seal test for a CommitLog segment: the position of its terminal BLANK, or ``None``.

    A segment is complete when walking from 0 over valid records reaches a BLANK whose TOTALSIZE
    equals ``file_size - pos`` (§4.5, §12). Only headers and length fields are read, so this is cheap on a
    1 GiB ``mmap``/``memoryview``; *check_crc* also verifies each BODYCRC (no copies either way).
    With *file_start*, every PHYSICALOFFSET must equal ``file_start + pos``.
    Garbage never raises: it yields ``None``.

    The hop from record to record (TOTALSIZE, magic) is the only sequential part; the lengths inside each record
    are then checked for all records at once (`_layouts_ok`): a 1 GiB segment of 1 KiB messages is a million
    records, and checking each one's layout in Python took the sealer over a second of GIL-holding CPU.
    """
    mv = byte_view(buf, file_size, BLANK_SIZE)
    if mv is None:
        return None
    with mv:
        # Room for the BLANK is always left after the last message: messages must end by file_size - 8.
        msg_end = file_size - BLANK_SIZE
        pos = 0
        unpack_ii = _II.unpack_from
        starts: list[int] = []
        v2: list[int] = []  # starts of the MAGIC_V2 records (2-byte topic length)
        blank = None
        try:
            while pos <= msg_end:
                total, magic = unpack_ii(mv, pos)
                if magic == BLANK_MAGIC:
                    if total != file_size - pos:
                        return None
                    blank = pos
                    break
                if magic == MAGIC_V2:
                    v2.append(pos)
                elif magic != MAGIC_V1:
                    return None
                if total < 91 or pos + total > msg_end:
                    return None
                starts.append(pos)
                pos += total
                if len(starts) == _CHECK_BATCH:  # memory stays small for any number of records
                    if not _records_ok(mv, file_size, starts, v2, pos, check_crc, file_start):
                        return None
                    starts, v2 = [], []
        except struct.error:
            return None
        if blank is None or (starts and not _records_ok(mv, file_size, starts, v2, blank, check_crc, file_start)):
            return None
        return blank


_CHECK_BATCH = 1 << 16  # records checked at once by _records_ok: ~10 MB of arrays


def _records_ok(mv: memoryview, file_size: int, starts: list[int], v2: list[int], end: int, check_crc: bool,
                file_start: int | None) -> bool:
    """The checks of a run of records the hop found (the last one ends at `end`), at once. (The arrays over `mv`
    die with this frame, before the caller releases `mv`.)"""
    a = np.frombuffer(mv, dtype=np.uint8, count=file_size)
    at = np.array(starts, dtype=np.int64)
    wide = np.isin(at, np.array(v2, dtype=np.int64)) if v2 else np.zeros(len(at), dtype=bool)
    ok = _layouts_ok(a, at, np.append(at[1:], end) - at, wide, check_crc)
    if ok is None:
        return False
    if file_start is not None and not np.array_equal(_be(a, at + PHYSICAL_OFFSET_POSITION, 8, True),
                                                      at + file_start):
        return False
    return not check_crc or all(_crc_ok(mv, int(p), int(b), int(n)) for p, b, n in zip(at, *ok))


def _be(a: np.ndarray, idx: np.ndarray, width: int, signed: bool) -> np.ndarray:
    """Big-endian integers of `width` bytes at byte offsets `idx` of `a`, one gather of `width` adjacent bytes
    per offset (offsets clipped into `a`: a record whose lengths point outside is rejected by its own checks,
    not by an IndexError)."""
    idx = np.minimum(np.maximum(idx, 0), len(a) - width)
    raw = a[idx[:, None] + np.arange(width)]
    return raw.view(f">{'i' if signed else 'u'}{width}").ravel().astype(np.int64)


def _layouts_ok(a: np.ndarray, pos: np.ndarray, total: np.ndarray, wide: np.ndarray, need_body: bool):
    """`_message_layout` for every record at once: None if any record's lengths disagree with its TOTALSIZE,
    else (body offsets, body lengths) relative to each record (for the crc check). Four gathers: the records
    are far apart, so each one costs a cache miss per record, and fewer gathers is what makes this fast."""
    flags = _be(a, pos + SYSFLAG_POSITION + 3, 1, False)  # the host-v6 flags are in SYSFLAG's low byte
    body_off = 72 + np.where(flags & BORNHOST_V6_FLAG, 20, 8) + np.where(flags & STOREHOSTADDRESS_V6_FLAG, 20, 8)
    tl_size = np.where(wide, 2, 1)
    ok = total >= body_off + tl_size + 2
    body_len = _be(a, pos + body_off - 4, 4, True)
    tl_off = body_off + body_len
    ok &= (body_len >= 0) & (tl_off + tl_size + 2 <= total)
    topic2 = _be(a, pos + tl_off, 2, True)
    topic_len = np.where(wide, topic2, topic2 >> 8)  # MAGIC_V1: a signed byte, the first of the two
    pl_off = tl_off + tl_size + topic_len
    ok &= (topic_len >= 0) & (pl_off + 2 <= total)
    props_len = _be(a, pos + pl_off, 2, True)
    ok &= (props_len >= 0) & (pl_off + 2 + props_len == total)
    if not ok.all():
        return None
    return (body_off, body_len) if need_body else ()


# the vectorised checks, for codecs of logs that wrap CommitLog records (tierfs.store.dledger)
be_ints = _be
check_layouts = _layouts_ok


def complete_records_end(buf, pos: int, *, buf_offset: int, file_start: int, file_size: int,
                         trusted_end: int) -> tuple[int, bool]:
    """Walk the records of a CommitLog segment still being written, as far as each is wholly written.

    *buf* holds the segment from position *buf_offset*; the walk starts at segment position *pos* (a record
    boundary) and returns ``(end, more)``: *end* is the position after the last complete record (after the
    terminal BLANK when there is one), *more* is True when the walk stopped only because the next record runs
    past the end of *buf* (read more and call again from *end*).

    Why this is stricter than the broker's recovery: a copy of a segment taken while it is written (mmap'd
    pages reach the daemon page by page, in any order) can hold a record whose last page is still zeros. The
    broker's recovery checks only lengths and the body's crc, so a record torn inside its topic or properties
    would pass it and be served with wrong properties. A record ending at or before *trusted_end* (the last
    written byte seen before the pages were flushed: one appender writes records in order, so every record up
    to there was complete) needs only its lengths; a later one must also have its body crc, its
    PHYSICALOFFSET (``file_start + pos``) and a topic and properties free of NUL bytes.
    """
    with memoryview(buf) as mv:
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        end = buf_offset + len(mv)
        unpack_ii = _II.unpack_from
        while True:
            rel = pos - buf_offset
            if pos + BLANK_SIZE > end:
                return pos, pos + BLANK_SIZE <= file_size
            total, magic = unpack_ii(mv, rel)
            if magic == BLANK_MAGIC:
                return (pos + BLANK_SIZE, False) if total == file_size - pos else (pos, False)
            if magic == MAGIC_V1:
                version = 1
            elif magic == MAGIC_V2:
                version = 2
            else:
                return pos, False
            if total < 91 or pos + total + BLANK_SIZE > file_size:
                return pos, False
            if pos + total > end:
                return pos, True
            if pos + total > trusted_end:
                lay = _message_layout(mv, rel, total, version, len(mv))
                if lay is None or not _crc_ok(mv, rel, lay[3], lay[4]) \
                        or _Q.unpack_from(mv, rel + PHYSICAL_OFFSET_POSITION)[0] != file_start + pos:
                    return pos, False
                if _nul_in_text(mv, rel, lay):
                    return pos, False
            pos += total
