"""Chaos run: a real RocketMQ broker on tierfs (S3 on a local Ceph RGW behind the fault proxy) under a steady
producer and a lagging consumer for --minutes, with faults drawn at random from issue 28's list: the store slow
(2 s a request), the store answering 503, radosgw stopped (SIGSTOP), kill -9 of the broker (restarted), the hot
dir's disk full (ENOSPC). At the end every acknowledged message is read back by content.

    python bench/chaos.py [--minutes 30] [--version 5.5.0] [--seed N] [--faults slow,503,...] [--json out.json]

Prints faults survived, messages acknowledged, lost (must be 0: exit 1 otherwise), duplicates, and the p99 send
latency of messages acknowledged during faults and outside them. tests/test_broker_faults.py runs a 2-minute
version on the broker of its own fixture (`run`). Needs root, /dev/fuse, the Ceph packages and the Maven
artifacts of ./mount-scripts/test (tests/brokerutil.py).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import brokerutil as B  # noqa: E402

FAULTS = ("slow", "503", "store-stopped", "broker-kill9", "enospc")
ROUND = 4_000  # messages per produce round of the steady producer
THREADS = 16


def _start_fault(env, kind: str) -> None:
    from test_broker_faults import SLOW_MS, fill

    if kind == "slow":
        env.proxy.set("latency", latency_ms=SLOW_MS)
    elif kind == "503":
        env.proxy.set("error", status=503, code="SlowDown")
    elif kind == "store-stopped":
        env.rgw.freeze_rgw()
    elif kind == "broker-kill9":
        env.rmq.stop_broker(signal.SIGKILL)
    elif kind == "enospc":
        fill(env.hotfs / "filler")


def _end_fault(env, kind: str) -> None:
    if kind in ("slow", "503"):
        env.proxy.passthrough()
    elif kind == "store-stopped":
        env.rgw.thaw_rgw()
    elif kind == "broker-kill9":
        env.rmq.start_broker(env.conf())
    elif kind == "enospc":
        (env.hotfs / "filler").unlink(missing_ok=True)


def run(env, minutes: float, seed: int, faults: tuple[str, ...] = FAULTS, log=print) -> dict:
    """Drive `env` (a tests/test_broker_faults.FaultEnv with its broker up) for `minutes`: a steady producer
    and a lagging consumer, faults at random. Returns the figures; `lost` must be 0."""
    rng = random.Random(seed)
    hold = min(60.0, max(10.0, minutes * 6))  # seconds a fault lasts
    deadline = time.monotonic() + minutes * 60
    windows: list[tuple[int, int, str]] = []  # (epoch-ms start, end, kind)
    stop = threading.Event()
    rounds: list[Path] = []  # the acked files of the chaos producer's rounds (ROUND messages, THREADS threads)
    counts = {"rounds": 0, "send_errors": 0, "consumer_reads": 0, "consumer_failures": 0}

    def producer() -> None:
        while not stop.is_set():
            n = len(env.rounds)
            try:
                res = env.produce_round(ROUND, threads=THREADS)
                counts["send_errors"] += res["errors"]
            except B.BrokerError:  # the broker is down (kill -9): the client could not start its session
                counts["send_errors"] += 1
                stop.wait(1)
            rounds.extend(p for p, _ in env.rounds[n:])
            counts["rounds"] += 1

    def consumer() -> None:  # a lagging reader: everything from offset 0, again and again
        n = 0
        while not stop.is_set():
            n += 1
            try:
                env.consume(f"g-chaos-{seed}-{n}", start=0, count=max(env.next_seq, 1), topics="FA,FB", queues=4)
                counts["consumer_reads"] += 1
            except B.BrokerError:
                counts["consumer_failures"] += 1
            stop.wait(5)

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    survived: dict[str, int] = {}
    try:
        stop.wait(min(hold / 2, 20))  # healthy first: the producer's steady state
        while time.monotonic() + hold < deadline:
            kind = rng.choice(faults)
            log(f"chaos: {kind} for {hold:.0f} s")
            t0 = int(time.time() * 1000)
            _start_fault(env, kind)
            try:
                stop.wait(hold)
            finally:
                _end_fault(env, kind)
            windows.append((t0, int(time.time() * 1000), kind))
            assert env.mount.alive(), f"the tierfs daemon died during {kind}:\n{env.mount.log_tail(40)}"
            assert env.rmq.broker.proc.poll() is None, f"the broker died during {kind}"
            survived[kind] = survived.get(kind, 0) + 1
            stop.wait(hold / 2)
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    backlog_deadline = time.monotonic() + 300
    while env.backlog() and time.monotonic() < backlog_deadline:
        time.sleep(1)
    check = env.verify_all(strict=False)  # every acknowledged message, by content
    during, outside = [], []
    slack = 5_000  # a send acknowledged just after a fault ended waited on it
    for acked in rounds:
        for ack_ms, lat in B.send_latencies(acked, ROUND, THREADS):
            hit = any(s <= ack_ms <= e + slack for s, e, _ in windows)
            (during if hit else outside).append(lat)
    return {"minutes": minutes, "seed": seed, "faults_survived": survived, "acknowledged": env.acked_count(),
            "lost": check.get("missing", 0), "bad": check["bad"], "duplicates": check["dups"],
            "send_errors": counts["send_errors"], "produce_rounds": counts["rounds"],
            "consumer_reads": counts["consumer_reads"], "consumer_failures": counts["consumer_failures"],
            "p99_ms_during_faults": B.p99(during), "p99_ms_outside_faults": B.p99(outside),
            "sends_during_faults": len(during), "sends_outside_faults": len(outside)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--version", default="5.5.0", choices=B.VERSIONS)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    args = ap.parse_args()
    from ceph_rgw import RGW
    from faultproxy import start_proxy
    from test_broker_faults import QUEUES, TOPICS, FaultEnv

    base = Path(tempfile.mkdtemp(prefix="tierfs-chaos-"))
    rgw = RGW(base / "ceph").start()
    proxy = start_proxy(rgw.endpoint_url)
    env = None
    try:
        (base / "env").mkdir()
        env = FaultEnv(args.version, base / "env", rgw, proxy)
        env.mount.mount()
        env.rmq = B.RocketMQ(args.version, env.base / "home")
        env.rmq.start_namesrv()
        env.rmq.start_broker(env.conf())
        env.client("topics", env.rmq.ns_addr, env.rmq.broker_addr, QUEUES, *TOPICS.split(","))
        out = run(env, args.minutes, args.seed, tuple(args.faults.split(",")))
    finally:
        if env is not None:
            env.close()
        proxy.stop()
        rgw.close()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 1 if out["lost"] or out["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
