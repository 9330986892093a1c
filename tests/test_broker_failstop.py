"""Issue 28: kill -9 of the tierfs daemon mid-produce, three times, on RocketMQ 4.9.7 and 5.5.0 under SYNC_FLUSH,
with the store mounted by `tierfs mount --supervise`: 0 acknowledged messages lost (asserted).

Unsupervised (tests/test_broker.py's scenario 3), the kernel aborts the FUSE connection when the daemon dies,
msync fails, and 4.9's MappedFile.flush swallows that failure and answers SEND_OK: those messages are gone after
the restart. Supervised, the broker's msync waits on the still-open connection until the supervisor has SIGKILLed
the broker; the test then plays the broker's service manager (restarts it once the supervisor has remounted).
At the end one consumer checks every acknowledged message of the three rounds by content.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from mountutil import pid_alive, requires_fuse, run, wait_for
from test_failstop import SupervisedMount

import brokerutil as B

pytestmark = requires_fuse

TOPIC = "TK"
QUEUES = 2
ROUND = 60_000  # messages a round's producer would send; it stops at the first failed send of each thread
KILLS = 3
UNITS_BEFORE_KILL = 2_000  # ConsumeQueue units written in a round before its kill: the kill lands mid-produce
BODY = 100
OPTS = ("tiering.enabled=true,seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,"
        f"broker.max_hash_slot_num={B.HASH_SLOTS},broker.max_index_num={B.INDEX_NUM},compaction.enabled=false")


class Env:
    """Name server, supervised mount (hot dir on its own tmpfs) and broker of one version."""

    def __init__(self, version: str, base: Path):
        self.version, self.base = version, base
        self.hot, self.mnt = base / "hot", base / "mnt"
        self.hot.mkdir()
        self.mnt.mkdir()
        run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=0755", "tierfs-failstop-hot", self.hot], check=True)
        self.mount = SupervisedMount(self.hot, self.mnt, options=(OPTS,))
        self.rmq = B.RocketMQ(version, base / "home")

    def conf(self) -> dict[str, str]:
        return self.rmq.broker_conf(self.mnt)

    def close(self) -> None:
        try:
            self.rmq.close()
        finally:
            try:
                self.mount.cleanup()
            finally:  # the daemons' helper processes may hold hot files for a moment after their daemon exited
                wait_for(lambda: run(["umount", self.hot], timeout=60).returncode == 0, 60, 0.5,
                         what=f"unmounting the hot dir tmpfs {self.hot}")


@pytest.fixture(scope="module", params=B.VERSIONS)
def env(request, tmp_path_factory):
    e = Env(request.param, tmp_path_factory.mktemp(f"failstop-{request.param}"))
    try:
        e.mount.mount()
        e.rmq.start_namesrv()
        e.rmq.start_broker(e.conf())
        e.rmq.client("topics", e.rmq.ns_addr, e.rmq.broker_addr, QUEUES, f"{TOPIC}:{QUEUES}")
        yield e
    finally:
        e.close()


def cq_units(hot: Path) -> int:
    """ConsumeQueue units the broker has written to the hot dir for TOPIC (units are written in order, so the
    last non-zero one of each queue's last file is found by bisection)."""
    total = 0
    for q in range(QUEUES):
        files = sorted((hot / "consumequeue" / TOPIC / str(q)).glob("*"))
        for i, path in enumerate(files):
            if i < len(files) - 1:
                total += path.stat().st_size // 20
                continue
            with open(path, "rb") as f:
                data = f.read()
            lo, hi = 0, len(data) // 20
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if data[mid * 20:mid * 20 + 20].strip(b"\0") else (lo, mid)
            total += lo
    return total


def test_daemon_kill_loses_no_acknowledged_message(env: Env):
    rmq, m = env.rmq, env.mount
    merged = 0  # BitSet (as an int) of every acknowledged message of every round, from sequence 0
    rounds = []
    t0 = time.monotonic()
    for kill in range(1, KILLS + 1):
        start = (kill - 1) * ROUND
        acked = env.base / f"acked-{kill}"
        result: dict = {}

        def produce() -> None:
            try:
                result["res"] = rmq.client("produce", rmq.ns_addr, B.BROKER_NAME, TOPIC, QUEUES, start, ROUND, BODY,
                                           16, acked)
            except Exception as e:  # noqa: BLE001 - asserted below
                result["err"] = e

        before = cq_units(env.hot)
        producer = threading.Thread(target=produce)
        producer.start()
        wait_for(lambda: cq_units(env.hot) >= before + UNITS_BEFORE_KILL, 180, 0.1,
                 what=f"round {kill}: the broker writing {UNITS_BEFORE_KILL} messages")
        daemon = m.pid
        os.kill(daemon, signal.SIGKILL)
        broker_code = rmq.broker.proc.wait(120)  # the supervisor's SIGKILL (or a crash: asserted after the count)
        producer.join(300)
        assert not producer.is_alive(), "the producer did not end after the broker died"
        res = result.get("res")
        assert res is not None, f"producer failed: {result.get('err')}"
        merged |= int.from_bytes(acked.read_bytes(), "little") << start
        wait_for(lambda: m.state()["remounts"] == kill, 120, 0.1, what=f"remount {kill} by the supervisor")
        m.pid = m.state()["daemon"]
        assert m.pid != daemon and pid_alive(m.pid)
        rounds.append((res["acked"], res["errors"], broker_code))
        rmq.start_broker(env.conf())  # the broker's service manager
    bits = env.base / "acked-all"
    bits.write_bytes(merged.to_bytes((merged.bit_length() + 7) // 8, "little"))
    got = rmq.client("consume", rmq.ns_addr, B.BROKER_NAME, TOPIC, QUEUES, 0, KILLS * ROUND, BODY, "g-failstop",
                     bits, 0)
    n_acked = bin(merged).count("1")
    print(f"\nbroker {env.version}, {KILLS} daemon kills under SYNC_FLUSH in {time.monotonic() - t0:.0f} s: "
          f"(acked, send errors, broker exit) per round {rounds}; {n_acked} acknowledged, "
          f"{got.get('missing', 0)} lost, {got['bad']} differing")
    assert got.get("missing", 0) == 0, f"{got['missing']} acknowledged messages lost: {got['first_missing']}"
    # a message the broker never acknowledged may come back torn (see test_broker.assert_all_read)
    assert got["bad_acked"] == 0, f"acknowledged messages differing from what was sent: {got['first_bad']}"
    assert all(a > 0 and e > 0 for a, e, _ in rounds), rounds
    assert all(code == -signal.SIGKILL for *_, code in rounds), f"broker not stopped by the supervisor: {rounds}"
