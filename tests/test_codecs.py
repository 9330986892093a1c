"""Property tests for the pure RocketMQ store codecs in ``tierfs.store``."""

from __future__ import annotations

import datetime as dt
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierfs.store import checkpoint as ckpt
from tierfs.store import commitlog as cl
from tierfs.store import consumequeue as cq
from tierfs.store import indexfile as ix
from tierfs.store import names
from tierfs.store.javahash import index_hash_of, index_key_hash, java_string_hash, tags_hash_code

INT_MIN = -(1 << 31)
LONG_MAX = (1 << 63) - 1
int32 = st.integers(INT_MIN, (1 << 31) - 1)
int64 = st.integers(-(1 << 63), LONG_MAX)

# Text that may contain lone surrogates (Java strings can) and non-BMP characters.
any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=60)


def ref_java_hash(s: str) -> int:
    """Textbook String.hashCode: h = 31*h + c over UTF-16 code units, wrapped to int32."""
    units = s.encode("utf-16-be", "surrogatepass")
    h = 0
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


# ------------------------------------------------------------------------------------------ javahash

def test_java_hash_known_values():
    assert java_string_hash("") == 0
    assert java_string_hash("hello") == 99162322
    # "TopicTest#KEY1" by the formula sum(c_i * 31**(n-1-i)) mod 2**32, as signed int32.
    s = "TopicTest#KEY1"
    by_hand = sum(ord(c) * 31 ** (len(s) - 1 - i) for i, c in enumerate(s)) % (1 << 32)
    by_hand = by_hand - (1 << 32) if by_hand >= 1 << 31 else by_hand
    assert java_string_hash(s) == by_hand == -1656969516
    # Non-BMP: U+1F600 is the surrogate pair D83D DE00 in a Java string.
    assert java_string_hash("\U0001F600") == 31 * 0xD83D + 0xDE00 == 1772899
    assert java_string_hash("a\U0001F600") == (97 * 31 * 31 + 31 * 0xD83D + 0xDE00)
    # Java collisions: "Aa" and "BB" share a hash code.
    assert java_string_hash("Aa") == java_string_hash("BB") == 2112


def test_index_key_hash_min_value():
    # "polygenelubricants".hashCode() == Integer.MIN_VALUE; Math.abs keeps it negative -> the broker uses 0.
    assert java_string_hash("polygenelubricants") == INT_MIN
    assert index_key_hash("polygenelubricants") == 0
    assert index_hash_of(-5) == 5 and index_hash_of(7) == 7 and index_hash_of(INT_MIN) == 0


@given(any_text)
def test_java_hash_matches_reference(s):
    assert java_string_hash(s) == ref_java_hash(s)
    assert index_key_hash(s) == (0 if ref_java_hash(s) == INT_MIN else abs(ref_java_hash(s)))


@given(any_text, any_text)
def test_java_hash_continuation(a, b):
    assert java_string_hash(b, java_string_hash(a)) == java_string_hash(a + b)


@given(st.one_of(st.none(), any_text))
def test_tags_hash_code(tags):
    assert tags_hash_code(tags) == (ref_java_hash(tags) if tags else 0)


# ------------------------------------------------------------------------------------------ properties

prop_text = st.text(
    st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=("Cs",), exclude_characters="\x01\x02"),
    min_size=1,
    max_size=20,
)
prop_dicts = st.dictionaries(prop_text, prop_text, max_size=6)


@given(prop_dicts, st.booleans())
def test_properties_round_trip(props, trailing):
    s = cl.properties_to_string(props, trailing)
    assert s.endswith("\x02") == (trailing and bool(props))
    assert cl.string_to_properties(s) == props


def test_properties_java_quirks():
    assert cl.properties_to_string({"a": "1", "b": None, "c": "3"}) == "a\x011\x02c\x013\x02"
    assert cl.properties_to_string({"a": "1", "c": "3"}, trailing_separator=False) == "a\x011\x02c\x013"
    assert cl.properties_to_string({}) == ""
    # Empty names or values are dropped by the parser; duplicates: last wins; garbage is skipped.
    assert cl.string_to_properties("a\x01\x02b\x01c") == {"b": "c"}
    assert cl.string_to_properties("\x01x\x02k\x01v\x02k\x01w") == {"k": "w"}
    assert cl.string_to_properties("noseparator\x02\x02\x02") == {}
    assert cl.string_to_properties("") == {}


# ------------------------------------------------------------------------------------------ commitlog

def hosts(v6: bool):
    return st.tuples(st.binary(min_size=16 if v6 else 4, max_size=16 if v6 else 4), int32)


@st.composite
def messages(draw, version=None):
    version = draw(st.sampled_from([1, 2])) if version is None else version
    born_v6 = draw(st.booleans())
    store_v6 = draw(st.booleans())
    other_flags = draw(st.integers(0, 0xFFFF)) & ~(cl.BORNHOST_V6_FLAG | cl.STOREHOSTADDRESS_V6_FLAG)
    sys_flag = other_flags | (cl.BORNHOST_V6_FLAG if born_v6 else 0) | (cl.STOREHOSTADDRESS_V6_FLAG if store_v6 else 0)
    if version == 1:
        topic = draw(st.text(min_size=1, max_size=127).filter(lambda t: len(t.encode()) <= 127))
    else:
        topic = draw(st.one_of(st.text(min_size=1, max_size=40), st.text(min_size=128, max_size=300)))
    props = draw(prop_dicts)
    return cl.Message(
        topic=topic,
        body=draw(st.one_of(st.just(b""), st.binary(max_size=600))),
        queue_id=draw(int32),
        flag=draw(int32),
        queue_offset=draw(int64),
        physical_offset=draw(int64),
        sys_flag=sys_flag,
        born_timestamp=draw(int64),
        born_host=draw(hosts(born_v6)),
        store_timestamp=draw(int64),
        store_host=draw(hosts(store_v6)),
        reconsume_times=draw(int32),
        prepared_transaction_offset=draw(int64),
        properties=props,
        version=version,
        trailing_separator=draw(st.booleans()) if props else False,
    )


@given(messages(), st.binary(max_size=64), st.binary(max_size=64))
def test_message_round_trip(msg, before, after):
    raw = cl.encode_message(msg)
    topic_b = msg.topic.encode()
    props_b = cl.properties_to_string(msg.properties, msg.trailing_separator).encode()
    assert len(raw) == cl.message_length(msg.sys_flag, len(msg.body), len(topic_b), len(props_b), msg.version)
    v4 = not msg.sys_flag & (cl.BORNHOST_V6_FLAG | cl.STOREHOSTADDRESS_V6_FLAG)
    if v4 and msg.version == 1:
        assert len(raw) == 91 + len(msg.body) + len(topic_b) + len(props_b)
    total, magic, crc = struct.unpack_from(">iii", raw)
    assert total == len(raw)
    assert magic == (cl.MAGIC_V2 if msg.version == 2 else cl.MAGIC_V1)
    assert crc == zlib.crc32(msg.body) & 0x7FFFFFFF
    assert struct.unpack_from(">q", raw, cl.QUEUE_OFFSET_POSITION)[0] == msg.queue_offset
    assert struct.unpack_from(">q", raw, cl.PHYSICAL_OFFSET_POSITION)[0] == msg.physical_offset
    assert struct.unpack_from(">i", raw, cl.SYSFLAG_POSITION)[0] == msg.sys_flag

    buf = before + raw + after
    dec = cl.decode_record(buf, len(before), check_crc=True)
    assert isinstance(dec, cl.Message)
    assert dec.total_size == len(raw) and dec.body_crc == crc
    for f in ("topic", "body", "queue_id", "flag", "queue_offset", "physical_offset", "sys_flag",
              "born_timestamp", "born_host", "store_timestamp", "store_host", "reconsume_times",
              "prepared_transaction_offset", "properties", "version", "trailing_separator"):
        assert getattr(dec, f) == getattr(msg, f), f
    assert cl.encode_message(dec) == raw
    # Also readable from a memoryview and a bytearray.
    assert cl.decode_record(memoryview(bytearray(buf)), len(before)) == dec
    # Truncation anywhere inside the record is "end of data", never an exception.
    assert cl.decode_record(raw[:-1], 0) is None
    # A body bit flip is caught by the CRC check only.
    if msg.body:
        bad = bytearray(raw)
        bad[len(raw) - len(props_b) - 2 - len(topic_b) - (2 if msg.version == 2 else 1) - 1] ^= 1
        assert cl.decode_record(bytes(bad), 0, check_crc=True) is None
        assert cl.decode_record(bytes(bad), 0) is not None


def test_v1_rejects_long_topic_and_host_mismatch():
    with pytest.raises(ValueError):
        cl.encode_message(cl.Message(topic="t" * 128, version=1))
    assert len(cl.encode_message(cl.Message(topic="t" * 128, version=2))) == 92 + 128
    with pytest.raises(ValueError):
        cl.encode_message(cl.Message(topic="t", sys_flag=cl.BORNHOST_V6_FLAG))  # 4-byte born host
    with pytest.raises(ValueError):
        cl.encode_message(cl.Message(topic="t", properties={"k": "v" * 40000}))


def test_record_packer_matches_encode_message():
    msg = cl.Message(topic="TopicTest", body=b"x" * 100, queue_id=3, queue_offset=9, physical_offset=4096,
                     store_timestamp=1700000000123, born_timestamp=1700000000100,
                     properties={"KEYS": "k-1", "TAGS": "TagA"})
    raw = cl.encode_message(msg)
    packer = cl.RecordPacker(b"TopicTest", 0, 1, msg.born_host, msg.store_host)
    props = cl.properties_to_string(msg.properties).encode()
    buf = bytearray(len(raw) + 10)
    n = packer.pack_into(buf, 5, msg.body, props, 3, 9, 4096, 1700000000123, 1700000000100)
    assert n == len(raw) == packer.size(100, len(props))
    assert bytes(buf[5:5 + n]) == raw


def test_lone_surrogates_encode_like_java():
    # String.getBytes(UTF_8) turns an unpaired surrogate into '?'.
    raw = cl.encode_message(cl.Message(topic="T\ud800", properties={"k": "v\udfff"}))
    dec = cl.decode_record(raw, 0)
    assert dec.topic == "T?" and dec.properties == {"k": "v?"}


def test_blank():
    raw = cl.encode_blank(1000)
    assert raw == struct.pack(">ii", 1000, cl.BLANK_MAGIC) and len(raw) == cl.BLANK_SIZE
    assert cl.decode_record(raw + bytes(992), 0) == cl.Blank(1000)
    assert cl.BLANK_MAGIC == -875286124 and cl.MAGIC_V1 == -626843481 and cl.MAGIC_V2 == -626843477
    with pytest.raises(ValueError):
        cl.encode_blank(7)
    assert cl.decode_record(struct.pack(">ii", 4, cl.BLANK_MAGIC), 0) is None  # smaller than itself
    assert cl.decode_record(bytes(64), 0) is None  # zeros = end of data


def test_message_id():
    assert cl.message_id((bytes([10, 0, 0, 1]), 10911), 1234) == "0A00000100002A9F00000000000004D2"
    assert len(cl.message_id((bytes(16), 1), 0)) == 56


def build_segment(msgs: list[cl.Message], file_size: int, start: int = 0, seal: bool = True) -> tuple[bytearray, int]:
    """Lay records out like the broker (BLANK when len + 8 > remaining); return (buffer, blank pos or -1)."""
    buf = bytearray(file_size)
    pos = 0
    for m in msgs:
        m.physical_offset = start + pos
        raw = cl.encode_message(m)
        if len(raw) + cl.BLANK_SIZE > file_size - pos:
            break
        buf[pos:pos + len(raw)] = raw
        pos += len(raw)
    if not seal:
        return buf, -1
    buf[pos:pos + 8] = cl.encode_blank(file_size - pos)
    return buf, pos


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages(), max_size=8), st.integers(200, 6000), st.sampled_from([0, 1 << 30]))
def test_sealed_commitlog_end(msgs, file_size, start):
    buf, blank = build_segment(msgs, file_size, start)
    assert cl.sealed_commitlog_end(buf, file_size) == blank
    assert cl.sealed_commitlog_end(memoryview(buf), file_size, check_crc=True, file_start=start) == blank
    assert cl.sealed_commitlog_end(bytes(buf), file_size, file_start=start + 1) in (None, 0)
    walked = list(cl.iter_records(buf, 0, check_crc=True))
    assert walked[-1] == (blank, cl.Blank(file_size - blank))
    assert [p for p, _ in walked[:-1]] == [m.physical_offset - start for m in msgs[:len(walked) - 1]]
    # Not sealed: no BLANK, a BLANK with a wrong length, or a damaged record in front of it.
    open_buf, _ = build_segment(msgs, file_size, start, seal=False)
    assert cl.sealed_commitlog_end(open_buf, file_size) is None
    wrong = bytearray(buf)
    wrong[blank:blank + 4] = struct.pack(">i", file_size - blank - 1)
    assert cl.sealed_commitlog_end(wrong, file_size) is None
    if blank > 0:
        damaged = bytearray(buf)
        damaged[4:8] = b"\0\0\0\0"
        assert cl.sealed_commitlog_end(damaged, file_size) is None
    # The buffer must hold the whole file.
    assert cl.sealed_commitlog_end(buf[:-1], file_size) is None


@settings(max_examples=300)
@given(st.binary(max_size=400), st.integers(-10, 500), st.integers(-10, 500), st.booleans())
def test_garbage_never_raises(data, pos, file_size, check_crc):
    r = cl.decode_record(data, pos, check_crc=check_crc)
    assert r is None or isinstance(r, (cl.Message, cl.Blank))
    for _ in cl.iter_records(data, max(pos, 0), check_crc=check_crc):
        pass
    assert cl.sealed_commitlog_end(data, file_size, check_crc=check_crc) in (None, *range(0, max(file_size, 0) + 1))
    assert cq.is_full_and_valid(data, file_size) in (True, False)
    assert 0 <= cq.count_valid_units(data) <= len(data) // 20
    if len(data) >= ix.HEADER_SIZE:
        ix.lookup(data, 12345, 0, LONG_MAX, 64, 3, 50)
        list(ix.iter_chain(data, 7, 3, 50))


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages(version=1), min_size=1, max_size=5), st.data())
def test_mutated_segment_never_raises(msgs, data):
    buf, blank = build_segment(msgs, 4096)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    r = cl.sealed_commitlog_end(buf, 4096, check_crc=True)
    assert r is None or 0 <= r <= 4096 - 8
    for _ in cl.iter_records(buf, 0):
        pass


def reference_sealed_end(buf, file_size: int, check_crc: bool = False, file_start: int | None = None):
    """The record-by-record seal walk that the vectorized one replaced, kept as its oracle."""
    mv = memoryview(buf).cast("B")
    msg_end, pos = file_size - cl.BLANK_SIZE, 0
    try:
        while pos <= msg_end:
            total, magic = struct.unpack_from(">ii", mv, pos)
            if magic == cl.BLANK_MAGIC:
                return pos if total == file_size - pos else None
            if magic not in (cl.MAGIC_V1, cl.MAGIC_V2):
                return None
            lay = cl._message_layout(mv, pos, total, 1 if magic == cl.MAGIC_V1 else 2, msg_end)
            if lay is None or (check_crc and not cl._crc_ok(mv, pos, lay[3], lay[4])):
                return None
            if file_start is not None and struct.unpack_from(">q", mv, pos + cl.PHYSICAL_OFFSET_POSITION)[0] \
                    != file_start + pos:
                return None
            pos += total
    except struct.error:
        return None
    return None


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages(), min_size=1, max_size=6), st.data())
def test_vectorized_seal_walk_agrees_with_the_record_by_record_walk(msgs, data):
    """Bytes changed where the lengths live (each record's head, SYSFLAG, BODYLENGTH, its last bytes: topic and
    properties lengths) or anywhere: the same verdict as the record-by-record walk, for every option."""
    start = 1 << 30
    buf, blank = build_segment(msgs, 4096, start)
    lengths = []  # where each record keeps a length: TOTALSIZE, magic, SYSFLAG, BODYLENGTH, topic, properties
    for p, r in cl.iter_records(buf, 0):
        lay = cl._message_layout(buf, p, len(cl.encode_message(r)), r.version, len(buf)) \
            if isinstance(r, cl.Message) else None
        lengths += [p + k for k in range(8)]
        if lay is not None:
            lengths += [p + cl.SYSFLAG_POSITION + k for k in range(4)] + [p + lay[3] - 4 + k for k in range(4)]
            lengths += [p + lay[5] - 2, p + lay[5] - 1, p + lay[7] - 2, p + lay[7] - 1]
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.sampled_from(lengths)) if data.draw(st.booleans()) else data.draw(st.integers(0, 4095))
        buf[i] = (buf[i] + data.draw(st.sampled_from([-2, -1, 1, 2, 0x40, 0x80]))) & 0xFF  # one length a bit off
    batch, cl._CHECK_BATCH = cl._CHECK_BATCH, data.draw(st.sampled_from([1, 2, 3, cl._CHECK_BATCH]))
    try:  # records are checked in runs of _CHECK_BATCH: a run may end anywhere
        for check_crc in (False, True):
            for file_start in (None, start):
                assert cl.sealed_commitlog_end(buf, 4096, check_crc=check_crc, file_start=file_start) \
                    == reference_sealed_end(buf, 4096, check_crc, file_start)
    finally:
        cl._CHECK_BATCH = batch


def test_garbage_non_buffers():
    assert cl.decode_record(None, 0) is None
    assert cl.sealed_commitlog_end(None, 100) is None
    assert cl.sealed_commitlog_end(b"x" * 100, "100") is None
    assert cq.is_full_and_valid(None, 20) is False


# ------------------------------------------------------------------------------------------ consume queue

@given(int64, int32, int64)
def test_cq_unit_round_trip(off, size, tags):
    raw = cq.encode_unit(off, size, tags)
    assert len(raw) == cq.UNIT_SIZE == 20
    assert cq.decode_unit(b"xx" + raw, 2) == cq.CqUnit(off, size, tags)
    assert cq.is_valid(cq.CqUnit(off, size, tags)) == (off >= 0 and size > 0)


def test_cq_constants_and_names():
    assert cq.PRE_BLANK == cq.CqUnit(0, 0x7FFFFFFF, 0) and cq.is_valid(cq.PRE_BLANK) and cq.is_pre_blank(cq.PRE_BLANK)
    assert cq.PRE_BLANK_BYTES == struct.pack(">qiq", 0, 0x7FFFFFFF, 0)
    assert cq.round_cq_file_size(6000000) == 6000000
    assert cq.round_cq_file_size(6000001) == 6000020
    assert cq.round_cq_file_size(1) == 20
    assert cq.file_name_for(0, 6000000) == "00000000000000000000"
    assert cq.file_name_for(300000, 6000000) == "00000000000006000000"
    assert cq.file_name_for(600001, 6000000) == "00000000000012000000"
    assert cq.position_for(300001, 6000000) == 20
    with pytest.raises(ValueError):
        cq.decode_unit(bytes(19), 0)


@given(st.integers(0, 10**9), st.integers(1, 10**6).map(lambda n: n * 20))
def test_cq_file_arithmetic(index, file_size):
    start = int(cq.file_name_for(index, file_size))
    assert start % file_size == 0
    assert start + cq.position_for(index, file_size) == index * 20
    assert 0 <= cq.position_for(index, file_size) < file_size


@given(st.integers(1, 50), st.integers(0, 50), st.data())
def test_cq_count_and_seal(units_per_file, n_valid, data):
    n_valid = min(n_valid, units_per_file)
    file_size = units_per_file * 20
    buf = bytearray(file_size)
    for i in range(n_valid):
        buf[i * 20:(i + 1) * 20] = cq.encode_unit(data.draw(st.integers(0, LONG_MAX)), data.draw(st.integers(1, 1 << 20)), 0)
    assert cq.count_valid_units(buf) == n_valid
    assert cq.is_full_and_valid(buf, file_size) == (n_valid == units_per_file)
    assert cq.is_full_and_valid(buf + b"\0", file_size) is False
    assert cq.is_full_and_valid(buf, file_size + 20) is False


# ------------------------------------------------------------------------------------------ index

COLLIDING = ["Aa", "BB", "AaAa", "BBBB", "AaBB", "BBAa", "x", "y", "key-1", "key-2", "polygenelubricants"]


@st.composite
def index_ops(draw):
    slots = draw(st.integers(1, 7))
    items = draw(st.integers(2, 40))
    keys = draw(st.lists(st.sampled_from(COLLIDING), min_size=1, max_size=60))
    t = draw(st.integers(1, 1 << 41))
    ops = []
    phy = draw(st.integers(0, 1 << 40))
    for k in keys:
        t += draw(st.integers(0, 5000))
        phy += draw(st.integers(0, 3000))
        ops.append((k, phy, t))
    prev = draw(st.one_of(st.just((0, 0)), st.tuples(st.integers(1, 1 << 40), st.integers(1, 1 << 41))))
    return slots, items, ops, prev


def model_times(ops_done, prev_ts):
    """Time of each item as a reader computes it (``begin + timeDiff*1000``), derived from the broker's rules:
    whole seconds, clamped at 0, and the first item measured from the pre-seeded begin before begin moves."""
    begin = prev_ts
    diffs = []
    for i, (_, _, t) in enumerate(ops_done):
        d = t - begin
        diffs.append(0 if begin <= 0 or d <= 0 else min(d // 1000, (1 << 31) - 1))
        if i == 0:
            begin = t
    return [begin + d * 1000 for d in diffs]


def model_lookup(done, times, slots, key_hash, b, e, max_num):
    """Brute force over the list of puts: walk the key's bucket newest first, stop at the first item older than b."""
    out = []
    for (k, phy, _), t in reversed(list(zip(done, times))):
        if index_key_hash(f"T#{k}") % slots != key_hash % slots:
            continue
        if index_key_hash(f"T#{k}") == key_hash and b <= t <= e:
            out.append(phy)
            if len(out) >= max_num:
                break
        if t < b:
            break
    return out


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(index_ops(), st.integers(1, 70))
def test_index_writer_and_lookup_vs_model(case, max_num):
    slots, items, ops, (prev_phy, prev_ts) = case
    buf = bytearray(ix.index_file_size(slots, items))
    w = ix.IndexWriter(buf, slots, items, prev_phy, prev_ts)
    done = []
    for k, phy, t in ops:
        ok = w.put_key(f"T#{k}", phy, t)
        assert ok == (len(done) < items - 1)
        if ok:
            done.append((k, phy, t))
    assert w.is_full == (len(done) == items - 1)

    # Header as the broker leaves it in the buffer.
    h = ix.decode_header(buf, raw=True)
    assert h == w.header or (not done and h.index_count == 0)
    if done:
        assert h.index_count == len(done) + 1
        assert h.begin_phy_offset == done[0][1] and h.end_phy_offset == done[-1][1]
        assert h.begin_timestamp == done[0][2] and h.end_timestamp == done[-1][2]
        assert h.hash_slot_count == len({index_key_hash(f"T#{k}") % slots for k, _, _ in done})
    else:
        assert (h.begin_phy_offset, h.begin_timestamp) == (prev_phy, prev_ts)
    assert ix.decode_item(buf, 0, slots) == ix.IndexItem(0, 0, 0, 0)  # item 0 unused

    times = model_times(done, prev_ts)
    for k in set(COLLIDING):
        kh = index_key_hash(f"T#{k}")
        # Every item with an equal full hash, newest first (different keys included: the caller resolves them).
        expect = [phy for k2, phy, _ in reversed(done) if index_key_hash(f"T#{k2}") == kh]
        assert model_lookup(done, times, slots, kh, 0, LONG_MAX, 64) == expect[:64]
        assert ix.lookup(buf, f"T#{k}", 0, LONG_MAX, max_num, slots, items) == expect[:max_num]
        assert ix.lookup(buf, kh, 0, LONG_MAX, max_num, slots, items) == expect[:max_num]
        # Time-windowed lookups.
        for b, e in ((times[len(times) // 2], times[len(times) // 2] + 3000), (times[-1], LONG_MAX)) if done else ():
            assert ix.lookup(buf, kh, b, e, max_num, slots, items) == model_lookup(done, times, slots, kh, b, e, max_num)
        # The chain of the slot visits exactly the items in that bucket, newest first.
        chain = [no for no, _ in ix.iter_chain(buf, kh, slots, items)]
        bucket = [i + 1 for i, (k2, _, _) in enumerate(done) if index_key_hash(f"T#{k2}") % slots == kh % slots]
        assert chain == bucket[::-1]


@settings(max_examples=60)
@given(index_ops(), st.integers(0, 60))
def test_index_writer_load_resumes_identically(case, cut):
    slots, items, ops, (prev_phy, prev_ts) = case
    a = bytearray(ix.index_file_size(slots, items))
    b = bytearray(len(a))
    wa = ix.IndexWriter(a, slots, items, prev_phy, prev_ts)
    wb = ix.IndexWriter(b, slots, items, prev_phy, prev_ts)
    for i, (k, phy, t) in enumerate(ops):
        if i == cut:
            wb = ix.IndexWriter(b, slots, items, load=True)
        assert wa.put_key(f"T#{k}", phy, t) == wb.put_key(f"T#{k}", phy, t)
    assert a == b


def test_index_sizes_and_keys():
    assert ix.index_file_size() == 420000040
    assert ix.index_file_size(1000, 4000) == 40 + 4000 + 80000
    assert ix.index_keys_for_message("T", {"UNIQ_KEY": "U1", "KEYS": "a  b c "}) == ["T#U1", "T#a", "T#b", "T#c"]
    assert ix.index_keys_for_message("T", {"KEYS": ""}) == []
    assert ix.index_keys_for_message("T", {"UNIQ_KEY": "U"}, cl.TRANSACTION_ROLLBACK_TYPE) == []
    assert ix.index_keys_for_message("T", {"UNIQ_KEY": "U"}, cl.TRANSACTION_PREPARED_TYPE) == ["T#U"]


def test_index_writer_pre_seed_and_flush_header():
    buf = bytearray(ix.index_file_size(3, 5))
    w = ix.IndexWriter(buf, 3, 5, prev_end_phy=777, prev_end_ts=1_700_000_000_000)
    h = ix.decode_header(buf, raw=True)
    assert (h.begin_phy_offset, h.end_phy_offset, h.begin_timestamp, h.end_timestamp) == (777, 777, 1_700_000_000_000,
                                                                                          1_700_000_000_000)
    assert h.index_count == 0 and ix.decode_header(buf).index_count == 1  # fresh file: 0 on disk, read as 1
    # First item: time diff relative to the pre-seeded begin, then begin moves to the item's time.
    assert w.put_key("T#a", 1000, 1_700_000_005_500)
    assert ix.decode_item(buf, 1, 3).time_diff == 5
    assert ix.decode_header(buf).begin_timestamp == 1_700_000_005_500
    buf[0:40] = bytes(40)
    w.flush_header()
    assert ix.decode_header(buf) == w.header


def test_lookup_terminates_on_cycles():
    slots, items = 1, 10
    buf = bytearray(ix.index_file_size(slots, items))
    buf[0:40] = ix.IndexHeader(1, 1, 0, 0, 1, 5).encode()
    struct.pack_into(">i", buf, 40, 3)
    base = 40 + 4
    struct.pack_into(">iqii", buf, base + 3 * 20, 0, 33, 0, 2)
    struct.pack_into(">iqii", buf, base + 2 * 20, 0, 22, 0, 3)  # 3 -> 2 -> 3 -> ...
    assert ix.lookup(buf, 0, 0, LONG_MAX, 64, slots, items) == [33, 22] * 5
    assert len(list(ix.iter_chain(buf, 0, slots, items))) == items


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(COLLIDING), min_size=1, max_size=80), st.integers(2, 9))
def test_query_offsets_across_files(keys, items):
    """Roll to a new file when full, like IndexService; a query over all files sees every item newest first."""
    slots = 3
    files: list[bytearray] = []
    w = None
    done = []
    for i, k in enumerate(keys):
        if w is None or w.is_full:
            prev = w.header if w else None
            files.append(bytearray(ix.index_file_size(slots, items)))
            w = ix.IndexWriter(files[-1], slots, items, prev.end_phy_offset if prev else 0,
                               prev.end_timestamp if prev else 0)
        assert w.put_key(f"T#{k}", 100 + i, 1_700_000_000_000 + i * 10)
        done.append((k, 100 + i))
    for k in set(keys):
        kh = index_key_hash(f"T#{k}")
        expect = [p for k2, p in reversed(done) if index_key_hash(f"T#{k2}") == kh][:64]
        assert ix.query_offsets(files, f"T#{k}", 0, LONG_MAX, 64, slots, items) == expect
        headers = [ix.decode_header(f) for f in files]
        assert ix.query_offsets(files, kh, 0, LONG_MAX, 64, slots, items, headers) == expect


def test_is_time_matched():
    h = ix.IndexHeader(begin_timestamp=100, end_timestamp=200)
    assert ix.is_time_matched(h, 50, 250) and ix.is_time_matched(h, 150, 300) and ix.is_time_matched(h, 0, 100)
    assert not ix.is_time_matched(h, 201, 300) and not ix.is_time_matched(h, 0, 99)


# ------------------------------------------------------------------------------------------ checkpoint

@given(int64, int64, int64, int64, int64)
def test_checkpoint_round_trip(p, lg, i, m, c):
    cp = ckpt.Checkpoint(p, lg, i, m, c)
    raw = ckpt.encode_checkpoint(cp)
    assert len(raw) == ckpt.CHECKPOINT_SIZE == 4096 and raw[40:] == bytes(4056)
    assert ckpt.decode_checkpoint(raw) == cp
    raw3 = ckpt.encode_checkpoint(cp, fields=3)
    assert raw3[24:] == bytes(4096 - 24)
    assert ckpt.decode_checkpoint(raw3) == ckpt.Checkpoint(p, lg, i)
    assert cp.min_timestamp() == max(min(p, lg) - 3000, 0)
    assert cp.min_timestamp_index() == min(cp.min_timestamp(), i)


def test_checkpoint_errors():
    with pytest.raises(ValueError):
        ckpt.decode_checkpoint(bytes(39))
    with pytest.raises(ValueError):
        ckpt.encode_checkpoint(ckpt.Checkpoint(), fields=4)


# ------------------------------------------------------------------------------------------ names

@given(st.integers(0, LONG_MAX))
def test_offset_names(offset):
    n = names.offset_to_name(offset)
    assert len(n) == 20 and n.isdigit() and names.name_to_offset(n) == offset and names.is_offset_name(n)


def test_names_examples_and_errors():
    assert names.offset_to_name(0) == "00000000000000000000"
    assert names.offset_to_name(1073741824) == "00000000001073741824"
    for bad in ("", "12a", ".fuse_hidden0001", "-1", "+5", "99999999999999999999", "１２"):
        assert not names.is_offset_name(bad)
        with pytest.raises(ValueError):
            names.name_to_offset(bad)
    with pytest.raises(ValueError):
        names.offset_to_name(-1)
    utc = dt.timezone.utc
    assert names.index_file_name(0, utc) == "19700101000000000"
    assert names.index_file_name(1_700_000_000_123, utc) == "20231114221320123"
    assert names.index_file_name(1_700_000_000_123, dt.timezone(dt.timedelta(hours=8))) == "20231115061320123"


@given(st.integers(0, 4_000_000_000_000), st.integers(-12, 14))
def test_index_name_round_trip(ms, hours):
    tz = dt.timezone(dt.timedelta(hours=hours))
    n = names.index_file_name(ms, tz)
    assert len(n) == 17 and names.is_index_name(n)
    assert names.index_name_to_ms(n, tz) == ms
