"""The pipeline on a real Spark standalone cluster (tests/sparkcluster.py: a master and two one-core workers whose
Python has no tierfs, so the driver's shipping of the package is what makes the executors work).

Every cluster run must give exactly the bytes a local[2] run gives on the same store content: lz4c objects,
.cidx sidecars and the archive table's data files (their rows, less the store id and broker), keyed by path. The
reference comes from one local run (module fixture);
the cluster runs cover `tierfs compact --master spark://...` on a shared posix store, the scheduled job with
spark.master set on Ceph RGW, and a worker killed (SIGKILL, with its executor) while the job's tasks run.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from mountutil import FUSE_SKIP_REASON, Mount, wait_for
from sparkcluster import SparkCluster, spark_cluster  # noqa: F401 (the fixture)
from test_compaction import PIPE_OPTS, compact, tiered_store
from test_tiering import assert_same_bytes, copy_in, reference_store, s3_opts, segments, status  # noqa: F401
from tierfs.objectstore import ObjectStore, open_store
from tierfs.spark import archive as ar
from tierfs.spark.table import TABLE_PREFIX

pytestmark = pytest.mark.skipif(FUSE_SKIP_REASON is not None, reason=FUSE_SKIP_REASON or "")


def cluster_opts(cluster: SparkCluster, master: bool = True) -> str:
    conf = cluster.conf()
    if not master:
        conf.pop("spark.master")
    return ",".join(f"{k}={v}" for k, v in conf.items())


def outputs(m, store: ObjectStore) -> dict[str, bytes]:
    """Everything the pipeline wrote for mount m: lz4c objects by file path, sidecars and archive files by key
    without the store id."""
    st = status(m)
    sid = st["store_id"]
    out = {}
    for f in st["files"]:
        if f["state"] == "tiered":
            assert f["format"] == "lz4c" and len(f["objects"]) == 1, f
            out[f"lz4c {f['path']}"] = store.get(f["objects"][0])
    for prefix in (f"{sid}/idx/", f"{sid}/archive/"):
        for info in store.list(prefix):
            out[info.key[len(sid):]] = store.get(info.key)
    # the archive table's data files (archive.format = delta): named and filled with the store id (also the
    # default broker name), which differs between runs, so compared by their rows without those columns
    for info in store.list(TABLE_PREFIX):
        if info.key.endswith(".parquet"):
            rows = pq.read_table(io.BytesIO(store.get(info.key)))
            assert set(rows.column("store_id").to_pylist()) == set(rows.column("broker").to_pylist()) == {sid}
            out[info.key.replace(ar.safe_name(sid), "<sid>")] = rows.drop_columns(["store_id", "broker"])
    return out


def assert_same_outputs(got: dict[str, object], want: dict[str, object]) -> None:
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not got[k] == want[k]]
    assert not differ, f"{len(differ)} outputs differ from the local run, e.g. {differ[:3]}"
    assert any(k.startswith("/idx/") for k in want)
    assert any(k.startswith(("/archive/", TABLE_PREFIX)) for k in want)


def posix_store(m) -> ObjectStore:
    return open_store(f"file://{m.state_dir / 'objects'}")


@pytest.fixture(scope="module")
def local_outputs(reference_store, tmp_path_factory) -> dict[str, bytes]:
    """The pipeline's outputs of a local[2] run (`tierfs compact`) over the reference store."""
    root = tmp_path_factory.mktemp("local-ref")
    made: list[Mount] = []

    def factory(options=(), env=None) -> Mount:
        m = Mount(root / "hot", root / "mnt", options=options, env=env)
        (root / "hot").mkdir(exist_ok=True)
        (root / "mnt").mkdir(exist_ok=True)
        made.append(m)
        m.mount()
        return m

    try:
        m = tiered_store(factory, reference_store)
        summary = compact(m)
        assert summary["ok"], summary
        return outputs(m, posix_store(m))
    finally:
        for m in made:
            m.cleanup()


def test_compact_on_cluster_posix_shared_is_byte_identical(mount_store, reference_store, spark_cluster,
                                                           local_outputs):
    m = tiered_store(mount_store, reference_store,
                     f"{PIPE_OPTS},objectstore.posix_shared=true,{cluster_opts(spark_cluster, master=False)}")
    # not a terminal: progress comes as lines, per stage, segments done / total as the cluster finishes them
    r = subprocess.run([sys.executable, "-m", "tierfs", "compact", str(m.mnt), "--master", spark_cluster.url],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and ": ok" in r.stdout.splitlines()[0], (r.stdout, r.stderr, m.log_text()[-3000:])
    summary = status(m)["compaction"]["last"][0]
    n = sum(k.startswith("lz4c ") for k in local_outputs)
    assert summary["ok"] and summary["applied"]["segments"] == n, summary
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("tierfs: ")]
    for stage in ("segments", "index", "archive"):
        mine = [ln for ln in progress if ln.startswith(f"tierfs: {stage}: ")]
        assert mine[0].startswith(f"tierfs: {stage}: 0/") and mine[-1].endswith(" segments done"), progress
        done, total = mine[-1].split(": ")[2].split()[0].split("/")
        assert done == total != "0", progress
    assert_same_outputs(outputs(m, posix_store(m)), local_outputs)
    # the executors fetched the shipped package: the cluster's Python could not have imported tierfs otherwise
    assert list(spark_cluster.root.glob("worker*/app-*/*/tierfs-package.zip"))
    assert_same_bytes(m, reference_store, segments(reference_store)[::4])


def test_scheduled_job_on_cluster_s3_is_byte_identical(mount_store, reference_store, spark_cluster, rgw,
                                                       local_outputs, tmp_path):
    bucket = "spark-cluster-sched"
    opts = s3_opts(rgw, bucket, ",compaction.enabled=true,compaction.interval_seconds=12,"
                               f"compaction.min_age_seconds=0,{cluster_opts(spark_cluster)}")
    m = mount_store(options=[opts])
    copy_in(reference_store, m.mnt)
    want = sum(k.startswith("lz4c ") for k in local_outputs)

    def all_compacted() -> bool:
        st = status(m)
        comp = st["compaction"]
        lz = [f for f in st["files"] if f["state"] == "tiered" and f["format"] == "lz4c"]
        return comp["running"] is None and len(lz) == want and all(j["ok"] for j in comp["last"])

    wait_for(all_compacted, timeout=180, interval=0.5, what="the scheduled cluster jobs")
    last = status(m)["compaction"]["last"]
    assert last and all(j["ok"] for j in last), last
    store = open_store(f"s3://{bucket}/stores", endpoint_url=rgw.endpoint_url, access_key=rgw.access_key,
                       secret_key=rgw.secret_key, region=rgw.region, addressing="path")
    assert_same_outputs(outputs(m, store), local_outputs)


def test_worker_killed_mid_job_loses_and_duplicates_nothing(mount_store, reference_store, spark_cluster,
                                                            local_outputs):
    """SIGKILL of a worker (and its executor) while compaction tasks run: Spark re-runs its tasks on the other
    worker; every item is done once, the swap stays whole, and the outputs are still the local run's bytes."""
    slow = "spark.executorEnv.TIERFS_FAILPOINTS=spark.item.segments=sleep:0.3"
    m = tiered_store(mount_store, reference_store,
                     f"{PIPE_OPTS},objectstore.posix_shared=true,{cluster_opts(spark_cluster)},{slow}")
    jobs = m.state_dir / "jobs"
    proc = subprocess.Popen([sys.executable, "-m", "tierfs", "compact", str(m.mnt), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def segments_started() -> bool:
            for d in jobs.glob("*"):
                lines = (d / "progress.jsonl").read_text().splitlines() if (d / "progress.jsonl").exists() else []
                if sum('"path"' in ln and '"segments"' in ln for ln in lines) >= 1:
                    return True
            assert proc.poll() is None, proc.communicate()
            return False

        wait_for(segments_started, timeout=120, interval=0.05, what="the first compacted segment")
        # the executors' Python is the cluster's own (no tierfs): spark.pyspark.python reached them
        pythons = spark_cluster.python_workers()
        assert pythons and set(pythons) == {str(spark_cluster.worker_python)}, pythons
        running = status(m)["compaction"]["running"]
        assert running["stage"] == "segments" and running["progress"]["segments"]["total"] > 1, running
        text = (m.ctl / "status").read_text()
        assert "stage segments: " in text and "segments done" in text, text
        spark_cluster.workers[0].kill(signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = json.loads(out)
    assert summary["ok"], (summary, err)
    job = jobs / summary["job_id"]
    assert "lost" in (job / "job.log").read_text().lower(), "the job did not notice the killed worker"
    n = sum(k.startswith("lz4c ") for k in local_outputs)
    assert summary["applied"]["segments"] == n
    lines = [json.loads(ln) for ln in (job / "progress.jsonl").read_text().splitlines()]
    done = [(ln["stage"], ln["path"]) for ln in lines if "path" in ln]
    assert len(done) == len(set(done)) and all(ln["ok"] for ln in lines if "path" in ln)
    assert_same_outputs(outputs(m, posix_store(m)), local_outputs)
    assert_same_bytes(m, reference_store, segments(reference_store)[::3])
    spark_cluster.restart_worker(0)
