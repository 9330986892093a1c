"""Prometheus metrics on real mounts: `cat MNT/.tierfs/metrics` and the optional `metrics.listen` HTTP listener
(off by default) serve every required family, and the counters move with tiering, eviction and cold reads, on
the posix object store and on Ceph RGW."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from mountutil import evict, fd_targets, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_tiering import (  # noqa: F401
    TIER_OPTS,
    copy_in,
    reference_store,
    s3_opts,
    segments,
    status,
    wait_tiered_and_evicted,
)

from tierfs.metrics import CONTROL_TTL

# family names as the parser reports them (counters without their _total suffix)
REQUIRED = {
    # bytes and files per kind and state
    "tierfs_files", "tierfs_bytes", "tierfs_local_bytes",
    # upload backlog and the age of its oldest entry
    "tierfs_upload_backlog_files", "tierfs_upload_backlog_bytes", "tierfs_upload_backlog_oldest_seconds",
    # upload and download bytes and latency histograms
    "tierfs_upload_seconds", "tierfs_upload_bytes", "tierfs_download_seconds", "tierfs_download_bytes",
    "tierfs_uploads", "tierfs_uploaded_bytes", "tierfs_fetches", "tierfs_fetched_bytes", "tierfs_prefetched_bytes",
    # cache hit ratio
    "tierfs_tiered_reads", "tierfs_cache_hit_ratio", "tierfs_cache_bytes", "tierfs_cache_budget_bytes",
    # read-ahead window sizes
    "tierfs_readahead_streams", "tierfs_readahead_window_blocks", "tierfs_prefetch_inflight_bytes",
    "tierfs_prefetch_budget_bytes",
    # evictions
    "tierfs_evicted_bytes", "tierfs_evicted_blocks",
    # errors by type, FUSE latency and errors by operation
    "tierfs_errors", "tierfs_fuse_op_seconds", "tierfs_fuse_op_errors",
    "tierfs_info", "tierfs_uptime_seconds", "tierfs_open_files", "tierfs_fuse_read_bytes", "tierfs_fuse_written_bytes",
    "tierfs_rewrites", "tierfs_identical_rewrites", "tierfs_objectstore_down_seconds",
    # what the fleet's alerts watch (examples/prometheus/tierfs-alerts.yml)
    "tierfs_worker_restarts", "tierfs_lease_held", "tierfs_lease_fenced", "tierfs_hot_dir_size_bytes",
    "tierfs_hot_dir_free_bytes",
    # archive freshness (archive.max_lag_seconds)
    "tierfs_archive_lag_seconds", "tierfs_archive_max_lag_seconds",
}
HISTOGRAMS = {"tierfs_upload_seconds", "tierfs_upload_bytes", "tierfs_download_seconds", "tierfs_download_bytes",
              "tierfs_fuse_op_seconds", "tierfs_readahead_window_blocks"}


def parse(text: str) -> dict:
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in HISTOGRAMS & set(fams):
        assert fams[name].type == "histogram", name
    return fams


def scrape(m) -> dict:
    time.sleep(CONTROL_TTL)  # the control file reuses one scrape for this long (one `cat` = one scrape)
    return parse((m.ctl / "metrics").read_text())


def value(fams: dict, sample: str, **labels: str) -> float:
    """Sum of the samples called `sample` whose labels include `labels`."""
    return sum(s.value for f in fams.values() if sample.startswith(f.name) for s in f.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def check_histogram(fams: dict, name: str, count: str = "_count", **labels: str) -> None:
    """Cumulative buckets never decrease and +Inf equals _count (_gcount for a gauge histogram)."""
    groups: dict[tuple, list] = {}
    for s in fams[name].samples:
        if s.name == name + "_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            groups.setdefault(key, []).append((float(s.labels["le"]), s.value))
    assert groups, f"{name}{labels} has no buckets"
    for key, buckets in groups.items():
        counts = [c for _, c in sorted(buckets)]
        assert counts == sorted(counts), (name, key, buckets)
        assert counts[-1] == value(fams, name + count, **dict(key)), (name, key)


def listening_ports(pid: int) -> set[int]:
    """TCP ports `pid` listens on: its socket fds matched against /proc/net/tcp{,6} rows in state LISTEN."""
    inodes = {target[8:-1] for target in fd_targets(pid) if target.startswith("socket:[")}
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def exercise_and_check(m, ref: Path) -> None:
    """Tier, evict, cold-read through the mount, checking that the right counters move at each step."""
    start = scrape(m)
    assert REQUIRED <= set(start), f"missing families: {sorted(REQUIRED - set(start))}"
    assert value(start, "tierfs_cache_budget_bytes") == 2 << 20
    assert value(start, "tierfs_uploads_total") == 0
    copy_in(ref, m.mnt)
    n_segs = len(segments(ref))
    wait_for(lambda: len([f for f in status(m)["files"] if f["state"] == "tiered"]) >= n_segs // 2, timeout=90,
             what="tiering")
    wait_tiered_and_evicted(m, [f["path"] for f in status(m)["files"]], timeout=90)
    tiered = scrape(m)
    n_tiered = len([f for f in status(m)["files"] if f["state"] == "tiered"])
    assert value(tiered, "tierfs_files", state="tiered") >= n_tiered > 0
    assert value(tiered, "tierfs_files", kind="commitlog", state="hot") >= 1  # the active one, never sealed
    assert value(tiered, "tierfs_bytes", state="tiered") > value(tiered, "tierfs_local_bytes", state="tiered")
    assert value(tiered, "tierfs_uploads_total") >= n_tiered
    assert value(tiered, "tierfs_upload_seconds_count") == value(tiered, "tierfs_uploads_total")
    assert value(tiered, "tierfs_upload_bytes_sum") == value(tiered, "tierfs_uploaded_bytes_total")
    assert value(tiered, "tierfs_evicted_bytes_total") > 0 and value(tiered, "tierfs_evicted_blocks_total") > 0
    assert value(tiered, "tierfs_cache_bytes") <= 2 << 20
    assert value(tiered, "tierfs_fuse_written_bytes_total") > 0
    assert value(tiered, "tierfs_fuse_op_seconds_count", op="write") > 0
    check_histogram(tiered, "tierfs_fuse_op_seconds", op="write")
    check_histogram(tiered, "tierfs_upload_seconds")
    # a cold read of an evicted segment: fetches, downloads, waited reads, read-ahead
    victim = next(f for f in status(m)["files"] if f["state"] == "tiered" and f["kind"] == "commitlog"
                  and f["resident_bytes"] < f["size"])
    evict(m.mnt / victim["path"])
    with open(m.mnt / victim["path"], "rb") as f:  # keep the stream open to see its read-ahead window
        while f.read(128 * 1024):
            pass
        during = scrape(m)
        assert value(during, "tierfs_readahead_streams") >= 1
        assert value(during, "tierfs_readahead_window_blocks_bucket", le="+Inf") >= 1
        check_histogram(during, "tierfs_readahead_window_blocks", "_gcount")
    cold = scrape(m)
    assert value(cold, "tierfs_fetches_total") > value(tiered, "tierfs_fetches_total")
    assert value(cold, "tierfs_fetched_bytes_total") > value(tiered, "tierfs_fetched_bytes_total")
    assert value(cold, "tierfs_download_seconds_count") > value(tiered, "tierfs_download_seconds_count")
    assert value(cold, "tierfs_download_bytes_sum") == value(cold, "tierfs_fetched_bytes_total")
    assert value(cold, "tierfs_tiered_reads_total", result="waited") > value(tiered, "tierfs_tiered_reads_total",
                                                                            result="waited")
    assert 0 <= value(cold, "tierfs_cache_hit_ratio") < 1
    assert value(cold, "tierfs_fuse_read_bytes_total") >= victim["size"]
    check_histogram(cold, "tierfs_fuse_op_seconds", op="read")
    check_histogram(cold, "tierfs_download_seconds")
    assert value(cold, "tierfs_errors_total") == 0
    assert value(cold, "tierfs_fuse_op_seconds_count", op="read") > value(tiered, "tierfs_fuse_op_seconds_count",
                                                                          op="read")


def test_metrics_posix(mount_store, reference_store):
    m = mount_store(options=[TIER_OPTS])
    assert listening_ports(m.pid) == set(), "metrics listener must be off by default"
    text = (m.ctl / "metrics").read_text()
    assert text.startswith("# HELP"), text[:200]
    assert "metrics" in os.listdir(m.ctl)
    # cat works like on any file; the control file is read-only
    assert subprocess.run(["cat", str(m.ctl / "metrics")], capture_output=True, timeout=30).stdout.startswith(b"#")
    with pytest.raises(OSError):
        open(m.ctl / "metrics", "w")
    exercise_and_check(m, reference_store)
    # a corrupt object shows up as an error by type
    victim = next(f for f in status(m)["files"] if f["state"] == "tiered" and f["resident_bytes"] < f["size"] // 2)
    for key in victim["objects"]:  # one flipped byte in every 64 KiB block of its content
        obj = m.state_dir / "objects" / key
        data = bytearray(obj.read_bytes())
        for off in range(100, len(data) - 4096, 64 * 1024):
            data[off] ^= 0xFF
        obj.write_bytes(bytes(data))
    evict(m.mnt / victim["path"])
    with open(m.mnt / victim["path"], "rb") as f, pytest.raises(OSError):
        while f.read(1 << 20):
            pass
    after = scrape(m)
    assert value(after, "tierfs_errors_total", type="corrupt_object") > 0
    assert value(after, "tierfs_errors_total", type="fetch") > 0
    assert value(after, "tierfs_fuse_op_errors_total", op="read") > 0


def test_metrics_http_listener(mount_store):
    port = free_port()
    m = mount_store(options=[f"tiering.enabled=true,metrics.listen=127.0.0.1:{port}"])
    assert port in listening_ports(m.pid)
    (m.mnt / "f").write_bytes(b"x" * 10000)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    over_http = parse(body)
    in_mount = scrape(m)
    assert REQUIRED <= set(over_http), f"missing over HTTP: {sorted(REQUIRED - set(over_http))}"
    assert set(over_http) == set(in_mount)
    assert value(over_http, "tierfs_fuse_written_bytes_total") == 10000
    m.umount()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_metrics_listener_port_taken_refuses_mount(mount_store):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        m = mount_store(options=[f"metrics.listen=127.0.0.1:{port}"], mount=False)
        res = m._cli_mount()
    assert res.returncode != 0
    assert "metrics.listen" in res.stderr and str(port) in res.stderr, res.stderr
    assert not m.is_mounted()


def test_metrics_s3(mount_store, reference_store, rgw):
    m = mount_store(options=[s3_opts(rgw, "metrics")])
    exercise_and_check(m, reference_store)
    assert rgw.secret_key not in (m.ctl / "metrics").read_text()
