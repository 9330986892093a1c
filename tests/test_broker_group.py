"""A RocketMQ broker group on tierfs: a master and a slave of one brokerName, each its own JVM and store root
(`master/` and `slave/` below one mount root, found by tierfs's store-root discovery), HA replication running.

4.9.7 master-slave: the master (SYNC_MASTER: a send is acknowledged once the slave has it) takes every message;
once the sealed segments of both stores are tiered and evicted, the master stops and a new consumer group reads
everything from offset 0 off the slave, every acknowledged message checked by content.

5.5.0 controller mode: a controller process (rocketmq-controller's ControllerStartup) elects the master;
kill -9 of the master, the controller promotes the slave, which serves all history out of the tier and takes new
writes; the old master comes back as a slave, truncates to the new epoch and catches up on tierfs; kill -9 of
the new master hands the group back to it, and it serves everything acknowledged.

A slave's sealed CommitLog segments are byte-identical to its master's (what a replica pair stored once relies
on): checked through the mount, on evicted segments.
"""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path

import pytest

import brokerutil as B
from mountutil import requires_fuse, wait_for
from test_broker import BODY, Env, assert_all_read, timed, wait_evicted

pytestmark = requires_fuse

TOPICS = "GA,GB"
QUEUES = 4
N = 60_000  # about 15 MiB of CommitLog: three sealed 4 MiB segments per store
ROOTS = ("master", "slave")
REPORT: dict[str, dict] = {}
HA_CONNECTED = "HAService receive new connection"


class GroupEnv(Env):
    """A broker group on one tierfs mount (test_broker's: hot dir on a tmpfs of its own, objects in a local
    directory), the group's first broker standing for the single one's client and name server."""

    def __init__(self, version: str, base: Path, controller: bool):
        super().__init__(version, base)
        self.group = B.BrokerGroup(version, base / "home", [self.mnt / r for r in ROOTS], controller=controller)

    def client(self, *args: object, timeout: float = 300) -> dict:
        return self.group.members[0].client(*args, timeout=timeout)

    def produce_group(self, start: int, count: int, acked: Path) -> dict:
        return self.client("produce", self.group.ns_addr, B.BROKER_NAME, TOPICS, QUEUES, start, count, BODY, 32,
                           acked)

    def consume_group(self, group: str, count: int, acked: Path) -> dict:
        return self.client("consume", self.group.ns_addr, B.BROKER_NAME, TOPICS, QUEUES, 0, count, BODY, group,
                           acked, 0)

    def close(self) -> None:
        try:
            self.group.close()
        finally:
            super().close()


def commitlog_rows(st: dict, root: str) -> list[dict]:
    return [f for f in st["files"] if f["kind"] == "commitlog" and f["path"].startswith(f"{root}/")]


def wait_tiered_and_evicted(env: GroupEnv, roots: tuple[str, ...], least: int, timeout: float = 180) -> dict:
    """Each store root has at least `least` tiered CommitLog segments, all but the newest tiered one evicted,
    and the upload backlog is empty."""
    def counts(st: dict) -> dict:
        out = {}
        for r in roots:
            tiered = [f for f in commitlog_rows(st, r) if f["state"] == "tiered"]
            out[r] = (len(tiered), sum(f["resident_bytes"] < f["size"] for f in tiered))
        return out

    def ok(seen: dict) -> bool:
        return all(seen[r][0] >= least and seen[r][1] >= seen[r][0] - 1 for r in roots)

    return wait_evicted(env, counts, ok, f"CommitLog segments of {roots} tiered and evicted", timeout)


def identical_sealed_segments(env: GroupEnv, a: str, b: str) -> int:
    """The tiered CommitLog segments of store root `a` that store root `b` also has are byte-identical to b's
    (read through the mount: evicted bytes come from the tier). How many were compared (at least one)."""
    st = env.status()
    names = {f["path"].rsplit("/", 1)[1] for f in commitlog_rows(st, a) if f["state"] == "tiered"}
    names &= {p.name for p in (env.mnt / b / "commitlog").iterdir()}
    assert names, f"no tiered CommitLog segment of {a} that {b} has too"
    for name in sorted(names):
        da, db = (hashlib.sha256((env.mnt / r / "commitlog" / name).read_bytes()).hexdigest() for r in (a, b))
        assert da == db, f"CommitLog segment {name} differs between {a} and {b}"
    return len(names)


def caught_up(env: GroupEnv, follower: str, leader: str) -> bool:
    """Every ConsumeQueue of the follower has as many units as the leader's: it replicated (and dispatched)
    everything the leader has."""
    qs = [Path(t) / str(q) for t in TOPICS.split(",") for q in range(QUEUES)]
    return all(B.queue_offset(env.mnt / follower / "consumequeue" / q) ==
               B.queue_offset(env.mnt / leader / "consumequeue" / q) for q in qs)


def _start(env: GroupEnv, report: dict) -> None:
    with timed(report, "start"):
        env.mount.mount()
        env.group.start()
        g = env.group
        env.client("topics", g.ns_addr, g.members[0].broker_addr, QUEUES, *TOPICS.split(","))
    # a send before the slave's HA connection is up waits its syncFlushTimeout out and fails
    wait_for(lambda: HA_CONNECTED in env.group.members[0].broker_log(), 60, 0.5,
             what="the slave's HA connection to the master")
    # the slave serves pulls with the master gone: it must have synchronised the topics from the master
    wait_for(lambda: all(t in _read(env.mnt / ROOTS[1] / "config" / "topics.json") for t in TOPICS.split(",")),
             60, 0.5, what="the slave synchronising the topic configs")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.fixture
def master_slave(tmp_path):
    report = REPORT.setdefault("4.9.7 master-slave", {})
    env = GroupEnv("4.9.7", tmp_path, controller=False)
    try:
        _start(env, report)
        yield env
    finally:
        env.close()
        print(f"\nbroker group 4.9.7 master-slave step seconds: {report}")


def test_master_slave_slave_serves_evicted_history(master_slave: GroupEnv):
    """4.9.7 master-slave on one mount: every message acknowledged by the SYNC_MASTER is read back by content
    from the slave, from offset 0, after both stores' sealed segments were tiered and evicted and the master
    stopped."""
    env, report = master_slave, REPORT["4.9.7 master-slave"]
    acked = env.base / "acked"
    with timed(report, f"produce {N}"):
        res = env.produce_group(0, N, acked)
    assert res["acked"] == N and res["errors"] == 0, (res["first_errors"], res)
    wait_for(lambda: caught_up(env, "slave", "master"), 120, 0.5, what="the slave dispatching every message")
    with timed(report, "wait evicted"):
        counts = wait_tiered_and_evicted(env, ROOTS, 3)
    with timed(report, "compare segments"):
        same = identical_sealed_segments(env, "master", "slave")
    master = env.group.members[0]
    with timed(report, "master stop"):
        master.stop_broker(signal.SIGTERM)  # unregisters: the name server routes the group to the slave only
    with timed(report, f"consume {N} from slave"):
        got = env.consume_group("g-from-slave", N, acked)
    assert_all_read(got, N)
    assert got["read"] == N and got["dups"] == 0, got
    report["msgs/s from slave"] = round(N / got["secs"])
    print(f"\n4.9.7 group: (tiered, evicted) CommitLog segments per store {counts}; {same} sealed segments "
          f"byte-identical between master and slave")
