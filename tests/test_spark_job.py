"""The Spark pipeline driver, `python -m tierfs.spark --job-dir DIR`, on a real local SparkSession (local[2]).

A byte-accurate store is written natively by examples/producer.py; its sealed segments are uploaded as raw chunk
objects exactly as the engine does (layout.chunk_keys, a crc32c per block), to a posix store and to Ceph RGW. The
job then runs as a child process, and its outputs are checked independently: archive rows against a decode of
the native CommitLog files with the codecs (and the producer's deterministic bodies), lz4c objects against the
native bytes, .cidx sidecars against chain walks of the native IndexFiles. JVM start-up costs ~10 s, so each
Spark run checks many things at once.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import crc32c
import pyarrow.parquet as pq
import pytest

from tierfs.objectstore import ObjectStore, open_store
from tierfs.spark import archive as ar
from tierfs.store import cidx
from tierfs.store import commitlog as cl
from tierfs.store import indexfile as ix
from tierfs.store.paths import classify
from tierfs.store.seal import SealParams, is_sealed
from tierfs.tier import layout, lz4c

REPO = Path(__file__).resolve().parent.parent
PRODUCER = REPO / "examples" / "producer.py"
QUERY = REPO / "examples" / "archive_query.py"
sys.path.insert(0, str(REPO / "examples"))
from producer import body_pool, expected_body, parse_seq  # noqa: E402

CL_SIZE, SLOTS, ITEMS = 1 << 20, 100, 400
CHUNK, BLOCK = 256 << 10, 64 << 10
SEED = 7
TOPIC_PREFIX = "%RETRY%Grp"  # '%' must survive the Hive-escaped partition path
STORE_ID = "s1"
LONG_MAX = (1 << 63) - 1
TODAY = dt.datetime.now(dt.timezone.utc).date()


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("native")
    r = subprocess.run([sys.executable, str(PRODUCER), str(root), "--commitlog-size", str(CL_SIZE),
                        "--cq-size", "6000", "--index-slots", str(SLOTS), "--index-items", str(ITEMS),
                        "--messages", "6000", "--topics", "2", "--queues", "2", "--seed", str(SEED),
                        "--topic-prefix", TOPIC_PREFIX], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return root


def sealed(root: Path) -> dict[str, list[str]]:
    """Sealed segments by kind (what the engine would have tiered), oldest first."""
    out: dict[str, list[str]] = {"commitlog": [], "consumequeue": [], "index": []}
    params = SealParams(max_index_num=ITEMS, max_hash_slot_num=SLOTS)
    for top in out:
        for p in sorted((root / top).rglob("*")):
            rel = str(p.relative_to(root))
            kind = classify(rel)
            if p.is_file() and kind.is_segment and is_sealed(kind, p.read_bytes(), p.stat().st_size, params)[0]:
                out[top].append(rel)
    return out


def upload(store: ObjectStore, root: Path, rel: str, generation: int = 0) -> dict:
    """Put a segment as raw chunk objects like Uploader.upload_blocking; return its catalog entry (SEG)."""
    data = (root / rel).read_bytes()
    keys = layout.chunk_keys(STORE_ID, rel, generation, "raw", len(data), CHUNK)
    block_crcs = [crc32c.crc32c(data[b:b + BLOCK]) for b in range(0, len(data), BLOCK)]
    for i, key in enumerate(keys):
        store.put(key, data[i * CHUNK:(i + 1) * CHUNK])
    return {"path": rel, "kind": classify(rel).value, "generation": generation, "size": len(data), "format": "raw",
            "chunk_bytes": CHUNK, "block_bytes": BLOCK, "crc32c": crc32c.crc32c(data), "block_crcs": block_crcs,
            "objects": keys}


def missing(rel: str, size: int = CL_SIZE) -> dict:
    """A catalog entry whose objects were never uploaded."""
    return {"path": rel, "kind": classify(rel).value, "generation": 0, "size": size, "format": "raw",
            "chunk_bytes": CHUNK, "block_bytes": BLOCK, "crc32c": 0, "block_crcs": [0] * -(-size // BLOCK),
            "objects": layout.chunk_keys(STORE_ID, rel, 0, "raw", size, CHUNK)}


def messages(root: Path, rels: list[str]) -> dict[int, cl.Message]:
    """Every message of these CommitLog segments by physical offset, decoded with the codec from the native files."""
    out = {}
    for rel in rels:
        base = int(rel.rsplit("/", 1)[1])
        for pos, rec in cl.iter_records((root / rel).read_bytes(), check_crc=True):
            if isinstance(rec, cl.Message):
                out[base + pos] = rec
    return out


def write_input(job_dir: Path, store: dict, **doc) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    base = {"job_id": job_dir.name, "stages": ["segments", "index", "archive"], "store": store,
            "store_id": STORE_ID, "spark": {"spark.master": "local[2]"}, "segments": [], "indexes": [],
            "commitlogs": [], "max_hash_slot_num": SLOTS, "max_index_num": ITEMS, "retention": {},
            "today": TODAY.isoformat()}
    base.update(doc)
    path = job_dir / "input.json"
    path.write_text(json.dumps(base))
    path.chmod(0o600)


def run_job(job_dir: Path, timeout: float = 400, failpoints: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TIERFS_FAILPOINTS"}
    if failpoints:
        env["TIERFS_FAILPOINTS"] = failpoints
    return subprocess.run([sys.executable, "-m", "tierfs.spark", "--job-dir", str(job_dir)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


def progress(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "progress.jsonl").read_text().splitlines()]


def archive_rows(store: ObjectStore, keys: list[str]) -> list[dict]:
    """Rows of these archive files, with topic and date taken from the key (the partition values)."""
    rows = []
    for key in keys:
        k = ar.parse_archive_key(STORE_ID, key)
        assert k is not None, key
        for row in pq.read_table(io.BytesIO(store.get(key))).to_pylist():
            rows.append(dict(row, topic=k.topic, date=k.date, _key=key))
    return rows


def check_archive(store: ObjectStore, root: Path, result: dict, rels: list[str]) -> int:
    """Archive rows equal the store's messages field by field; returns the row count."""
    want = messages(root, rels)
    assert sorted(r["path"] for r in result["archive"]) == sorted(rels)
    keys = [k for r in result["archive"] for k in r["keys"]]
    assert len(keys) == len(set(keys))
    for r in result["archive"]:
        assert r["generation"] == 0 and r["bytes"] > 0
        assert r["bytes"] == sum(store.head(k).size for k in r["keys"])
    rows = archive_rows(store, keys)
    assert sum(r["rows"] for r in result["archive"]) == len(rows) == len(want)
    pool = body_pool(SEED)
    seen = set()
    for row in rows:
        m = want[row["phys_offset"]]
        seen.add(row["phys_offset"])
        store_ts = dt.datetime.fromtimestamp(m.store_timestamp / 1000, dt.timezone.utc)
        assert row["topic"] == m.topic and row["topic"].startswith(TOPIC_PREFIX)
        assert row["date"] == store_ts.date()
        assert row["_key"].split("/")[2] == "topic=" + m.topic.replace("%", "%25")
        assert row["_key"].endswith(f"part-{m.physical_offset // CL_SIZE * CL_SIZE:020d}-g0.parquet")
        assert (row["queue_id"], row["queue_offset"]) == (m.queue_id, m.queue_offset)
        assert row["store_timestamp"] == store_ts
        assert row["born_timestamp"] == dt.datetime.fromtimestamp(m.born_timestamp / 1000, dt.timezone.utc)
        assert row["keys"] == m.keys and row["tags"] == m.tags
        assert dict(row["properties"]) == m.properties
        assert row["body"] == m.body and row["body_crc"] == m.body_crc == cl.body_crc(m.body)
        assert (row["sys_flag"], row["flag"], row["reconsume_times"]) == (m.sys_flag, m.flag, m.reconsume_times)
        assert row["store_host"] == "127.0.0.1:10911" and row["born_host"] == "127.0.0.1:54321"
        assert row["msg_id"] == cl.message_id(m.store_host, m.physical_offset)
        seq = parse_seq(m.keys[0])  # and the producer's own idea of the message, independent of the codec
        assert row["body"] == expected_body(seq, SEED, len(row["body"]), pool)
    assert seen == set(want)
    return len(rows)


def check_segments(store: ObjectStore, root: Path, result: dict, rels: list[str]) -> None:
    assert sorted(r["path"] for r in result["segments"]) == sorted(rels)
    for r in result["segments"]:
        data = (root / r["path"]).read_bytes()
        assert r["key"] == layout.lz4c_key(STORE_ID, r["path"], 0) and r["format"] == "lz4c"
        obj = store.get(r["key"])
        assert len(obj) == r["compressed_bytes"] and r["size"] == len(data) and r["block_bytes"] == BLOCK
        assert lz4c.decode(obj) == data and r["crc32c"] == crc32c.crc32c(data)


def check_indexes(store: ObjectStore, root: Path, result: dict, rels: list[str]) -> None:
    assert sorted(r["path"] for r in result["indexes"]) == sorted(rels)
    msgs = messages(root, sorted(str(p.relative_to(root)) for p in (root / "commitlog").iterdir()))
    probes = [ix.build_key(m.topic, k) for m in msgs.values() for k in m.keys + [m.uniq_key]][::3]
    hits = 0
    for r in result["indexes"]:
        side = store.get(r["key"])
        assert r["key"] == layout.cidx_key(STORE_ID, r["path"], 0)
        assert len(side) == r["bytes"] and crc32c.crc32c(side) == r["crc32c"]
        buf = (root / r["path"]).read_bytes()
        header = cidx.parse_header(side[:cidx.HEADER_SIZE])
        def read(off: int, n: int, side: bytes = side) -> bytes:
            return side[off:off + n]

        for key in probes:
            got = cidx.lookup(read, key, 0, LONG_MAX, 64, header)
            assert got == ix.lookup(buf, key, 0, LONG_MAX, 64, SLOTS, ITEMS), (r["path"], key)
            hits += len(got)
    assert hits > 0


def seed_archive(store: ObjectStore, first_segment: str) -> dict[str, str]:
    """Archive objects that the sweep must delete (expired, superseded) or leave alone."""
    t0 = ar.escape_partition_value(f"{TOPIC_PREFIX}0")
    name = first_segment.rsplit("/", 1)[1]
    keys = {
        "expired": f"{STORE_ID}/archive/topic={t0}/date=2000-01-01/part-{name}-g0.parquet",
        "expired_edge": f"{STORE_ID}/archive/topic={t0}/date={TODAY - dt.timedelta(days=8)}/part-x-g0.parquet",
        "kept_edge": f"{STORE_ID}/archive/topic={t0}/date={TODAY - dt.timedelta(days=7)}/part-x-g0.parquet",
        "kept_topic": f"{STORE_ID}/archive/topic=Keep/date=2000-01-01/part-x-g0.parquet",
        "superseded": f"{STORE_ID}/archive/topic={t0}/date={TODAY}/part-{name}-g3.parquet",
        "other_segment": f"{STORE_ID}/archive/topic={t0}/date={TODAY}/part-00000000009999999999-g3.parquet",
        "junk": f"{STORE_ID}/archive/README",
    }
    empty = io.BytesIO()
    pq.write_table(ar.arrow_schema().empty_table(), empty)  # valid, so the archive stays queryable
    for name, key in keys.items():
        store.put(key, b"not parquet" if name == "junk" else empty.getvalue())
    return keys


def check_sweep(store: ObjectStore, result: dict, seeded: dict[str, str]) -> None:
    assert sorted(result["archive_deleted"]) == sorted([seeded["expired"], seeded["expired_edge"]])
    assert result["archive_superseded"] == [seeded["superseded"]]
    for name, key in seeded.items():
        assert store.exists(key) == (name not in ("expired", "expired_edge", "superseded")), name


def check_archive_in_place(root: str, rows: int, want_offsets: set[int], filesystem=None, duckdb_too: bool = True
                           ) -> None:
    """The archive directory (posix) or prefix (S3) read as it lies, by pyarrow and DuckDB: plain Parquet files.

    Files that are not Parquet (the seeded README) are skipped the way a user would: by name or by validity."""
    import pyarrow.dataset as ds

    dset = ds.dataset(root, format="parquet", partitioning="hive", filesystem=filesystem, exclude_invalid_files=True)
    table = dset.to_table(columns=["phys_offset", "topic", "date"])
    assert table.num_rows == rows and set(table.column("phys_offset").to_pylist()) == want_offsets
    assert {t for t in table.column("topic").to_pylist()} >= {f"{TOPIC_PREFIX}0", f"{TOPIC_PREFIX}1"}
    if duckdb_too:
        import duckdb

        con = duckdb.connect()
        got = con.execute(f"SELECT count(*), count(DISTINCT phys_offset), min(phys_offset), max(phys_offset) FROM "
                         f"read_parquet('{root}/**/*.parquet', hive_partitioning = true)").fetchall()[0]
        con.close()
        assert got == (rows, len(want_offsets), min(want_offsets), max(want_offsets))


def check_progress(job_dir: Path, stages: dict[str, list[dict]], result: dict) -> None:
    lines = progress(job_dir)
    for stage, items in stages.items():
        mine = [ln for ln in lines if ln["stage"] == stage]
        assert mine[0] == {"stage": stage, "total": len(items)}
        done = mine[1:]
        assert sorted(ln["path"] for ln in done) == sorted(s["path"] if isinstance(s, dict) else "" for s in items)
        for ln in done:
            assert set(ln) >= {"stage", "path", "ok", "bytes_in", "bytes_out", "error"}
            assert ln["ok"] == (ln["error"] is None)
            if ln["ok"]:
                assert ln["bytes_in"] > 0 and ln["bytes_out"] > 0
    assert sum(not ln.get("ok", True) for ln in lines) == len(result["errors"])


def run_full_job(tmp_path: Path, native: Path, store: ObjectStore, store_spec: dict,
                 crash_index: bool = False) -> tuple[Path, dict, dict]:
    """Upload, seed, run one job with all three stages plus failing items; check everything but the query.

    crash_index: every index-stage task kills its Python worker (a failpoint): each must become an errors[] entry
    while the other stages complete."""
    segs = sealed(native)
    assert len(segs["commitlog"]) >= 5 and len(segs["index"]) >= 4 and segs["consumequeue"]
    compact = segs["commitlog"][:2] + segs["consumequeue"][:2] + segs["index"][:1]
    indexes = segs["index"][:3]
    commitlogs = segs["commitlog"]
    uploaded = {rel: upload(store, native, rel) for rel in set(compact + indexes + commitlogs)}
    seeded = seed_archive(store, commitlogs[0])
    items = {
        "segments": [uploaded[r] for r in compact] + [missing("commitlog/00000000000104857600")],
        "index": [uploaded[r] for r in indexes] + [missing("index/20000101000000000", 40 + SLOTS * 4 + ITEMS * 20)],
        "archive": [uploaded[r] for r in commitlogs] + [missing("commitlog/00000000000209715200"),
                                                       {"path": "commitlog/00000000000314572800"}],
    }
    job = tmp_path / "job-all"
    write_input(job, store_spec, segments=items["segments"], indexes=items["index"], commitlogs=items["archive"],
                retention={"*": 7, "Keep": 100000})
    t0 = time.monotonic()
    r = run_job(job, failpoints="spark.item.index=kill" if crash_index else "")
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((job / "result.json").read_text())
    assert result["job_id"] == "job-all" and not result["ok"]
    errors = {(e["stage"], e["path"]): e["error"] for e in result["errors"]}
    assert len(errors) == len(result["errors"]) == 4 + crash_index * len(indexes), result["errors"]
    for stage, rel in (("segments", "commitlog/00000000000104857600"), ("index", "index/20000101000000000"),
                       ("archive", "commitlog/00000000000209715200")):
        if stage == "index" and crash_index:
            continue
        assert "ObjectNotFound" in errors[(stage, rel)], errors
        assert layout.chunk_key(STORE_ID, rel, 0, "raw", 0) in errors[(stage, rel)]
    assert "'generation' is missing" in errors[("archive", "commitlog/00000000000314572800")]
    check_segments(store, native, result, compact)
    if crash_index:
        assert result["indexes"] == []
        for seg in items["index"]:
            error = errors[("index", seg["path"])]
            assert "Py4JJavaError" in error and "Python worker exited unexpectedly" in error, error
            assert len(error) <= 1100 and "\tat " not in error
    else:
        check_indexes(store, native, result, indexes)
    rows = check_archive(store, native, result, commitlogs)
    check_sweep(store, result, seeded)
    check_progress(job, items, result)
    print(f"\njob wall {wall:.1f} s, session start {result['session_start_seconds']} s, stages "
          f"{json.dumps(result['stages'])}, {rows} archive rows")
    return job, result, seeded


# ---------------------------------------------------------------------------------------------- pure parts


def test_partition_escaping_and_keys_round_trip():
    for topic in ("TopicA", "%RETRY%group", "%DLQ%g|x", "a/b=c:d", "Ünïcode", ""):
        key = ar.archive_key("sid", topic, "2026-11-21", "00000000001073741824", 2)
        k = ar.parse_archive_key("sid", key)
        assert (k.topic, k.date, k.segment_name, k.generation) == (topic, dt.date(2026, 11, 21),
                                                                    "00000000001073741824", 2)
        assert key.count("/") == 4
    assert ar.archive_key("sid", "%RETRY%g", "2026-01-02", "0", 0) == \
        "sid/archive/topic=%25RETRY%25g/date=2026-01-02/part-0-g0.parquet"
    for junk in ("sid/archive/README", "sid/archive/topic=a/date=bad/part-0-g0.parquet",
                 "sid/archive/topic=a/date=2026-01-01/other.parquet", "other/archive/topic=a/date=2026-01-01/x"):
        assert ar.parse_archive_key("sid", junk) is None


def test_segments_are_grouped_into_tasks_of_a_sensible_size():
    from tierfs.spark.job import TASK_BYTES, plan_tasks

    gib, mib = 1 << 30, 1 << 20
    assert plan_tasks([gib] * 3, 2) == [[0], [1], [2]]  # big segments: a task each
    assert plan_tasks([], 4) == []
    small = plan_tasks([6 * mib] * 40, 2)  # ConsumeQueue-sized files share tasks, still 2 or more per core
    assert sorted(i for t in small for i in t) == list(range(40)) and 4 <= len(small) <= 5
    mixed = plan_tasks([gib] + [mib] * 300 + [gib], 2)
    assert mixed[0] == [0] and mixed[-1] == [301] and all(len(t) * mib <= TASK_BYTES for t in mixed[1:-1])


def test_driver_class_data_archive_plan(tmp_path, monkeypatch):
    """One archive per Java runtime and classpath settings, whatever the job directory: the first job records it,
    the next ones map it; turned off by the environment or by a job's own class-sharing options."""
    from tierfs.spark import cds
    from tierfs.spark.job import JobInput, QUICK_JVM, spark_conf

    monkeypatch.setenv(cds.ENV, str(tmp_path / "cds"))
    base = {"spark.driver.extraJavaOptions": QUICK_JVM, "spark.master": "local[2]"}
    first = cds.plan(base)
    assert first is not None and first.tmp is not None and "-XX:ArchiveClassesAtExit=" in first.java_options
    assert first.tmp.parent == first.archive.parent == tmp_path / "cds"
    other = cds.plan({**base, "spark.driver.extraClassPath": "/opt/x.jar"})
    assert other is not None and other.archive != first.archive
    first.archive.write_bytes(b"archive")  # what publish() moves into place when the recording JVM exits
    mapped = cds.plan({**base, "spark.master": "spark://127.0.0.1:7077"})
    assert (mapped.archive, mapped.tmp) == (first.archive, None)
    assert f"-XX:SharedArchiveFile={first.archive}" in mapped.java_options
    inp = JobInput(job_dir=tmp_path / "job", job_id="j", stages=[], store={}, store_id="s", spark=base, items={},
                   max_hash_slot_num=1, max_index_num=1, retention={}, today=dt.date(2026, 1, 1))
    opts = spark_conf(inp, mapped)["spark.driver.extraJavaOptions"]
    assert opts.startswith(QUICK_JVM) and "log4j2.configurationFile" in opts and opts.endswith(mapped.java_options)
    assert cds.plan({**base, "spark.driver.extraJavaOptions": "-Xshare:off"}) is None
    monkeypatch.setenv(cds.ENV, "off")
    assert cds.plan(base) is None


def test_field_columns_gathered_by_arrow_equal_the_byte_ranges():
    """_Writer._binary/_text build field columns from numpy-made binary views: empty values, values of up to 12
    bytes (inline in the view), longer ones, values ending the buffer, invalid UTF-8 (replaced like bytes.decode)."""
    import random

    import numpy as np

    w = ar._Writer("/nonexistent")
    rnd = random.Random(5)
    for _ in range(200):
        data = bytes(rnd.choice(b"ab\xff\xc3\xa9 ") for _ in range(rnd.randrange(0, 120)))
        spans = [(a, rnd.randrange(0, len(data) - a + 1)) for a in
                 (rnd.randrange(0, len(data) + 1) for _ in range(rnd.randrange(0, 12)))]
        at = np.array([a for a, _ in spans], np.int64)
        length = np.array([n for _, n in spans], np.int64)
        want = [data[a:a + n] for a, n in spans]
        assert w._binary(memoryview(data), at, length).to_pylist() == want
        assert w._text(memoryview(data), at, length).to_pylist() == [v.decode("utf-8", "replace") for v in want]


def test_job_drops_a_class_data_archive_its_driver_cannot_start_with(tmp_path, monkeypatch):
    """A damaged archive (a truncated one crashes the JVM that maps it) must not stop every later job: the driver
    removes it and starts without one. The failpoint stands for the crash."""
    from tierfs.spark import cds
    from tierfs.spark.job import QUICK_JVM

    monkeypatch.setenv(cds.ENV, str(tmp_path / "cds"))
    spark = {"spark.master": "local[1]"}
    planned = cds.plan({"spark.driver.extraJavaOptions": QUICK_JVM, **spark})
    planned.archive.write_bytes(b"damaged")
    job = tmp_path / "job"
    job.mkdir()
    # one segment to compact (its object is missing: an item error), so that the job starts Spark
    seg = {"path": "commitlog/00000000000000000000", "generation": 1, "size": 4096, "format": "raw",
           "objects": ["s/seg/missing"]}
    (job / "input.json").write_text(json.dumps({"job_id": "cds", "stages": ["segments"], "store_id": "s",
                                                "spark": spark, "segments": [seg],
                                                "store": {"url": f"file://{tmp_path / 'objects'}"}}))
    r = run_job(job, failpoints="spark.session.cds")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((job / "result.json").read_text())
    assert result["session_start_seconds"] > 0 and [e["path"] for e in result["errors"]] == [seg["path"]], result
    assert "which is removed" in r.stderr and not planned.archive.exists()


def test_retention_boundaries():
    today = dt.date(2026, 11, 21)
    assert not ar.is_expired(dt.date(2026, 11, 14), 7, today)  # today and the 7 dates before it are kept
    assert ar.is_expired(dt.date(2026, 11, 13), 7, today)
    assert ar.is_expired(dt.date(2026, 11, 20), 0, today) and not ar.is_expired(today, 0, today)
    assert not ar.is_expired(dt.date(2026, 11, 20), 0.5, today)
    assert not ar.is_expired(dt.date(1970, 1, 1), None, today)
    assert ar.retention_days({"*": 3, "A": 9}, "A") == 9 and ar.retention_days({"*": 3}, "B") == 3
    assert ar.retention_days({"A": 9}, "B") is None
    assert not ar.is_expired(dt.date(2000, 1, 1), 1e9, today)


def test_column_wise_properties_match_the_broker_decoder(tmp_path):
    """KEYS, TAGS and the properties map parsed column-wise by Arrow equal MessageDecoder's rules (the codec's
    string_to_properties): empty names or values dropped, the last of a name wins, with or without the trailing
    separator, a value holding NAME_VALUE_SEPARATOR, unicode, and KEYS tokens split on single spaces."""
    raws = ["", "\x02", "KEYS\x01k1 k2\x02TAGS\x01t\x02", "KEYS\x01 a  b \x02TAGS\x01x\x02TAGS\x01y",
            "\x01v\x02n\x01\x02KEYS\x01\x02TAGS\x01\x02", "A\x01b\x01c\x02\x02\x02B\x01\u00fc\u20ac",
            "KEYS\x01one\x02KEYS\x01two three\x02KEYS\x01\x02", "novalue\x02=\x01=\x02", "TAGS\x01a\x02b"]
    w = ar._Writer(str(tmp_path))
    props, keys, tags = w._property_columns(raws)
    for raw, p, k, t in zip(raws, props.to_pylist(), keys.to_pylist(), tags.to_pylist()):
        want = cl.string_to_properties(raw)
        assert dict(p) == want, raw
        m = cl.Message(topic="T", properties=want)
        assert (k, t) == (m.keys, m.tags), raw


def test_decoder_refuses_what_is_not_a_sealed_segment(native):
    rel = sealed(native)["commitlog"][0]
    data = bytearray((native / rel).read_bytes())
    name = rel.rsplit("/", 1)[1]

    def blocks(buf):
        return [bytes(buf[i:i + 4096]) for i in range(0, len(buf), 4096)]

    good = list(ar.iter_messages(blocks(data), name, len(data)))
    assert len(good) == len(messages(native, [rel]))
    second = good[1][0]
    bad = bytearray(data)
    bad[second + 200] ^= 0xFF  # a body byte: BODYCRC mismatch
    with pytest.raises(ar.ArchiveError, match=f"record at position {second} is invalid"):
        list(ar.iter_messages(blocks(bad), name, len(bad)))
    with pytest.raises(ar.ArchiveError, match="content ends at position"):
        list(ar.iter_messages(blocks(data[:second + 50]), name, len(data)))
    with pytest.raises(ar.ArchiveError, match="BLANK at position .* has TOTALSIZE"):
        list(ar.iter_messages(blocks(data), name, len(data) + 4096))
    with pytest.raises(ar.ArchiveError, match="expected 1048576"):  # PHYSICALOFFSET disagrees with the name
        list(ar.iter_messages(blocks(data), "00000000000001048576", len(data)))


def test_archive_task_reads_lz4c_segments_and_skips_expired_partitions(native, tmp_path):
    """The executor task alone (no Spark): an lz4c segment archives like its raw form; expired rows are skipped."""
    from tierfs.spark.tasks import compact_segment

    store = open_store(f"file://{tmp_path}/objects")
    rel = sealed(native)["commitlog"][1]
    raw = upload(store, native, rel)
    row = compact_segment(store, STORE_ID, raw)
    lz = dict(raw, format="lz4c", objects=[row["key"]])
    got = ar.archive_segment(store, STORE_ID, lz, {"*": 7}, TODAY)
    n = len(messages(native, [rel]))
    assert got["rows"] == n and got["expired_rows"] == 0 and got["bytes_read"] >= CL_SIZE - 8192
    assert sorted(r["phys_offset"] for r in archive_rows(store, got["keys"])) == sorted(messages(native, [rel]))
    later = ar.archive_segment(store, STORE_ID, raw, {"*": 7, f"{TOPIC_PREFIX}1": 30}, TODAY + dt.timedelta(days=9))
    assert later["expired_rows"] + later["rows"] == n and later["rows"] > 0
    assert all(k.split("/")[2] == "topic=%25RETRY%25Grp1" for k in later["keys"])


BAD_INPUTS = [
    ("missing", None, "input.json does not exist"),
    ("not-json", "{not json", "is not valid JSON: Expecting property name"),
    ("unknown-stage", {"stages": ["archive", "compact"]}, 'unknown stage(s) "compact"'),
    ("non-local-posix", {"spark": {"spark.master": "spark://10.0.0.1:7077"}},
     ("the posix object store is not visible to cluster executors; set objectstore.posix_shared=true if it is on "
      "shared storage")),
    ("not-spark-key", {"spark": {"master": "local[2]"}}, "'spark' key 'master' is not a Spark setting"),
    ("bad-url", {"store": {"url": "ftp://host/x", "options": {}}}, "unknown scheme 'ftp'"),
    ("bad-option", {"store": {"url": "file:///tmp/x", "options": {"colour": 1}}}, "unknown option(s) colour"),
    ("bad-retention", {"retention": {"*": -1}}, "'retention' of topic '*' must be a number of days >= 0"),
    ("bad-table-expiry", {"table_expiry": {"retention_days": 7, "vacuum_grace_hours": 0.5}},
     "'table_expiry' must be an object with retention_days (a number >= 0) and vacuum_grace_hours (an integer"),
]


@pytest.mark.parametrize("name,doc,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_before_spark_starts(tmp_path, name, doc, message):
    job = tmp_path / name
    job.mkdir()
    if isinstance(doc, str):
        (job / "input.json").write_text(doc)
    elif isinstance(doc, dict):
        write_input(job, **{"store": {"url": f"file://{tmp_path}/objects", "options": {}}, **doc})
    t0 = time.monotonic()
    r = run_job(job, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr and r.stderr.startswith("tierfs.spark: error: "), r.stderr
    assert time.monotonic() - t0 < 20  # no JVM was started
    assert not (job / "result.json").exists() and not (job / "progress.jsonl").exists()


# ---------------------------------------------------------------------------------------------- Spark runs


def test_posix_job_all_stages_then_query_the_archive(native, tmp_path):
    objects = tmp_path / "objects"
    store = open_store(f"file://{objects}")
    run_full_job(tmp_path, native, store, {"url": f"file://{objects}", "options": {}})
    msgs = messages(native, sealed(native)["commitlog"])
    check_archive_in_place(str(objects / ar.archive_prefix(STORE_ID)), len(msgs), set(msgs))
    # examples/archive_query.py: Spark SQL over the archive agrees with the codec's count per topic and date
    want: dict[tuple[str, str], int] = {}
    for m in messages(native, sealed(native)["commitlog"]).values():
        day = dt.datetime.fromtimestamp(m.store_timestamp / 1000, dt.timezone.utc).date().isoformat()
        want[(m.topic, day)] = want.get((m.topic, day), 0) + 1
    topics = sorted({t for t, _ in want})
    r = subprocess.run([sys.executable, str(QUERY), "--store", f"file://{objects}", "--store-id", STORE_ID,
                        "--topic", topics[0], "--topic", topics[1], "--master", "local[2]", "--json", "counts"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {(row["topic"], row["date"]): row["messages"] for row in map(json.loads, r.stdout.splitlines())}
    assert got == want


def test_s3_job_all_stages_with_crashing_workers(native, tmp_path, rgw):
    bucket = rgw.make_bucket("spark-job")
    spec = {"url": f"s3://{bucket}/t", "options": {"endpoint_url": rgw.endpoint_url, "access_key": rgw.access_key,
                                                     "secret_key": rgw.secret_key, "region": rgw.region,
                                                     "addressing": "path", "max_attempts": 2}}
    store = open_store(spec["url"], **spec["options"])
    job, _, _ = run_full_job(tmp_path, native, store, spec, crash_index=True)
    from pyarrow.fs import S3FileSystem

    host = rgw.endpoint_url.split("://", 1)[1]
    fs = S3FileSystem(access_key=rgw.access_key, secret_key=rgw.secret_key, endpoint_override=host, scheme="http",
                      region=rgw.region)
    msgs = messages(native, sealed(native)["commitlog"])
    check_archive_in_place(f"{bucket}/t/{ar.archive_prefix(STORE_ID)}".rstrip("/"), len(msgs), set(msgs), fs,
                           duckdb_too=False)  # DuckDB reads S3 through its httpfs extension, a download
    assert rgw.secret_key not in (job / "progress.jsonl").read_text() + (job / "result.json").read_text()


def test_job_killed_midway_leaves_no_result(native, tmp_path):
    objects = tmp_path / "objects"
    store = open_store(f"file://{objects}")
    segs = [upload(store, native, rel) for rel in sealed(native)["commitlog"]]
    job = tmp_path / "job-kill"
    write_input(job, {"url": f"file://{objects}", "options": {}}, stages=["archive"], commitlogs=segs)
    proc = subprocess.Popen([sys.executable, "-m", "tierfs.spark", "--job-dir", str(job)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ((job / "progress.jsonl").exists() and (job / "progress.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no progress line"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert progress(job)[0] == {"stage": "archive", "total": len(segs)}
        assert not (job / "result.json").exists()
        assert not [p for p in job.iterdir() if p.name.startswith(".result")]
        # the JVM notices its driver is gone (stdin EOF) and exits with its Python workers
        deadline = time.monotonic() + 60
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(proc.pid), "the job's JVM outlived the killed driver"
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stderr.close()


def _group_alive(pgid: int) -> bool:
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.getpgid(int(p)) == pgid and Path(f"/proc/{p}/stat").read_text().split(") ")[1][0] != "Z":
                    return True
            except (OSError, IndexError):
                continue
    return False
