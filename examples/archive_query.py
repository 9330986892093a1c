#!/usr/bin/env python3
"""Query the Parquet message archive written by the tierfs pipeline with Spark SQL.

Usage:
    python examples/archive_query.py --store file:///srv/tier --store-id ID counts
    python examples/archive_query.py --store s3://bucket/prefix --endpoint-url http://127.0.0.1:7480 \\
        --access-key KEY --secret-key SECRET --store-id ID --topic TopicA --since 2026-11-01 key k-42
    python examples/archive_query.py ... sql "SELECT tags, count(*) FROM archive GROUP BY tags"

Commands: ``counts`` (messages and body bytes per topic and date), ``key KEY`` (messages whose KEYS hold KEY),
``sql QUERY`` (any query over the view ``archive``: the Parquet columns plus the partition columns ``topic`` and
``date``). ``--json`` prints one JSON object per result row instead of a table.

The archive is plain Parquet on every backend. A file:// store is read in place: Spark gets the selected files
under ``<store>/<store-id>/archive/`` directly. From s3:// the partitions selected by ``--topic``/``--since``/
``--until`` are copied into a temporary Hive-style directory first, through the tierfs ObjectStore interface
(boto3), as a pip-installed PySpark has no s3a jars; a Spark with hadoop-aws reads ``s3a://BUCKET/PREFIX/<store-id>
/archive/`` in place just as well.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

try:
    import tierfs.spark  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierfs.objectstore import ObjectStore, open_store
from tierfs.spark.archive import archive_prefix, escape_partition_value, parse_archive_key

COPY_PIECE = 8 << 20

QUERIES = {
    "counts": ("SELECT topic, date, count(*) AS messages, sum(length(body)) AS body_bytes FROM archive "
               "GROUP BY topic, date ORDER BY topic, date"),
    "key": ("SELECT topic, date, queue_id, queue_offset, phys_offset, store_timestamp, tags, keys, msg_id, "
            "length(body) AS body_bytes FROM archive WHERE array_contains(keys, :key) ORDER BY phys_offset"),
}

LOG4J = """rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %p %c{1}: %m%n
logger.nativeloader.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativeloader.level = error
"""


def fetch_partitions(store: ObjectStore, store_id: str, dest: Path, topics: set[str], since: dt.date | None,
                     until: dt.date | None) -> tuple[list[str], int]:
    """The matching archive files: in place for a posix store, else copied into dest/topic=../date=../;
    returns (file paths, bytes)."""
    files: list[str] = []
    nbytes = 0
    root = getattr(store, "root", None)  # the posix store: its archive files are plain Parquet files
    for info in store.list(archive_prefix(store_id)):
        k = parse_archive_key(store_id, info.key)
        if k is None or (topics and k.topic not in topics) or (since and k.date < since) or (until and k.date > until):
            continue
        nbytes += info.size
        if root is not None:
            files.append(os.path.join(root, info.key))
            continue
        out = dest / f"topic={escape_partition_value(k.topic)}" / f"date={k.date.isoformat()}" / info.key.rsplit("/", 1)[1]
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            for off in range(0, info.size, COPY_PIECE):
                f.write(store.get_range(info.key, off, min(COPY_PIECE, info.size - off)))
        files.append(str(out))
    return files, nbytes


def spark_session(master: str, tmp: Path):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    (tmp / "log4j2.properties").write_text(LOG4J)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("tierfs-archive-query")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{tmp / 'log4j2.properties'}")
             # topic and date stay strings (a topic named "123" must not become an integer column)
             .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC")  # timestamps shown in UTC, like the date partitions
             .getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    return spark


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="object store URL: file:///PATH or s3://BUCKET/PREFIX")
    ap.add_argument("--store-id", required=True, help="store id (the first key segment of the archive)")
    ap.add_argument("--endpoint-url", help="S3 endpoint (RGW, MinIO); empty for AWS")
    ap.add_argument("--access-key", help="S3 access key (default: the AWS credential chain)")
    ap.add_argument("--secret-key", help="S3 secret key")
    ap.add_argument("--region")
    ap.add_argument("--topic", action="append", default=[], help="only this topic (repeatable)")
    ap.add_argument("--since", type=dt.date.fromisoformat, help="first date YYYY-MM-DD")
    ap.add_argument("--until", type=dt.date.fromisoformat, help="last date YYYY-MM-DD")
    ap.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    ap.add_argument("--limit", type=int, default=100, help="rows to print (default 100)")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("counts", help="messages and body bytes per topic and date")
    sub.add_parser("key", help="messages whose KEYS contain KEY").add_argument("key")
    sub.add_parser("sql", help="a Spark SQL query over the view `archive`").add_argument("query")
    a = ap.parse_args(argv)

    options = {k: v for k, v in (("access_key", a.access_key), ("secret_key", a.secret_key), ("region", a.region))
               if v}
    try:
        store = open_store(a.store, endpoint_url=a.endpoint_url, **options)
    except ValueError as e:
        print(f"archive_query: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tierfs-archive-query-") as tmp_s:
        tmp = Path(tmp_s)
        data = tmp / "archive"
        root = getattr(store, "root", None)
        base = os.path.join(root, archive_prefix(a.store_id)) if root is not None else str(data)
        files, nbytes = fetch_partitions(store, a.store_id, data, set(a.topic), a.since, a.until)
        store.close()
        if not files:
            print(f"archive_query: no archive files under {a.store}/{archive_prefix(a.store_id)} match the filters",
                  file=sys.stderr)
            return 1
        print(f"archive_query: {len(files)} files, {nbytes} bytes{' (in place)' if root else ''}", file=sys.stderr)
        spark = spark_session(a.master, tmp)
        try:
            spark.read.option("basePath", base).parquet(*files).createOrReplaceTempView("archive")
            if a.cmd == "sql":
                df = spark.sql(a.query)
            elif a.cmd == "key":
                df = spark.sql(QUERIES["key"], args={"key": a.key})
            else:
                df = spark.sql(QUERIES["counts"])
            if a.json:
                for row in df.limit(a.limit).collect():
                    print(json.dumps(row.asDict(recursive=True), default=str))
            else:
                df.show(a.limit, truncate=False)
        except Exception as e:  # a bad query or an unreadable file: one line, not a JVM stack trace
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            print(f"archive_query: query failed: {first}", file=sys.stderr)
            return 1
        finally:
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
