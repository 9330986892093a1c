"""archive.catalog = hive: the archive job registers the Delta table in a real Hive Metastore (tests/hivemetastore.py).

The store is the multi-topic one of tests/test_spark_job.py (examples/producer.py), on the posix store and on Ceph
RGW (registered at its s3a:// location, read through S3A). Jobs run as the daemon runs
them (`python -m tierfs.spark`, a local SparkSession); a separate reader SparkSession with Hive support on the same
metastore, which never creates a table itself, then counts every message by topic through the registered names.
Through the daemon (`tierfs compact --only archive` on a mount), the metastore is stopped and started again (by
PID): a registration failure never costs the commit, and the next job registers the table.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

import deltaspark as ds
from hivemetastore import Metastore, hive_metastore, hive_sql  # noqa: F401 (the fixture)
from test_archive_table import GEN0, _job, table_rows
from test_compaction import PIPE_OPTS, compact, tiered_store
from test_spark_job import messages, native, sealed, upload, write_input  # noqa: F401 (the fixture)
from test_tiering import reference_store  # noqa: F401 (the fixture)
from tierfs.config import Config, ConfigError
from tierfs.objectstore import open_store
from tierfs.spark import catalog as hc


# ---------------------------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("overrides, message", [
    (["archive.catalog=hive"], ["'archive.catalog_uri' is empty", 'archive.catalog_uri = "thrift://HOST:9083"']),
    (["archive.catalog=hive,archive.catalog_uri=thrift://h:9083,archive.format=parquet"],
     ["'archive.format' is 'parquet'", 'archive.format = "delta"']),
    (["archive.catalog_uri=http://h:9083"], ["config key 'archive.catalog_uri'", "is not thrift://HOST:PORT"]),
    (["archive.catalog_uri=thrift://h"], ["config key 'archive.catalog_uri'", "thrift://HOST:PORT"]),
    (["archive.catalog_table=messages"], ["config key 'archive.catalog_table'", "a database and a table",
                                          "'tierfs.messages'"]),
    (["archive.catalog_table=tierfs.my-table"], ["config key 'archive.catalog_table'", "'my-table' is not a name"]),
    (["archive.catalog=glue"], ["archive.catalog", "hive"]),
])
def test_bad_catalog_config_is_refused_naming_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        Config.load(None, overrides)
    for m in message:
        assert m in str(e.value)


def test_catalog_config_and_the_location_readers_use(tmp_path):
    (tmp_path / "c.toml").write_text('[archive]\ncatalog = "hive"\ncatalog_uri = "thrift://a:9083,thrift://b:9083"\n')
    cfg = Config.load(str(tmp_path / "c.toml"))
    assert (cfg["archive.catalog"], cfg["archive.catalog_table"]) == ("hive", "tierfs.messages")
    assert Config.load(None, [])["archive.catalog"] == "none"
    assert hc.reader_location("s3://bkt/pre/fix/tables/messages") == "s3a://bkt/pre/fix/tables/messages"
    assert hc.reader_location("file:///srv/objects/tables/messages/") == "file:/srv/objects/tables/messages"
    assert hc.same_location("file:/srv/t", "file:///srv/t/") and not hc.same_location("file:/srv/t", "file:/srv/u")
    assert not hc.same_location("s3a://b/t", "s3://b/t")


@pytest.mark.parametrize("catalog, fmt, message", [
    ({"kind": "glue", "uri": "thrift://h:1", "table": "a.b"}, "delta", "'catalog' must be"),
    ({"kind": "hive", "uri": "h:1", "table": "a.b"}, "delta", "'catalog': 'h:1' is not thrift://HOST:PORT"),
    ({"kind": "hive", "uri": "thrift://h:1", "table": "ab"}, "delta", "'catalog': it must name a database"),
    ({"kind": "hive", "uri": "thrift://h:1", "table": "a.b"}, "parquet", "needs 'archive_format' \"delta\""),
])
def test_bad_catalog_in_the_job_input_is_refused(tmp_path, catalog, fmt, message):
    from tierfs.spark import job

    doc = {"job_id": "j", "stages": ["archive"], "store": {"url": f"file://{tmp_path}"}, "store_id": "s1",
           "commitlogs": [], "archive_format": fmt, "catalog": catalog}
    with pytest.raises(job.InputError, match=re.escape(message)):
        job.parse_input(doc, tmp_path, "input.json")
    ok = job.parse_input(dict(doc, archive_format="delta", catalog={}), tmp_path, "input.json")
    assert ok.catalog is None


# ---------------------------------------------------------------------------------------------- jobs + a metastore


def _archive(tmp_path: Path, name: str, store: Path | dict, segs: list[dict], metastore: Metastore,
             table: str = "tierfs.messages") -> dict:
    """An archive job of `store` (a posix store's directory, or a spec) with archive.catalog = hive."""
    d = tmp_path / name
    spec = store if isinstance(store, dict) else {"url": f"file://{store}", "options": {}}
    write_input(d, spec, stages=["archive"], commitlogs=segs,
                archive_format="delta", broker="broker-a",
                catalog={"kind": "hive", "uri": metastore.uri, "table": table})
    r = _job(d)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((d / "result.json").read_text())


def _by_topic(native: Path, rels: list[str]) -> Counter:
    return Counter(m.topic for m in messages(native, rels).values())


def test_archive_job_registers_the_table_in_a_hive_metastore(native, tmp_path, hive_metastore, rgw):
    rels = sorted(sealed(native)["commitlog"])
    a = tmp_path / "objects-a"
    segs_a = [upload(open_store(f"file://{a}"), native, rel, GEN0 + i) for i, rel in enumerate(rels)]
    loc_a, loc_b = (hc.reader_location(f"file://{tmp_path / x}/tables/messages") for x in ("objects-a", "objects-b"))

    # 1. the first job commits the table and registers it (database and table created)
    r = _archive(tmp_path, "a1", a, segs_a, hive_metastore)
    assert r["ok"], r["errors"]
    assert r["catalog"] == dict(r["catalog"], registered=True, created=True, database_created=True,
                                table="tierfs.messages", location=loc_a, uri=hive_metastore.uri)
    # 2. again: nothing to archive, the entry is found where it belongs and left as it is
    r = _archive(tmp_path, "a2", a, segs_a, hive_metastore)
    assert r["ok"] and all(x["committed_before"] for x in r["archive"]), r["errors"]
    assert r["catalog"] == dict(r["catalog"], registered=True, created=False, database_created=False)

    # 3. a store on S3 (Ceph RGW): registered at the s3a:// location Spark readers use
    bucket = rgw.make_bucket("archive-catalog")
    s3 = {"url": f"s3://{bucket}/t", "options": {"endpoint_url": rgw.endpoint_url, "access_key": rgw.access_key,
                                                 "secret_key": rgw.secret_key, "region": rgw.region,
                                                 "addressing": "path", "max_attempts": 2}}
    segs_s3 = [upload(open_store(s3["url"], **s3["options"]), native, rel, GEN0 + i) for i, rel in enumerate(rels[:2])]
    r = _archive(tmp_path, "s3", s3, segs_s3, hive_metastore, table="archive2.messages_s3")
    assert r["ok"], r["errors"]
    assert r["catalog"] == dict(r["catalog"], registered=True, created=True, database_created=True,
                                location=f"s3a://{bucket}/t/tables/messages")
    assert rgw.secret_key not in (tmp_path / "s3" / "result.json").read_text()

    # a reader's own Spark on the same metastore, with no CREATE TABLE of its own, reads both by name
    spark = hive_sql(hive_metastore)
    try:
        ds.s3a(spark, rgw.endpoint_url, rgw.access_key, rgw.secret_key, rgw.region)
        for table, want in (("tierfs.messages", _by_topic(native, rels)),
                            ("archive2.messages_s3", _by_topic(native, rels[:2]))):
            got = spark.sql(f"SELECT topic, count(*) AS n FROM {table} GROUP BY topic").collect()
            assert {row.topic: row.n for row in got} == dict(want) and len(want) >= 2, table
        # a name registered at another location is never re-pointed: an error naming the key and both locations
        # (called in the reader's JVM, whose Hive client is the job driver's)
        with pytest.raises(hc.CatalogError) as e:
            hc.register(spark._jvm, hc.CatalogSpec("hive", hive_metastore.uri, "tierfs.messages"), loc_b)
        for s in ("archive.catalog_table 'tierfs.messages'", f"at {loc_a!r}", f"table {loc_b!r}", "never re-points"):
            assert s in str(e.value), str(e.value)
        (row,) = spark.sql("DESCRIBE DETAIL tierfs.messages").collect()
        assert (row.format, row.location, row.partitionColumns) == ("delta", loc_a, ["topic", "date"])
    finally:
        ds.stop(spark)


def test_daemon_registers_and_retries_after_a_metastore_outage(mount_store, reference_store, hive_metastore):
    """`tierfs compact --only archive` on a mount with archive.catalog = hive: the metastore is down, the table is
    committed and the summary carries the registration failure; with it back, the next request (nothing new to
    archive) still runs a job, which registers the table; the one after has nothing to do."""
    from deltalake import DeltaTable

    catalog = f"archive.catalog=hive,archive.catalog_uri={hive_metastore.uri},archive.catalog_table=daemon.messages"
    m = tiered_store(mount_store, reference_store, f"{PIPE_OPTS},{catalog}")
    table = m.state_dir / "objects" / "tables" / "messages"
    hive_metastore.stop()
    try:
        s = compact(m, "--only", "archive")
    finally:
        hive_metastore.start()
    assert not s["ok"] and s["applied"]["archive"] > 0 and s["catalog"]["registered"] is False, s
    (err,) = s["errors"]
    assert err["path"] == "daemon.messages" and hive_metastore.uri in err["error"] and s["catalog"]["error"]
    assert DeltaTable(str(table)).version() == 0
    assert "archive table not registered in the catalog" in m.log_text()
    s = compact(m, "--only", "archive")
    assert s["ok"] and s["applied"]["archive"] == 0, s
    assert s["catalog"] == dict(s["catalog"], registered=True, created=True, table="daemon.messages",
                                location=hc.reader_location(f"file://{table}"))
    s = compact(m, "--only", "archive")
    assert s["ok"] and s.get("note") == "nothing to do", s
