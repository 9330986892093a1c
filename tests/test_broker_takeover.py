"""Takeover of a real RocketMQ broker's store (4.9.7 and 5.5.0, SYNC_FLUSH and ASYNC_FLUSH) after the loss of its
machine: continuous tiering every 2 s, a producer sending, then kill -9 of the tierfs daemon and of the broker,
the whole hot dir removed; `tierfs mount --takeover --force HOLDER` on a new hot dir, an unmodified broker
started on it (it finds `abort` and recovers abnormally), and a new consumer group reads every message that was
acknowledged before a continuous-tiering round that finished before the loss, each body and property equal to
what was sent.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

import brokerutil as B
from mountutil import Mount, requires_fuse, wait_for
from test_broker import BODY, assert_all_read
from test_rpo import TakeoverMount, wait_round_after

pytestmark = requires_fuse

RPO = 2.0
OPTS = (f"tiering.enabled=true,cache.max_bytes=8MiB,cache.block_bytes=256KiB,objectstore.chunk_bytes=1MiB,"
        f"seal.quiet_seconds=0.5,seal.scan_interval_seconds=0.5,broker.max_hash_slot_num={B.HASH_SLOTS},"
        f"broker.max_index_num={B.INDEX_NUM},delete.grace_seconds=2,compaction.enabled=false,"
        f"tiering.rpo_seconds={RPO},lease.ttl_seconds=60")
COUNT = 12_000


@pytest.mark.parametrize("version,flush", [(B.VERSIONS[0], "ASYNC_FLUSH"), (B.VERSIONS[-1], "SYNC_FLUSH")])
def test_broker_takeover_after_losing_the_node(tmp_path: Path, version: str, flush: str):
    objects = tmp_path / "objects"
    objects.mkdir()
    a = Mount(tmp_path / "hot-a", tmp_path / "mnt-a", options=(OPTS, f"objectstore.url=file://{objects},"
                                                                      f"store.id=brk"))
    a.hot.mkdir()
    a.mnt.mkdir()
    rmq = B.RocketMQ(version, tmp_path / "home")
    b: TakeoverMount | None = None
    try:
        a.mount()
        rmq.start_namesrv()
        rmq.start_broker(rmq.broker_conf(a.mnt, flushDiskType=flush))
        rmq.client("topics", rmq.ns_addr, rmq.broker_addr, 4, "TO")
        acked = tmp_path / "acked"
        result: dict = {}

        def producer() -> None:
            try:
                result["res"] = rmq.client("produce", rmq.ns_addr, B.BROKER_NAME, "TO", 4, 0, COUNT, BODY, 8, acked)
            except Exception as e:  # noqa: BLE001 - reported below
                result["err"] = e

        t = threading.Thread(target=producer)
        t.start()
        wait_for(lambda: json.loads((a.mnt / ".tierfs" / "status.json").read_text())["bytes_written"] > 3 << 20,
                 timeout=120, interval=0.2, what="the broker writing 3 MiB")
        cut_ms = int(time.time() * 1000)
        wait_round_after(a, cut_ms / 1000)
        # the node is lost: the daemon and the broker die, the hot dir is gone
        a.kill(signal.SIGKILL)
        rmq.stop_broker(signal.SIGKILL)
        t.join(300)
        assert not t.is_alive(), "the producer did not end after the broker died"
        shutil.rmtree(a.hot)
        durable = tmp_path / "acked-before-cut"
        n_before = B.acked_before(acked, COUNT, cut_ms, durable)
        assert n_before > 300, n_before

        b = TakeoverMount(f"file://{objects}/brk", tmp_path / "hot-b", tmp_path / "mnt-b", options=[OPTS])
        b.hot.mkdir()
        b.mnt.mkdir()
        refused = b._cli_mount()
        holder = re.search(r"--force '([^']+)'", refused.stderr)
        assert refused.returncode != 0 and holder, refused.stderr
        shutil.rmtree(b.hot / ".tierfs", ignore_errors=True)
        b.force = holder.group(1)
        t0 = time.monotonic()
        b.mount()
        assert (b.mnt / "abort").exists(), "the lost broker's abort file is part of the point taken over"
        rmq.start_broker(rmq.broker_conf(b.mnt, flushDiskType=flush))
        res = rmq.client("consume", rmq.ns_addr, B.BROKER_NAME, "TO", 4, 0, COUNT, BODY, "g-takeover", durable, 0)
        print(f"\nbroker {version} {flush}: {n_before} acknowledged before the cut, {res['distinct']} read after "
              f"the takeover ({time.monotonic() - t0:.1f} s from takeover to all read)")
        assert_all_read(res, n_before)
    finally:
        try:
            rmq.close()
        finally:
            a.cleanup()
            if b is not None:
                b.cleanup()
