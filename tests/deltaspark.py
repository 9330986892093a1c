"""Spark SQL over the archive's Delta table, in the test process: Delta Lake's Spark runtime, resolved from Maven.

    delta_sql -> SparkSession   (module scope; a local[1] session with Delta's SQL extension and catalog)

The jars are not committed: mount-scripts/_install.sh (install_delta_spark) resolves tests/delta/pom.xml and writes
the classpath to ~/.cache/tierfs/delta-spark/<key>/classpath; a missing one fails the test saying how to resolve it
(never a skip). The key names Delta's version, the Spark version it is built for and the Hadoop version of pyspark's
own client: Delta publishes one runtime per Spark minor version (delta-spark_<spark>_2.13) and none loads in another
(Delta 4.4.0 is built for Spark 4.2: on 4.3 it fails with NoSuchMethodError), and hadoop-aws must match Spark's
Hadoop. hadoop-aws (S3A, with the AWS SDK bundle) is there only so that these reading tests reach Ceph RGW: the
pipeline itself never uses S3A.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DELTA_VERSION = "4.4.0"
POM = Path(__file__).resolve().parent / "delta" / "pom.xml"
CACHE = Path(os.environ.get("TIERFS_DELTA_SPARK_CACHE", Path.home() / ".cache" / "tierfs" / "delta-spark"))
# What a user sets, with --packages io.delta:delta-spark_<spark>_2.13:<delta> (README, the archive section)
DELTA_CONF = {"spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
              "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog"}


def spark_binary() -> str:
    """The installed PySpark's major.minor, which names Delta's artifact."""
    import pyspark

    return ".".join(pyspark.__version__.split(".")[:2])


def hadoop_version() -> str:
    """The Hadoop version of pyspark's bundled client (hadoop-aws must be the same)."""
    import pyspark

    jars = sorted((Path(pyspark.__file__).resolve().parent / "jars").glob("hadoop-client-api-*.jar"))
    if not jars:
        raise RuntimeError("pyspark has no bundled hadoop-client-api jar: cannot tell which hadoop-aws matches")
    return jars[-1].name[len("hadoop-client-api-"):-len(".jar")]


def resolve_args() -> list[str]:
    """What mount-scripts/_install.sh passes to Maven, then the classpath file it writes (last)."""
    return [f"-Ddelta.version={DELTA_VERSION}", f"-Dspark.binary={spark_binary()}",
            f"-Dhadoop.version={hadoop_version()}", str(classpath_file())]


def classpath_file() -> Path:
    return CACHE / f"{DELTA_VERSION}-spark{spark_binary()}-hadoop{hadoop_version()}" / "classpath"


def classpath() -> list[str]:
    """The resolved jars, or a clear failure saying how to resolve them."""
    f = classpath_file()
    how = (f"run ./mount-scripts/test, or: source mount-scripts/_install.sh; install_delta_spark (it resolves {POM} "
           f"with {' '.join(resolve_args()[:-1])})")
    if not f.is_file():
        pytest.fail(f"Delta Lake {DELTA_VERSION} for Spark {spark_binary()} is not resolved ({f} missing): {how}",
                    pytrace=False)
    jars = [j for j in f.read_text().strip().split(":") if j]
    missing = [j for j in jars if not os.path.exists(j)]
    if missing or not any(f"/delta-spark_{spark_binary()}_2.13-" in j for j in jars):
        pytest.fail(f"the Delta classpath {f} is stale (missing: {missing[:3]}): {how}", pytrace=False)
    return jars


def start() -> "pyspark.sql.SparkSession":  # noqa: F821
    from pyspark.sql import SparkSession

    b = SparkSession.builder.master("local[1]").appName("tierfs-delta-sql").config("spark.jars", ",".join(classpath()))
    for k, v in {**DELTA_CONF, "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                 "spark.sql.shuffle.partitions": "1", "spark.databricks.delta.snapshotPartitions": "1",
                 "spark.sql.session.timeZone": "UTC"}.items():
        b = b.config(k, v)
    return b.getOrCreate()


def stop(spark) -> None:
    """Stop the session and its JVM (the gateway's process, by PID), so the next start() launches a new one."""
    from pyspark import SparkContext

    gw = SparkContext._gateway
    proc = getattr(gw, "proc", None)
    spark.stop()
    if gw is not None:
        gw.shutdown()
    SparkContext._gateway = SparkContext._jvm = None
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def s3a(spark, endpoint_url: str, access_key: str, secret_key: str, region: str) -> None:
    """S3A settings for a path-style S3 endpoint (Ceph RGW on 127.0.0.1): the keys the README tells a user to pass
    as --conf spark.hadoop.fs.s3a.*."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    for k, v in {"endpoint": endpoint_url, "endpoint.region": region, "path.style.access": "true",
                 "access.key": access_key, "secret.key": secret_key}.items():
        conf.set(f"fs.s3a.{k}", v)


@pytest.fixture(scope="module")
def delta_sql():
    spark = start()
    try:
        yield spark
    finally:
        stop(spark)
