"""The archive as a Delta Lake table (archive.format = "delta"): exactly once, on a real local SparkSession.

The store is the byte-accurate one of tests/test_spark_job.py (examples/producer.py, two topics, two queues each);
its CommitLog segments are uploaded as raw chunk objects with distinct generations, as the engine's one sequence
gives them. The job is killed (SIGKILL of the driver, a failpoint) between writing the data files and the commit,
then between the commit and its result, and run again each time: the table must hold every message exactly once,
(topic, queue, offset) by (topic, queue, offset), field by field against a decode of the native files, read by
delta-rs, by DuckDB and by Spark SQL (Delta Lake's Spark runtime: tests/deltaspark.py), in place on the posix store
and on Ceph RGW.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from test_spark_job import (REPO, SEED, STORE_ID, TODAY, TOPIC_PREFIX, _group_alive, messages, native,  # noqa: F401
                            sealed, upload, write_input)
from sparkcluster import spark_cluster  # noqa: F401 (the fixture)
import deltaspark as ds
from deltaspark import delta_sql  # noqa: F401 (the fixture)
from tierfs.objectstore import ObjectStore, open_store
from tierfs.spark import archive as ar
from tierfs.spark import table as tb
from tierfs.store import commitlog as cl

sys.path.insert(0, str(REPO / "examples"))
from producer import body_pool, expected_body, parse_seq  # noqa: E402

GEN0 = 1000  # generations of the uploaded segments: GEN0, GEN0 + 1, ...


# ---------------------------------------------------------------------------------------------- pure parts


def test_table_file_names_are_safe_and_parse_back():
    for topic in ("%RETRY%Grp0", "a/b", "T_1", "tōpic", ""):
        rel = ar.table_file("broker a", "slave/commitlog/00000000001073741824", 7, "s 1", topic, "2026-01-02")
        assert all(c.isalnum() or c in "=/.-_~" for c in rel), rel
        assert rel.startswith(f"topic={ar.safe_name(topic)}/date=2026-01-02/")
        assert ar.parse_table_file(rel) == (ar.safe_name("broker a"), ar.safe_name("commitlog~00000000001073741824"),
                                            7)
    assert ar.safe_name("a_b") != ar.safe_name("a/b") and ar.safe_name("a_2Fb") != ar.safe_name("a/b")
    assert ar.parse_table_file("topic=x/date=2026-01-01/other.parquet") is None


def test_a_segment_has_one_key_on_every_replica_and_its_content_a_digest():
    """Master and slave (two stores, or two roots of one mount) name a segment alike when their broker is named;
    unnamed stores and roots never share a group. The digest follows every block's crc32c."""
    Z = "0" * 20
    assert ar.segment_base("slave/commitlog/00000000001073741824") == ar.segment_base("commitlog/00000000001073741824")
    assert ar.segment_base("n1/dledger-n1/data/00000000000000000000") == "dledger~00000000000000000000"
    assert ar.broker_group("broker-a", "m", f"master/commitlog/{Z}") == \
        ar.broker_group("broker-a", "s", f"commitlog/{Z}")
    assert ar.broker_group("", "m", f"master/commitlog/{Z}") == ("m", "m/master")
    assert ar.broker_group("", "m", f"slave/commitlog/{Z}")[1] != ar.broker_group("", "m", f"master/commitlog/{Z}")[1]
    seg = {"path": "commitlog/0", "size": 4, "crc32c": 9, "block_crcs": [1, 2]}
    d = ar.content_digest(seg)
    assert 0 <= d < 1 << 62 and d == ar.content_digest(dict(seg, path=f"slave/commitlog/{Z}", generation=5))
    assert d != ar.content_digest(dict(seg, block_crcs=[1, 3])) and d != ar.content_digest(dict(seg, size=5))
    with pytest.raises(ar.ArchiveError, match="commitlog/0: the segment entry has no crc32c"):
        ar.content_digest({"path": "commitlog/0", "size": 4})


def test_the_broker_name_a_controller_mode_broker_records():
    from tierfs.store import brokeridentity

    assert brokeridentity.parse("DefaultCluster#broker-a#1\n") == "broker-a"
    assert brokeridentity.parse("broker-a") == brokeridentity.parse("a##1") == brokeridentity.parse("") == ""


def test_files_of_other_content_of_the_same_segment_are_superseded():
    seg = "commitlog/00000000000000000000"
    paths = [ar.table_file("g", seg, d, "s1", "T", "2026-01-01") for d in (3, 5, 9)]
    paths += [ar.table_file("g", "slave/" + seg, 3, "s2", "T", "2026-01-02"),  # a replica's copy: same segment
              ar.table_file("h", seg, 3, "s1", "T", "2026-01-01"),            # another group
              ar.table_file("g", "commitlog/1", 3, "s1", "T", "2026-01-01")]  # another segment
    assert tb.superseded(paths, [{"path": seg, "group": "g", "digest": 5}]) == [paths[0], paths[2], paths[3]]


# ---------------------------------------------------------------------------------------------- a Spark job


def _job(job_dir: Path, failpoints: str = "") -> subprocess.CompletedProcess:
    """Run the job in its own process group; after a kill, wait for the group (the driver's JVM) to go."""
    env = {k: v for k, v in os.environ.items() if k != "TIERFS_FAILPOINTS"}
    if failpoints:
        env["TIERFS_FAILPOINTS"] = failpoints
    proc = subprocess.Popen([sys.executable, "-m", "tierfs.spark", "--job-dir", str(job_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:  # killed: the JVM notices its driver is gone (stdin EOF) and exits
        import time

        deadline = time.monotonic() + 60
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def table_rows(uri: str, columns: list[str] | None = None):
    from deltalake import DeltaTable

    return DeltaTable(uri).to_pyarrow_table(columns=columns)


def check_rows(native: Path, rels: list[str], uri: str) -> int:
    """Every message of these segments is in the table exactly once, field by field; returns the row count."""
    want = messages(native, rels)
    rows = table_rows(uri).to_pylist()
    ids = Counter((r["topic"], r["queue_id"], r["queue_offset"]) for r in rows)
    assert max(ids.values()) == 1, [k for k, n in ids.items() if n > 1][:5]
    assert len(rows) == len(want) and {r["phys_offset"] for r in rows} == set(want)
    assert set(ids) == {(m.topic, m.queue_id, m.queue_offset) for m in want.values()}
    pool = body_pool(SEED)
    gens = {rel: GEN0 + i for i, rel in enumerate(sorted(rels))}
    for r in rows:
        m = want[r["phys_offset"]]
        store_ts = dt.datetime.fromtimestamp(m.store_timestamp / 1000, dt.timezone.utc)
        assert r["topic"] == m.topic and r["topic"].startswith(TOPIC_PREFIX)
        assert r["date"] == store_ts.date() and r["store_timestamp"] == store_ts
        assert r["born_timestamp"] == dt.datetime.fromtimestamp(m.born_timestamp / 1000, dt.timezone.utc)
        assert (r["queue_id"], r["queue_offset"]) == (m.queue_id, m.queue_offset)
        assert r["keys"] == m.keys and r["tags"] == m.tags and dict(r["properties"]) == m.properties
        assert r["body"] == m.body == expected_body(parse_seq(m.keys[0]), SEED, len(m.body), pool)
        assert r["msg_id"] == cl.message_id(m.store_host, m.physical_offset)
        seg = f"commitlog/{m.physical_offset // (1 << 20) * (1 << 20):020d}"
        assert (r["broker"], r["store_id"], r["segment"]) == ("broker-a", STORE_ID, seg)
        assert r["segment_generation"] == gens[seg]
    return len(rows)


def spark_sql_reads_every_message(spark, path: str, native: Path, rels: list[str]) -> None:
    """Spark SQL reads the table in place: every message of these segments once, (topic, queue, offset) by
    (topic, queue, offset) with its body and keys; the README's query gives one topic's history in order."""
    want = {(m.topic, m.queue_id, m.queue_offset): m for m in messages(native, rels).values()}
    rows = spark.sql(f"SELECT topic, queue_id, queue_offset, keys, body FROM delta.`{path}`").collect()
    assert Counter((r.topic, r.queue_id, r.queue_offset) for r in rows) == Counter(want.keys())
    for r in rows:
        m = want[(r.topic, r.queue_id, r.queue_offset)]
        assert (bytes(r.body), list(r.keys)) == (m.body, m.keys)
    topic = sorted({k[0] for k in want})[0]
    hist = spark.sql("SELECT queue_id, queue_offset, store_timestamp, keys, body "  # the README's query
                     f"FROM delta.`{path}` WHERE topic = '{topic}' ORDER BY queue_id, queue_offset").collect()
    assert [(r.queue_id, r.queue_offset, bytes(r.body)) for r in hist] == \
        [(k[1], k[2], want[k].body) for k in sorted(k for k in want if k[0] == topic)]
    assert all(r.store_timestamp == dt.datetime.fromtimestamp(want[(topic, r.queue_id, r.queue_offset)]
                                                             .store_timestamp / 1000, dt.timezone.utc)
               .replace(tzinfo=None) for r in hist)
    # registered by name in the session's catalog (a Hive metastore or Unity Catalog takes the same statement):
    # an external table over the same log, dropped again without touching the files
    spark.sql(f"CREATE TABLE tierfs_messages USING DELTA LOCATION '{path}'")
    try:
        n = spark.sql(f"SELECT count(*) AS n FROM tierfs_messages WHERE topic = '{topic}'").collect()[0].n
        assert n == len(hist)
    finally:
        spark.sql("DROP TABLE tierfs_messages")
    assert spark.sql(f"SELECT count(*) AS n FROM delta.`{path}`").collect()[0].n == len(want)


def test_table_exactly_once_across_kills_then_duckdb_and_spark_sql_read_it(native, tmp_path, delta_sql):
    from deltalake import DeltaTable

    objects = tmp_path / "objects"
    store: ObjectStore = open_store(f"file://{objects}")
    rels = sorted(sealed(native)["commitlog"])
    assert len(rels) >= 5
    segs = [upload(store, native, rel, GEN0 + i) for i, rel in enumerate(rels)]
    uri = f"file://{objects}/tables/messages"
    spec = {"url": f"file://{objects}", "options": {}}

    def job(name: str, items: list[dict], failpoints: str = "") -> tuple[subprocess.CompletedProcess, Path]:
        d = tmp_path / name
        write_input(d, spec, stages=["archive"], commitlogs=items, archive_format="delta", broker="broker-a")
        return _job(d, failpoints), d

    # 1. killed after every data file is written, before the commit: nothing is in the table
    r, d = job("kill-before", segs, "archive.table.before_commit=kill")
    assert r.returncode == -signal.SIGKILL and not (d / "result.json").exists(), r.stderr[-2000:]
    files = [p for p in (objects / "tables/messages").rglob("*.parquet")]
    assert len(files) >= len(segs)  # written ...
    assert not (objects / "tables/messages/_delta_log").exists()  # ... and not committed

    # 2. the re-run commits, and is killed before its result: the daemon would run it again
    r, d = job("kill-after", segs, "archive.table.after_commit=kill")
    assert r.returncode == -signal.SIGKILL and not (d / "result.json").exists(), r.stderr[-2000:]
    assert DeltaTable(uri).version() == 0
    n = check_rows(native, rels, uri)

    # 3. the next run finds every generation committed: no file written, no commit, every segment reported
    r, d = job("rerun", segs)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((d / "result.json").read_text())
    assert result["ok"] and sorted(x["path"] for x in result["archive"]) == rels
    assert all(x["committed_before"] and x["keys"] == [] for x in result["archive"])
    assert DeltaTable(uri).version() == 0 and check_rows(native, rels, uri) == n

    # 4. a segment compacted to lz4c keeps its content: not archived again; nor is a new generation of a segment
    # whose bytes were written again unchanged (other content replaces: test_master_and_slave_archive_once)
    from tierfs.spark.tasks import compact_segment

    lz = compact_segment(store, STORE_ID, segs[0])
    lz4c_seg = dict(segs[0], format="lz4c", objects=[lz["key"]])
    regen = upload(store, native, rels[1], GEN0 + 100)
    r, d = job("regen", [lz4c_seg, regen])
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((d / "result.json").read_text())
    assert result["ok"], result["errors"]
    assert all(x.get("committed_before") for x in result["archive"]) and len(result["archive"]) == 2
    assert DeltaTable(uri).version() == 0 and check_rows(native, rels, uri) == n

    # 5. DuckDB reads the same rows (through delta-rs' Arrow dataset: its delta extension is a download)
    import duckdb

    messages_ds = DeltaTable(uri).to_pyarrow_dataset()  # noqa: F841 - DuckDB finds it by name
    con = duckdb.connect()
    got = con.execute("SELECT count(*), count(DISTINCT (topic, queue_id, queue_offset)), count(DISTINCT topic) "
                      "FROM messages_ds").fetchall()[0]
    assert got == (n, n, 2)
    want = Counter(m.topic for m in messages(native, rels).values())
    topic = sorted(want)[0]
    got = con.execute("SELECT count(*), min(queue_offset) FROM messages_ds WHERE topic = ?", [topic]).fetchall()[0]
    assert got == (want[topic], 0)
    con.close()

    # 6. Spark SQL reads the same rows, through Delta Lake's Spark runtime
    spark_sql_reads_every_message(delta_sql, uri, native, rels)


def test_bad_archive_format_in_the_input_is_refused(tmp_path):
    d = tmp_path / "bad"
    write_input(d, {"url": f"file://{tmp_path}/o", "options": {}}, stages=["archive"], archive_format="iceberg")
    r = subprocess.run([sys.executable, "-m", "tierfs.spark", "--job-dir", str(d)], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2 and "'archive_format' must be one of parquet, delta" in r.stderr


@pytest.mark.parametrize("value", ["iceberg", "Parquet2"])
def test_archive_format_config_names_the_key_and_the_choices(value):
    from tierfs.config import SCHEMA, ConfigError

    key = next(k for k in SCHEMA if k.name == "archive.format")
    with pytest.raises(ConfigError, match="config key 'archive.format'.*allowed: one of delta, parquet"):
        key.parse(value)


def test_table_on_ceph_rgw_commits_once_and_reads_in_place(native, tmp_path, rgw, delta_sql):
    """The same table on S3 (Ceph RGW): commits are put-if-absent log objects; a re-run adds nothing; delta-rs,
    DuckDB and Spark SQL (S3A) read it from the bucket."""
    from deltalake import DeltaTable

    bucket = rgw.make_bucket("archive-table")
    spec = {"url": f"s3://{bucket}/t", "options": {"endpoint_url": rgw.endpoint_url, "access_key": rgw.access_key,
                                                     "secret_key": rgw.secret_key, "region": rgw.region,
                                                     "addressing": "path", "max_attempts": 2}}
    store = open_store(spec["url"], **spec["options"])
    rels = sorted(sealed(native)["commitlog"])
    segs = [upload(store, native, rel, GEN0 + i) for i, rel in enumerate(rels)]
    table = tb.TableSpec.of_store(spec["url"], spec["options"])
    for name, failpoints in (("kill-after", "archive.table.after_commit=kill"), ("rerun", "")):
        d = tmp_path / name
        write_input(d, spec, stages=["archive"], commitlogs=segs, archive_format="delta", broker="broker-a")
        r = _job(d, failpoints)
        assert r.returncode == (-signal.SIGKILL if failpoints else 0), r.stderr[-3000:]
    result = json.loads((tmp_path / "rerun" / "result.json").read_text())
    assert result["ok"] and all(x["committed_before"] for x in result["archive"])
    dt_ = DeltaTable(table.uri, storage_options=table.storage_options)
    assert dt_.version() == 0
    t = dt_.to_pyarrow_table(columns=["topic", "queue_id", "queue_offset", "phys_offset"])
    want = messages(native, rels)
    assert t.num_rows == len(want) and set(t.column("phys_offset").to_pylist()) == set(want)
    import duckdb

    messages_ds = dt_.to_pyarrow_dataset()  # noqa: F841 - DuckDB finds it by name
    got = duckdb.connect().execute("SELECT count(DISTINCT (topic, queue_id, queue_offset)) FROM messages_ds")
    assert got.fetchall()[0][0] == len(want)
    topic = sorted({m.topic for m in want.values()})[0]
    got = duckdb.connect().execute("SELECT count(*) FROM messages_ds WHERE topic = ?", [topic]).fetchall()[0][0]
    assert got == sum(m.topic == topic for m in want.values())
    ds.s3a(delta_sql, rgw.endpoint_url, rgw.access_key, rgw.secret_key, rgw.region)
    spark_sql_reads_every_message(delta_sql, f"s3a://{bucket}/t/{tb.TABLE_PREFIX.rstrip('/')}", native, rels)
    assert rgw.secret_key not in (tmp_path / "rerun" / "result.json").read_text()
    # what two stores committing at once rely on: the log's next commit is created only if absent
    from botocore.exceptions import ClientError

    c = rgw.client()
    key = f"t/{tb.TABLE_PREFIX}_delta_log/{0:020d}.json"
    with pytest.raises(ClientError, match="PreconditionFailed"):
        c.put_object(Bucket=bucket, Key=key, Body=b"{}", IfNoneMatch="*")
    two = DeltaTable(table.uri, storage_options=table.storage_options)
    assert two.version() == 0
    assert two.transaction_version(tb.app_id("broker-a", segs[0]["path"])) == ar.content_digest(segs[0])


def test_table_on_a_standalone_cluster_killed_mid_commit(native, tmp_path, spark_cluster):
    """Executors of a real standalone cluster (whose Python has no tierfs) write the data files of a multi-topic
    store; the driver is killed before its commit, then after it; the re-run finds everything committed once."""
    objects = tmp_path / "objects"
    store = open_store(f"file://{objects}")
    rels = sorted(sealed(native)["commitlog"])
    segs = [upload(store, native, rel, GEN0 + i) for i, rel in enumerate(rels)]
    spec = {"url": f"file://{objects}", "options": {}}
    uri = f"file://{objects}/tables/messages"
    for name, failpoints in (("kill-before", "archive.table.before_commit=kill"),
                             ("kill-after", "archive.table.after_commit=kill"), ("rerun", "")):
        d = tmp_path / name
        write_input(d, spec, stages=["archive"], commitlogs=segs, archive_format="delta", broker="broker-a",
                    posix_shared=True, spark=spark_cluster.conf())
        r = _job(d, failpoints)
        assert r.returncode == (-signal.SIGKILL if failpoints else 0), r.stderr[-3000:]
        if name == "kill-before":
            assert list((objects / "tables/messages").rglob("*.parquet"))
            assert not (objects / "tables/messages/_delta_log").exists()
    result = json.loads((tmp_path / "rerun" / "result.json").read_text())
    assert result["ok"] and all(x["committed_before"] for x in result["archive"])
    assert list(spark_cluster.root.glob("worker*/app-*/*/tierfs-package.zip"))  # the executors had no tierfs
    check_rows(native, rels, uri)


def test_an_unreadable_table_fails_each_segment_not_the_job(native, tmp_path):
    """A damaged log (here: a commit that is not JSON) makes every segment an error naming the table; nothing is
    written, and the job still gives its result."""
    objects = tmp_path / "objects"
    store = open_store(f"file://{objects}")
    rels = sorted(sealed(native)["commitlog"])[:2]
    segs = [upload(store, native, rel, GEN0 + i) for i, rel in enumerate(rels)]
    log = objects / "tables/messages/_delta_log"
    log.mkdir(parents=True)
    (log / f"{0:020d}.json").write_text("not json\n")
    d = tmp_path / "job"
    write_input(d, {"url": f"file://{objects}", "options": {}}, stages=["archive"], commitlogs=segs,
                archive_format="delta")
    r = _job(d)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((d / "result.json").read_text())
    assert not result["ok"] and result["archive"] == []
    assert sorted(e["path"] for e in result["errors"]) == rels
    assert all(f"archive table file://{objects}/tables/messages cannot be read" in e["error"]
               for e in result["errors"]), result["errors"]
    assert not list((objects / "tables/messages").rglob("*.parquet"))


# ---------------------------------------------------------------------------------------------- a broker group


def rewrite(data: bytes, change, start: float = 0.0) -> bytes:
    """A copy of a sealed CommitLog segment whose messages from `start` (a share of the records) on are
    change(message), re-encoded in place: the same layout, valid CRCs (a rewritten range, or old store times)."""
    recs = [(pos, rec) for pos, rec in cl.iter_records(data, check_crc=True) if isinstance(rec, cl.Message)]
    out = bytearray(data)
    for pos, rec in recs[int(len(recs) * start):]:
        enc = cl.encode_message(change(rec))
        assert len(enc) == rec.total_size
        out[pos:pos + len(enc)] = enc
    return bytes(out)


def place(root: Path, rel: str, data: bytes) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)


def identities(uri: str) -> Counter:
    t = table_rows(uri, ["broker", "topic", "queue_id", "queue_offset"])
    return Counter(zip(*(t.column(c).to_pylist() for c in ("broker", "topic", "queue_id", "queue_offset"))))


def test_master_and_slave_archive_each_message_once(native, tmp_path):
    """A master's and its slave's stores (byte-identical segments at the same offsets) archive into one table:
    each message once per (broker group, topic, queue, offset), whichever store archives first, and when both
    are roots of one mount archived by one job (the replica's job, with nothing to write, starts no Spark). A replica whose segment an unclean election rewrote replaces the
    segment's rows (reported), never adds to them. Fails on the per-store keying (each store's rows added)."""
    import dataclasses

    objects = tmp_path / "objects"
    store = open_store(f"file://{objects}")
    uri = f"file://{objects}/tables/messages"
    spec = {"url": f"file://{objects}", "options": {}}
    rels = sorted(sealed(native)["commitlog"])
    group = tmp_path / "group"
    for rel in rels:
        for root in ("master", "slave"):
            place(group, f"{root}/{rel}", (native / rel).read_bytes())
    m_segs = [upload(store, group, f"master/{rel}", GEN0 + i) for i, rel in enumerate(rels)]
    s_segs = [upload(store, group, f"slave/{rel}", GEN0 + 50 + i) for i, rel in enumerate(rels)]
    want = Counter((m.topic, m.queue_id, m.queue_offset) for m in messages(native, rels).values())
    assert len(want) == sum(want.values())

    def job(name: str, store_id: str, broker: str, items: list[dict]) -> dict:
        d = tmp_path / name
        write_input(d, spec, stages=["archive"], commitlogs=items, archive_format="delta", broker=broker,
                    store_id=store_id)
        r = _job(d)
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads((d / "result.json").read_text())
        assert result["ok"], result["errors"]
        return result

    def expect(brokers: dict[str, Counter]) -> None:
        got = identities(uri)
        assert max(got.values()) == 1, [k for k, n in got.items() if n > 1][:5]
        for b, w in brokers.items():
            assert Counter({k[1:]: n for k, n in got.items() if k[0] == b}) == w, b

    # 1. the master's store archives; then the slave's (another store, the same broker name) adds nothing
    r = job("master", "store-m", "broker-a", m_segs)
    assert all(x["table_version"] == 0 for x in r["archive"])
    expect({"broker-a": want})
    r = job("slave", "store-s", "broker-a", s_segs)
    assert all(x.get("committed_before") and x["rows"] == 0 for x in r["archive"]) and len(r["archive"]) == len(rels)
    assert r["session_start_seconds"] == 0, "Spark started for a job with nothing to write"
    assert table_rows(uri, ["store_id"]).column("store_id").unique().to_pylist() == ["store-m"]
    expect({"broker-a": want})

    # 2. both roots on one mount (one store id), one job: each segment written once, its replica takes its outcome
    r = job("one-mount", "store-ms", "broker-b", m_segs + s_segs)
    by_path = {x["path"]: x for x in r["archive"]}
    assert len(by_path) == 2 * len(rels)
    assert all(by_path[s["path"]].get("replica_of") == m["path"] for m, s in zip(m_segs, s_segs))
    expect({"broker-a": want, "broker-b": want})

    # 3. an unclean election rewrote the second half of the last segment on the slave: its content replaces the
    # master's rows of that segment (the replaced digest is reported), no identity is doubled
    last = rels[-1]
    place(group, f"diverged/{last}", rewrite((native / last).read_bytes(),
                                            lambda m: dataclasses.replace(m, body=m.body[::-1]), start=0.5))
    div = dict(upload(store, group, f"diverged/{last}", GEN0 + 99), path=f"slave/{last}")
    r = job("unclean", "store-s", "broker-a", [div])
    (row,) = r["archive"]
    assert row["replaced_digest"] == ar.content_digest(m_segs[-1]) and row["rows"] > 0
    from deltalake import DeltaTable

    assert DeltaTable(uri).transaction_version(tb.app_id("broker-a", last)) == ar.content_digest(div)
    expect({"broker-a": want, "broker-b": want})
    t = table_rows(uri, ["broker", "segment", "store_id", "body", "phys_offset"]).to_pylist()
    seg_rows = [x for x in t if x["broker"] == "broker-a" and x["segment"] == f"slave/{last}"]
    assert len(seg_rows) == row["rows"] and {x["store_id"] for x in seg_rows} == {"store-s"}
    div_msgs = messages(group, [f"diverged/{last}"])
    assert all(x["body"] == div_msgs[x["phys_offset"]].body for x in seg_rows)
    orig = messages(native, [last])
    assert sum(x["body"] != orig[x["phys_offset"]].body for x in seg_rows) > 0
    assert not any(x["broker"] == "broker-a" and x["segment"] == f"master/{last}" for x in t)


def test_replicas_committing_at_once_add_one_copy(native, tmp_path):
    """The master's and the slave's drivers commit the same segments from the same table version: the slave's
    try loses (delta-rs refuses a second commit of the segment's txn, or a second creation of the table) and its
    commit, looking again, adds nothing. Deterministic: the slave's try is made against the version it read
    before the master committed."""
    objects = tmp_path / "objects"
    store = open_store(f"file://{objects}")
    spec = tb.TableSpec.of_store(f"file://{objects}", {})
    rels = sorted(sealed(native)["commitlog"])[:4]
    rows = {}
    for sid in ("store-m", "store-s"):
        segs = [upload(store, native, rel, GEN0 + i) for i, rel in enumerate(rels)]
        rows[sid] = [ar.archive_segment_table(store, sid, seg, tb.TABLE_PREFIX, "broker-a") for seg in segs]
    for batch, what in ((slice(0, 2), "the table's creation"), (slice(2, 4), "an append")):
        m, s = rows["store-m"][batch], rows["store-s"][batch]
        stale = tb._open(spec)  # what the slave's driver read: no table, then version 0
        assert tb.commit(spec, "store-m", m).raced == []
        with pytest.raises(tb.LostRace):
            tb.attempt_commit(stale, spec, "store-s", s)
        done = tb.commit(spec, "store-s", s)
        assert sorted(done.raced) == sorted(r["path"] for r in s), what
    got = identities(spec.uri)
    assert max(got.values()) == 1 and sum(got.values()) == len(messages(native, rels))
    assert table_rows(spec.uri, ["store_id"]).column("store_id").unique().to_pylist() == ["store-m"]


def test_rows_outlive_the_broker_and_expire_after_retention_days(native, tmp_path):
    """A segment the broker deleted (its objects gone) keeps its rows; archive.retention_days expires rows by
    their store date through Delta (delete, then vacuum of the unreferenced files after the grace period)."""
    import dataclasses

    objects = tmp_path / "objects"
    store = open_store(f"file://{objects}")
    uri = f"file://{objects}/tables/messages"
    spec = {"url": f"file://{objects}", "options": {}}
    rels = sorted(sealed(native)["commitlog"])
    aged = tmp_path / "aged"  # the first segment's messages were stored 30 days ago
    month = 30 * 86_400_000
    place(aged, rels[0], rewrite((native / rels[0]).read_bytes(), lambda m: dataclasses.replace(
        m, store_timestamp=m.store_timestamp - month, born_timestamp=m.born_timestamp - month)))
    segs = [upload(store, aged if i == 0 else native, rel, GEN0 + i) for i, rel in enumerate(rels)]
    old_n = len(messages(aged, rels[:1]))

    def job(name: str, items: list[dict], **doc) -> dict:
        d = tmp_path / name
        write_input(d, spec, stages=["archive"], commitlogs=items, archive_format="delta", broker="broker-a", **doc)
        r = _job(d)
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads((d / "result.json").read_text())
        assert result["ok"], result["errors"]
        return result

    job("archive", segs)
    n = table_rows(uri, ["queue_offset"]).num_rows
    assert n == len(messages(native, rels)) and old_n > 0
    old_files = [p for p in (objects / "tables/messages").rglob("*.parquet")
                 if f"date={(TODAY - dt.timedelta(days=30)).isoformat()}" in str(p)
                 or f"date={(TODAY - dt.timedelta(days=31)).isoformat()}" in str(p)]
    assert old_files
    # the broker deletes its segments (their objects go); a job without retention keeps every row
    store.delete_many([k for s in segs for k in s["objects"]])
    assert not any(store.exists(k) for s in segs for k in s["objects"])
    r = job("no-retention", [])
    assert "table_expiry" not in r and table_rows(uri, ["queue_offset"]).num_rows == n
    assert all(p.exists() for p in old_files)
    # 7 days: the month-old rows go (their date partitions' files removed, then vacuumed: grace 0 in the test)
    r = job("retention", [], today=TODAY.isoformat(), table_expiry={"retention_days": 7, "vacuum_grace_hours": 0})
    assert r["table_expiry"]["deleted_rows"] == old_n and r["table_expiry"]["vacuumed_files"] >= len(old_files)
    assert table_rows(uri, ["queue_offset"]).num_rows == n - old_n
    assert not any(p.exists() for p in old_files)
    dates = set(table_rows(uri, ["date"]).column("date").to_pylist())
    assert min(dates) >= TODAY - dt.timedelta(days=7)
