"""A RocketMQ broker group on tierfs: a master and a slave of one brokerName, each its own JVM and store root
(below one mount root, found by tierfs's store-root discovery; or, for master-slave, each on a mount of its own),
HA replication running. Every mount keeps an 8 MiB local budget (test_broker's options), so sealed segments of
both stores are evicted before they are read.

4.9.7 master-slave: the master (SYNC_MASTER: a send is acknowledged once the slave has it) takes every message;
once the sealed segments of both stores are tiered and evicted, the master stops and a new consumer group reads
everything from offset 0 off the slave, every acknowledged message checked by content. Then both stores
archive (`tierfs compact --only archive`, archive.broker_name naming the group: a 4.x broker records no
brokerName) into the one Delta table beside the bucket's objects: each sealed segment is committed once (the
slave's run adds no table version), each message stored in a sealed segment is one row, with what was sent.

5.5.0 controller mode: a controller process (rocketmq-controller's ControllerStartup) elects the master;
kill -9 of the master, the controller promotes the slave, which serves all history out of the tier and takes new
writes; the old master comes back as a slave and catches up on tierfs; kill -9 of the new master hands the group
back to it, and it serves everything acknowledged. Then an unclean election makes the old master truncate its
CommitLog into a tiered, evicted segment (RocketMQ rewrites its tail through the mmap and deletes the segments
after it; tierfs re-materialises the tiered one as a hot file) and it ends up byte-identical to the new master.

A slave's sealed CommitLog segments are byte-identical to its master's (what a replica pair stored once relies
on): checked through the mount, on evicted segments; on one mount the group's objects hold those bytes once
(stored bytes group/master <= 1.05).
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import sqlite3
import time
from collections import Counter
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
TRUNCATED = r"truncate dirty files to (\d+)"  # AutoSwitchHAClient, 5.5.0
PROBE = "GP"  # one-message sends that wait for a new master


class GroupEnv(Env):
    """A broker group on one tierfs mount, or two (test_broker's: hot dir on a tmpfs of its own, objects in a
    local directory); the group's first broker runs the clients and the name server."""

    def __init__(self, version: str, base: Path, controller: bool, roots: tuple[str, str] = ROOTS,
                 two_mounts: bool = False):
        super().__init__(version, base)
        self.roots = roots
        # with two mounts the second store is on a tierfs of its own (hot tmpfs, daemon, object directory)
        self.second: Env | None = None
        self.report: dict = {}
        try:
            if two_mounts:  # one bucket (the first's object directory), one broker group: its chunks stored once
                (base / "second").mkdir()
                self.second = Env(version, base / "second")
                for place in (self, self.second):
                    place.objects = self.objects
                    place.mount.options = (*place.mount.options, f"objectstore.url=file://{self.objects}",
                                           f"upload.dedup_group={B.BROKER_NAME}",
                                           "upload.dedup_group_grace_seconds=1")
            self.places = {roots[0]: self, roots[1]: self.second or self}
            if not controller:  # a 4.x broker records no brokerName in its store: the archive is told its group
                for place in dict.fromkeys(self.places.values()):
                    place.mount.options = (*place.mount.options, f"archive.broker_name={B.BROKER_NAME}")
            self.group = B.BrokerGroup(version, base / "home", [self.path(r) for r in roots], controller=controller)
        except BaseException:  # e.g. RocketMQ not resolved: no tmpfs left behind
            if self.second is not None:
                self.second.close()
            super().close()
            raise

    def path(self, root: str) -> Path:
        """The store root `root` through its mount."""
        return self.places[root].mnt / root

    def rows(self, root: str) -> list[dict]:
        """The CommitLog rows of store root `root` in its mount's status."""
        return [f for f in self.places[root].status()["files"]
                if f["kind"] == "commitlog" and f["path"].startswith(f"{root}/")]

    def client(self, *args: object, timeout: float = 300) -> dict:
        return self.group.members[0].client(*args, timeout=timeout)

    def produce_group(self, start: int, count: int, acked: Path, topics: str = TOPICS, queues: int = QUEUES,
                      threads: int = 32) -> dict:
        return self.client("produce", self.group.ns_addr, B.BROKER_NAME, topics, queues, start, count, BODY,
                           threads, acked)

    def consume_group(self, group: str, count: int, acked: Path, positions: Path | None = None) -> dict:
        return self.client("consume", self.group.ns_addr, B.BROKER_NAME, TOPICS, QUEUES, 0, count, BODY, group,
                           acked, 0, *([positions] if positions else []))

    def mount_all(self) -> None:
        for place in dict.fromkeys(self.places.values()):
            place.mount.mount()

    def close(self) -> None:
        try:
            self.group.close()
        finally:
            try:
                if self.second is not None:
                    self.second.close()
            finally:
                super().close()


def wait_tiered_and_evicted(env: GroupEnv, roots: tuple[str, ...], least: int, timeout: float = 180) -> dict:
    """Each store root has at least `least` tiered CommitLog segments, all but the newest tiered one evicted,
    and the upload backlog of its mount is empty."""
    seen: dict = {}
    for place in dict.fromkeys(env.places[r] for r in roots):
        mine = tuple(r for r in roots if env.places[r] is place)

        def counts(st: dict, mine: tuple[str, ...] = mine) -> dict:
            out = {}
            for r in mine:
                tiered = [f for f in st["files"] if f["kind"] == "commitlog" and f["path"].startswith(f"{r}/")
                          and f["state"] == "tiered"]
                out[r] = (len(tiered), sum(f["resident_bytes"] < f["size"] for f in tiered))
            return out

        def ok(seen: dict, mine: tuple[str, ...] = mine) -> bool:
            return all(seen[r][0] >= least and seen[r][1] >= seen[r][0] - 1 for r in mine)

        seen.update(wait_evicted(place, counts, ok, f"CommitLog segments of {mine} tiered and evicted", timeout))
    return seen


def identical_sealed_segments(env: GroupEnv, a: str, b: str) -> int:
    """The tiered CommitLog segments of store root `a` that store root `b` also has are byte-identical to b's
    (read through the mounts: evicted bytes come from the tier). How many were compared (at least one)."""
    names = {f["path"].rsplit("/", 1)[1] for f in env.rows(a) if f["state"] == "tiered"}
    names &= {p.name for p in (env.path(b) / "commitlog").iterdir()}
    assert names, f"no tiered CommitLog segment of {a} that {b} has too"
    for name in sorted(names):
        da, db = (hashlib.sha256((env.path(r) / "commitlog" / name).read_bytes()).hexdigest() for r in (a, b))
        assert da == db, f"CommitLog segment {name} differs between {a} and {b}"
    return len(names)


def identical_files(env: GroupEnv, a: str, b: str, kind: str) -> tuple[int, int]:
    """(files of `kind` tiered in store root `a` that b has under the same path, how many of those are
    byte-identical): each broker builds its ConsumeQueues and IndexFiles itself, so unlike the CommitLog they may
    differ (a measurement for deduplication, not an invariant)."""
    rows = [f for f in env.places[a].status()["files"] if f["kind"] == kind and f["path"].startswith(f"{a}/")
            and f["state"] == "tiered"]
    same = common = 0
    for f in rows:
        rel = f["path"].split("/", 1)[1]
        other = env.path(b) / rel
        if other.is_file():
            common += 1
            same += (env.path(a) / rel).read_bytes() == other.read_bytes()
    return common, same


def stored_bytes(env: GroupEnv) -> tuple[int, int]:
    """(bytes of every segment object in the group's object directory, bytes of the objects the master's rows
    name: what the master alone would store). On one mount the replicas' identical chunks are one
    content-addressed object (upload.dedup); on two mounts sharing the bucket, one object of the group's
    namespace (upload.dedup_group): either way the two are about equal."""
    total = alone = 0
    shared = {str(f.relative_to(env.objects)): f.stat().st_size for f in (env.objects / "groups").rglob("*/cas/*/*")
              if f.is_file()}
    total += sum(shared.values())
    for place in dict.fromkeys(env.places.values()):
        sid = place.status()["store_id"]
        sizes = {str(f.relative_to(place.objects)): f.stat().st_size for pre in ("seg", "cas")
                 for f in (place.objects / sid / pre).rglob("*") if f.is_file()}
        total += sum(sizes.values())
        sizes.update(shared)
        if place is env.places["master"]:
            db = sqlite3.connect(f"file:{place.mount.state_dir / 'catalog.db'}?mode=ro", uri=True, timeout=30)
            try:
                rows = db.execute("SELECT objects, unit_ref FROM files WHERE path LIKE 'master/%'").fetchall()
            finally:
                db.close()
            keys = {k for objs, _ in rows for k in json.loads(objs)} | {r.split(":", 2)[2] for _, r in rows if r}
            alone = sum(sizes.get(k, 0) for k in keys)
    return total, alone


def archive(env: GroupEnv, root: str, step: str) -> dict:
    """`tierfs compact --only archive` on the mount of store root `root` (Spark on 2 cores), timed as `step`: the
    job's summary (clean), with the seconds its Spark session took to start (0: none started)."""
    m = env.places[root].mount
    with timed(env.report, step):
        r = m.cli("compact", m.mnt, "--json", "--only", "archive", "--master", "local[2]", timeout=600)
    assert r.returncode == 0 and r.stdout.strip(), f"{r.stdout}\n{r.stderr}\n{m.log_text()[-3000:]}"
    summary = json.loads(r.stdout)
    assert summary["ok"] and not summary["errors"], summary
    result = m.state_dir / "jobs" / summary["job_id"] / "result.json"
    summary["session_start_seconds"] = json.loads(result.read_text())["session_start_seconds"] \
        if result.exists() else 0
    return summary


def archive_table(env: GroupEnv):
    """The archive table the group's stores commit to, beside the objects (one bucket for the group)."""
    from deltalake import DeltaTable

    return DeltaTable(str(env.objects / "tables" / "messages"))


def tiered_bases(env: GroupEnv, root: str) -> list[int]:
    """Base offsets of store root `root`'s tiered CommitLog segments, in order."""
    return sorted(int(f["path"].rsplit("/", 1)[1]) for f in env.rows(root) if f["state"] == "tiered")


def active_base(env: GroupEnv, root: str) -> int:
    """Base offset of store root `root`'s active CommitLog segment: the newest holding a record (the broker
    creates the next one, all zeros, ahead of time). Reads the first bytes of the newest files (hot)."""
    for p in sorted((p for p in (env.path(root) / "commitlog").iterdir() if p.name.isdigit()),
                    key=lambda p: int(p.name), reverse=True):
        with open(p, "rb") as f:
            if f.read(4).strip(b"\0"):
                return int(p.name)
    raise AssertionError(f"no CommitLog segment of {root} holds a record")


def sealed_bases(env: GroupEnv, root: str) -> list[int]:
    """Base offsets of store root `root`'s sealed CommitLog segments, once every one is tiered: those below the
    active segment (a CommitLog segment seals once the broker rolled past it, format §12; the active one never
    does), from 0 on (no retention here). The broker takes no message meanwhile."""
    sealed = list(range(0, active_base(env, root), B.COMMITLOG_BYTES))
    wait_for(lambda: tiered_bases(env, root) == sealed, 120, 0.5,
             what=f"every sealed CommitLog segment of {root} tiered (and no other)")
    return sealed


def archive_group(env: GroupEnv) -> dict:
    """Both stores of the group archive into one table: the master's store, the master's again (nothing to do)
    and the slave's (on one mount the first job takes both roots). Each sealed segment is committed once: the
    slave's run adds no table version and no file, and starts no Spark. What check_archived_once needs."""
    ms, sl = env.roots
    bases = {r: sealed_bases(env, r) for r in env.roots}
    assert bases[ms] == bases[sl] and len(bases[ms]) >= 3, bases
    n = len(bases[ms])
    one_mount = env.second is None
    first = archive(env, ms, "archive: master")
    # one mount: its job takes both roots' segments and writes each once (the slave's are the master's replicas)
    assert first["applied"]["archive"] == (2 * n if one_mount else n), first
    table = archive_table(env)
    version, files = table.version(), sorted(table.file_uris())
    again = archive(env, ms, "archive: master again")
    assert again.get("note") == "nothing to do", again
    if not one_mount:  # the replica's job finds every segment in the table: it writes nothing, starts no Spark
        replica = archive(env, sl, "archive: slave")
        assert replica["applied"]["archive"] == n and replica["archive_rows"] == 0, replica
        assert replica["session_start_seconds"] == 0, replica
    table = archive_table(env)
    assert (table.version(), sorted(table.file_uris())) == (version, files), \
        f"the replica's run changed the table: {table.history(3)}"
    # the probe messages (topic PROBE, one queue) were sent before any other: all in the first segment
    probes = B.queue_offset(env.path(sl) / "consumequeue" / PROBE / "0")
    return {"sealed segments": n, "end": n * B.COMMITLOG_BYTES, "probes": probes, "table version": version,
            "table files": len(files)}


def check_archived_once(env: GroupEnv, archived: dict, acked: Path, where: Path, count: int) -> dict:
    """The table archive_group made holds exactly the messages the broker stored in a sealed CommitLog segment.
    The archive takes tiered segments only, and a CommitLog segment is tiered only once sealed (the active
    segment, which the broker still appends to, never is); both stores held the same sealed segments, from
    offset 0. A consumer told where the broker stored each acknowledged message (`where`: CommitLog and queue
    offset), so: the acknowledged messages (of sequence numbers 0..count-1) whose CommitLog offset is below the
    end of the last sealed segment, plus the probe messages. Each is one row, under its (topic, queue, queue
    offset), with the body, keys, tags and properties it was sent with. Figures for the report."""
    ms, sl = env.roots
    rows = archive_table(env).to_pyarrow_table(columns=["topic", "queue_id", "queue_offset", "phys_offset", "keys",
                                                        "tags", "properties", "body", "broker", "segment"]).to_pylist()
    ids = Counter((r["topic"], r["queue_id"], r["queue_offset"]) for r in rows)
    dups = sum(c - 1 for c in ids.values())
    assert dups == 0, [k for k, c in ids.items() if c > 1][:5]
    pos = B.positions(where)
    bits = int.from_bytes(acked.read_bytes(), "little")
    ack = [seq for seq in range(count) if bits >> seq & 1]
    assert len(ack) == count and all(pos[seq][0] >= 0 for seq in ack)
    want = {seq for seq in ack if pos[seq][0] < archived["end"]}
    topics = TOPICS.split(",")
    got: dict[int, dict] = {}
    probes = []
    for r in rows:
        seq = int(dict(r["properties"])["seq"])
        seg = r["phys_offset"] - r["phys_offset"] % B.COMMITLOG_BYTES
        assert r["broker"] == B.BROKER_NAME and r["segment"] in (f"{ms}/commitlog/{seg:020d}",
                                                                 f"{sl}/commitlog/{seg:020d}"), r["segment"]
        assert (r["body"], r["keys"], r["tags"], dict(r["properties"]).get("p")) == \
            (B.body(seq, BODY), [f"K{seq}"], f"T{seq % 5}", f"v{seq * 7919 % 100003}"), (seq, r)
        if r["topic"] == PROBE:
            probes.append(r["queue_offset"])
            continue
        assert seq not in got, f"message {seq} archived twice"
        got[seq] = r
        assert (r["topic"], r["queue_id"], r["phys_offset"], r["queue_offset"]) == \
            (B.topic_of(topics, seq), B.queue_of(topics, QUEUES, seq), *pos[seq]), (seq, r)
    assert set(got) == want, (f"{len(want - set(got))} missing (first {sorted(want - set(got))[:5]}), "
                              f"{len(set(got) - want)} not in a sealed segment (first {sorted(set(got) - want)[:5]})")
    assert sorted(probes) == list(range(archived["probes"])), (sorted(probes), archived)
    return {"rows": len(rows), "duplicates": dups, "messages": len(want), "of acked": count, **archived}


def caught_up(env: GroupEnv, follower: str, leader: str) -> bool:
    """Every ConsumeQueue of the follower has as many units as the leader's: it replicated (and dispatched)
    everything the leader has."""
    return B.caught_up(env.path(follower), env.path(leader), TOPICS.split(","), QUEUES)


def _start(env: GroupEnv, report: dict) -> None:
    g = env.group
    with timed(report, "start"):
        env.mount_all()
        g.start()
    with timed(report, "start: in sync"):
        if g.controller:  # the first broker registered is elected; the second joins the sync state set
            wait_for(lambda: B.in_sync(g.members[0], 1), 90, 0.5, what="the slave joining the sync state set")
    with timed(report, "start: topics"):
        env.client("topics", g.ns_addr, g.members[0].broker_addr, QUEUES, *TOPICS.split(","), f"{PROBE}:1")
    # a send before the slave's HA connection is up waits its syncFlushTimeout out and fails; and a 4.9 slave
    # reports its offset (which starts the transfer) only a heartbeat interval (5 s) after it connected: the
    # first sends wait for that, then for the catch-up, on a loaded machine past the timeout
    wait_for(lambda: HA_CONNECTED in g.members[0].broker_log(), 60, 0.5,
             what="the slave's HA connection to the master")
    with timed(report, "start: first send acknowledged by both"):
        wait_master(env, "start")
    # the slave serves pulls with the master gone: it must have synchronised the topic configs from the master
    wait_for(lambda: all(t in _read(env.path(env.roots[1]) / "config" / "topics.json")
                         for t in (*TOPICS.split(","), PROBE)),
             60, 0.5, what="the slave synchronising the topic configs")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.fixture(params=("one mount", "two mounts"))
def master_slave(request, tmp_path):
    report = REPORT.setdefault(f"4.9.7 master-slave, {request.param}", {})
    env = GroupEnv("4.9.7", tmp_path, controller=False, two_mounts=request.param == "two mounts")
    env.report = report
    try:
        _start(env, report)
        yield env
    finally:
        env.close()
        print(f"\nbroker group 4.9.7 master-slave, {request.param}, step seconds: {report}")


def test_master_slave_slave_serves_evicted_history(master_slave: GroupEnv):
    """4.9.7 master-slave, on one mount and on two: every message acknowledged by the SYNC_MASTER is read back by content
    from the slave, from offset 0, after both stores' sealed segments were tiered and evicted and the master
    stopped. Both stores then archive into one table, each message of a sealed segment exactly once
    (archive_group, check_archived_once)."""
    env, report = master_slave, master_slave.report
    acked = env.base / "acked"
    with timed(report, f"produce {N}"):
        res = env.produce_group(0, N, acked)
    assert res["acked"] == N and res["errors"] == 0, (res["first_errors"], res)
    wait_for(lambda: caught_up(env, "slave", "master"), 120, 0.5, what="the slave dispatching every message")
    with timed(report, "wait evicted"):
        counts = wait_tiered_and_evicted(env, ROOTS, 3)
    with timed(report, "compare segments"):
        same = identical_sealed_segments(env, "master", "slave")
        others = {kind: identical_files(env, "master", "slave", kind) for kind in ("consumequeue", "index")}
        stored, alone = stored_bytes(env)
    master = env.group.members[0]
    with timed(report, "master stop"):
        master.stop_broker(signal.SIGTERM)  # unregisters: the name server routes the group to the slave only
    where = env.base / "positions"
    with timed(report, f"consume {N} from slave"):
        got = env.consume_group("g-from-slave", N, acked, where)
    assert_all_read(got, N)
    assert got["read"] == N and got["dups"] == 0, got
    report["msgs/s from slave"] = round(N / got["secs"])
    archived = check_archived_once(env, archive_group(env), acked, where, N)
    print(f"\n4.9.7 group archive table: {archived}")
    print(f"\n4.9.7 group: (tiered, evicted) CommitLog segments per store {counts}; {same} sealed segments "
          f"byte-identical between master and slave; (tiered files the slave has too, byte-identical) by kind: "
          f"{others}; stored bytes group/master = {stored / alone:.3f} ({stored} / {alone})")
    report["stored bytes group/master"] = round(stored / alone, 3)
    assert stored / alone <= 1.05, (stored, alone)  # one mount, or two sharing the group: stored once


@pytest.fixture(scope="module", params=("one mount", "two mounts"))
def controller_group(request, tmp_path_factory):
    """One 5.5.0 controller-mode group for the tests below, which run in order on it: its two brokers' stores on
    one mount, then (a second group) each on a mount of its own."""
    report = REPORT.setdefault(f"5.5.0 controller, {request.param}", {})
    env = GroupEnv("5.5.0", tmp_path_factory.mktemp("controller-group"), controller=True, roots=("node0", "node1"),
                   two_mounts=request.param == "two mounts")
    env.report = report
    try:
        _start(env, report)
        yield env
    finally:
        env.close()
        print(f"\nbroker group 5.5.0 controller mode, {request.param}, step seconds: {report}")


def kill_and_wait_promotion(env: GroupEnv, dead: int, report: dict, step: str) -> None:
    """kill -9 of member `dead`, then wait for the member the controller promoted; the failover time, kill to
    the first acknowledged send, goes into `report`."""
    killed_ms = int(time.time() * 1000)
    assert env.group.members[dead].stop_broker(signal.SIGKILL) == -signal.SIGKILL
    report[f"failover {step} s"] = round((wait_master(env, step) - killed_ms) / 1000, 1)


def wait_master(env: GroupEnv, step: str) -> int:
    """One-message sends to the probe topic until one is acknowledged (by whichever member is the master);
    the epoch-ms of that acknowledgement."""
    return env.group.first_ack(env.base / f"acked-probe-{step}", PROBE, BODY)


def test_controller_failover_and_rejoin_on_tierfs(controller_group: GroupEnv):
    """5.5.0 controller mode, on one mount and on two. kill -9 of the master: the controller promotes the slave, which serves
    all history (its evicted segments) and takes new writes; the old master restarts as a slave, truncates to
    the new master's epoch and catches up on tierfs; kill -9 of the new master hands the group back to it, and it
    serves every message acknowledged by either. Before the first kill, on two mounts, both stores archive into one
    table with no archive config (brokerIdentity names the group), each message of a sealed segment once."""
    env, report = controller_group, controller_group.report
    g, (a, b) = env.group, env.roots
    first, second, merged = env.base / "acked-1", env.base / "acked-2", env.base / "acked-all"
    m2 = 10_000
    with timed(report, f"produce {N}"):
        res = env.produce_group(0, N, first)
    assert res["acked"] == N and res["errors"] == 0, (res["first_errors"], res)
    wait_for(lambda: caught_up(env, b, a), 120, 0.5, what="the slave dispatching every message")
    with timed(report, "wait evicted"):
        counts = wait_tiered_and_evicted(env, env.roots, 3)
    identical_sealed_segments(env, a, b)
    # each store finds the group's name in its root's brokerIdentity: no archive config (checked below)
    archived = archive_group(env) if env.second is not None else None

    kill_and_wait_promotion(env, 0, report, "1")
    with timed(report, f"produce {m2} to the new master"):
        res = env.produce_group(N, m2, second)
    assert res["acked"] == m2 and res["errors"] == 0, (res["first_errors"], res)
    merged.write_bytes(B.merge_acked([(first.read_bytes(), 0), (second.read_bytes(), N)]))
    where = env.base / "positions-new-master"
    with timed(report, "consume all from the new master"):
        got = env.consume_group("g-new-master", N + m2, merged, where)
    assert_all_read(got, N + m2)
    if archived is not None:  # the new master stored the old master's messages at the same offsets
        print(f"\n5.5.0 controller group archive table: {check_archived_once(env, archived, merged, where, N + m2)}")

    with timed(report, "old master rejoins and catches up"):
        syncs = len(re.findall(r"syncStateSet has been changed into", g.members[1].broker_log()))
        g.members[0].start_broker(g.conf(0))
        wait_for(lambda: caught_up(env, a, b), 180, 0.5, what="the old master catching up as a slave")
        wait_for(lambda: B.in_sync(g.members[1], syncs + 1), 90, 0.5,
                 what="the old master back in the sync state set")
    old_log = g.members[0].broker_log()
    assert "Begin to change to slave" in old_log, old_log[-3000:]
    truncated = re.findall(TRUNCATED, old_log)
    with timed(report, "wait evicted after rejoin"):
        wait_tiered_and_evicted(env, env.roots, 4)
    same = identical_sealed_segments(env, a, b)

    kill_and_wait_promotion(env, 1, report, "2")
    with timed(report, "consume all from the old master"):
        got = env.consume_group("g-old-master", N + m2, merged)
    assert_all_read(got, N + m2)
    print(f"\n5.5.0 controller group: (tiered, evicted) CommitLog segments per store {counts}; truncations on "
          f"rejoin {truncated}; {same} sealed segments byte-identical after the rejoin")


def test_unclean_election_truncates_tiered_segments(controller_group: GroupEnv):
    """After the test above node0 is the master alone. It takes messages the stopped node1 never gets, seals
    and tiers segments of them (evicted); kill -9 of node0, and the controller, restarted with
    enableElectUncleanMaster, elects node1, which takes new writes. node0 comes back as a slave and truncates
    its CommitLog to node1's epoch: into a tiered, evicted segment (tierfs rewrites it as a hot file) and past it
    (whole tiered segments deleted). It then holds node1's bytes exactly, and after a last failover serves every
    message acknowledged but those the unclean election gave up (which are gone, as RocketMQ intends)."""
    env, report = controller_group, controller_group.report
    g, (a, b) = env.group, env.roots
    node0_mount = env.places[a].mount
    before = N + 10_000  # what the test above acknowledged
    lost, third, fourth = 30_000, env.base / "acked-3", env.base / "acked-4"
    with timed(report, f"produce {lost} to node0 alone"):
        res = env.produce_group(before, lost, third)
    assert res["acked"] == lost and res["errors"] == 0, (res["first_errors"], res)
    # 7.5 MiB past node1's end: node0 fills and seals the segment node1's end lies in (and more after it)
    wait_tiered_and_evicted(env, (a,), 6)
    tiered = {int(f["path"].rsplit("/", 1)[1]) for f in env.rows(a) if f["state"] == "tiered"}
    rewrites = node0_mount.log_text().count("re-materialising")
    assert g.members[0].stop_broker(signal.SIGKILL) == -signal.SIGKILL
    with timed(report, "unclean election of node1"):
        g.members[0].stop_controller()
        g.members[0].start_controller(enableElectUncleanMaster="true")
        g.members[1].start_broker(g.conf(1))
        wait_master(env, "3")
    fourth_start = before + lost
    res = env.produce_group(fourth_start, 4_000, fourth)
    assert res["acked"] == 4_000 and res["errors"] == 0, (res["first_errors"], res)
    with timed(report, "node0 rejoins: truncation and catch-up"):
        syncs = len(re.findall(r"syncStateSet has been changed into", g.members[1].broker_log()))
        g.members[0].start_broker(g.conf(0))
        wait_for(lambda: re.search(TRUNCATED, g.members[0].broker_log()) is not None, 120, 0.5,
                 what="node0 truncating its CommitLog to node1's epoch")
        wait_for(lambda: B.in_sync(g.members[1], syncs + 1), 120, 0.5, what="node0 back in the sync state set")
    point = int(re.findall(TRUNCATED, g.members[0].broker_log())[-1])
    segment = point - point % B.COMMITLOG_BYTES
    assert segment in tiered, f"node0 truncated to {point}, in segment {segment}: not one it had tiered {tiered}"
    assert node0_mount.log_text().count("re-materialising") > rewrites, "no tiered segment was rewritten"
    wait_tiered_and_evicted(env, env.roots, 6)
    same = identical_sealed_segments(env, a, b)
    kill_and_wait_promotion(env, 1, report, "4")
    merged = env.base / "acked-kept"
    merged.write_bytes(B.merge_acked([((env.base / "acked-all").read_bytes(), 0), (fourth.read_bytes(), fourth_start)]))
    with timed(report, "consume all from node0"):
        got = env.client("consume", g.ns_addr, B.BROKER_NAME, TOPICS, QUEUES, 0, fourth_start + 4_000, BODY,
                         "g-after-truncation", merged, 0)
    assert_all_read(got, before + 4_000)
    assert got["distinct"] == before + 4_000 and got["dups"] == 0, f"given-up messages still served: {got}"
    print(f"\nunclean election: node0 truncated to {point} (inside tiered segment {segment}); {same} sealed segments "
          f"byte-identical afterwards")
