"""A real Apache RocketMQ name server and broker, each its own JVM on 127.0.0.1, for the broker tests and
bench/broker.py. Nothing here imports pytest or tierfs: it only starts, talks to and stops Java processes.

The artifacts come from Maven Central through `tests/broker/pom.xml`; `./mount-scripts/test` resolves them once
per version into ~/.m2 and writes each version's runtime classpath to `CACHE/<version>/classpath`
(a missing one is a failure that says so, never a skip). The test client `tests/broker/BrokerClient.java` is
compiled with javac at fixture time against the version under test. Every process is started in its own session and stopped by pid.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

HERE = Path(__file__).resolve().parent / "broker"
POM = HERE / "pom.xml"
CLIENT_SRC = HERE / "BrokerClient.java"
CACHE = Path(os.environ.get("TIERFS_ROCKETMQ_CACHE", Path.home() / ".cache" / "tierfs" / "rocketmq"))
# 4.9.8 is not on Maven Central (only its rocketmq-broker pom is); 4.9.7 is the newest complete 4.9.x.
# 5.5.1's rocketmq-client is missing there; 5.5.0 is the newest complete 5.x.
VERSIONS = ("4.9.7", "5.5.0")
CLUSTER = "TierfsCluster"
BROKER_NAME = "broker-a"
JVM_OPENS = [f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in
             ("java.nio", "sun.nio.ch", "java.lang", "java.util", "java.lang.reflect", "java.util.concurrent",
              "jdk.internal.ref")] + ["--add-exports=java.base/jdk.internal.ref=ALL-UNNAMED"]  # 4.9 on Java 17

_LOGBACK = """<configuration>
  <appender name="F" class="ch.qos.logback.core.FileAppender">
    <file>{log}</file>
    <encoder><pattern>%d{{HH:mm:ss.SSS}} %-5level [%thread] %logger{{20}} - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="F"/></root>
</configuration>
"""


class BrokerError(AssertionError):
    pass


def classpath_file(version: str) -> Path:
    return CACHE / version / "classpath"


def classpath(version: str) -> str:
    """The version's classpath, or a clear failure saying how to resolve it (never a skip)."""
    f = classpath_file(version)
    if not f.is_file():
        raise BrokerError(f"Apache RocketMQ {version} is not resolved ({f} missing): run ./mount-scripts/test, "
                          f"or mvn -f {POM} -Drocketmq.version={version} dependency:build-classpath "
                          f"-Dmdep.outputFile={f}")
    cp = f.read_text().strip()
    missing = [j for j in cp.split(":") if j and not os.path.exists(j)]
    if missing:
        raise BrokerError(f"Apache RocketMQ {version}: {len(missing)} jars of {f} are gone from ~/.m2 "
                          f"(e.g. {missing[0]}); run ./mount-scripts/test again")
    return cp


def client_classes(version: str) -> Path:
    """Compile BrokerClient.java against this version's client (once per source hash); the class dir."""
    digest = hashlib.sha256(CLIENT_SRC.read_bytes()).hexdigest()[:12]
    out = CACHE / version / f"client-{digest}"
    if not (out / "BrokerClient.class").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["javac", "-nowarn", "-encoding", "UTF-8", "-cp", classpath(version), "-d", str(tmp),
                            str(CLIENT_SRC)], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise BrokerError(f"javac BrokerClient.java against RocketMQ {version} failed:\n{r.stderr[-4000:]}")
        try:
            os.replace(tmp, out)
        except OSError:  # another process compiled the same source first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def acked_before(acked: Path, count: int, cut_ms: int, out: Path) -> int:
    """The messages the producer saw acknowledged before `cut_ms` (its ACKED.ms file: one big-endian epoch-ms
    per message, 0 = never), written to `out` as the BitSet the consumer expects; returns how many."""
    ack_ms = struct.unpack(f">{count}q", Path(f"{acked}.ms").read_bytes())
    bits = bytearray((count + 7) // 8)  # java.util.BitSet.toByteArray layout
    for i, ms in enumerate(ack_ms):
        if 0 < ms < cut_ms:
            bits[i // 8] |= 1 << (i % 8)
    out.write_bytes(bytes(bits))
    return sum(0 < ms < cut_ms for ms in ack_ms)


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, gap: int = 3) -> list[int]:
    """n ports each with `gap` free ports below it (a 4.9 broker also listens on listenPort - 2). Below the
    kernel's ephemeral range: a port the kernel handed out as free is also what it hands the next outgoing
    connection as its source port (a CI run: a 4.9.7 broker's HA port was taken by then, BindException)."""
    ports: list[int] = []
    pick = random.SystemRandom()
    high = max(_ephemeral_low(), 12_000)
    while len(ports) < n:
        p = pick.randrange(10_000, high)
        if any(abs(p - q) <= gap for q in ports):
            continue
        try:
            for q in range(p - gap, p + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        ports.append(p)
    return ports


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class JavaProcess:
    """One JVM in its own session, stdout+stderr to a file; stopped by pid."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str]):
        self.name, self.log = name, log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                         env=dict(env), start_new_session=True)
        self.pid = self.proc.pid

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_output(self, marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.output():
            if self.proc.poll() is not None:
                raise BrokerError(f"{self.name} exited {self.proc.returncode} before {marker!r}:\n"
                                  f"{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise BrokerError(f"{self.name} printed no {marker!r} in {timeout}s:\n{self.output()[-4000:]}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal by pid and wait; SIGKILL if SIGTERM did not end it in `timeout`. The exit code."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.proc.returncode


class RocketMQ:
    """A name server plus one broker of one version, with their home (logs, ROCKETMQ_HOME) under `home`.
    With `namesrv`, the broker of this instance registers with that instance's name server (and controller)
    and starts none of its own: one member of a broker group."""

    def __init__(self, version: str, home: Path, heap: str = "512m", direct: str = "256m",
                 namesrv: "RocketMQ | None" = None):
        self.version = version
        self.cp = classpath(version)
        self.classes = client_classes(version)
        self.home = Path(home)
        (self.home / "conf").mkdir(parents=True, exist_ok=True)
        for part in ("broker", "namesrv", "tools"):  # 4.9 startup classes configure logback from these files
            (self.home / "conf" / f"logback_{part}.xml").write_text(
                _LOGBACK.format(log=self.home / "logs" / f"{part}.log"))
        self.ns_port, self.port, self.ha_port = free_ports(3)
        self.shared = namesrv
        if namesrv is not None:
            self.ns_port = namesrv.ns_port
        self.namesrv: JavaProcess | None = None
        self.controller: JavaProcess | None = None
        self.controller_port = self.controller_starts = 0
        self.broker: JavaProcess | None = None
        self.heap, self.direct = heap, direct
        self.conf: dict[str, str] = {}
        self.starts = 0

    @property
    def ns_addr(self) -> str:
        return f"127.0.0.1:{self.ns_port}"

    @property
    def broker_addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _java(self, main: str, *args: str, heap: str, extra_cp: str = "") -> list[str]:
        cp = f"{extra_cp}:{self.cp}" if extra_cp else self.cp
        return ["java", "-server", f"-Xms{heap}", f"-Xmx{heap}", f"-XX:MaxDirectMemorySize={self.direct}",
                "-XX:+UseG1GC", *JVM_OPENS, f"-Drocketmq.home.dir={self.home}", f"-Duser.home={self.home}",
                "-Duser.timezone=UTC", "-Drocketmq.client.logRoot=" + str(self.home / "logs"),
                "-cp", cp, main, *args]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROCKETMQ")}
        env["ROCKETMQ_HOME"] = str(self.home)
        return env

    def start_namesrv(self, timeout: float = 60) -> None:
        conf = self.home / "namesrv.conf"
        conf.write_text(f"listenPort={self.ns_port}\n")
        self.namesrv = JavaProcess("name server", self._java("org.apache.rocketmq.namesrv.NamesrvStartup", "-c",
                                                             str(conf), heap="256m"),
                                   self.home / "namesrv.out", self._env())
        self.namesrv.wait_output("boot success", timeout)

    @property
    def controller_addr(self) -> str:
        owner = self.shared or self
        assert owner.controller_port, "no controller started"
        return f"127.0.0.1:{owner.controller_port}"

    def start_controller(self, timeout: float = 90, **overrides: object) -> None:
        """A standalone 5.x controller (rocketmq-controller's ControllerStartup, a DLedger group of one) for the
        brokers of controller mode; its store under this home, never on the mount. Started again (after
        stop_controller), it keeps its port and store, so it remembers the broker group."""
        if not self.controller_port:  # a DLedger controller serves brokers on its peer port (listenPort unbound)
            self.controller_port, = free_ports(1)
        conf = self.home / "controller.conf"
        conf.write_text("".join(f"{k}={v}\n" for k, v in {**dict(
            controllerDLegerGroup="tierfs-ctl",
            controllerDLegerPeers=f"n0-127.0.0.1:{self.controller_port}", controllerDLegerSelfId="n0",
            controllerStorePath=self.home / "controller-store", mappedFileSize=4 << 20,
            enableElectUncleanMaster="false", notifyBrokerRoleChanged="true",
            scanNotActiveBrokerInterval=1000, scanInactiveMasterInterval=1000), **overrides}.items()))
        self.controller_starts += 1
        self.controller = JavaProcess("controller", self._java("org.apache.rocketmq.controller.ControllerStartup",
                                                               "-c", str(conf), heap="256m"),
                                      self.home / f"controller.{self.controller_starts}.out", self._env())
        self.controller.wait_output("boot success", timeout)

    def stop_controller(self) -> None:
        if self.controller is not None:
            self.controller.stop(signal.SIGKILL, 30)

    def broker_conf(self, store: Path, **overrides: object) -> dict[str, str]:
        """broker.conf for a store at `store`: small segments, SYNC_FLUSH, ports of this instance."""
        conf: dict[str, object] = dict(
            brokerClusterName=CLUSTER, brokerName=BROKER_NAME, brokerId=0, brokerRole="ASYNC_MASTER",
            brokerIP1="127.0.0.1", brokerIP2="127.0.0.1",  # brokerIP2: the HA address, never the host's own IP
            namesrvAddr=self.ns_addr, listenPort=self.port, haListenPort=self.ha_port,
            storePathRootDir=store, storePathCommitLog=store / "commitlog",
            mappedFileSizeCommitLog=COMMITLOG_BYTES, mappedFileSizeConsumeQueue=20 * 6000,
            maxIndexNum=INDEX_NUM, maxHashSlotNum=HASH_SLOTS, flushDiskType="SYNC_FLUSH",
            flushIntervalConsumeQueue=200, flushConsumeQueueThoroughInterval=1000,
            flushCommitLogThoroughInterval=1000, autoCreateTopicEnable="false", syncFlushTimeout=10_000,
            waitTimeMillsInSendQueue=10_000,  # no "broker busy" flow control on a loaded 2-core machine
            deleteWhen="04", fileReservedTime=72, diskMaxUsedSpaceRatio=95, cleanResourceInterval=1000,
            mappedFileSizeTimerLog=TIMERLOG_BYTES, timerMaxDelaySec=3600,
        )
        conf.update(overrides)
        return {k: str(v) for k, v in conf.items()}

    def start_broker(self, conf: Mapping[str, str], timeout: float = 120) -> JavaProcess:
        assert self.broker is None or self.broker.proc.poll() is not None, "a broker is already running"
        self.conf = dict(conf)
        path = self.home / "broker.conf"
        path.write_text("".join(f"{k}={v}\n" for k, v in conf.items()))
        self.starts += 1
        self.broker = JavaProcess(f"broker ({self.version})", self._java(
            "org.apache.rocketmq.broker.BrokerStartup", "-c", str(path), heap=self.heap),
            self.home / f"broker.{self.starts}.out", self._env())
        self.broker.wait_output("boot success", timeout)
        return self.broker

    def stop_broker(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        if self.broker is None:
            return None
        return self.broker.stop(sig, timeout)

    def broker_log(self) -> str:
        """The broker's store log (4.9: logs/broker.log; 5.x: logs/rocketmqlogs/store.log)."""
        parts = []
        for p in (self.home / "logs" / "broker.log", self.home / "logs" / "rocketmqlogs" / "store.log",
                  self.home / "logs" / "rocketmqlogs" / "broker.log"):
            if p.is_file():
                parts.append(p.read_text(errors="replace"))
        return "\n".join(parts)

    def client(self, *args: object, timeout: float = 300, heap: str = "256m") -> dict:
        """Run BrokerClient with args; its JSON result line. Raises with its output on failure. Admin calls
        and queries are short: C1 only and the serial GC keep their JVM from competing with the broker."""
        argv = self._java("BrokerClient", *[str(a) for a in args], heap=heap, extra_cp=str(self.classes))
        if args[0] not in ("produce", "consume"):
            argv = [{"-XX:+UseG1GC": "-XX:+UseSerialGC"}.get(a, a) for a in argv]
            argv.insert(1, "-XX:TieredStopAtLevel=1")
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self._env(),
                               start_new_session=True)
        except subprocess.TimeoutExpired as e:
            raise BrokerError(f"BrokerClient {args[0]} ran past {timeout}s: {e.stdout!r} {e.stderr!r}") from None
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not lines:
            raise BrokerError(f"BrokerClient {' '.join(map(str, args))} exited {r.returncode}:\n"
                              f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        return json.loads(lines[-1])

    def close(self) -> None:
        """Kill the broker then the name server by pid (SIGKILL: the store is thrown away, and a 5.x broker's
        graceful shutdown takes 10-20 s)."""
        for p in (self.broker, self.namesrv, self.controller):
            if p is not None:
                p.stop(signal.SIGKILL, 30)



class BrokerGroup:
    """A broker group of one brokerName: two brokers, each its own JVM, home and store root, sharing the first
    one's name server. Master-slave (4.x/5.x): members[0] is the master (brokerId 0, SYNC_MASTER), members[1]
    the slave (brokerId 1, SLAVE), replicating over HA. Controller mode (5.x, `controller=True`): a controller
    process too, both brokers with enableControllerMode and the controller deciding which one is the master."""

    def __init__(self, version: str, home: Path, stores: Sequence[Path], controller: bool = False,
                 heap: str = "512m"):
        self.version, self.stores, self.controller = version, [Path(s) for s in stores], controller
        first = RocketMQ(version, Path(home) / "b0", heap=heap)
        self.members = [first] + [RocketMQ(version, Path(home) / f"b{i}", heap=heap, namesrv=first)
                                  for i in range(1, len(self.stores))]

    @property
    def ns_addr(self) -> str:
        return self.members[0].ns_addr

    def conf(self, i: int, **overrides: object) -> dict[str, str]:
        """broker.conf of member i: the single-broker settings (small segments, SYNC_FLUSH) plus its role."""
        m = self.members[i]
        if self.controller:
            role: dict[str, object] = dict(
                enableControllerMode="true", controllerAddr=m.controller_addr, brokerId=-1, brokerRole="SLAVE",
                allAckInSyncStateSet="true",  # an acknowledgement means: on every replica of the sync state set
                syncBrokerMetadataPeriod=1000, checkSyncStateSetPeriod=1000, haMaxTimeSlaveNotCatchup=5000,
                controllerHeartBeatTimeoutMills=3000, sendHeartbeatTimeoutMillis=1000,
                brokerHeartbeatInterval=500)
        elif i == 0:
            role = dict(brokerId=0, brokerRole="SYNC_MASTER")
        else:
            role = dict(brokerId=i, brokerRole="SLAVE")
        return m.broker_conf(self.stores[i], **{**role, **overrides})

    def start(self) -> None:
        """The name server (and controller), then every broker in order; in controller mode, the first to
        register becomes the master."""
        self.members[0].start_namesrv()
        if self.controller:
            self.members[0].start_controller()
        for i, m in enumerate(self.members):
            m.start_broker(self.conf(i))

    def close(self) -> None:
        """Every broker, then the name server and controller, by pid."""
        for m in reversed(self.members):
            m.close()

    def first_ack(self, probe: Path, topic: str, body: int, timeout: float = 120) -> int:
        """One-message sends to `topic` (one queue) until one is acknowledged by whichever member is the master;
        the epoch-ms of that acknowledgement. Each try is a client JVM of its own (a second or two of start-up
        in every figure taken with it); its acknowledgements go to PROBE-N and PROBE-N.ms."""
        deadline = time.monotonic() + timeout
        tries = 0
        while True:
            tries += 1
            acked = Path(f"{probe}-{tries}")
            if self.members[0].client("produce", self.ns_addr, BROKER_NAME, topic, 1, tries, 1, body, 1,
                                      acked)["acked"] == 1:
                return int.from_bytes(Path(f"{acked}.ms").read_bytes()[:8], "big")
            if time.monotonic() > deadline:
                raise BrokerError(f"no send to {topic} acknowledged by a master in {timeout}s ({tries} tries)")
            time.sleep(0.2)


def sync_sets(master: RocketMQ) -> int:
    """How many sync state sets of two brokers the master has logged (5.x controller mode)."""
    return len(re.findall(r"syncStateSet has been changed into \[\d+, \d+\]", master.broker_log()))


def in_sync(master: RocketMQ, changes: int) -> bool:
    """The master has logged at least `changes` sync state sets of two brokers."""
    return sync_sets(master) >= changes


def caught_up(follower: Path, leader: Path, topics: Sequence[str], queues: int) -> bool:
    """Every ConsumeQueue of `topics` in the follower's store has as many units as the leader's: it replicated
    (and dispatched) everything the leader has."""
    qs = [Path(t) / str(q) for t in topics for q in range(queues)]
    return all(queue_offset(follower / "consumequeue" / q) == queue_offset(leader / "consumequeue" / q) for q in qs)


# Segment geometry shared by broker.conf and the tierfs options (tierfs must know the IndexFile size).
INDEX_NUM = 20_000
COMMITLOG_BYTES = 4 << 20
HASH_SLOTS = 5_000
TIMERLOG_BYTES = 52 * 5_000  # TimerLog units are 52 bytes; a segment ends with a roll blank


def body(seq: int, size: int) -> bytes:
    """BrokerClient.body: a message's body is a pure function of its sequence number."""
    unit = b"m%012d|" % seq
    return (unit * (size // len(unit) + 1))[:size]


def topic_of(topics: Sequence[str], seq: int) -> str:
    """BrokerClient.topicOf."""
    return topics[seq % len(topics)]


def queue_of(topics: Sequence[str], queues: int, seq: int) -> int:
    """BrokerClient.queueOf."""
    return (seq // len(topics)) % queues


def positions(path: Path) -> list[tuple[int, int]]:
    """A consume's POSITIONS_FILE: (CommitLog offset, queue offset) where the broker stored each sequence number
    from the consume's START, (-1, -1) for one not read."""
    raw = Path(path).read_bytes()
    v = struct.unpack(f">{len(raw) // 8}q", raw)
    return list(zip(v[0::2], v[1::2]))


def merge_acked(parts: Sequence[tuple[bytes, int]]) -> bytes:
    """java.util.BitSet byte arrays (little-endian), each over a range starting at its offset, as one BitSet
    from 0: what a consumer of all those ranges at once is told to expect."""
    v = 0
    for bits, start in parts:
        v |= int.from_bytes(bits, "little") << start
    return v.to_bytes((v.bit_length() + 7) // 8, "little")


def queue_offset(queue_dir: Path) -> int:
    """How many messages a queue holds: its last ConsumeQueue file's start (file names are byte offsets, 20
    bytes a unit) plus the units written in it (the file is preallocated with zeros, units are written in
    order: a binary search reads a few units). Reads only the last file, which is hot; 0 for no file."""
    files = sorted((p for p in queue_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) \
        if queue_dir.is_dir() else []
    if not files:
        return 0
    last = files[-1]
    with open(last, "rb") as f:
        lo, hi = 0, os.fstat(f.fileno()).st_size // 20  # lo units are written; is unit `mid` written?
        while lo < hi:
            mid = (lo + hi) // 2
            f.seek(mid * 20)
            if f.read(20).strip(b"\0"):
                lo = mid + 1
            else:
                hi = mid
    return int(last.name) // 20 + lo


def send_latencies(acked: Path, count: int, threads: int) -> list[tuple[int, int]]:
    """(ack epoch-ms, send latency ms) of each acknowledged message but each thread's first, from ACKED.ms alone.
    A BrokerClient thread sends message i, i + threads, ... one after the other, so a message's latency is the
    time between its acknowledgement and the one before it on its thread (client overhead is microseconds)."""
    ms = struct.unpack(f">{count}q", Path(f"{acked}.ms").read_bytes())
    return [(ms[i], ms[i] - ms[i - threads]) for i in range(threads, count) if ms[i] > 0 and ms[i - threads] > 0]


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank, as BrokerClient computes it); 0 for no values."""
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * 0.99))] if s else 0.0
