"""A real Hive Metastore server on 127.0.0.1 for the tests of archive.catalog = hive, and a Spark reader on it.

    hive_metastore -> Metastore   (module scope; a standalone Hive 3.1 metastore, embedded Derby, stop()/start())
    hive_sql(metastore) -> SparkSession   (a local session with Hive support and Delta Lake, as a reader runs it)

The jars are not committed: mount-scripts/_install.sh (install_hive_metastore) resolves tests/hive/pom.xml and
writes the classpath to ~/.cache/tierfs/hive-metastore/<version>/classpath; a missing one fails the test saying
how to resolve it (never a skip). Hive 3.1, not 4.x: Spark's built-in metastore client (Hive 2.3) cannot read
tables from a 4.x metastore (`Invalid method name: 'get_table'`), so neither could a reader's Spark.
The server is started by PID in its own process group, ready when its port accepts, killed by PID; its Derby
database and warehouse live in the fixture's tmp dir and survive a stop()/start().
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from brokerutil import free_ports
from ceph_rgw import _port_open

HIVE_VERSION = "3.1.3"
POM = Path(__file__).resolve().parent / "hive" / "pom.xml"
CACHE = Path(os.environ.get("TIERFS_HIVE_CACHE", Path.home() / ".cache" / "tierfs" / "hive-metastore"))
START_TIMEOUT = 120.0


def classpath() -> str:
    f = CACHE / HIVE_VERSION / "classpath"
    how = ("run ./mount-scripts/test, or: source mount-scripts/_install.sh; install_hive_metastore (it resolves "
           f"{POM} with -Dhive.version={HIVE_VERSION})")
    if not f.is_file():
        pytest.fail(f"the Hive Metastore {HIVE_VERSION} is not resolved ({f} missing): {how}", pytrace=False)
    jars = [j for j in f.read_text().strip().split(":") if j]
    missing = [j for j in jars if not os.path.exists(j)]
    if missing or not any("/hive-standalone-metastore-" in j for j in jars):
        pytest.fail(f"the Hive Metastore classpath {f} is stale (missing: {missing[:3]}): {how}", pytrace=False)
    return ":".join(jars)


def _site(props: dict[str, str]) -> str:
    rows = "".join(f"  <property><name>{k}</name><value>{v}</value></property>\n" for k, v in props.items())
    return f"<?xml version=\"1.0\"?>\n<configuration>\n{rows}</configuration>\n"


class Metastore:
    """One metastore server: its port stays the same across stop()/start(), its database too."""

    def __init__(self, base: Path):
        self.base = base
        self.port = free_ports(1, gap=0)[0]
        self.warehouse = base / "warehouse"
        self.warehouse.mkdir(parents=True, exist_ok=True)
        conf = base / "conf"
        conf.mkdir(exist_ok=True)
        # the standalone metastore's defaults name classes of hive-exec (absent here): the expression proxy and
        # the replication dump cleaner task
        (conf / "metastore-site.xml").write_text(_site({
            "javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={base / 'db'};create=true",
            "javax.jdo.option.ConnectionDriverName": "org.apache.derby.jdbc.EmbeddedDriver",
            "datanucleus.schema.autoCreateAll": "true",
            "metastore.schema.verification": "false",
            "metastore.warehouse.dir": f"file://{self.warehouse}",
            "metastore.thrift.bind.host": "127.0.0.1",
            "metastore.thrift.port": str(self.port),
            "metastore.expression.proxy": "org.apache.hadoop.hive.metastore.DefaultPartitionExpressionProxy",
            "metastore.task.threads.always": "org.apache.hadoop.hive.metastore.events.EventCleanerTask",
        }))
        self.cmd = ["java", "-Xmx384m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-cp",
                    f"{conf}:{classpath()}", "org.apache.hadoop.hive.metastore.HiveMetaStore", "-p", str(self.port)]
        self.proc: subprocess.Popen | None = None
        self.log = base / "metastore.log"

    @property
    def uri(self) -> str:
        return f"thrift://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                         cwd=self.base, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not _port_open(self.port):
            if self.proc.poll() is not None:
                self.proc = None
                pytest.fail(f"the Hive Metastore exited before serving: {self.tail()}", pytrace=False)
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the Hive Metastore did not serve 127.0.0.1:{self.port} within {START_TIMEOUT:.0f} s: "
                            f"{self.tail()}", pytrace=False)
            time.sleep(0.2)

    def stop(self) -> None:
        """Kill the server by PID (its process group) and wait until it and its port are gone."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        deadline = time.monotonic() + 30
        while _port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def hive_metastore(tmp_path_factory):
    m = Metastore(tmp_path_factory.mktemp("hive-metastore"))
    m.start()
    try:
        yield m
    finally:
        m.stop()


def hive_sql(metastore: Metastore):
    """A reader's SparkSession: Hive as its catalog (the metastore), Delta Lake's runtime (tests/deltaspark.py).
    Stop it with deltaspark.stop()."""
    from pyspark.sql import SparkSession

    import deltaspark as ds
    from tierfs.spark.job import QUICK_JVM  # the job driver's quick start: a reader's few queries gain from it too

    b = SparkSession.builder.master("local[1]").appName("tierfs-hive-reader") \
        .config("spark.jars", ",".join(ds.classpath()))
    for k, v in {**ds.DELTA_CONF, "spark.sql.catalogImplementation": "hive",
                 "spark.hadoop.hive.metastore.uris": metastore.uri,
                 "spark.sql.warehouse.dir": str(metastore.warehouse), "spark.ui.enabled": "false",
                 "spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "1",
                 "spark.databricks.delta.snapshotPartitions": "1", "spark.sql.session.timeZone": "UTC",
                 "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                 "spark.driver.extraJavaOptions": QUICK_JVM}.items():
        b = b.config(k, v)
    return b.getOrCreate()
