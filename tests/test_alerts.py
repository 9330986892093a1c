"""The fleet's alerting rules and dashboard (examples/prometheus, examples/grafana) against a real Prometheus.

Debian's `prometheus` server (1 s scrape and evaluation) scrapes live mounts on 127.0.0.1 through their
`metrics.listen` listeners and evaluates examples/prometheus/tierfs-alerts.yml, rendered for the test by
`for_test`: the same expressions with every `for:` and range window shortened and the time thresholds scaled down
(the shipped file keeps its production values, which `test_rules_and_dashboard_are_valid` checks). Each alert must
fire under its fault and clear after it, as seen through Prometheus's own /api/v1/alerts:

* S3 through the fault proxy, the store answering 503 to everything: upload backlog age, RPO lag, object store down,
  object store errors, writer lease lost; then the store back: all clear.
* a live writable mount taken over by another (--takeover --force): lease lost (fenced) on the old one, cleared
  when it is unmounted.
* a mount under `tierfs supervise` whose daemon is killed -9: fail-stop fires (the supervisor's remount count),
  and clears once the window has passed.
* a posix store on a 64 MiB tmpfs hot dir, the evictor failing at its failpoint: worker restarts; the tmpfs filled
  to 95 %: hot dir nearly full; the daemon killed -9: daemon gone; and each clears (filler removed, remount).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mountutil import free_port, tmpfs, wait_for
from must_run import missing_tool_reason
from test_failstop import SupervisedMount
from test_rpo import takeover, wait_round_after
from prometheus_client.parser import text_string_to_metric_families
from test_tiering import TIER_OPTS, copy_in, reference_store, s3_opts  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "examples" / "prometheus" / "tierfs-alerts.yml"
SCRAPE_CONFIG = REPO / "examples" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "examples" / "grafana" / "tierfs.json"
JOB = "tierfs"  # the job name the rules (TierfsDaemonDown) expect

ALERTS = {"TierfsDaemonDown", "TierfsFailStop", "TierfsUploadBacklogStale", "TierfsRPOLag", "TierfsObjectStoreDown",
          "TierfsObjectStoreErrors", "TierfsWorkerRestarting", "TierfsLeaseLost", "TierfsHotDirNearlyFull"}
# Per alert, the production threshold as the shipped file writes it and the test's (seconds scaled down; ratios
# and counts are kept). A file that no longer carries the production text fails the rendering.
TEST_THRESHOLDS = {
    "TierfsUploadBacklogStale": ("> 1800", "> 4"),
    "TierfsRPOLag": ("> 300", "> 4"),
    "TierfsObjectStoreDown": ("> 120", "> 3"),
    "TierfsFailStop": ("< 3600", "< 8"),
}
# alerts with no `for:`: one restart or fail-stop is the news
NO_FOR = {"TierfsWorkerRestarting", "TierfsFailStop"}
# dashboard series only some mounts export, and the test that sees them
CONDITIONAL = {"tierfs_supervisor_remounts_total": "test_fail_stop_fires_and_clears",
               "tierfs_supervisor_last_failstop_timestamp_seconds": "test_fail_stop_fires_and_clears"}
TEST_FOR = "1s"
TEST_WINDOW = "5s"
LEASE_TTL = 6.0  # lease.ttl_seconds of the S3 mount: its lease lapses ~5.4 s into an outage


# ------------------------------------------------------------------------------------------ the rules file


def alert_blocks(text: str) -> dict[str, str]:
    """Each alerting rule's text, by alert name (the file lists one `- alert:` item per rule)."""
    parts = re.split(r"(?m)^(?=[ \t]*- alert: )", text)
    return {re.search(r"- alert: (\S+)", p).group(1): p for p in parts[1:]}


def _seconds(duration: str) -> float:
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * unit[u] for n, u in re.findall(r"(\d+)([smhd])", duration))


def for_test(text: str) -> str:
    """The shipped rules with test-sized durations: every `for:` TEST_FOR, every range window TEST_WINDOW, and the
    time thresholds of TEST_THRESHOLDS; the expressions are otherwise the shipped ones."""
    head, _, _ = text.partition(next(iter(alert_blocks(text).values())))
    out = [head]
    for name, block in alert_blocks(text).items():
        block = re.sub(r"(?m)^(\s*for: ).*$", rf"\g<1>{TEST_FOR}", block)
        block = re.sub(r"\[\d+[smhd]\]", f"[{TEST_WINDOW}]", block)
        if name in TEST_THRESHOLDS:
            prod, test = TEST_THRESHOLDS[name]
            expr = re.search(r"(?m)^\s*expr: .*$", block).group(0)
            assert prod in expr, f"{name}: the production threshold {prod!r} is not in {expr.strip()!r}"
            block = block.replace(expr, expr.replace(prod, test))
        out.append(block)
    return "".join(out)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------------------------------ the dashboard


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard (panel targets, panels of rows, annotations)."""
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for top in dash["panels"] for p in [top, *top.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash.get("annotations", {}).get("list", []) if "expr" in a]
    return exprs


def concrete(expr: str) -> str:
    """A dashboard expression as Grafana sends it: template variables replaced."""
    return expr.replace("$__rate_interval", "1m").replace("$instance", ".*")


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\btierfs_[a-z0-9_]+", expr))


# ------------------------------------------------------------------------------------------ Prometheus


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping `targets` as job tierfs every second, with `rules`; its own data
    dir; stopped by PID."""

    def __init__(self, workdir: Path, targets: list[str], rules: str):
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "rules.yml").write_text(rules)
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 900ms}\n"
            "rule_files: [rules.yml]\n"
            f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: {json.dumps(targets)}\n")
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        self.url = f"http://127.0.0.1:{self.port}"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir)

    def wait_ready(self) -> None:
        wait_for(self._ready, timeout=60, what=f"prometheus ready on {self.url}")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}"
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def api(self, path: str, **params: str) -> dict | list:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = json.loads(urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def active(self, instance: str) -> dict[str, str]:
        """Alerts of `instance` that are pending or firing: name -> state (firing wins over pending)."""
        out: dict[str, str] = {}
        for a in self.api("alerts")["alerts"]:
            if a["labels"].get("instance") == instance and out.get(a["labels"]["alertname"]) != "firing":
                out[a["labels"]["alertname"]] = a["state"]
        return out

    def wait_firing(self, instance: str, names: set[str], timeout: float, what: str = "") -> None:
        def firing() -> bool:
            now = self.active(instance)
            return all(now.get(n) == "firing" for n in names)
        try:
            wait_for(firing, timeout=timeout, interval=0.5, what=f"{sorted(names)} firing for {instance} {what}")
        except AssertionError as e:
            raise AssertionError(f"{e}; active now: {self.active(instance)}") from None

    def wait_clear(self, instance: str, names: set[str], timeout: float, what: str = "") -> None:
        try:
            wait_for(lambda: not names & set(self.active(instance)), timeout=timeout, interval=0.5,
                     what=f"{sorted(names)} cleared for {instance} {what}")
        except AssertionError as e:
            raise AssertionError(f"{e}; active now: {self.active(instance)}") from None

    def wait_scraped(self, instance: str, timeout: float = 60) -> None:
        """The target is up, and every rule group was evaluated after that (so `active` tells the truth)."""
        wait_for(lambda: any(r["value"][1] == "1" for r in self.query(f'up{{job="{JOB}",instance="{instance}"}}')),
                 timeout=timeout, interval=0.5, what=f"{instance} scraped")
        seen = time.time()

        def evaluated() -> bool:
            groups = self.api("rules")["groups"]
            return bool(groups) and all(_rfc3339(g["lastEvaluation"]) > seen for g in groups)
        wait_for(evaluated, timeout=timeout, interval=0.5, what="the rules evaluated")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _rfc3339(ts: str) -> float:
    """Prometheus's lastEvaluation (RFC 3339 with nanoseconds) as a Unix time."""
    from datetime import datetime

    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", ts)
    assert m, ts
    base = datetime.fromisoformat(m.group(1) + (m.group(3).replace("Z", "+00:00"))).timestamp()
    return base + float("0." + (m.group(2) or "0"))


@pytest.fixture
def prometheus(tmp_path: Path):
    """Factory: prometheus(targets) -> a started Prometheus evaluating the test rendering of the shipped rules."""
    for binary in ("prometheus", "promtool"):
        if (why := missing_tool_reason(binary)) is not None:
            pytest.skip(why)
    made: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        p = Prometheus(tmp_path / f"prometheus{len(made)}", targets, for_test(RULES.read_text()))
        made.append(p)  # stopped at teardown even if it never gets ready
        p.wait_ready()
        return p
    yield start
    for p in made:
        p.stop()


# ------------------------------------------------------------------------------------------ the tests


def test_rules_and_dashboard_are_valid(prometheus, tmp_path):
    """promtool accepts the shipped rules and their test rendering; the shipped file carries production values
    (no `for:` under a minute but the worker restart alert's, none of the test thresholds); every alert has a
    severity, a summary, a description and a runbook line naming its README section; every dashboard
    expression parses as PromQL (promtool, as recording rules)."""
    text = RULES.read_text()
    res = promtool("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    blocks = alert_blocks(text)
    assert set(blocks) == ALERTS
    readme = (REPO / "README.md").read_text()
    assert "### Monitoring a fleet" in readme
    for name, block in blocks.items():
        assert re.search(r"severity: (critical|warning)", block), name
        for key in ("summary", "description"):
            assert re.search(rf"(?m)^\s*{key}: ", block), (name, key)
        assert f'runbook: "README.md#monitoring-a-fleet ({name})"' in block, name
        assert f"`{name}`" in readme, f"README's Monitoring a fleet does not explain {name}"
        durations = re.findall(r"(?m)^\s*for: (\S+)", block)
        if name not in NO_FOR:
            assert durations and _seconds(durations[0]) >= 60, (name, durations)
        for window in re.findall(r"\[(\d+[smhd])\]", block):
            assert _seconds(window) >= 300, (name, window)
    rendered = tmp_path / "test-rules.yml"
    rendered.write_text(for_test(text))
    res = promtool("check", "rules", str(rendered))
    assert res.returncode == 0, res.stdout + res.stderr
    assert set(alert_blocks(rendered.read_text())) == ALERTS
    res = promtool("check", "config", str(SCRAPE_CONFIG))
    assert res.returncode == 0, res.stdout + res.stderr

    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p.get("targets"), f"panel {p['title']!r} has no query"
    exprs = dashboard_exprs()
    recording = tmp_path / "dashboard-exprs.yml"
    recording.write_text("groups:\n  - name: dashboard\n    rules:\n" + "".join(
        f"      - record: dashboard:expr{i}\n        expr: {json.dumps(concrete(e))}\n" for i, e in enumerate(exprs)))
    res = promtool("check", "rules", str(recording))
    assert res.returncode == 0, res.stdout + res.stderr
    covered = set().union(*(metric_names(e) for e in exprs))
    for must in ("tierfs_upload_backlog_oldest_seconds", "tierfs_rpo_lag_seconds", "tierfs_errors_total",
                 "tierfs_worker_restarts_total", "tierfs_lease_held", "tierfs_hot_dir_free_bytes",
                 "tierfs_uploads_total", "tierfs_fetches_total", "tierfs_tiered_reads_total",
                 "tierfs_upload_seconds_bucket", "tierfs_download_seconds_bucket", "tierfs_bytes",
                 "tierfs_evicted_bytes_total", "tierfs_cache_bytes"):
        assert must in covered, f"the dashboard does not show {must}"


def exported_samples(text: str) -> set[str]:
    """Series names an exposition carries: its samples', and those of families without samples yet (HELP)."""
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples} | \
        set(re.findall(r"(?m)^# HELP (\S+)", text))


def test_s3_outage_fires_and_clears_store_backlog_rpo_and_lease_alerts(mount_store, reference_store, fault_proxy,
                                                                       rgw, prometheus):
    """An S3 mount (continuous tiering every second, a 6 s lease) through the fault proxy. The dashboard's every
    metric is exported and its every query answers. The store answering 503 to everything: object
    store down, object store errors and lease lost fire while the mount is idle (its lease renewals
    fail), then upload backlog age and RPO lag once a store is copied in; the store back: each clears."""
    port = free_port()
    instance = f"127.0.0.1:{port}"
    opts = s3_opts(rgw, "alerts").replace(rgw.endpoint_url, fault_proxy.endpoint_url)
    m = mount_store(options=[f"{opts},metrics.listen={instance},tiering.rpo_seconds=1,lease.ttl_seconds={LEASE_TTL},"
                             "upload.retry_max_seconds=1"])
    (m.mnt / "warmup").write_bytes(b"w" * 4096)  # the appendlog has a kind to report
    prom = prometheus([instance])
    prom.wait_scraped(instance)
    prom.wait_clear(instance, ALERTS, timeout=60, what="before any fault")

    body = urllib.request.urlopen(f"http://{instance}/metrics", timeout=10).read().decode()
    exported = exported_samples(body)
    for expr in dashboard_exprs():
        missing = metric_names(expr) - exported - set(CONDITIONAL)
        assert not missing, f"dashboard query {expr!r} names metrics tierfs does not export: {sorted(missing)}"
        prom.query(concrete(expr))  # answers (a query Prometheus refuses raises)

    outage = {"TierfsUploadBacklogStale", "TierfsRPOLag", "TierfsObjectStoreDown", "TierfsObjectStoreErrors",
              "TierfsLeaseLost"}
    t0 = time.monotonic()
    fault_proxy.set("error", status=503, code="ServiceUnavailable")
    # idle, the mount's only requests are its lease renewals: enough to see the store down
    prom.wait_firing(instance, {"TierfsObjectStoreDown", "TierfsObjectStoreErrors", "TierfsLeaseLost"},
                     timeout=120, what="with the store answering 503 to an idle mount")
    idle = time.monotonic() - t0
    copy_in(reference_store, m.mnt)
    prom.wait_firing(instance, outage, timeout=120, what="with the store answering 503")
    fired = time.monotonic() - t0
    assert m.alive()
    fault_proxy.passthrough()
    t1 = time.monotonic()
    prom.wait_clear(instance, outage, timeout=180, what="once the store answers again")
    print(f"idle outage alerts firing after {idle:.1f} s, all after {fired:.1f} s, all clear {time.monotonic() - t1:.1f} s after the store came "
          f"back")


def test_takeover_fires_lease_lost_on_the_mount_taken_over(tmp_path, mount_store, prometheus):
    """Split brain averted: a takeover (--takeover --force) of a live writable mount fences it; its
    TierfsLeaseLost fires with tierfs_lease_fenced 1, and clears once that mount is unmounted (the runbook)."""
    objects = tmp_path / "objects"
    objects.mkdir()
    port = free_port()
    instance = f"127.0.0.1:{port}"
    opts = [TIER_OPTS, f"objectstore.url=file://{objects},store.id=fleet,tiering.rpo_seconds=1,"
                       f"lease.ttl_seconds={LEASE_TTL}"]
    a = mount_store(options=[*opts, f"metrics.listen={instance}"])
    (a.mnt / "f").write_bytes(b"x" * 4096)
    prom = prometheus([instance])
    prom.wait_scraped(instance)
    prom.wait_clear(instance, ALERTS, timeout=60, what="before any fault")
    wait_round_after(a, time.time())  # a consistent point to take over from
    b, _ = takeover(tmp_path, f"file://{objects}/fleet", opts, "b")
    try:
        prom.wait_firing(instance, {"TierfsLeaseLost"}, timeout=120, what="on the mount taken over")
        fenced = prom.query(f'tierfs_lease_fenced{{instance="{instance}"}}')
        assert [r["value"][1] for r in fenced] == ["1"], fenced
        a.umount()
        prom.wait_clear(instance, {"TierfsLeaseLost"}, timeout=60, what="once the fenced mount is unmounted")
    finally:
        b.cleanup()


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 64 MiB tmpfs for the hot dir (set up before the mount, so torn down after it)."""
    with tmpfs(tmp_path / "ram", "64m", "tierfs-alerts-tmpfs") as ram:
        yield ram


def fill_leaving(filler: Path, share: float) -> None:
    """Allocate `filler` until `share` of its file system is left free (the daemon may write meanwhile: a
    too-large request, refused whole by tmpfs, is made again from a fresh look)."""
    for _ in range(5):
        sv = os.statvfs(filler.parent)
        want = sv.f_bavail * sv.f_frsize - int(sv.f_blocks * sv.f_frsize * share)
        if want <= 0:
            return
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, os.fstat(fd).st_size, want)
            return
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        finally:
            os.close(fd)
    raise AssertionError(f"could not fill {filler.parent} to {1 - share:.0%}")


def test_worker_restart_hot_dir_full_and_daemon_gone_fire_and_clear(small_tmpfs, mount_store, reference_store,
                                                                    prometheus):
    """A posix-store mount on a 64 MiB tmpfs whose evictor fails at its failpoint: worker restarts fire while
    tiering makes it evict, and clear once it stops failing; a filler leaving 5 % of the tmpfs free: hot dir
    nearly full, cleared by removing it; kill -9 of the daemon: daemon gone, cleared by the remount."""
    port = free_port()
    instance = f"127.0.0.1:{port}"
    m = mount_store(hot=small_tmpfs / "hot", options=[f"{TIER_OPTS},metrics.listen={instance},"
                                                      "mount.catalog_reserve_bytes=1MiB"],
                    env={"TIERFS_FAILPOINTS": "tier.evict=raise"})
    prom = prometheus([instance])
    prom.wait_scraped(instance)
    prom.wait_clear(instance, ALERTS, timeout=60, what="before any fault")

    copy_in(reference_store, m.mnt)  # tiering fills the 2 MiB cache: the evictor runs into its failpoint
    prom.wait_firing(instance, {"TierfsWorkerRestarting"}, timeout=120, what="with the evictor failing")
    restarting = [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == "TierfsWorkerRestarting"]
    assert {a["labels"]["worker"] for a in restarting} == {"evictor"}, restarting
    # the evictor stops failing once the cache is under budget and nothing more is tiered
    prom.wait_clear(instance, {"TierfsWorkerRestarting"}, timeout=180, what="once the evictor stops failing")

    filler = small_tmpfs / "filler"
    fill_leaving(filler, 0.05)
    prom.wait_firing(instance, {"TierfsHotDirNearlyFull"}, timeout=60, what="with the tmpfs 95 % full")
    filler.unlink()
    prom.wait_clear(instance, {"TierfsHotDirNearlyFull"}, timeout=60, what="once the filler is gone")

    m.kill(signal.SIGKILL)
    prom.wait_firing(instance, {"TierfsDaemonDown"}, timeout=60, what="with the daemon killed -9")
    m.mount()
    prom.wait_clear(instance, {"TierfsDaemonDown"}, timeout=60, what="once the daemon is mounted again")
    prom.wait_scraped(instance)
    assert "TierfsDaemonDown" not in prom.active(instance)


def test_fail_stop_fires_and_clears(tmp_path, fuse_required, prometheus):
    """`tierfs mount --supervise`: the daemon exports the supervisor's fail-stops (0, never); kill -9 of the daemon
    makes the supervisor fail-stop and remount, the new daemon exports 1 and its time, and TierfsFailStop fires,
    then clears once that time is old enough (8 s in the test, an hour shipped)."""
    port = free_port()
    instance = f"127.0.0.1:{port}"
    (tmp_path / "hot").mkdir()
    (tmp_path / "mnt").mkdir()
    m = SupervisedMount(tmp_path / "hot", tmp_path / "mnt", options=[f"metrics.listen={instance}"])
    try:
        m.mount()
        prom = prometheus([instance])
        prom.wait_scraped(instance)
        prom.wait_clear(instance, ALERTS, timeout=60, what="before any fault")
        body = urllib.request.urlopen(f"http://{instance}/metrics", timeout=10).read().decode()
        assert "tierfs_supervisor_remounts_total 0.0" in body, body[:3000]
        assert "tierfs_supervisor_last_failstop_timestamp_seconds 0.0" in body, body[:3000]
        for expr in dashboard_exprs():
            if metric_names(expr) & set(CONDITIONAL):
                prom.query(concrete(expr))

        os.kill(m.pid, signal.SIGKILL)
        prom.wait_firing(instance, {"TierfsFailStop"}, timeout=120, what="after the daemon was killed -9")
        assert m.state()["remounts"] == 1
        m.pid = m.state()["daemon"]
        now = prom.query(f'tierfs_supervisor_remounts_total{{instance="{instance}"}}')
        assert [r["value"][1] for r in now] == ["1"], now
        prom.wait_clear(instance, {"TierfsFailStop"}, timeout=60, what="once the remount left the window")
    finally:
        m.cleanup()
