"""The archive table registered in a Hive Metastore (archive.catalog = "hive"): the job driver's side.

After its commits the archive job makes sure the metastore holds `archive.catalog_table` as an external Delta
table at the table's location, so a reader's Spark (or any engine on that metastore) runs
`SELECT ... FROM tierfs.messages` without a CREATE TABLE of its own. Idempotent: the database and the table are
created when missing, a table already there at this location is left as it is, and one at another location is an
error naming both (tierfs never re-points a table: that would hide someone else's data). It runs after the commit
and apart from it: a metastore that is down or refuses costs the registration only (an error in the job's result),
the table stays committed and the next archive job registers it.

Mechanism: the Hive metastore client that Spark itself uses (org.apache.hadoop.hive.metastore.HiveMetaStoreClient of
hive-metastore 2.3, in pyspark's jars and in every Spark built with Hive support), called through the driver's py4j
gateway, writes the very entry Spark SQL with Delta Lake writes for `CREATE TABLE db.t USING DELTA LOCATION '...'`
(observed with Spark 4.2 and Delta 4.4 on a Hive 3.1 metastore, see _table): provider delta in the table
properties, an empty schema (the Delta log is the schema's authority), the location in the serde's `path`
property, and no storage location of the metastore's own, so the metastore never has to reach the table's storage
(an s3a:// location would need S3A on the metastore). Only the driver registers: executors (which may lack tierfs)
take no part. Rejected alternatives:
  * that CREATE TABLE statement in the job's SparkSession: it needs Delta Lake's Spark runtime in the job and Hive
    as the whole session's catalog, and Delta reads the table's log through Hadoop's FileSystem on the driver, for
    an s3:// store the S3A connector with its own credentials; the pipeline uses none of them (delta-rs commits,
    boto3 reads the store);
  * a Python Thrift client: none is maintained on PyPI (hmsclient 0.1.1 of 2018; hive-metastore-client 1.0.9 of
    2021 pins thrift 0.13), and the bundled client is the one Spark readers use, so the two speak alike by
    construction. Its Thrift calls (get_table and the like) are those Hive 4 metastores dropped: Spark's built-in
    client cannot read tables from a 4.x metastore either (`Invalid method name: 'get_table'`); 2.x and 3.x serve both.

The location is the one Spark readers use: s3://bucket/prefix/... as s3a://bucket/prefix/..., file:///path as
file:/path (Spark's spelling).
"""

from __future__ import annotations

import re
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

__all__ = ["CatalogSpec", "CatalogError", "check_uris", "check_table_name", "reader_location", "same_location",
           "register"]

KINDS = ("none", "hive")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Hive client settings for one registration: a metastore that is down costs a few seconds, not minutes
CLIENT_CONF = {"hive.metastore.connect.retries": "3", "hive.metastore.client.connect.retry.delay": "1s",
               "hive.metastore.client.socket.timeout": "60s"}


class CatalogError(Exception):
    """The metastore holds something tierfs must not change (the message names the key and what to do)."""


@dataclass(frozen=True)
class CatalogSpec:
    kind: str    # "hive"
    uri: str     # thrift://host:port[,thrift://...]
    table: str   # database.table

    @property
    def database(self) -> str:
        return self.table.split(".")[0]

    @property
    def name(self) -> str:
        return self.table.split(".")[1]


def check_uris(value: str) -> str | None:
    """Why a metastore URI list is not thrift://HOST:PORT[,...], or None (empty: none set)."""
    if not value:
        return None
    for part in value.split(","):
        u = urllib.parse.urlsplit(part.strip())
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme != "thrift" or not u.hostname or port is None or u.path not in ("", "/"):
            return f"{part.strip()!r} is not thrift://HOST:PORT"
    return None


def check_table_name(value: str) -> str | None:
    """Why a name is not DATABASE.TABLE (Hive identifiers: letters, digits, '_'), or None."""
    parts = value.split(".")
    if len(parts) != 2:
        return "it must name a database and a table, separated by one '.'"
    bad = [p for p in parts if not _NAME.fullmatch(p)]
    if bad:
        return f"{bad[0]!r} is not a name of letters, digits and '_' (not starting with a digit)"
    return None


def reader_location(table_uri: str) -> str:
    """The table's location as Spark readers name it: s3:// through S3A, file:///x as file:/x."""
    u = urllib.parse.urlsplit(table_uri)
    if u.scheme.lower() == "s3":
        return urllib.parse.urlunsplit(("s3a", u.netloc, u.path.rstrip("/"), "", ""))
    if u.scheme.lower() == "file":
        return "file:" + (u.path.rstrip("/") or "/")
    return table_uri.rstrip("/")


def same_location(a: str, b: str) -> bool:
    """Whether two spellings of a location name the same place (file:/x = file:///x, a trailing '/')."""
    def norm(x: str) -> tuple[str, str, str]:
        u = urllib.parse.urlsplit(x.strip())
        return u.scheme.lower(), u.netloc, u.path.rstrip("/") or "/"

    return norm(a) == norm(b)


def _table(api: Any, jvm: Any, spec: CatalogSpec, location: str, spark_version: str) -> Any:
    """The metastore entry Spark SQL with Delta Lake writes for CREATE TABLE db.t USING DELTA LOCATION 'location'."""
    def jmap(d: dict[str, str]) -> Any:
        m = jvm.java.util.HashMap()
        for k, v in d.items():
            m.put(k, v)
        return m

    def jlist(items: list) -> Any:
        out = jvm.java.util.ArrayList()
        for x in items:
            out.add(x)
        return out

    serde = api.SerDeInfo()
    serde.setSerializationLib("org.apache.hadoop.hive.serde2.lazy.LazySimpleSerDe")
    serde.setParameters(jmap({"serialization.format": "1", "path": location}))
    sd = api.StorageDescriptor()
    sd.setCols(jlist([api.FieldSchema("col", "array<string>", "from deserializer")]))
    sd.setInputFormat("org.apache.hadoop.mapred.SequenceFileInputFormat")
    sd.setOutputFormat("org.apache.hadoop.hive.ql.io.HiveSequenceFileOutputFormat")
    sd.setCompressed(False)
    sd.setNumBuckets(-1)
    sd.setSerdeInfo(serde)
    sd.setBucketCols(jlist([]))
    sd.setSortCols(jlist([]))
    sd.setParameters(jmap({}))
    t = api.Table()
    t.setDbName(spec.database)
    t.setTableName(spec.name)
    t.setOwner(jvm.java.lang.System.getProperty("user.name"))
    t.setSd(sd)
    t.setPartitionKeys(jlist([]))
    t.setTableType("EXTERNAL_TABLE")
    t.setParameters(jmap({"EXTERNAL": "TRUE", "spark.sql.sources.provider": "delta",
                          "spark.sql.sources.schema": '{"type":"struct","fields":[]}',
                          "spark.sql.partitionProvider": "catalog", "spark.sql.create.version": spark_version,
                          "tierfs.registered_by": "tierfs archive job"}))
    return t


def _java_class(e: BaseException) -> str:
    je = getattr(e, "java_exception", None)
    return je.getClass().getSimpleName() if je is not None else ""


def _registered_location(t: Any) -> tuple[str, str]:
    """(location, provider) of a metastore table: Spark's data source tables keep it in the serde's `path`."""
    params = t.getParameters() or {}
    sd = t.getSd()
    serde = sd.getSerdeInfo() if sd is not None else None
    sparams = (serde.getParameters() if serde is not None else None) or {}
    return (sparams.get("path") or (sd.getLocation() if sd is not None else "") or "",
            params.get("spark.sql.sources.provider") or "")


def _check_registered(t: Any, spec: CatalogSpec, location: str) -> None:
    theirs, provider = _registered_location(t)
    if not same_location(theirs, location):
        raise CatalogError(
            f"archive.catalog_table {spec.table!r} is registered in the Hive Metastore {spec.uri} at {theirs!r}, "
            f"not at this store's archive table {location!r}; tierfs never re-points a table: set "
            f"archive.catalog_table to another DATABASE.TABLE, or drop that table in the metastore (an external "
            f"table's files stay) if it is stale")
    if provider.lower() != "delta":
        raise CatalogError(
            f"archive.catalog_table {spec.table!r} in the Hive Metastore {spec.uri} is at the archive table's "
            f"location {location!r} but is not a Delta table (provider {provider or 'none'!r}); drop it there or "
            f"set archive.catalog_table to another DATABASE.TABLE")


def register(jvm: Any, spec: CatalogSpec, location: str, hive_conf: dict[str, str] | None = None,
             spark_version: str = "") -> dict:
    """Make sure the metastore has spec.table as the external Delta table at `location`, through the driver JVM's
    Hive client. Returns what it found or did ({"created": ..., "database_created": ...}); raises CatalogError for
    a table of that name elsewhere, py4j's Py4JJavaError when the metastore cannot be reached or refuses."""
    hive = jvm.org.apache.hadoop.hive
    api = hive.metastore.api
    conf = hive.conf.HiveConf()
    for k, v in {**CLIENT_CONF, **(hive_conf or {}), "hive.metastore.uris": spec.uri}.items():
        conf.set(k, v)
    t0 = time.monotonic()
    client = hive.metastore.HiveMetaStoreClient(conf)
    try:
        out = {"created": False, "database_created": False}
        try:
            client.getDatabase(spec.database)
        except Exception as e:  # noqa: BLE001 - py4j's error for a Java exception; which one is looked at
            if _java_class(e) != "NoSuchObjectException":
                raise
            db = api.Database()
            db.setName(spec.database)
            db.setDescription("tierfs: the archive of RocketMQ messages")
            try:
                client.createDatabase(db)
                out["database_created"] = True
            except Exception as e2:  # noqa: BLE001
                if _java_class(e2) != "AlreadyExistsException":  # another store's job made it meanwhile
                    raise
        try:
            _check_registered(client.getTable(spec.database, spec.name), spec, location)
        except Exception as e:  # noqa: BLE001
            if _java_class(e) != "NoSuchObjectException":
                raise
            try:
                client.createTable(_table(api, jvm, spec, location, spark_version))
                out["created"] = True
            except Exception as e2:  # noqa: BLE001
                if _java_class(e2) != "AlreadyExistsException":
                    raise
                # another store's job registered it meanwhile: it must be at this location too
                _check_registered(client.getTable(spec.database, spec.name), spec, location)
        out["seconds"] = round(time.monotonic() - t0, 3)
        return out
    finally:
        client.close()
