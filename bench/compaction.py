#!/usr/bin/env python3
"""Pipeline benchmark (issue 4): lz4c compaction, index sidecars and the Parquet archive, against their baselines.

One run generates a small broker store (CommitLog segments of three body types: JSON events, text log lines,
random binary; records as examples/producer.py writes them: KEYS, UNIQ_KEY, TAGS, WAIT properties, real offsets
and body CRCs; plus the IndexFiles of those messages), measures the pure codecs on it in this process, then
mounts tierfs on a throwaway Ceph RGW (tests/ceph_rgw.py, or --backend posix), writes the store through the
mount, lets it tier and evict, and measures:

  1 compaction  `tierfs compact MNT --json` (the real daemon + Spark child on local[--spark-cores]); the segments
                stage's MB/s divided by the cores it used, vs. lz4c encode of the same bytes in one process.
                Also MB per CPU-second (JVM + Python workers, sampled from /proc) and per task-second.
  2 ratio       uncompressed / lz4c object size per body type: the codec here and the job's objects.
  3 look-up     cold key look-ups on tiered, fully evicted IndexFiles: the .cidx sidecar (the `tierfs query`
                path: ranged GETs through a counting reader) vs. the broker's chain walk on an mmap of the file
                through the mount (raw objects before the job, lz4c after it), GETs counted (the daemon's fetch
                counter, the sidecar reader's count); plus `query_offsets` end to end over all index files.
  4 seq read    a compacted (lz4c) segment vs. a raw copy of the same bytes, both evicted, read through the mount.
  5 archive     the archive stage's rows/s (per core; the table unless -o archive.format=parquet) vs. decoding
                the same segments with the CommitLog codec in one process (tierfs.spark.archive.iter_messages,
                CRC-checked); also archive_segment (plain Parquet) and archive_segment_table (the table's data
                files, then their commit) in one process to a local store (no Spark, no object store reads).

Every byte read is checked (crc32c per MiB), look-up answers are compared with a chain walk of the original files.
Eviction between cold measurements: the daemon's own (tiny cache.max_bytes; status.json resident_bytes == 0)
plus posix_fadvise(DONTNEED) on the file seen through the mount, checked with mincore.
--repeat N repeats the codec baselines and the look-up rounds (medians), --seq-repeat the sequential read pairs
(alternating which side goes first); the Spark job runs once per run (it compacts the store it is given). The
machine may be shared: CPU-second figures (this process, and the job's processes sampled from /proc) are steadier
than wall-clock ones, and the 1-minute load average is reported per phase. --py-spy DIR profiles the whole job
(driver, JVM children, Python workers) and splits the samples by task function.

    .venv/bin/python bench/compaction.py                       # defaults: ~5 min on 2 cores
    .venv/bin/python bench/compaction.py --repeat 3 --json out.json
    .venv/bin/python bench/compaction.py --segment-size 32MiB --lookups 20 --py-spy /tmp/prof
    .venv/bin/python bench/compaction.py --backend posix -o readahead.max_blocks=16
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common as C  # noqa: E402

from tierfs.config import parse_size  # noqa: E402
from tierfs.fs import control as _control  # noqa: E402
from tierfs.store import cidx  # noqa: E402
from tierfs.store import commitlog as cl  # noqa: E402
from tierfs.store import indexfile as ix  # noqa: E402
from tierfs.store.javahash import index_key_hash  # noqa: E402
from tierfs.tier import lz4c  # noqa: E402

MiB = 1 << 20
PIECE = MiB  # granularity of the crc32c list every read through the mount is checked against
LONG_MAX = (1 << 63) - 1
BODY_TYPES = ("json", "text", "binary")
TOPICS = {"json": "UserEvents", "text": "AppLogs", "binary": "SensorFrames"}
TAGS = {"json": b"event", "text": b"log", "binary": b"frame"}
# Some daemon versions reuse a rendering of the control files for this long even on open (newer ones render each
# open afresh): counters read right after an operation wait it out so they never predate the operation.
STATUS_REUSE_S = float(getattr(_control, "RENDER_REUSE_SECONDS", 0.0))
BASE_OPTS = ("tiering.enabled=true,cache.max_bytes=0,seal.quiet_seconds=1,seal.scan_interval_seconds=0.5,"
             "delete.grace_seconds=3600,compaction.enabled=false")


# ======================================================================================== realistic bodies

_WORDS = ("wireless", "headphones", "running", "shoes", "coffee", "grinder", "laptop", "stand", "usb", "c", "cable",
          "winter", "jacket", "kids", "organic", "tea", "garden", "hose", "led", "desk", "lamp", "phone", "case",
          "yoga", "mat", "backpack", "water", "bottle", "bluetooth", "speaker", "gift", "card", "sale")
_EVENTS = ("page_view", "page_view", "page_view", "search", "search", "add_to_cart", "checkout", "login", "logout",
           "payment_failed")
_COUNTRIES = ("DE", "FR", "US", "GB", "NL", "ES", "IT", "PL", "SE", "JP", "BR", "IN", "CA", "AU")
_PLANS = ("free", "free", "basic", "plus", "enterprise")
_OS = ("android", "ios", "windows", "macos", "linux")
_LOCALES = ("en-US", "de-DE", "fr-FR", "es-ES", "ja-JP", "pt-BR", "en-GB", "nl-NL")
_AGENTS = ("Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/126.0 Safari/537.36",
           "Mozilla/5.0 (iPhone; CPU iPhone OS 17_5 like Mac OS X) AppleWebKit/605.1.15 Version/17.5 Mobile/15E148",
           "Mozilla/5.0 (Macintosh; Intel Mac OS X 14_5) AppleWebKit/605.1.15 (KHTML, like Gecko) Version/17.5",
           "ShopApp/5.12.3 (Android 14; Pixel 8)", "ShopApp/5.12.1 (iOS 17.5; iPhone15,2)")
_REFERRERS = ("https://www.google.com/", "https://www.bing.com/", "", "https://t.co/", "https://news.example.org/",
              "https://shop.example.com/")
_CATEGORIES = ("electronics", "fashion", "home", "garden", "sports", "books", "toys", "grocery")
_CURRENCIES = ("EUR", "USD", "GBP", "JPY", "SEK")


_SECOND = [-1, ""]  # the last second formatted (bodies of consecutive messages share it)


def _utc_stamp(ts_ms: int) -> str:
    """ISO-8601 UTC with milliseconds, e.g. 2026-11-21T17:30:00.123Z."""
    sec = ts_ms // 1000
    if _SECOND[0] != sec:
        _SECOND[:] = [sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))]
    return f"{_SECOND[1]}.{ts_ms % 1000:03d}Z"


def json_body(rnd: random.Random, seq: int, ts_ms: int) -> bytes:
    """A clickstream event as services emit them: compact JSON, ids and numbers random, field names repeated."""
    kind = rnd.choice(_EVENTS)
    ev: dict[str, Any] = {
        "event_id": f"{rnd.getrandbits(128):032x}", "type": kind, "seq": seq,
        "ts": _utc_stamp(ts_ms),
        "user": {"id": rnd.randrange(1, 5_000_000), "country": rnd.choice(_COUNTRIES), "plan": rnd.choice(_PLANS),
                 "new": rnd.random() < 0.08},
        "session_id": f"{rnd.getrandbits(64):016x}",
        "device": {"os": rnd.choice(_OS), "app_version": f"5.{rnd.randrange(20)}.{rnd.randrange(10)}",
                   "locale": rnd.choice(_LOCALES), "screen": rnd.choice(("1920x1080", "390x844", "1440x900"))},
        "context": {"ip": f"{rnd.randrange(1, 224)}.{rnd.randrange(256)}.{rnd.randrange(256)}.{rnd.randrange(256)}",
                    "user_agent": rnd.choice(_AGENTS), "referrer": rnd.choice(_REFERRERS)},
    }
    if kind in ("add_to_cart", "checkout", "payment_failed"):
        items = [{"sku": f"SKU-{rnd.randrange(1_000_000):07d}", "qty": rnd.randrange(1, 4),
                  "price": round(rnd.uniform(1.5, 400), 2), "category": rnd.choice(_CATEGORIES)}
                 for _ in range(rnd.randrange(1, 6))]
        ev["cart"] = {"items": items, "currency": rnd.choice(_CURRENCIES),
                      "total": round(sum(i["qty"] * i["price"] for i in items), 2)}
        if kind == "payment_failed":
            ev["error"] = {"code": rnd.choice(("card_declined", "insufficient_funds", "timeout")),
                           "provider": rnd.choice(("stripe", "adyen", "paypal"))}
    elif kind == "search":
        ev["search"] = {"query": " ".join(rnd.choices(_WORDS, k=rnd.randrange(1, 5))),
                        "results": rnd.randrange(0, 2000), "page": rnd.randrange(1, 5)}
    elif kind == "page_view":
        cat = rnd.choice(_CATEGORIES)
        ev["page"] = {"url": f"/{cat}/{'-'.join(rnd.choices(_WORDS, k=3))}-{rnd.randrange(10**6)}",
                      "category": cat, "load_ms": rnd.randrange(40, 3000)}
    return json.dumps(ev, separators=(",", ":")).encode()


_LOGGERS = ("c.e.shop.order.OrderService", "c.e.shop.cart.CartController", "c.e.shop.payment.PaymentClient",
            "o.h.engine.jdbc.spi.SqlExceptionHelper", "c.e.shop.search.SearchService", "o.a.k.clients.NetworkClient",
            "c.e.shop.auth.TokenFilter", "c.e.shop.inventory.StockReservation")
_THREADS = ("http-nio-8080-exec-{}", "scheduling-{}", "kafka-producer-network-thread | producer-{}",
            "ForkJoinPool.commonPool-worker-{}", "grpc-default-executor-{}")
_MESSAGES = (
    ("INFO", "Order {n} placed: user={u} items={k} total={p} {c} in {ms} ms"),
    ("INFO", "GET /api/v2/products/{n} 200 {ms}ms user={u}"),
    ("INFO", "POST /api/v2/cart/{u}/items 201 {ms}ms sku=SKU-{n}"),
    ("DEBUG", "Cache miss for key product:{n}, loading from database"),
    ("INFO", "Search '{q}' returned {k} results in {ms} ms"),
    ("WARN", "Slow query ({ms} ms): select p1_0.id,p1_0.name,p1_0.price from product p1_0 where p1_0.id=?"),
    ("WARN", "Retrying payment authorization for order {n} (attempt {k}/3)"),
    ("INFO", "Reserved {k} units of SKU-{n} for order {n2}"),
    ("INFO", "Token refreshed for user {u}, expires in 3600 s"),
)
_ERROR = ("ERROR", "Payment provider call failed for order {n}: Read timed out after {ms} ms")
_TRACE = ("java.net.SocketTimeoutException: Read timed out",
          "\tat java.base/sun.nio.ch.NioSocketImpl.timedRead(NioSocketImpl.java:288)",
          "\tat java.base/java.net.Socket$SocketInputStream.read(Socket.java:1099)",
          "\tat org.apache.hc.core5.http.impl.io.SessionInputBufferImpl.fillBuffer(SessionInputBufferImpl.java:149)",
          "\tat com.example.shop.payment.PaymentClient.authorize(PaymentClient.java:{l})",
          "\tat com.example.shop.order.OrderService.checkout(OrderService.java:{l2})",
          "\tat java.base/java.lang.Thread.run(Thread.java:1583)")


def text_body(rnd: random.Random, seq: int, ts_ms: int) -> bytes:
    """1-6 Spring-Boot-style application log lines (a log shipper's batch); 2% are errors with a stack trace."""
    lines = []
    t = ts_ms
    for _ in range(rnd.randrange(1, 7)):
        level, tmpl = _ERROR if rnd.random() < 0.02 else rnd.choice(_MESSAGES)
        stamp = _utc_stamp(t)
        msg = tmpl.format(n=rnd.randrange(10**7), n2=rnd.randrange(10**7), u=rnd.randrange(1, 5_000_000),
                          k=rnd.randrange(1, 40), p=f"{rnd.uniform(2, 900):.2f}", c=rnd.choice(_CURRENCIES),
                          ms=rnd.randrange(1, 4000), q=" ".join(rnd.choices(_WORDS, k=rnd.randrange(1, 4))))
        thread = rnd.choice(_THREADS).format(rnd.randrange(1, 40))
        lines.append(f"{stamp} {level:>5} 7 --- [{thread[:15]:>15}] {rnd.choice(_LOGGERS):<40} : {msg}")
        if level == "ERROR":
            lines.extend(x.format(l=rnd.randrange(50, 400), l2=rnd.randrange(50, 400)) for x in _TRACE)
        t += rnd.randrange(0, 30)
    return "\n".join(lines).encode()


def binary_body(rnd: random.Random, seq: int, ts_ms: int) -> bytes:
    """Already-compressed or encrypted payloads (images, protobuf+zstd, ciphertext): incompressible bytes."""
    return rnd.randbytes(256 + (seq * 0x9E3779B1 >> 7) % 1281)


BODIES: dict[str, Callable[[random.Random, int, int], bytes]] = {"json": json_body, "text": text_body,
                                                                  "binary": binary_body}


# ======================================================================================== the store


@dataclass
class Segment:
    rel: str
    body: str
    topic: str
    size: int
    messages: int
    first_seq: int
    body_bytes: int = 0


@dataclass
class IndexInfo:
    rel: str
    sealed: bool
    first_seq: int
    last_seq: int


@dataclass
class Store:
    root: Path
    uniq_prefix: str = ""  # UNIQ_KEY = prefix + 12 hex digits of the message sequence number
    segments: list[Segment] = field(default_factory=list)
    indexes: list[IndexInfo] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def messages(self) -> int:
        return sum(s.messages for s in self.segments)


def index_name(ts_ms: int) -> str:
    """The broker names an IndexFile after its creation time: yyyyMMddHHmmssSSS."""
    t = dt.datetime.fromtimestamp(ts_ms / 1000, dt.UTC)
    return t.strftime("%Y%m%d%H%M%S") + f"{ts_ms % 1000:03d}"


class IndexBuilder:
    """Writes IndexFiles as the broker's dispatcher does (UNIQ_KEY then KEYS per message, roll when full)."""

    def __init__(self, root: Path, slots: int, items: int, store: Store):
        self.root, self.slots, self.items, self.store = root / "index", slots, items, store
        self.root.mkdir(parents=True, exist_ok=True)
        self.size = ix.index_file_size(slots, items)
        self.w: ix.IndexWriter | None = None
        self.name = ""
        self.first_seq = 0
        self.last_seq = 0

    def put(self, seq: int, hashes: tuple[int, int], phys: int, ts: int) -> None:
        for h in hashes:
            if self.w is None or not self.w.put_key(h, phys, ts):
                self._roll(seq, ts)
                self.w.put_key(h, phys, ts)
        self.last_seq = seq

    def _roll(self, seq: int, ts: int) -> None:
        prev = self.w
        self.close()
        self.w = ix.IndexWriter(bytearray(self.size), self.slots, self.items,
                                prev.header.end_phy_offset if prev else 0, prev.header.end_timestamp if prev else 0)
        self.name, self.first_seq = index_name(ts), seq

    def close(self) -> None:
        if self.w is None:
            return
        self.w.flush_header()
        (self.root / self.name).write_bytes(self.w.buf)
        self.store.indexes.append(IndexInfo(f"index/{self.name}", self.w.is_full, self.first_seq, self.last_seq))
        self.w = None


def build_store(root: Path, seg_size: int, per_type: int, slots: int, items: int, seed: int) -> Store:
    """CommitLog segments (per_type of each body type, in BODY_TYPES order, one topic per type, 4 queues each)
    and the IndexFiles of their messages, all sealed as a broker leaves them at a roll."""
    t0 = time.perf_counter()
    rnd = random.Random(seed)
    store = Store(root, f"{rnd.getrandbits(80):020X}")
    (root / "commitlog").mkdir(parents=True, exist_ok=True)
    uniq = store.uniq_prefix.encode()
    idx = IndexBuilder(root, slots, items, store)
    born_host, store_host = (b"\x0a\x00\x01\x17", 43012), (b"\x0a\x00\x00\x05", 10911)
    ts0 = int(time.time() * 1000) - 3_600_000
    seq = 0
    qoff: dict[tuple[str, int], int] = {}
    for body_type in BODY_TYPES:
        topic = TOPICS[body_type]
        packer = cl.RecordPacker(topic.encode(), 0, 1, born_host, store_host)
        make, tag = BODIES[body_type], TAGS[body_type]
        for _ in range(per_type):
            base = len(store.segments) * seg_size
            seg = Segment(f"commitlog/{base:020d}", body_type, topic, seg_size, 0, seq)
            buf = bytearray(seg_size)
            pos = 0
            while True:
                ts = ts0 + seq // 20  # 20k messages/s
                body = make(rnd, seq, ts)
                q = seq % 4
                props = b"KEYS\x01k-%d\x02UNIQ_KEY\x01%s%012X\x02TAGS\x01%s\x02WAIT\x01true\x02" % (
                    seq, uniq, seq, tag)
                total = packer.size(len(body), len(props))
                if pos + total + cl.BLANK_SIZE > seg_size:
                    break
                o = qoff.get((topic, q), 0)
                packer.pack_into(buf, pos, body, props, queue_id=q, queue_offset=o, physical_offset=base + pos,
                                 store_timestamp=ts, born_timestamp=ts - 3, crc=zlib.crc32(body) & 0x7FFFFFFF)
                qoff[(topic, q)] = o + 1
                idx.put(seq, (index_key_hash(f"{topic}#{store.uniq_prefix}{seq:012X}"),
                              index_key_hash(f"{topic}#k-{seq}")), base + pos, ts)
                pos += total
                seq += 1
                seg.messages += 1
                seg.body_bytes += len(body)
            buf[pos:pos + cl.BLANK_SIZE] = cl.encode_blank(seg_size - pos)
            if cl.sealed_commitlog_end(buf, seg_size, file_start=base) != pos:
                raise RuntimeError(f"generated {seg.rel} fails the CommitLog seal rule")
            (root / seg.rel).write_bytes(buf)
            store.segments.append(seg)
            C.log(f"  {seg.rel}: {body_type}, {seg.messages:,} messages")
    idx.close()
    store.seconds = time.perf_counter() - t0
    return store


def piece_crcs(data: bytes | memoryview) -> list[int]:
    return [crc32c.crc32c(data[i:i + PIECE]) for i in range(0, len(data), PIECE)]


def lookup_keys(store: Store, n: int, seed: int) -> list[tuple[IndexInfo, str]]:
    """n `topic#key` keys of messages indexed in sealed IndexFiles, spread over them, UNIQ_KEY and KEYS alternating."""
    rnd = random.Random(seed)
    sealed = [i for i in store.indexes if i.sealed]
    if not sealed:
        raise SystemExit("no IndexFile filled up: raise --per-type or --segment-size, or lower --index-items")
    out = []
    for k in range(n):
        info = sealed[k % len(sealed)]
        seq = rnd.randrange(info.first_seq + 1, info.last_seq)  # not a message that straddles two files
        seg = next(s for s in reversed(store.segments) if s.first_seq <= seq)
        key = f"k-{seq}" if k % 2 else f"{store.uniq_prefix}{seq:012X}"
        out.append((info, f"{seg.topic}#{key}"))
    return out


# ======================================================================================== in-process baselines


def median(values) -> float:
    return C.median(list(values))


def codec_baselines(store: Store, block_bytes: int, repeat: int) -> dict:
    """lz4c encode and decode of every segment in this process (wall and CPU), compressed sizes per body type."""
    out: dict[str, dict] = {}
    for body_type in BODY_TYPES:
        segs = [s for s in store.segments if s.body == body_type]
        raw = cbytes = 0
        enc_w, enc_c, dec_w, dec_c = [], [], [], []
        for rep in range(repeat):
            ew = ec = dw = dc = 0.0
            for s in segs:
                data = (store.root / s.rel).read_bytes()
                t, c = time.perf_counter(), time.process_time()
                w = lz4c.Lz4cWriter(block_bytes)
                obj = w.add(data) + w.finish()
                ew, ec = ew + time.perf_counter() - t, ec + time.process_time() - c
                t, c = time.perf_counter(), time.process_time()
                back = lz4c.decode(obj)
                dw, dc = dw + time.perf_counter() - t, dc + time.process_time() - c
                if back != data:
                    raise RuntimeError(f"lz4c round trip of {s.rel} returned different bytes")
                if rep == 0:
                    raw += len(data)
                    cbytes += len(obj)
                del data, obj, back
            enc_w.append(ew), enc_c.append(ec), dec_w.append(dw), dec_c.append(dc)
        body = sum(s.body_bytes for s in segs)
        out[body_type] = {"segments": len(segs), "bytes": raw, "lz4c_bytes": cbytes, "ratio": raw / cbytes,
                          "body_share": body / raw,
                          "encode_MBps": raw / median(enc_w) / 1e6, "encode_MB_per_cpu_s": raw / median(enc_c) / 1e6,
                          "decode_MBps": raw / median(dec_w) / 1e6, "decode_MB_per_cpu_s": raw / median(dec_c) / 1e6,
                          "encode_s": median(enc_w), "encode_cpu_s": median(enc_c)}
    per = [out[t] for t in BODY_TYPES]
    tot = sum(v["bytes"] for v in per)
    out["all"] = {"bytes": tot, "lz4c_bytes": sum(v["lz4c_bytes"] for v in per),
                  "encode_MBps": tot / sum(v["encode_s"] for v in per) / 1e6,
                  "encode_MB_per_cpu_s": tot / sum(v["encode_cpu_s"] for v in per) / 1e6}
    out["all"]["ratio"] = tot / out["all"]["lz4c_bytes"]
    return out


def _blocks(data: bytes, block_bytes: int) -> Iterator[bytes]:
    mv = memoryview(data)
    for i in range(0, len(data), block_bytes):
        yield mv[i:i + block_bytes]


def decode_baselines(store: Store, block_bytes: int, repeat: int, with_archive: bool, tmp: Path) -> dict:
    """Rows/s of the CommitLog codec alone (archive.iter_messages: streamed, CRC-checked, offsets checked) and, with
    with_archive, of archive_segment in this process (decode + Parquet, written to a local posix store)."""
    import pyarrow.parquet  # noqa: F401 - imported before the timing, as a Spark worker has after its first task

    from tierfs.objectstore import open_store
    from tierfs.spark import archive

    out: dict[str, dict] = {}
    today = dt.datetime.now(dt.UTC).date()
    local = open_store(f"file://{tmp / 'local-archive'}") if with_archive else None
    try:
        for body_type in BODY_TYPES:
            segs = [s for s in store.segments if s.body == body_type]
            walls, cpus = [], []
            for _ in range(repeat):
                w = c = 0.0
                n = 0
                for s in segs:
                    data = (store.root / s.rel).read_bytes()
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in archive.iter_messages(_blocks(data, block_bytes), s.rel.rsplit("/", 1)[-1], len(data)):
                        n += 1
                    w, c = w + time.perf_counter() - t0, c + time.process_time() - c0
                if n != sum(s.messages for s in segs):
                    raise RuntimeError(f"decoded {n} messages of {body_type}, wrote {sum(s.messages for s in segs)}")
                walls.append(w), cpus.append(c)
            o = out[body_type] = {"rows": n, "decode_s": median(walls), "decode_cpu_s": median(cpus)}
            if local is not None:  # rows/s is per row: the first segment of the type is enough
                s = segs[0]
                data = (store.root / s.rel).read_bytes()
                seg = {"path": s.rel, "generation": 1, "size": len(data), "crc32c": crc32c.crc32c(data)}
                t0, c0 = time.perf_counter(), time.process_time()
                row = archive.archive_segment(local, "bench", seg, {}, today,
                                              read=lambda _st, _seg, d=data: _blocks(d, block_bytes))
                o.update(archive_rows=row["rows"], archive_s=time.perf_counter() - t0,
                         archive_cpu_s=time.process_time() - c0)
                if row["rows"] != s.messages:
                    raise RuntimeError(f"local archive of {s.rel}: {row['rows']} rows, {s.messages} messages")
                # the same segment as archive-table files, then their commit (delta-rs, one transaction)
                from tierfs.spark import table

                t0, c0 = time.perf_counter(), time.process_time()
                row = archive.archive_segment_table(local, "bench", seg, table.TABLE_PREFIX, "bench",
                                                    read=lambda _st, _seg, d=data: _blocks(d, block_bytes))
                o.update(table_rows=row["rows"], table_s=time.perf_counter() - t0,
                         table_cpu_s=time.process_time() - c0)
                seg_t = table.TableSpec.of_store(f"file://{tmp / 'local-archive'}", {})
                t0 = time.perf_counter()
                table.commit(seg_t, "bench", [dict(row, generation=len(out) + 1)])
                o["table_commit_s"] = time.perf_counter() - t0
                if row["rows"] != s.messages:
                    raise RuntimeError(f"local table archive of {s.rel}: {row['rows']} rows, {s.messages} messages")
    finally:
        if local is not None:
            local.close()
            shutil.rmtree(tmp / "local-archive", ignore_errors=True)
    for o in [out[t] for t in BODY_TYPES] + [out.setdefault("all", {})]:
        if o is out["all"]:
            per = [out[t] for t in BODY_TYPES]
            o.update({k: sum(v[k] for v in per) for k in per[0]})
        o["decode_rows_s"], o["decode_rows_cpu_s"] = o["rows"] / o["decode_s"], o["rows"] / o["decode_cpu_s"]
        if "archive_s" in o:
            o["archive_rows_s"], o["archive_rows_cpu_s"] = o["archive_rows"] / o["archive_s"], \
                o["archive_rows"] / o["archive_cpu_s"]
            o["table_rows_s"], o["table_rows_cpu_s"] = o["table_rows"] / o["table_s"], \
                o["table_rows"] / o["table_cpu_s"]
    return out


# ======================================================================================== the mount


wait_until = C.wait_until


def files_of(mnt: C.TierfsMount) -> dict[str, dict]:
    return {f["path"]: f for f in mnt.status().get("files", [])}


def engine(mnt: C.TierfsMount, settle: bool = False) -> dict:
    """The daemon's engine counters (settle=True: right after an operation, see STATUS_REUSE_S)."""
    if settle and STATUS_REUSE_S:
        time.sleep(STATUS_REUSE_S + 0.05)
    return dict(mnt.status()["totals"].get("engine", {}))


def delta(a: dict, b: dict, keys: tuple[str, ...] = ("fetches", "fetch_bytes", "prefetch_bytes", "reads_waited",
                                                     "reads_local", "fetch_errors")) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in keys}


def wait_evicted(mnt: C.TierfsMount, rels: list[str], timeout: float = 120, fmt: str | None = None) -> float:
    """The daemon's eviction of `rels` (tiered, resident_bytes 0, optionally in format `fmt`), then the page cache
    of each file seen through the mount (fadvise DONTNEED, checked with mincore)."""
    def done() -> bool:
        fs = files_of(mnt)
        return all(fs.get(r, {}).get("state") == "tiered" and fs[r].get("resident_bytes") == 0
                   and (fmt is None or fs[r].get("format") == fmt) for r in rels)

    def progress() -> str:
        fs = files_of(mnt)
        return ", ".join(f"{r}: {fs.get(r, {}).get('state', 'not cataloged')} {fs.get(r, {}).get('format', '')} "
                         f"resident {fs.get(r, {}).get('resident_bytes', '?')}" for r in rels
                         if not (fs.get(r, {}).get("state") == "tiered" and fs[r].get("resident_bytes") == 0))[:600]

    if STATUS_REUSE_S:  # never decide on a rendering from before the last operation
        time.sleep(STATUS_REUSE_S + 0.05)
    waited = wait_until(done, timeout, f"{len(rels)} files tiered and evicted", progress)
    for r in rels:
        p = mnt.mnt / r
        C.evict(p)
        if C.resident_fraction(p) > 0:
            raise RuntimeError(f"{p} still has pages in the page cache after POSIX_FADV_DONTNEED")
    return waited


def check_readahead(mnt: C.TierfsMount, want_kb: int) -> str:
    """The daemon sets the mount's bdi read_ahead_kb (mount.read_ahead_kb) after mounting, best effort; on a loaded
    machine it has been seen left at the kernel's 128 KiB. Measure the configured value: re-apply it and say so."""
    time.sleep(0.5)
    have = mnt.kernel_tuning().get("read_ahead_kb")
    if not want_kb or have is None or have == want_kb:
        return ""
    C.set_bdi(mnt, [f"read_ahead_kb={want_kb}"])
    msg = f"mount read_ahead_kb was {have} instead of mount.read_ahead_kb={want_kb}; re-applied"
    C.log("WARNING: " + msg)
    return msg


def copy_in(store: Store, mnt: Path) -> None:
    """Write the store through the mount like a writer that flushes (1 MiB writes, fsync per file)."""
    C.copy_tree_in(store.root, mnt)


# ---------------------------------------------------------------------------------------- 3: look-ups


def chain_walk(mnt: C.TierfsMount, info: IndexInfo, key: str, slots: int, items: int) -> dict:
    """One cold look-up: the broker's walk over an mmap of the evicted IndexFile through the mount."""
    e0 = engine(mnt)
    t = time.perf_counter()
    with open(mnt.mnt / info.rel, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        offs = ix.lookup(m, key, 0, LONG_MAX, ix.MAX_MSGS_NUM_BATCH, slots, items)
    ms = (time.perf_counter() - t) * 1e3
    d = delta(e0, engine(mnt, settle=True))
    return {"ms": ms, "offsets": offs, "gets": d["fetches"], "get_bytes": d["fetch_bytes"]}


def chain_round(mnt: C.TierfsMount, keys: list[tuple[IndexInfo, str]], expect: dict, slots: int, items: int,
                fmt: str) -> list[dict]:
    rels = sorted({i.rel for i, _ in keys})
    out = []
    for info, key in keys:
        wait_evicted(mnt, rels, fmt=fmt)
        r = chain_walk(mnt, info, key, slots, items)
        if r["offsets"] != expect[(info.rel, key)]:
            raise RuntimeError(f"chain walk through the mount of {info.rel} for {key!r} answered {r['offsets']}, "
                               f"the original file {expect[(info.rel, key)]}")
        out.append(r)
    return out


def _byte_counting(read: Callable[[int, int], bytes]) -> tuple[Callable[[int, int], bytes], list[int]]:
    """`read` wrapped to add up the bytes it returns (in the returned one-element list)."""
    got = [0]

    def counted(off: int, n: int) -> bytes:
        data = read(off, n)
        got[0] += len(data)
        return data

    return counted, got


def sidecar_round(state: Path, keys: list[tuple[IndexInfo, str]], expect: dict) -> tuple[list[dict], float]:
    """Cold sidecar look-ups as `tierfs query` makes them: header, slot table entries, run; each a ranged GET
    through a counting reader (pipeline_cli's own). Returns the look-ups and the cost of opening the store."""
    from tierfs import pipeline_cli

    t = time.perf_counter()
    side = pipeline_cli._sidecars(state, "index")
    open_ms = (time.perf_counter() - t) * 1e3
    out = []
    for info, key in keys:
        name = info.rel.rsplit("/", 1)[-1]
        if name not in side.keys:
            raise RuntimeError(f"{info.rel} has no current .cidx sidecar in the catalog after the job")
        g0 = side.gets
        counted, got = _byte_counting(side.reader(side.keys[name]))
        t = time.perf_counter()
        offs = cidx.lookup(counted, key, 0, LONG_MAX, ix.MAX_MSGS_NUM_BATCH)
        ms = (time.perf_counter() - t) * 1e3
        if offs != expect[(info.rel, key)]:
            raise RuntimeError(f"sidecar of {info.rel} for {key!r} answered {offs}, the original file "
                               f"{expect[(info.rel, key)]}")
        out.append({"ms": ms, "offsets": offs, "gets": side.gets - g0, "get_bytes": got[0]})
    return out, open_ms


def query_round(mnt: C.TierfsMount, state: Path, keys: list[tuple[IndexInfo, str]], expect_all: dict,
                index_rels: list[str], sidecars: bool) -> list[dict]:
    """`tierfs query`'s index step end to end (pipeline_cli.query_offsets: every index file newest to oldest,
    headers read through the mount, sidecars for tiered files when `sidecars`, else the chain walk everywhere)."""
    from tierfs import pipeline_cli

    real = pipeline_cli._sidecars
    out = []
    try:
        if not sidecars:
            pipeline_cli._sidecars = lambda _state, _rel: pipeline_cli.Sidecars({}, {}, None)
        for _, key in keys:
            wait_evicted(mnt, index_rels, fmt="lz4c")
            e0 = engine(mnt)
            t = time.perf_counter()
            offs, stats = pipeline_cli.query_offsets(mnt.mnt, state, mnt.mnt / "index", key, 0, LONG_MAX, 32)
            ms = (time.perf_counter() - t) * 1e3
            d = delta(e0, engine(mnt, settle=True))
            if offs != expect_all[key]:
                raise RuntimeError(f"query_offsets({key!r}, sidecars={sidecars}) answered {offs}, a chain walk of "
                                   f"the original files {expect_all[key]}")
            out.append({"ms": ms, "mount_gets": d["fetches"], "mount_get_bytes": d["fetch_bytes"],
                        "sidecar_gets": stats["sidecar_gets"], "files": stats["files_searched"],
                        "files_by_sidecar": stats["files_by_sidecar"]})
    finally:
        pipeline_cli._sidecars = real
    return out


def lat_summary(rounds: list[dict], gets_key: str = "gets") -> dict:
    ms = sorted(r["ms"] for r in rounds)
    out = {"n": len(ms), "p50_ms": C.percentile(ms, 0.5), "p90_ms": C.percentile(ms, 0.9), "max_ms": ms[-1],
           "mean_ms": sum(ms) / len(ms), "gets_mean": sum(r[gets_key] for r in rounds) / len(rounds)}
    bkey = {"gets": "get_bytes", "mount_gets": "mount_get_bytes", "sidecar_gets": "mount_get_bytes"}[gets_key]
    out["bytes_mean"] = sum(r[bkey] for r in rounds) / len(rounds)
    return out


# ---------------------------------------------------------------------------------------- 4: sequential reads


def seq_read(mnt: C.TierfsMount, rel: str, crcs: list[int], size: int) -> dict:
    """One timed sequential read (1 MiB reads) of an evicted file through the mount, every MiB checked."""
    path = mnt.mnt / rel
    e0, cpu0 = engine(mnt), C.daemon_cpu_seconds(mnt.pid)
    buf = bytearray(PIECE)
    mv = memoryview(buf)
    got, crc, bad = 0, 0, []
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while (n := os.readv(fd, [mv])) > 0:
            data = mv[:n]
            while len(data):  # check every MiB of the stream against the reference, whatever the read sizes
                take = min(len(data), PIECE - got % PIECE)
                crc = crc32c.crc32c(data[:take], crc)
                got += take
                data = data[take:]
                if got % PIECE == 0 or got == size:
                    if crc != crcs[(got - 1) // PIECE]:
                        bad.append((got - 1) // PIECE * PIECE)
                    crc = 0
    finally:
        os.close(fd)
    dt_s = time.perf_counter() - t
    if got != size or bad:
        raise RuntimeError(f"{path}: read {got} of {size} bytes, wrong bytes at {bad[:5]}")
    d = delta(e0, engine(mnt, settle=True))
    return {"MBps": size / dt_s / 1e6, "seconds": dt_s, "gets": d["fetches"], "get_MiB": d["fetch_bytes"] / MiB,
            "daemon_cpu_s": C.daemon_cpu_seconds(mnt.pid) - cpu0, "reads_waited": d["reads_waited"],
            "reads_local": d["reads_local"]}


# ---------------------------------------------------------------------------------------- 1, 2, 5: the job


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class JobWatcher(threading.Thread):
    """Follows the pipeline job the daemon starts: finds its process (cmdline names the job dir), samples the CPU of
    every process in its session (driver, JVM, Python workers) and notes it at each stage start in progress.jsonl.
    Optionally runs py-spy on the whole tree."""

    def __init__(self, jobs_dir: Path, interval: float, py_spy_out: Path | None, py_spy_rate: int):
        super().__init__(daemon=True, name="job-watcher")
        self.jobs_dir, self.interval = jobs_dir, interval
        self.py_spy_out, self.py_spy_rate = py_spy_out, py_spy_rate
        self.t0 = time.time()
        self.stop = threading.Event()
        self.job_dir: Path | None = None
        self.sid: int | None = None
        self.cpu: dict[str, tuple[str, float]] = {}  # pid -> (role, CPU seconds so far)
        self.marks: dict[str, tuple[float, dict[str, float]]] = {}  # stage -> (time, CPU by role) at its start
        self.started: float | None = None
        self.finished: tuple[float, float] | None = None
        self._pos = 0
        self._spy: subprocess.Popen | None = None
        self.error: str | None = None

    def total_cpu(self) -> float:
        return sum(c for _, c in self.cpu.values())

    def cpu_by_role(self) -> dict[str, float]:
        out = {"total": 0.0}
        for role, c in self.cpu.values():
            out[role] = out.get(role, 0.0) + c
            out["total"] += c
        return out

    @staticmethod
    def _role(pid: str) -> str:
        cmd = _cmdline(pid)
        if "pyspark.daemon" in cmd or "pyspark.worker" in cmd:
            return "python workers"
        if "tierfs.spark" in cmd:
            return "driver"
        return "jvm" if "java" in cmd.split(" ", 1)[0] else "other"

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self._step()
                if self.finished:
                    break
                self.stop.wait(self.interval)
        except Exception as e:  # noqa: BLE001 - reported with the results
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._stop_spy()

    def _step(self) -> None:
        if self.job_dir is None:
            dirs = [d for d in self.jobs_dir.glob("*") if d.is_dir() and d.stat().st_mtime >= self.t0 - 1]
            if not dirs:
                return
            self.job_dir = max(dirs, key=lambda d: d.stat().st_mtime)
        needle = f"--job-dir {self.job_dir}"
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        if self.sid is None:
            for p in pids:
                if needle in _cmdline(p):
                    try:
                        self.sid = os.getsid(int(p))
                    except ProcessLookupError:
                        continue
                    self.started = time.monotonic()
                    if self.py_spy_out:
                        self._start_spy(int(p))
                    break
        if self.sid is not None:
            for p in pids:
                f = C.stat_fields(p)
                if f and int(f[3]) == self.sid:
                    # spark-submit starts as a shell script and execs java: look again until the role is known
                    role = self.cpu[p][0] if p in self.cpu and self.cpu[p][0] != "other" else self._role(p)
                    self.cpu[p] = (role, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
        now, cpu = time.monotonic(), self.cpu_by_role()
        prog = self.job_dir / "progress.jsonl"
        with contextlib.suppress(FileNotFoundError):
            with open(prog, "rb") as fh:
                fh.seek(self._pos)
                chunk = fh.read()
            end = chunk.rfind(b"\n") + 1
            for line in chunk[:end].splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if "total" in rec:
                        self.marks[rec["stage"]] = (now, cpu)
            self._pos += end
        if (self.job_dir / "result.json").exists() or (self.job_dir / "applied.json").exists():
            self.finished = (now, cpu)

    def _start_spy(self, pid: int) -> None:
        exe = C.py_spy_path()
        if exe is None:
            C.log("py-spy not found; install it with: .venv/bin/pip install py-spy")
            return
        self.py_spy_out.parent.mkdir(parents=True, exist_ok=True)
        self._spy = subprocess.Popen([exe, "record", "-p", str(pid), "--subprocesses", "-o", str(self.py_spy_out),
                                      "--format", "speedscope", "--rate", str(self.py_spy_rate), "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def _stop_spy(self) -> None:
        if self._spy is None:
            return
        if self._spy.poll() is None:
            self._spy.send_signal(signal.SIGINT)
        try:
            _, err = self._spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._spy.kill()
            _, err = self._spy.communicate()
        if not self.py_spy_out.exists():
            C.log(f"py-spy wrote no profile: {(err or '').strip()[-400:]}")

    def stage_cpu(self, stages: list[str]) -> dict[str, dict[str, float]]:
        """CPU seconds by role of the job's processes between each stage's start and the next one's (or the job's
        end), and before the first stage (JVM and session start-up)."""
        out: dict[str, dict[str, float]] = {}
        ordered = [s for s in stages if s in self.marks]
        if ordered:
            out["start-up"] = {k: round(v, 2) for k, v in self.marks[ordered[0]][1].items()}
        for i, s in enumerate(ordered):
            nxt = self.marks[ordered[i + 1]] if i + 1 < len(ordered) else self.finished
            if nxt:
                a, b = self.marks[s][1], nxt[1]
                out[s] = {k: round(b.get(k, 0.0) - a.get(k, 0.0), 2) for k in b}
        return out


def run_compact(mnt: C.TierfsMount, timeout: float, py_spy_out: Path | None, py_spy_rate: int,
                server_pids: dict[str, int]) -> dict:
    """`tierfs compact MNT --json` (all stages, one Spark session), watched; returns summary, result, CPU, times."""
    jobs = mnt.hot / ".tierfs" / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    w = JobWatcher(jobs, 0.2, py_spy_out, py_spy_rate)
    server0 = {name: C.proc_cpu_seconds(pid) for name, pid in server_pids.items()}
    w.start()
    t0 = time.perf_counter()
    # the daemon and its live helpers, not the job it starts in its own session (counted apart, by the watcher)
    dcpu0 = C.tree_cpu(mnt.pid, same_session=True).total
    proc = subprocess.Popen([C.PY, "-m", "tierfs", "compact", str(mnt.mnt), "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        w.stop.set()
        w.join(90)
    wall = time.perf_counter() - t0
    if not out.strip():
        raise RuntimeError(f"tierfs compact printed nothing (rc {proc.returncode}): {err.strip()[-2000:]}")
    summary = json.loads(out)
    job_dir = jobs / summary["job_id"]
    result = json.loads((job_dir / "result.json").read_text()) if (job_dir / "result.json").exists() else {}
    if not summary.get("ok"):
        raise RuntimeError(f"compaction job failed: {json.dumps(summary)[:3000]}\njob log: "
                           f"{(job_dir / 'job.log').read_text(errors='replace')[-3000:]}")
    progress = [json.loads(ln) for ln in (job_dir / "progress.jsonl").read_text().splitlines() if ln.strip()]
    stages = list(result.get("stages", {}))
    return {"summary": summary, "result": result, "progress": progress, "wall_s": wall, "job_dir": str(job_dir),
            "stage_cpu_s": w.stage_cpu(stages), "job_cpu_s": w.cpu_by_role(),
            "daemon_cpu_s": C.tree_cpu(mnt.pid, same_session=True).total - dcpu0, "watcher_error": w.error,
            "processes_seen": len(w.cpu),
            "server_cpu_s": {n: round(C.proc_cpu_seconds(p) - server0[n], 1) for n, p in server_pids.items()}}


def inprocess_compact(state: Path, job_dir: Path, paths: list[str]) -> dict:
    """The segments stage's task, tasks.compact_segment, in this process on the job's own inputs (its input.json)
    and the same object store: the task's cost without Spark. Writes under another store id, removed after. (The
    raw objects outlive the swap by delete.grace_seconds, which BASE_OPTS makes long enough.)"""
    from tierfs.spark.tasks import compact_segment
    from tierfs.tier import storeconfig

    segs = {s["path"]: s for s in json.loads((job_dir / "input.json").read_text())["segments"]}
    store = storeconfig.load(state).open()
    keys: list[str] = []
    nbytes = wall = cpu = 0.0
    try:
        keys.append(compact_segment(store, "bench-warmup", segs[paths[0]])["key"])  # untimed: imports, connections
        for p in paths:
            t, c = time.perf_counter(), time.process_time()
            row = compact_segment(store, "bench-inprocess", segs[p])
            wall, cpu = wall + time.perf_counter() - t, cpu + time.process_time() - c
            keys.append(row["key"])
            nbytes += row["size"]
    finally:
        store.delete_many(keys)
        store.close()
    return {"segments": len(paths), "bytes": nbytes, "MBps": nbytes / wall / 1e6, "MB_per_cpu_s": nbytes / cpu / 1e6}


# ======================================================================================== the run


def expected_offsets(store: Store, keys: list[tuple[IndexInfo, str]], slots: int, items: int) -> tuple[dict, dict]:
    """Answers of the broker's chain walk over the original files: per (file, key), and over all files."""
    bufs = {i.rel: (store.root / i.rel).read_bytes() for i in store.indexes}
    per_file = {(i.rel, k): ix.lookup(bufs[i.rel], k, 0, LONG_MAX, ix.MAX_MSGS_NUM_BATCH, slots, items)
                for i, k in keys}
    ordered = [bufs[i.rel] for i in sorted(store.indexes, key=lambda i: i.rel)]
    all_files = {k: ix.query_offsets(ordered, k, 0, LONG_MAX, 32, slots, items) for _, k in keys}
    for (rel, k), offs in per_file.items():
        if not offs:
            raise RuntimeError(f"generated key {k!r} is not found in {rel}")
    return per_file, all_files


def backend_opts(args: argparse.Namespace, stack: contextlib.ExitStack, base: Path) -> tuple[str, dict]:
    if args.backend == "posix":
        return f"objectstore.url=file://{base / 'objects'}", {}
    rgw = stack.enter_context(C.ceph_rgw(memstore_bytes=args.memstore, keep=args.keep))
    bucket = rgw.make_bucket(args.bucket)
    return C.rgw_store_options(rgw, bucket, "tierfs"), {"rgw_pids": rgw.pids()}


def run(args: argparse.Namespace) -> dict:
    res: dict[str, Any] = {"setup": {"load": {}}}
    setup = res["setup"]

    def load(phase: str) -> None:  # the machine is shared: keep its 1-minute load next to every phase
        setup["load"][phase] = round(os.getloadavg()[0], 1)

    with contextlib.ExitStack() as stack:
        base = stack.enter_context(C.temp_base(args.dir, prefix="tierfs-compaction-", keep=args.keep))
        C.log(f"generating {len(BODY_TYPES) * args.per_type} CommitLog segments of {args.segment_size >> 20} MiB "
              f"and their IndexFiles ({args.index_slots} slots, {args.index_items} items)...")
        store = build_store(base / "ref", args.segment_size, args.per_type, args.index_slots, args.index_items,
                            args.seed)
        setup.update(generate_s=round(store.seconds, 1), messages=store.messages, segments=len(store.segments),
                     segment_size=args.segment_size, index_files=len(store.indexes),
                     sealed_index_files=sum(i.sealed for i in store.indexes),
                     index_file_bytes=ix.index_file_size(args.index_slots, args.index_items))
        C.log(f"generated {store.messages:,} messages, {len(store.indexes)} IndexFiles "
              f"({setup['sealed_index_files']} full) in {store.seconds:.1f} s")
        crcs = {s.rel: piece_crcs((store.root / s.rel).read_bytes()) for s in store.segments}
        keys = lookup_keys(store, args.lookups, args.seed + 1)
        expect, expect_all = expected_offsets(store, keys, args.index_slots, args.index_items)

        C.log("in-process baselines: lz4c encode/decode, CommitLog decode, local archive...")
        load("baselines")
        res["codec"] = codec_baselines(store, args.block_bytes, args.repeat)
        res["decode"] = decode_baselines(store, args.block_bytes, args.repeat, not args.no_local_archive, base)
        C.log(f"codec: encode {res['codec']['all']['encode_MBps']:.0f} MB/s, ratio {res['codec']['all']['ratio']:.2f}; "
              f"decode {res['decode']['all']['decode_rows_s']:,.0f} rows/s")

        opts_backend, extra = backend_opts(args, stack, base)
        setup.update(extra)
        geometry = f"broker.max_hash_slot_num={args.index_slots},broker.max_index_num={args.index_items}"
        opts = [BASE_OPTS, f"cache.block_bytes={args.block_bytes},spark.master=local[{args.spark_cores}]",
                geometry, opts_backend, *args.options]
        mnt = stack.enter_context(C.TierfsMount(base / "hot", base / "mnt", opts, tierfs_src=args.tierfs_src))
        cfg = mnt.config()
        setup.update(chunk_bytes=int(cfg["objectstore.chunk_bytes"]), block_bytes=int(cfg["cache.block_bytes"]),
                     spark_master=cfg.get("spark.master"), backend=args.backend, options=opts[-len(args.options):]
                     if args.options else [])
        state = mnt.hot / ".tierfs"
        setup["readahead_fixup"] = check_readahead(mnt, int(cfg["mount.read_ahead_kb"]))
        C.log(f"mounted (daemon pid {mnt.pid}); writing the store through the mount...")
        t = time.perf_counter()
        copy_in(store, mnt.mnt)
        setup["write_through_mount_s"] = round(time.perf_counter() - t, 1)
        tiered = [s.rel for s in store.segments] + [i.rel for i in store.indexes if i.sealed]
        index_rels = [i.rel for i in store.indexes if i.sealed]
        setup["tier_and_evict_s"] = round(wait_evicted(mnt, tiered, timeout=900, fmt="raw"), 1)
        C.log(f"written in {setup['write_through_mount_s']} s, tiered and evicted in {setup['tier_and_evict_s']} s")

        # 3a: the chain walk before the pipeline ran (raw chunk objects)
        load("lookups raw")
        chain_raw: list[dict] = []
        for rep in range(args.repeat):
            chain_raw += chain_round(mnt, keys, expect, args.index_slots, args.index_items, "raw")
        C.log(f"chain walk (raw): p50 {lat_summary(chain_raw)['p50_ms']:.1f} ms, "
              f"{lat_summary(chain_raw)['gets_mean']:.1f} GETs")

        # 1, 2, 5: the job
        C.log(f"running `tierfs compact` (Spark local[{args.spark_cores}])...")
        prof = Path(args.py_spy).resolve() / "job.speedscope.json" if args.py_spy else None
        load("job start")
        job = run_compact(mnt, args.job_timeout, prof, args.py_spy_rate, setup.get("rgw_pids") or {})
        load("job end")
        res["job"] = job
        C.log(f"job done in {job['wall_s']:.1f} s: {json.dumps(job['result'].get('stages'))}")
        firsts = [next(s.rel for s in store.segments if s.body == t) for t in BODY_TYPES]
        res["task_inprocess"] = inprocess_compact(state, Path(job["job_dir"]), firsts)
        C.log(f"compact_segment in this process: {res['task_inprocess']['MBps']:.0f} MB/s, "
              f"{res['task_inprocess']['MB_per_cpu_s']:.0f} MB per CPU-second")

        # 4: raw copies of one segment per body type, written after the job so they stay raw
        copies = {}
        nseg = len(store.segments)
        for i, body_type in enumerate(BODY_TYPES):
            src = next(s for s in store.segments if s.body == body_type)
            rel = f"commitlog/{(nseg + i) * args.segment_size:020d}"
            with open(store.root / src.rel, "rb") as f, open(mnt.mnt / rel, "wb") as out:
                shutil.copyfileobj(f, out, MiB)
                out.flush()
                os.fsync(out.fileno())
            copies[body_type] = (src.rel, rel)
        wait_evicted(mnt, [c for _, c in copies.values()], timeout=600, fmt="raw")
        seq: dict[str, list[dict]] = {}
        load("seq reads")
        for body_type, (lz_rel, raw_rel) in copies.items():
            size = args.segment_size
            reps = []
            for rep in range(args.seq_repeat):
                r = {}
                order = [("lz4c", lz_rel), ("raw", raw_rel)]
                for side, rel in (order if rep % 2 == 0 else order[::-1]):
                    wait_evicted(mnt, [rel], fmt=side)
                    r[side] = seq_read(mnt, rel, crcs[lz_rel], size)
                reps.append(r)
                C.log(f"seq read {body_type} rep{rep}: raw {r['raw']['MBps']:.0f} MB/s, lz4c "
                      f"{r['lz4c']['MBps']:.0f} MB/s")
            seq[body_type] = reps
        res["seq"] = seq

        # 3b: sidecar vs the chain walk on the lz4c files, and query_offsets end to end
        side: list[dict] = []
        chain_lz: list[dict] = []
        load("lookups lz4c")
        open_ms = []
        for rep in range(args.repeat):
            s, o = sidecar_round(state, keys, expect)
            side += s
            open_ms.append(o)
            if not args.no_lz4c_walk:
                chain_lz += chain_round(mnt, keys, expect, args.index_slots, args.index_items, "lz4c")
        e2e_keys = keys[:args.query_lookups]
        q_side: list[dict] = []
        q_chain: list[dict] = []
        for rep in range(args.repeat):
            q_side += query_round(mnt, state, e2e_keys, expect_all, index_rels, True)
            q_chain += query_round(mnt, state, e2e_keys, expect_all, index_rels, False)
        res["lookup"] = {"keys": len(keys), "chain_raw": lat_summary(chain_raw), "sidecar": lat_summary(side),
                         "sidecar_store_open_ms": median(open_ms),
                         "chain_lz4c": lat_summary(chain_lz) if chain_lz else None,
                         "query_sidecar": lat_summary(q_side, "sidecar_gets") | {
                             "mount_gets_mean": sum(r["mount_gets"] for r in q_side) / len(q_side),
                             "files_mean": sum(r["files"] for r in q_side) / len(q_side)},
                         "query_chain": lat_summary(q_chain, "mount_gets") | {
                             "files_mean": sum(r["files"] for r in q_chain) / len(q_chain)},
                         "rounds": {"chain_raw": chain_raw, "sidecar": side, "chain_lz4c": chain_lz,
                                    "query_sidecar": q_side, "query_chain": q_chain}}
        setup["kernel"] = mnt.kernel_tuning()
        setup["store"] = store
    return res


# ======================================================================================== report


def summarize(res: dict, args: argparse.Namespace) -> dict:
    """The headline figures: job vs baseline, per item."""
    job, codec, dec = res["job"], res["codec"], res["decode"]
    result = job["result"]
    st = result["stages"]
    cores = args.spark_cores
    seg_st = st["segments"]
    n_items = seg_st["items"]
    used = min(cores, n_items)
    segs_in = seg_st["bytes_in"]
    item_s = {p["path"]: p.get("seconds") for p in job["progress"] if p.get("stage") == "segments" and "path" in p}
    store: Store = res["setup"]["store"]
    cl_paths = {s.rel for s in store.segments}
    cl_bytes = sum(s.size for s in store.segments)
    cl_task_s = sum(item_s.get(r) or 0 for r in cl_paths)
    stage_cpu = job["stage_cpu_s"]
    out: dict[str, Any] = {}
    codec_mbps = codec["all"]["encode_MBps"]
    job_core = segs_in / seg_st["seconds"] / 1e6 / used
    out["compaction"] = {
        "cores_used": used, "segments": n_items, "bytes_in": segs_in, "stage_s": seg_st["seconds"],
        "codec_MBps": codec_mbps, "job_MBps": segs_in / seg_st["seconds"] / 1e6, "job_MBps_per_core": job_core,
        "ratio": job_core / codec_mbps,
        "codec_MB_per_cpu_s": codec["all"]["encode_MB_per_cpu_s"],
        "job_MB_per_cpu_s": segs_in / stage_cpu["segments"]["total"] / 1e6 if stage_cpu.get("segments") else None,
        "workers_MB_per_cpu_s": segs_in / stage_cpu["segments"]["python workers"] / 1e6
        if stage_cpu.get("segments", {}).get("python workers") else None,
        "commitlog_MB_per_task_s": cl_bytes / cl_task_s / 1e6 if cl_task_s else None,
        "per_type_task_MBps": {}}
    for t in BODY_TYPES:
        paths = [s.rel for s in store.segments if s.body == t]
        ts = sum(item_s.get(p) or 0 for p in paths)
        out["compaction"]["per_type_task_MBps"][t] = sum(s.size for s in store.segments if s.body == t) / ts / 1e6 \
            if ts else None
    if out["compaction"]["job_MB_per_cpu_s"]:
        out["compaction"]["ratio_cpu"] = out["compaction"]["job_MB_per_cpu_s"] / out["compaction"]["codec_MB_per_cpu_s"]
    rows = {r["path"]: r for r in result.get("segments", [])}
    out["ratio"] = {}
    for t in BODY_TYPES:
        paths = [s.rel for s in store.segments if s.body == t]
        jb = sum(rows[p]["compressed_bytes"] for p in paths if p in rows)
        out["ratio"][t] = {"codec": codec[t]["ratio"], "job": sum(rows[p]["size"] for p in paths if p in rows) / jb
                           if jb else None, "body_share": codec[t]["body_share"]}
    idx_paths = [i.rel for i in store.indexes if i.sealed]
    ib = sum(rows[p]["compressed_bytes"] for p in idx_paths if p in rows)
    out["ratio"]["index"] = {"codec": None, "job": sum(rows[p]["size"] for p in idx_paths if p in rows) / ib
                             if ib else None, "body_share": None}
    a = st["archive"]
    rows_n = a["rows"]
    used_a = min(cores, a["items"])
    out["archive"] = {"rows": rows_n, "stage_s": a["seconds"], "rows_s": rows_n / a["seconds"],
                      "rows_s_per_core": rows_n / a["seconds"] / used_a, "cores_used": used_a,
                      "codec_rows_s": dec["all"]["decode_rows_s"], "codec_rows_cpu_s": dec["all"]["decode_rows_cpu_s"],
                      "local_archive_rows_s": dec["all"].get("archive_rows_s"),
                      "local_archive_rows_cpu_s": dec["all"].get("archive_rows_cpu_s"),
                      "local_table_rows_s": dec["all"].get("table_rows_s"),
                      "local_table_rows_cpu_s": dec["all"].get("table_rows_cpu_s"),
                      "local_table_commit_s": dec["all"].get("table_commit_s"),
                      "job_rows_per_cpu_s": rows_n / stage_cpu["archive"]["total"] if stage_cpu.get("archive") else None,
                      "workers_rows_per_cpu_s": rows_n / stage_cpu["archive"]["python workers"]
                      if stage_cpu.get("archive", {}).get("python workers") else None}
    out["archive"]["ratio"] = out["archive"]["rows_s_per_core"] / out["archive"]["codec_rows_s"]
    seq = {}
    for t, reps in res["seq"].items():
        ratios = [r["lz4c"]["MBps"] / r["raw"]["MBps"] for r in reps]
        src = next(s.rel for s in store.segments if s.body == t)
        # the engine counts fetched bytes after decompression; what crossed the network is the lz4c blocks
        lz_net = rows[src]["compressed_bytes"] / rows[src]["size"] if src in rows else float("nan")
        seq[t] = {"raw_MBps": median(r["raw"]["MBps"] for r in reps),
                  "lz4c_MBps": median(r["lz4c"]["MBps"] for r in reps), "ratio": median(ratios),
                  "ratio_min": min(ratios), "ratio_max": max(ratios),
                  "raw_get_MiB": reps[-1]["raw"]["get_MiB"], "lz4c_get_MiB": reps[-1]["lz4c"]["get_MiB"] * lz_net,
                  "raw_gets": reps[-1]["raw"]["gets"], "lz4c_gets": reps[-1]["lz4c"]["gets"],
                  "raw_daemon_cpu_s": median(r["raw"]["daemon_cpu_s"] for r in reps),
                  "lz4c_daemon_cpu_s": median(r["lz4c"]["daemon_cpu_s"] for r in reps)}
    out["seq"] = seq
    return out


def print_report(res: dict, summ: dict, args: argparse.Namespace) -> None:
    s = res["setup"]
    job = res["job"]
    print()
    print(f"tierfs pipeline benchmark  ({s['segments']} CommitLog segments of {s['segment_size'] >> 20} MiB, "
          f"{s['messages']:,} messages; {s['index_files']} IndexFiles of {s['index_file_bytes'] / MiB:.1f} MiB "
          f"({args.index_slots} slots, {args.index_items} items, {s['sealed_index_files']} tiered); backend "
          f"{s['backend']}; block {s['block_bytes'] >> 10} KiB, chunk {s['chunk_bytes'] >> 20} MiB; Spark "
          f"{s['spark_master']}; repeat {args.repeat}; load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    c = summ["compaction"]
    print()
    print("1. compaction, segments stage (MB of uncompressed input)")
    rows = [["MB/s per core (wall)", "lz4c encode, 1 process", c["codec_MBps"],
             f"job {c['job_MBps']:.1f} MB/s / {c['cores_used']} cores", c["job_MBps_per_core"], f"{c['ratio']:.2f}"],
            ["MB per CPU-second", "lz4c encode, 1 process", c["codec_MB_per_cpu_s"],
             "job: JVM + Python workers", c["job_MB_per_cpu_s"],
             f"{c['ratio_cpu']:.2f}" if c.get("ratio_cpu") else "-"]]
    tp = res.get("task_inprocess")
    if tp:
        rows.append(["MB per CPU-second", "lz4c encode, 1 process", c["codec_MB_per_cpu_s"],
                     "compact_segment in 1 process, same store", tp["MB_per_cpu_s"],
                     f"{tp['MB_per_cpu_s'] / c['codec_MB_per_cpu_s']:.2f}"])
    if c.get("workers_MB_per_cpu_s"):
        rows.append(["MB per CPU-second", "lz4c encode, 1 process", c["codec_MB_per_cpu_s"],
                     "job: Python workers only", c["workers_MB_per_cpu_s"],
                     f"{c['workers_MB_per_cpu_s'] / c['codec_MB_per_cpu_s']:.2f}"])
    if c["commitlog_MB_per_task_s"]:
        rows.append(["MB/s per busy task (CommitLog)", "lz4c encode, 1 process", c["codec_MBps"],
                     "sum of task seconds", c["commitlog_MB_per_task_s"],
                     f"{c['commitlog_MB_per_task_s'] / c['codec_MBps']:.2f}"])
    C.print_table(["figure", "baseline", "MB/s", "tierfs", "MB/s", "job/codec"], rows)
    print()
    print("2. compression ratio (uncompressed / lz4c object) and codec speed per body type")
    rows = []
    for t in BODY_TYPES:
        k = res["codec"][t]
        r = summ["ratio"][t]
        rows.append([t, f"{k['bytes'] / MiB:.0f} MiB", f"{k['lz4c_bytes'] / MiB:.1f} MiB", f"{k['body_share']:.0%}",
                     f"{r['codec']:.2f}", f"{r['job']:.2f}" if r["job"] else "-", k["encode_MBps"], k["decode_MBps"],
                     c["per_type_task_MBps"].get(t)])
    r = summ["ratio"]["index"]
    rows.append(["IndexFile", "-", "-", "-", "-", f"{r['job']:.2f}" if r["job"] else "-", "-", "-", "-"])
    C.print_table(["body", "input", "lz4c", "body share", "ratio codec", "ratio job", "encode MB/s",
                   "decode MB/s", "job MB/s/task"], rows)
    lk = res["lookup"]
    print()
    print(f"3. cold key look-up on tiered, fully evicted IndexFiles ({lk['keys']} keys x {args.repeat}; GETs per "
          f"look-up; ratio = chain walk raw / this)")
    base = lk["chain_raw"]
    rows = []
    for name, label, r in (("chain_raw", "chain walk via mount, raw objects (baseline)", base),
                           ("chain_lz4c", "chain walk via mount, lz4c objects", lk["chain_lz4c"]),
                           ("sidecar", ".cidx sidecar (tierfs query path)", lk["sidecar"])):
        if r is None:
            continue
        rows.append([label, r["p50_ms"], r["p90_ms"], r["max_ms"], f"{r['gets_mean']:.1f}",
                     f"{r['bytes_mean']:,.0f}", f"{base['p50_ms'] / r['p50_ms']:.1f}x"])
    qs, qc = lk["query_sidecar"], lk["query_chain"]
    rows.append([f"query_offsets over all {qc['files_mean']:.0f} files: chain walk", qc["p50_ms"], qc["p90_ms"],
                 qc["max_ms"], f"{qc['gets_mean']:.1f}", f"{qc['bytes_mean']:,.0f}", "1.0x"])
    rows.append([f"query_offsets over all {qs['files_mean']:.0f} files: sidecars", qs["p50_ms"], qs["p90_ms"],
                 qs["max_ms"], f"{qs['gets_mean']:.1f} + {qs['mount_gets_mean']:.1f} mount",
                 f"{qs['bytes_mean']:,.0f} mount", f"{qc['p50_ms'] / qs['p50_ms']:.1f}x"])
    C.print_table(["path", "p50 ms", "p90 ms", "max ms", "GETs", "bytes fetched", "speed-up"], rows)
    print("   (speed-up: p50 of the chain walk over raw objects / p50 of the row; query_offsets rows: vs its chain "
          "walk row. query_offsets reads every index file's header through the mount, also for files with a "
          "sidecar: the 'mount' GETs)")
    print(f"   (sidecar reader: opening the store and reading the catalog costs {lk['sidecar_store_open_ms']:.0f} ms "
          f"once per `tierfs query`, not included above)")
    print()
    print("4. sequential read through the mount of an evicted segment: lz4c vs a raw copy of the same bytes")
    rows = []
    for t, r in summ["seq"].items():
        rng = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}" if r["ratio_min"] != r["ratio_max"] else "-"
        rows.append([t, r["raw_MBps"], r["lz4c_MBps"], f"{r['ratio']:.2f}", rng,
                     f"{r['raw_gets']} / {r['raw_get_MiB']:.0f}", f"{r['lz4c_gets']} / {r['lz4c_get_MiB']:.0f}",
                     f"{r['raw_daemon_cpu_s']:.2f} / {r['lz4c_daemon_cpu_s']:.2f}"])
    C.print_table(["body", "raw MB/s", "lz4c MB/s", "lz4c/raw", "range", "raw GETs / MiB", "lz4c GETs / MiB",
                   "daemon CPU s raw/lz4c"], rows)
    print("   (MiB: bytes transferred from the object store; for lz4c the compressed blocks)")
    print(f"   ({C.DAEMON_CPU_NOTE})")
    a = summ["archive"]
    print()
    print("5. archive stage (CommitLog -> the archive table; Parquet with -o archive.format=parquet), rows per "
          "second")
    rows = [["rows/s per core", "CommitLog decode, 1 process", a["codec_rows_s"],
             f"job {a['rows_s']:,.0f} rows/s / {a['cores_used']} cores", a["rows_s_per_core"], f"{a['ratio']:.2f}"]]
    if a["local_archive_rows_s"]:
        rows.append(["rows/s, 1 core", "CommitLog decode, 1 process", a["codec_rows_s"],
                     "archive_segment in 1 process, local", a["local_archive_rows_s"],
                     f"{a['local_archive_rows_s'] / a['codec_rows_s']:.2f}"])
    if a["job_rows_per_cpu_s"]:
        rows.append(["rows per CPU-second", "CommitLog decode, 1 process", a["codec_rows_cpu_s"],
                     "job: JVM + Python workers", a["job_rows_per_cpu_s"],
                     f"{a['job_rows_per_cpu_s'] / a['codec_rows_cpu_s']:.2f}"])
    if a.get("workers_rows_per_cpu_s"):
        rows.append(["rows per CPU-second", "CommitLog decode, 1 process", a["codec_rows_cpu_s"],
                     "job: Python workers only", a["workers_rows_per_cpu_s"],
                     f"{a['workers_rows_per_cpu_s'] / a['codec_rows_cpu_s']:.2f}"])
    if a["local_archive_rows_cpu_s"]:
        rows.append(["rows per CPU-second", "CommitLog decode, 1 process", a["codec_rows_cpu_s"],
                     "archive_segment in 1 process, local", a["local_archive_rows_cpu_s"],
                     f"{a['local_archive_rows_cpu_s'] / a['codec_rows_cpu_s']:.2f}"])
    if a.get("local_table_rows_s"):
        rows.append(["rows/s, 1 core", "CommitLog decode, 1 process", a["codec_rows_s"],
                     "archive_segment_table in 1 process, local", a["local_table_rows_s"],
                     f"{a['local_table_rows_s'] / a['codec_rows_s']:.2f}"])
        rows.append(["rows/s, 1 core", "archive_segment (plain Parquet)", a["local_archive_rows_s"],
                     "archive_segment_table (table files)", a["local_table_rows_s"],
                     f"{a['local_table_rows_s'] / a['local_archive_rows_s']:.2f}"])
        rows.append(["rows per CPU-second", "archive_segment (plain Parquet)", a["local_archive_rows_cpu_s"],
                     "archive_segment_table (table files)", a["local_table_rows_cpu_s"],
                     f"{a['local_table_rows_cpu_s'] / a['local_archive_rows_cpu_s']:.2f}"])
    C.print_table(["figure", "baseline", "rows/s", "tierfs", "rows/s", "tierfs/base"], rows)
    result = job["result"]
    print()
    print("details:")
    print(f"  job: `tierfs compact` {job['wall_s']:.1f} s wall (Spark session start "
          f"{result.get('session_start_seconds')} s, job {result.get('seconds')} s, daemon verify+apply "
          f"{job['summary'].get('apply_seconds')} s); stages {json.dumps(result.get('stages'))}")
    print(f"  job CPU seconds by role (sampled from /proc, {job['processes_seen']} processes): total "
          f"{json.dumps({k: round(v, 1) for k, v in job['job_cpu_s'].items()})}; by stage "
          f"{json.dumps(job['stage_cpu_s'])}; "
          f"daemon CPU during the job (with its live helpers, the job apart) {job['daemon_cpu_s']:.1f} s; object store servers {json.dumps(job['server_cpu_s'])}"
          + (f"; watcher error {job['watcher_error']}" if job["watcher_error"] else ""))
    print("  per-item task seconds: "
          + ", ".join(f"{p['stage'][:3]}:{p['path'].rsplit('/', 1)[-1][-8:]}={p.get('seconds')}"
                      for p in job["progress"] if "path" in p))
    d = res["decode"]
    print("  in-process per body type: " + "; ".join(
        f"{t}: decode {d[t]['decode_rows_s']:,.0f} rows/s" + (f", archive {d[t]['archive_rows_s']:,.0f} rows/s"
                                                              if "archive_rows_s" in d[t] else "")
        for t in BODY_TYPES))
    print(f"  1-minute load average by phase: {json.dumps(s['load'])}")
    if s.get("readahead_fixup"):
        print(f"  WARNING: {s['readahead_fixup']}")
    print(f"  setup: generate {s['generate_s']} s, write through mount {s['write_through_mount_s']} s, tier+evict "
          f"{s['tier_and_evict_s']} s; kernel {s.get('kernel')}")
    sys.stdout.flush()


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("rgw", "posix"), default="rgw",
                    help="object store: a throwaway Ceph RGW (default, realistic) or a local posix dir")
    ap.add_argument("--segment-size", default="256MiB",
                    help="CommitLog segment size (default 256MiB: a broker's are 1GiB; at 64MiB a PySpark task's "
                         "35-55 ms start weighs four times as much against the codec)")
    ap.add_argument("--per-type", type=int, default=2, help="segments per body type (default 2)")
    ap.add_argument("--index-slots", type=int, default=100_000, help="broker maxHashSlotNum (default 100000)")
    ap.add_argument("--index-items", type=int, default=400_000, help="broker maxIndexNum (default 400000)")
    ap.add_argument("--block-bytes", default="1MiB", help="cache.block_bytes = lz4c block size (default 1MiB)")
    ap.add_argument("--spark-cores", type=int, default=2, help="spark.master=local[N] (default 2)")
    ap.add_argument("--lookups", type=int, default=12, help="cold look-ups per round and path (default 12)")
    ap.add_argument("--query-lookups", type=int, default=4,
                    help="end-to-end query_offsets look-ups per round and mode (default 4)")
    ap.add_argument("--seq-repeat", type=int, default=3,
                    help="sequential read pairs per body type, alternating which side goes first (default 3)")
    ap.add_argument("--no-lz4c-walk", action="store_true", help="skip the chain walk over lz4c index files")
    ap.add_argument("--no-local-archive", action="store_true", help="skip the in-process archive_segment baseline")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions of the repeatable measurements (medians)")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also write machine-readable results (to FILE, or stdout when no FILE)")
    ap.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help=f"extra `tierfs mount -o` options (after the bench's own: {BASE_OPTS})")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--bucket", default="tierfs-bench")
    ap.add_argument("--memstore", default="6GiB", help="RAM cap of the RGW's memstore OSD (only what is stored is used)")
    ap.add_argument("--job-timeout", type=float, default=1200)
    ap.add_argument("--dir", help="base dir for the temp files and mountpoint (default $TMPDIR)")
    ap.add_argument("--py-spy", metavar="DIR", help="record a py-spy profile of the Spark job (driver and workers)")
    ap.add_argument("--py-spy-rate", type=int, default=100)
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (debugging)")
    ap.add_argument("--tierfs-src", metavar="DIR", help="run the daemon from this source tree (A/B of versions)")
    args = ap.parse_args(argv)
    args.segment_size = parse_size(args.segment_size)
    args.block_bytes = parse_size(args.block_bytes)
    args.memstore = parse_size(args.memstore)
    if args.segment_size < 4 * MiB or args.segment_size % PIECE:
        ap.error("--segment-size must be a multiple of 1 MiB, at least 4 MiB")
    if min(args.per_type, args.repeat, args.seq_repeat, args.lookups, args.query_lookups, args.spark_cores) < 1:
        ap.error("--per-type, --repeat, --seq-repeat, --lookups, --query-lookups and --spark-cores must be >= 1")
    if args.index_slots < 1 or args.index_items < 2:
        ap.error("--index-slots must be >= 1 and --index-items >= 2")
    return args


TASK_FUNCTIONS = ("compact_segment", "build_index_sidecar", "archive_segment")


def profile_breakdown(path: Path, top: int = 12) -> dict:
    """Share of a py-spy speedscope profile of the job under each task function (their upload threads count as
    'outside'), and the functions with most self samples under each."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]

    def label(fi: int) -> str:
        f = frames[fi]
        return f"{f['name']} ({'/'.join((f.get('file') or '').split('/')[-2:])}:{f.get('line', '?')})"

    roots = {n: {i for i, f in enumerate(frames) if f["name"] == n} for n in (*TASK_FUNCTIONS, "run_item")}
    share: dict[str, float] = {}
    self_w: dict[str, dict[int, float]] = {}
    total = 0.0
    for prof in doc["profiles"]:
        if prof.get("type") != "sampled":
            continue
        for stack, w in zip(prof["samples"], prof["weights"]):
            total += w
            on = set(stack)
            cat = next((n for n in TASK_FUNCTIONS if on & roots[n]), None)
            cat = cat or ("run_item, other" if on & roots["run_item"] else "outside the task functions")
            share[cat] = share.get(cat, 0.0) + w
            if stack:
                d = self_w.setdefault(cat, {})
                d[stack[-1]] = d.get(stack[-1], 0.0) + w
    return {"samples": total,
            "share_pct": {k: round(100 * v / total, 1) for k, v in sorted(share.items(), key=lambda kv: -kv[1])},
            "self_pct_within": {k: [(label(fi), round(100 * w / share[k], 1))
                                    for fi, w in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
                                for k, d in self_w.items()}} if total else {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    C.install_signal_handlers()
    t0 = time.perf_counter()
    res = run(args)
    summ = summarize(res, args)
    print_report(res, summ, args)
    if args.py_spy:
        pf = Path(args.py_spy).resolve() / "job.speedscope.json"
        if pf.exists():
            sp = profile_breakdown(pf)
            res["job"]["profile_summary"] = sp
            print(f"\nSpark job profile (py-spy, {pf}, {sp.get('samples', 0):.0f} samples), share by task function: "
                  f"{json.dumps(sp.get('share_pct'))}")
            for cat, fns in sp.get("self_pct_within", {}).items():
                print(f"  self samples within {cat}:")
                for n, pct in fns:
                    print(f"    {pct:5.1f}%  {n}")
    C.log(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        res["setup"]["store"] = {"segments": [vars(s) for s in res["setup"]["store"].segments],
                                 "indexes": [vars(i) for i in res["setup"]["store"].indexes]}
        C.write_json(args.json, {"args": {k: v for k, v in vars(args).items()}, "summary": summ, **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
