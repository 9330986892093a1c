"""Pipeline codecs and executor tasks: lz4c objects, IndexFile sidecars (.cidx), and tierfs.spark.tasks against a
posix object store."""

from __future__ import annotations

import dataclasses
import random
import struct

import crc32c
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tierfs.objectstore import open_store
from tierfs.spark import tasks
from tierfs.store import cidx
from tierfs.store import indexfile as ix
from tierfs.store.javahash import index_key_hash
from tierfs.tier import layout, lz4c

LONG_MAX = (1 << 63) - 1
WORDS = [b"broker", b"topic", b"queue", b"offset", b"msgId", b"{\"k\":", b"1700000000123", b"\n", b" ", b"INFO"]


def make_content(parts: list[tuple[str, int, int]]) -> bytes:
    """Concatenate pieces of zeros, text-like words and random bytes (seeded, so examples shrink)."""
    out = bytearray()
    for kind, n, seed in parts:
        r = random.Random(seed)
        if kind == "zeros":
            out += bytes(n)
        elif kind == "text":
            piece = bytearray()
            while len(piece) < n:
                piece += r.choice(WORDS)
            out += piece[:n]
        else:
            out += r.randbytes(n)
    return bytes(out)


content_parts = st.lists(st.tuples(st.sampled_from(["zeros", "text", "random"]), st.integers(0, 3000),
                                   st.integers(0, 1 << 16)), max_size=5)
block_sizes = st.one_of(st.integers(1, 64), st.integers(65, 4096), st.sampled_from([256, 1024, 4096]))


@st.composite
def lz4c_cases(draw):
    bb = draw(block_sizes)
    content = make_content(draw(content_parts))
    if draw(st.booleans()):  # no short tail block
        content = content[:len(content) - len(content) % bb]
    return content, bb


# ------------------------------------------------------------------------------------------------ lz4c


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lz4c_cases(), st.lists(st.integers(0, 5000), max_size=8))
def test_lz4c_roundtrip_streaming(case, cuts):
    content, bb = case
    w = lz4c.Lz4cWriter(bb)
    pieces, pos = [], 0
    for c in sorted(cuts) + [len(content)]:  # feed in arbitrary pieces, including empty ones
        c = min(c, len(content))
        pieces.append(w.add(content[pos:max(pos, c)]))
        pos = max(pos, c)
    pieces.append(w.finish())
    obj = b"".join(pieces)
    assert obj == lz4c.encode(content, bb)
    assert lz4c.decode(obj) == content
    assert (w.size, w.content_crc32c, w.compressed_size) == (len(content), crc32c.crc32c(content), len(obj))

    t = lz4c.parse_trailer(obj[-lz4c.TRAILER_SIZE:], len(obj))
    assert lz4c.parse_trailer(obj, len(obj)) == t  # any tail of the object works
    assert (t.block_bytes, t.size, t.nblocks) == (bb, len(content), -(-len(content) // bb))
    f = lz4c.parse_footer(t, obj[t.footer_offset:t.footer_offset + t.footer_length])
    for i in range(t.nblocks):
        block = content[i * bb:(i + 1) * bb]
        assert f.ulen[i] == len(block) and f.crcs[i] == crc32c.crc32c(block)
        if f.flags[i] & lz4c.FLAG_RAW:
            assert obj[f.coff[i]:f.coff[i] + f.clen[i]] == block
        else:
            assert f.clen[i] < len(block)
    reads = []
    assert lz4c.read_footer(lambda o, n: reads.append((o, n)) or obj[o:o + n], len(obj)) == f
    assert len(reads) == (1 if t.footer_length + lz4c.TRAILER_SIZE <= 64 << 10 else 2)


def test_lz4c_block_kinds_and_sizes():
    bb = 1 << 16
    text = make_content([("text", 3 * bb, 1)])
    noise = make_content([("random", 2 * bb + 5, 2)])
    obj = lz4c.encode(text + noise, bb)
    f = lz4c.read_footer(lambda o, n: obj[o:o + n], len(obj))
    assert f.flags == [0, 0, 0, 1, 1, 1]  # text compresses, random bytes are stored raw
    assert f.ulen == [bb] * 5 + [5]
    assert lz4c.decode(obj) == text + noise
    empty = lz4c.encode(b"", bb)
    assert len(empty) == lz4c.TRAILER_SIZE and lz4c.decode(empty) == b""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lz4c_cases(), st.integers(0, 20000), st.integers(0, 20000))
def test_lz4c_random_ranges(case, offset, length):
    content, bb = case
    obj = lz4c.encode(content, bb)
    f = lz4c.read_footer(lambda o, n: obj[o:o + n], len(obj))
    first, n = lz4c.block_range(f, offset, length)
    off, ln = lz4c.block_span(f, first, n)
    data = lz4c.decode_blocks(f, first, n, obj[off:off + ln])
    assert data == content[first * bb:(first + n) * bb]
    rel = offset - first * bb
    assert data[rel:rel + length] == content[offset:offset + length]
    if n:  # the span is exactly the covering blocks, nothing more
        assert first * bb <= offset and (first + n) * bb >= min(offset + length, len(content))
        assert first * bb + len(data) <= len(content) and len(data) > (n - 1) * bb


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lz4c_cases(), st.data())
def test_lz4c_corruption_never_gives_wrong_bytes(case, data):
    content, bb = case
    obj = bytearray(lz4c.encode(content, bb))
    pos = data.draw(st.integers(0, len(obj) - 1))
    obj[pos] ^= data.draw(st.integers(1, 255))
    try:
        got = lz4c.decode(obj)
    except lz4c.Lz4cError:
        return
    # Undetected only when the content is still right: an lz4 match offset that copies identical bytes, or the
    # trailer's block_bytes when it does not change how the content splits into blocks (0 or 1 block).
    assert got == content
    t_end = len(obj) - lz4c.TRAILER_SIZE
    if pos >= t_end:
        assert 8 <= pos - t_end < 12 and lz4c.parse_trailer(obj).nblocks <= 1


def test_lz4c_corruption_messages():
    bb = 1024
    content = make_content([("text", 3000, 1), ("random", 2000, 2)])
    obj = lz4c.encode(content, bb)
    t = lz4c.parse_trailer(obj)
    f = lz4c.parse_footer(t, obj[t.footer_offset:-lz4c.TRAILER_SIZE])
    assert f.flags[0] == 0 and f.flags[4] == lz4c.FLAG_RAW

    def bad(b: bytearray, match: str) -> None:
        with pytest.raises(lz4c.Lz4cError, match=match):
            lz4c.decode(b)

    b = bytearray(obj); b[-lz4c.TRAILER_SIZE] ^= 1
    bad(b, "bad magic")
    b = bytearray(obj); b[t.footer_offset + 3] ^= 1
    bad(b, "footer: crc32c mismatch")
    b = bytearray(obj); b[f.coff[4] + 7] ^= 1
    bad(b, "block 4 crc32c mismatch")
    b = bytearray(obj); b[f.coff[0]:f.coff[0] + f.clen[0]] = b"\xff" * f.clen[0]
    bad(b, "block 0 (does not decompress|crc32c mismatch)")
    bad(bytearray(obj[:-1]), "bad magic")
    bad(bytearray(obj[:10]), "need 44 bytes")
    bad(bytearray(obj[1:]), "bytes, but the object is")
    b = bytearray(obj); struct.pack_into("<I", b, len(b) - 4, t.content_crc32c ^ 1)
    bad(b, "content crc32c mismatch")
    with pytest.raises(lz4c.Lz4cError, match="got 5 bytes"):
        lz4c.decode_blocks(f, 0, 1, b"12345")
    with pytest.raises(ValueError, match="outside"):
        lz4c.block_span(f, 3, 3)
    with pytest.raises(ValueError, match="block_bytes"):
        lz4c.Lz4cWriter(0)
    w = lz4c.Lz4cWriter(16)
    w.finish()
    with pytest.raises(ValueError, match="after finish"):
        w.add(b"x")


def rebuild(content: bytes, bb: int, edit) -> bytes:
    """An lz4c object whose footer entries were changed by *edit* and whose crcs were then made to match, so
    only the footer's structural checks can catch it."""
    obj = lz4c.encode(content, bb)
    t = lz4c.parse_trailer(obj)
    entries = [list(e) for e in struct.iter_unpack("<QIIII", obj[t.footer_offset:-lz4c.TRAILER_SIZE])]
    edit(entries)
    footer = b"".join(struct.pack("<QIIII", *e) for e in entries)
    trailer = struct.pack("<8sIIQQIII", lz4c.MAGIC, bb, t.nblocks, t.size, t.footer_offset, len(footer),
                          crc32c.crc32c(footer), t.content_crc32c)
    return obj[:t.footer_offset] + footer + trailer


def test_lz4c_footer_structure_checks():
    content = make_content([("text", 2500, 1), ("random", 1500, 2)])  # blocks 0-1 compress, 2-3 are raw
    cases = [
        (lambda e: e[1].__setitem__(2, 999), "block 1 has uncompressed length 999, expected 1024"),
        (lambda e: e[1].__setitem__(0, e[1][0] + 1), "block 1 starts at"),
        (lambda e: e[0].__setitem__(3, 6), "block 0 has unknown flags 0x6"),
        (lambda e: e[3].__setitem__(3, 0), None),  # a raw block read as lz4: fails to decompress or its crc
        (lambda e: e[0].__setitem__(3, 1), "raw block 0 is"),
        (lambda e: e[2].__setitem__(1, 1023), "block 3 starts at"),
    ]
    for edit, match in cases:
        with pytest.raises(lz4c.Lz4cError, match=match or "block 3"):
            lz4c.decode(rebuild(content, 1024, edit))
    obj = rebuild(content, 1024, lambda e: None)
    assert lz4c.decode(obj) == content
    # The blocks must end where the footer starts.
    t = lz4c.parse_trailer(obj)
    with pytest.raises(lz4c.Lz4cError, match="blocks end at"):
        lz4c.parse_footer(dataclasses.replace(t, footer_offset=t.footer_offset + 1),
                          obj[t.footer_offset:-lz4c.TRAILER_SIZE])
    with pytest.raises(lz4c.Lz4cError, match="compressed length 0"):
        entries = [[0, 0, 5, 0, 0]]
        footer = struct.pack("<QIIII", *entries[0])
        t = lz4c.Trailer(1024, 1, 5, 0, 24, crc32c.crc32c(footer), 0)
        lz4c.parse_footer(t, footer)


def test_lz4c_read_footer_large_footer_and_tiny_objects():
    content = make_content([("text", 3000, 4)])
    obj = lz4c.encode(content, 1)  # 3000 entries: a 72000-byte footer, more than the first tail read
    reads = []
    f = lz4c.read_footer(lambda o, n: reads.append((o, n)) or obj[o:o + n], len(obj))
    assert len(reads) == 2 and f.nblocks == 3000
    assert lz4c.decode_blocks(f, 0, 3000, obj[:f.trailer.footer_offset]) == content
    with pytest.raises(lz4c.Lz4cError, match="smaller than its 44-byte trailer"):
        lz4c.read_footer(lambda o, n: obj[o:o + n], 10)
    with pytest.raises(lz4c.Lz4cError, match="returned"):
        lz4c.read_footer(lambda o, n: b"", len(obj))


def test_lz4c_read_object_footer_from_a_store(tmp_path):
    """The one footer reader of the daemon's verify step and the executor tasks: HEAD + one tail GET; a missing
    object is ObjectMissing (not a corrupt object), a bad one Lz4cError."""
    store = open_store(f"file://{tmp_path}/objects")
    content = make_content([("json", 40_000, 1)])
    store.put("a.lz4c", lz4c.encode(content, 4096))
    calls = []

    class Counting:
        def head(self, key):
            calls.append("head")
            return store.head(key)

        def get_range(self, key, start, length):
            calls.append("get")
            return store.get_range(key, start, length)

    f = lz4c.read_object_footer(Counting(), "a.lz4c")
    assert calls == ["head", "get"] and f.trailer.size == len(content)
    assert f == lz4c.read_footer(lambda o, n: store.get_range("a.lz4c", o, n), store.head("a.lz4c").size)
    with pytest.raises(lz4c.ObjectMissing, match="'b.lz4c' does not exist"):
        lz4c.read_object_footer(store, "b.lz4c")
    store.put("c.lz4c", b"not an lz4c object at all, but long enough for a trailer....")
    with pytest.raises(lz4c.Lz4cError, match="bad magic"):
        lz4c.read_object_footer(store, "c.lz4c")


# ------------------------------------------------------------------------------------------------ cidx

KEYS = ["Aa", "BB", "AaAa", "BBBB", "AaBB", "BBAa", "x", "y", "key-1", "key-2", "polygenelubricants", "z9"]


@st.composite
def index_files(draw):
    """An IndexFile written like the broker: few slots (frequent collisions), maybe pre-seeded, maybe full."""
    slots = draw(st.integers(1, 7))
    items = draw(st.integers(2, 50))
    buf = bytearray(ix.index_file_size(slots, items))
    seed_phy, seed_ts = draw(st.one_of(st.just((0, 0)), st.tuples(st.integers(1, 1 << 40),
                                                                   st.integers(1, 1 << 41))))
    w = ix.IndexWriter(buf, slots, items, seed_phy, seed_ts)
    t = draw(st.integers(1, 1 << 41))
    phy = draw(st.integers(0, 1 << 40))
    for k in draw(st.lists(st.sampled_from(KEYS), max_size=60)):
        t += draw(st.integers(-3000, 5000))  # store times may step back: time_diff clamps at 0
        phy += draw(st.integers(0, 3000))
        w.put_key(f"T#{k}", phy, t)
    return slots, items, buf


def probe_hashes(buf: bytes, slots: int, items: int) -> set[int]:
    """Key hashes worth querying: every key's, every hash stored in an item, and one landing in each slot."""
    base = ix.HEADER_SIZE + slots * ix.SLOT_SIZE
    stored = {struct.unpack_from(">i", buf, base + i * ix.ITEM_SIZE)[0] for i in range(items)}
    return {index_key_hash(f"T#{k}") for k in KEYS} | stored | set(range(slots))


def time_windows(buf: bytes, r: random.Random) -> list[tuple[int, int]]:
    h = ix.decode_header(buf, raw=True)
    b, e = h.begin_timestamp, h.end_timestamp
    out = [(0, LONG_MAX), (b, e), (e, LONG_MAX), (LONG_MAX, LONG_MAX)]
    for _ in range(4):
        lo = r.randint(min(b, e) - 5000, max(b, e) + 5000)
        out.append((lo, lo + r.randint(0, 10000)))
    return out


def check_same_as_chain_walk(buf, slots: int, items: int, seed: int) -> None:
    side = cidx.build(buf, slots, items)
    h = cidx.parse_header(side, len(side))
    reads: list[tuple[int, int]] = []

    def read(off: int, n: int) -> bytes:
        reads.append((off, n))
        assert off + n <= len(side)
        return side[off:off + n]

    r = random.Random(seed)
    for kh in probe_hashes(buf, slots, items):
        for begin, end in time_windows(buf, r):
            for max_n in (1, 2, 3, 64, r.randint(0, 70)):
                want = ix.lookup(buf, kh, begin, end, max_n, slots, items)
                reads.clear()
                assert cidx.lookup(read, kh, begin, end, max_n, header=h) == want
                assert len(reads) <= 2
    for k in KEYS:  # string keys, header read through `read` too
        reads.clear()
        assert cidx.lookup(read, f"T#{k}", 0, LONG_MAX, 64) == ix.lookup(buf, f"T#{k}", 0, LONG_MAX, 64, slots, items)
        assert len(reads) <= 3


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index_files(), st.integers(0, 1 << 30))
def test_cidx_lookup_equals_chain_walk(case, seed):
    slots, items, buf = case
    side = cidx.build(buf, slots, items)
    h = cidx.parse_header(side, len(side))
    hdr = ix.decode_header(buf, raw=True)
    assert (h.begin_timestamp, h.end_timestamp, h.begin_phy_offset, h.end_phy_offset, h.hash_slot_count,
            h.index_count, h.slot_num) == (hdr.begin_timestamp, hdr.end_timestamp, hdr.begin_phy_offset,
                                           hdr.end_phy_offset, hdr.hash_slot_count, hdr.index_count, slots)
    assert h.item_count == max(hdr.index_count - 1, 0)  # a broker-written file: every item exactly once
    # Each run is its slot's chain, item by item.
    for s in range(slots):
        off, n = cidx.slot_entry_span(h, s)
        start, end = struct.unpack(">II", side[off:off + n])
        off, n = cidx.run_span(h, start, end - start)
        run = [side[off + j:off + j + 16] for j in range(0, n, 16)]
        chain = [struct.pack(">iqi", it.key_hash, it.phy_offset, it.time_diff)
                 for _, it in ix.iter_chain(buf, s, slots, items)]
        assert run == chain
    check_same_as_chain_walk(buf, slots, items, seed)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index_files(), st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(-2, 60)), min_size=1, max_size=6),
       st.integers(0, 1 << 30))
def test_cidx_damaged_files_same_as_chain_walk(case, damage, seed):
    """Overwrite slot values, prev links, time diffs and the index count with arbitrary small numbers (cycles,
    forward links, shared tails, out-of-range values): the sidecar still answers exactly like the chain walk."""
    slots, items, buf = case
    targets = [36] + [ix.HEADER_SIZE + s * 4 for s in range(slots)]
    targets += [ix.item_position(i, slots) + 16 for i in range(items)]  # prev links
    targets += [ix.item_position(i, slots) + 12 for i in range(items)]  # time diffs (negative ones end walks)
    for where, value in damage:
        struct.pack_into(">i", buf, targets[where % len(targets)], value)
    check_same_as_chain_walk(buf, slots, items, seed)


def test_cidx_cycle_is_walked_like_the_broker():
    slots, items = 1, 10
    buf = bytearray(ix.index_file_size(slots, items))
    buf[0:40] = ix.IndexHeader(1, 1, 0, 0, 1, 5).encode()
    struct.pack_into(">i", buf, 40, 3)
    base = 40 + 4
    struct.pack_into(">iqii", buf, base + 3 * 20, 0, 33, 0, 2)
    struct.pack_into(">iqii", buf, base + 2 * 20, 0, 22, 0, 3)  # 3 -> 2 -> 3 -> ...
    side = cidx.build(buf, slots, items)
    read = lambda o, n: side[o:o + n]  # noqa: E731
    assert cidx.lookup(read, 0, 0, LONG_MAX, 64) == ix.lookup(buf, 0, 0, LONG_MAX, 64, slots, items) == [33, 22] * 5


def test_cidx_refuses_bad_input():
    buf = bytearray(ix.index_file_size(4, 10))
    with pytest.raises(cidx.CidxError, match="must be 256 bytes"):
        cidx.build(buf[:-1], 4, 10)
    with pytest.raises(cidx.CidxError, match="must be"):
        cidx.build(buf, 5, 10)  # wrong geometry for these bytes
    with pytest.raises(ValueError, match="max_index_num"):
        cidx.build(buf, 4, 1)
    side = cidx.build(buf, 4, 10)
    assert cidx.lookup(lambda o, n: side[o:o + n], "T#a", 0, LONG_MAX, 64) == []
    with pytest.raises(cidx.CidxError, match="bad magic"):
        cidx.parse_header(b"X" + side[1:])
    with pytest.raises(cidx.CidxError, match="object is"):
        cidx.parse_header(side, len(side) + 16)
    with pytest.raises(cidx.CidxError, match="need 56 bytes"):
        cidx.parse_header(side[:20])
    # Shared tails: every slot heads the same long chain, so runs would repeat it far beyond the file's size.
    slots, items = 200, 1000
    buf = bytearray(ix.index_file_size(slots, items))
    w = ix.IndexWriter(buf, slots, items)
    for i in range(items - 1):
        w.put_key(0, i, 1000 + i)  # one chain of 999 items in slot 0
    for s in range(slots):
        struct.pack_into(">i", buf, ix.HEADER_SIZE + 4 * s, items - 1)
    with pytest.raises(cidx.CidxError, match="chains share items"):
        cidx.build(buf, slots, items)
    slots, items = 3, 40_001  # the same past the last flush: 3 x 40000 items, cap 80000
    buf = bytearray(ix.index_file_size(slots, items))
    w = ix.IndexWriter(buf, slots, items)
    for i in range(items - 1):
        w.put_key(0, i, 1000 + i)
    for s in range(slots):
        struct.pack_into(">i", buf, ix.HEADER_SIZE + 4 * s, items - 1)
    with pytest.raises(cidx.CidxError, match="by slot 2 the runs already hold 120000 items, more than 80000"):
        cidx.build(buf, slots, items)


def test_cidx_negative_time_diff_ends_the_walk():
    slots, items = 2, 12
    buf = bytearray(ix.index_file_size(slots, items))
    w = ix.IndexWriter(buf, slots, items)
    for i in range(items - 1):
        w.put_key(4, 100 + i, 1_700_000_000_000 + 1000 * i)  # all in slot 0
    struct.pack_into(">i", buf, ix.item_position(6, slots) + 12, -1)
    side = cidx.build(buf, slots, items)
    want = ix.lookup(buf, 4, 0, LONG_MAX, 64, slots, items)
    assert want == [110, 109, 108, 107, 106]  # items 11..7; item 6 stops the walk
    assert cidx.lookup(lambda o, n: side[o:o + n], 4, 0, LONG_MAX, 64) == want


# ------------------------------------------------------------------------------------------------ tasks


@pytest.fixture
def store(tmp_path):
    s = open_store(f"file://{tmp_path}/store", fsync=False)
    yield s
    s.close()


def upload_raw(store, store_id: str, path: str, content: bytes, chunk_bytes: int, block_bytes: int,
               generation: int = 3) -> dict:
    """Upload *content* as the daemon does (chunk objects) and return its catalog entry as a SEG dict."""
    keys = layout.chunk_keys(store_id, path, generation, "raw", len(content), chunk_bytes)
    for i, key in enumerate(keys):
        store.put(key, content[i * chunk_bytes:(i + 1) * chunk_bytes])
    mv = memoryview(content)
    return {"path": path, "kind": "commitlog", "generation": generation, "size": len(content), "format": "raw",
            "chunk_bytes": chunk_bytes, "block_bytes": block_bytes, "crc32c": crc32c.crc32c(content),
            "block_crcs": [crc32c.crc32c(mv[b:b + block_bytes]) for b in range(0, len(content), block_bytes)],
            "objects": keys}


@pytest.mark.parametrize("size", [0, 4096, 4 * 4096, 300_001])
def test_compact_and_read_segment(store, size):
    content = make_content([("text", size // 2, 1), ("random", size // 4, 2), ("zeros", size, 3)])[:size]
    seg = upload_raw(store, "sid", "commitlog/00000000000000000000", content, 4 * 4096, 4096)
    assert b"".join(tasks.read_segment(store, seg)) == content
    row = tasks.compact_segment(store, "sid", seg)
    key = layout.lz4c_key("sid", seg["path"], 3)
    assert row == {"path": seg["path"], "generation": 3, "format": "lz4c", "key": key, "size": size,
                   "compressed_bytes": store.head(key).size, "crc32c": seg["crc32c"], "block_bytes": 4096}
    obj = store.get(key)
    assert lz4c.decode(obj) == content
    if size > 100_000:
        assert row["compressed_bytes"] < size // 2
    lz = dict(seg, format="lz4c", objects=[key])
    blocks = list(tasks.read_segment(store, lz))
    assert b"".join(blocks) == content
    assert all(len(b) == 4096 for b in blocks[:-1])


def test_compaction_reads_through_reused_buffers(store, monkeypatch):
    """Many GETs per segment through the ring of pooled read buffers (and the one gathered output buffer of a
    store without streaming uploads): the object is byte for byte the codec's, and a second segment read through
    the same, now dirty, buffers too."""
    monkeypatch.setattr(tasks, "_READ_BYTES", 2 * 4096)  # 2 blocks per GET: ~40 GETs, each buffer reused ~13 times
    for i, seed in enumerate((5, 6)):
        content = make_content([("text", 100_000, seed), ("random", 30_000, seed), ("zeros", 40_000, seed)])
        seg = upload_raw(store, "sid", f"commitlog/0000000000000000{i}000", content, 8 * 4096, 4096)
        row = tasks.compact_segment(store, "sid", seg)
        assert store.get(row["key"]) == lz4c.encode(content, 4096)
        blocks = list(tasks.read_segment(store, seg))  # not transient: every block stays valid
        assert b"".join(blocks) == content


def test_read_segment_detects_corruption(store):
    content = make_content([("text", 50_000, 1), ("random", 20_000, 2)])
    seg = upload_raw(store, "sid", "commitlog/00000000000000001000", content, 4 * 4096, 4096)
    row = tasks.compact_segment(store, "sid", seg)
    lz = dict(seg, format="lz4c", objects=[row["key"]])

    bad = bytearray(content[4 * 4096:8 * 4096]); bad[5000] ^= 1
    store.put(seg["objects"][1], bytes(bad))
    with pytest.raises(tasks.SegmentError, match=r"chunk object .*000001' is corrupt: block 5"):
        b"".join(tasks.read_segment(store, seg))
    with pytest.raises(tasks.SegmentError, match="block 5"):  # and nothing is uploaded from bad input
        tasks.compact_segment(store, "sid2", seg)
    assert store.head(layout.lz4c_key("sid2", seg["path"], 3)) is None

    obj = bytearray(store.get(row["key"]))
    f = lz4c.read_footer(lambda o, n: bytes(obj[o:o + n]), len(obj))
    obj[f.coff[16] + 3] ^= 1  # the raw block of random bytes
    store.put(row["key"], bytes(obj))
    with pytest.raises(tasks.SegmentError, match=r"lz4c object .* is corrupt: .*block 16"):
        b"".join(tasks.read_segment(store, lz))
    with pytest.raises(tasks.SegmentError, match="catalog says"):
        next(tasks.read_segment(store, dict(lz, crc32c=seg["crc32c"] ^ 1)))
    with pytest.raises(tasks.SegmentError, match="does not exist"):
        next(tasks.read_segment(store, dict(lz, objects=["sid/seg/nope.lz4c"])))
    with pytest.raises(tasks.SegmentError, match="chunk objects listed"):
        next(tasks.read_segment(store, dict(seg, objects=seg["objects"][:-1])))
    with pytest.raises(tasks.SegmentError, match="catalog's"):  # catalog crc wrong for otherwise good chunks
        good = upload_raw(store, "sid3", seg["path"], content, 4 * 4096, 4096)
        tasks.compact_segment(store, "sid3", dict(good, crc32c=good["crc32c"] ^ 1))
    with pytest.raises(tasks.SegmentError, match="only raw segments"):
        tasks.compact_segment(store, "sid", lz)


def test_index_sidecar_round_trip(store):
    slots, items = 97, 3000
    buf = bytearray(ix.index_file_size(slots, items))
    w = ix.IndexWriter(buf, slots, items, 500, 1_700_000_000_000)
    r = random.Random(5)
    keys = [f"T#k{i}" for i in range(400)]
    t = 1_700_000_000_000
    for i in range(items - 1):
        t += r.randint(0, 2000)
        assert w.put_key(r.choice(keys), 1000 + 100 * i, t)
    seg = upload_raw(store, "sid", "index/20261121173000000", bytes(buf), 8 * 4096, 4096, generation=0)
    row = tasks.build_index_sidecar(store, "sid", seg, slots, items)
    key = layout.cidx_key("sid", seg["path"], 0)
    side = store.get(key)
    assert row == {"path": seg["path"], "generation": 0, "key": key, "bytes": len(side),
                   "crc32c": crc32c.crc32c(side)}
    read = lambda o, n: store.get_range(key, o, n)  # noqa: E731
    h = cidx.parse_header(read(0, cidx.HEADER_SIZE), store.head(key).size)
    for k in keys[:100]:
        for begin, end in ((0, LONG_MAX), (t - 100_000, t)):
            assert cidx.lookup(read, k, begin, end, 64, h) == ix.lookup(buf, k, begin, end, 64, slots, items)
    with pytest.raises(tasks.SegmentError, match="no index sidecar: IndexFile is"):
        tasks.build_index_sidecar(store, "sid", seg, slots + 1, items)
