"""A real Spark standalone cluster for tests: one master and two one-core workers on 127.0.0.1.

    spark_cluster -> SparkCluster   (module scope; a pytest plugin registered in conftest.py)

Each daemon is its own process (`pyspark/bin/spark-class org.apache.spark.deploy.master.Master` / `...Worker`)
in its own process group, on free ports, stopped by PID (SIGTERM to the group, then SIGKILL). The executors run
`worker_python`: a virtual environment of its own that sees the test venv's third-party packages (pyarrow, numpy, lz4,
crc32c, boto3, py4j) through a .pth line, but not tierfs (the editable install's finder is a .pth file of the
test venv, and .pth files of a directory added by a .pth line are not processed). So tierfs reaches executors
only the way a real cluster gets it: shipped by the job's driver.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mountutil import free_port

WORKER_CORES = 1
WORKER_MEMORY = "1g"
EXECUTOR_MEMORY = "512m"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def make_worker_python(root: Path) -> Path:
    """A venv without tierfs whose sys.path has the test venv's site-packages; returns its python."""
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    py = root / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "tierfs-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = subprocess.run([str(py), "-c", "import pyarrow, numpy, lz4, crc32c, boto3\n"
                            "try:\n import tierfs\nexcept ImportError:\n print('no tierfs')\n"],
                           capture_output=True, text=True, cwd="/", env=_clean_env())
    assert probe.stdout.strip() == "no tierfs", f"the worker Python is not as intended: {probe.stderr[-2000:]}"
    return py


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TIERFS_FAILPOINTS", "TIERFS_JOB_FAILPOINTS", "SPARK_HOME", "PYSPARK_PYTHON",
                        "PYSPARK_DRIVER_PYTHON")}
    env.update(extra)
    return env


@dataclass
class Daemon:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=logf, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the daemon's process group (the worker's executors and their Python workers with it)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # whatever is left of the group (executors)
        self.proc.wait(timeout=15)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class SparkCluster:
    root: Path
    worker_python: Path
    master_port: int = 0
    master_ui_port: int = 0
    master: Daemon | None = None
    workers: list[Daemon] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def conf(self) -> dict[str, str]:
        """The spark.* settings a job needs on this cluster (executors use the worker Python)."""
        return {"spark.master": self.url, "spark.pyspark.python": str(self.worker_python),
                "spark.executor.memory": EXECUTOR_MEMORY, "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1"}

    def _env(self) -> dict[str, str]:
        return _clean_env(SPARK_HOME=str(spark_home()), SPARK_LOCAL_IP="127.0.0.1", SPARK_DAEMON_MEMORY="256m",
                          SPARK_LOG_DIR=str(self.root / "logs"), SPARK_NO_DAEMONIZE="1",
                          PYSPARK_PYTHON=str(self.worker_python))

    def start(self) -> None:
        spark_class = str(spark_home() / "bin" / "spark-class")
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.master_port, self.master_ui_port = free_port(), free_port()
        self.master = Daemon("master", [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                        "--port", str(self.master_port), "--webui-port", str(self.master_ui_port)],
                             self._env(), self.root / "logs" / "master.log")
        self.master.start()
        self.wait(lambda: self._follow_ports() and self.state() is not None, 90, "the Spark master's web UI")
        for i in range(2):
            self.workers.append(self._worker(i))
            self.workers[-1].start()
        self.wait(lambda: self.alive_workers() == 2, 90, "two registered Spark workers")

    def _follow_ports(self) -> bool:
        """Take the ports the master bound from its log: a port free when it was picked may be taken by another
        process by the time the master binds it, and Spark then binds the next one (seen on a shared machine: the
        web UI on 45242 instead of 45241, and the wait timed out)."""
        try:
            text = self.master.log.read_text(errors="replace")
        except OSError:
            return True
        for service, attr in (("sparkMaster", "master_port"), ("MasterUI", "master_ui_port")):
            found = re.findall(rf"Successfully started service '{service}' on port (\d+)", text)
            if found:
                setattr(self, attr, int(found[-1]))
        return True

    def _worker(self, i: int) -> Daemon:
        work = self.root / f"worker{i}"
        work.mkdir(parents=True, exist_ok=True)
        argv = [str(spark_home() / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                "--host", "127.0.0.1", "--port", str(free_port()), "--webui-port", str(free_port()),
                "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY, "--work-dir", str(work), self.url]
        return Daemon(f"worker{i}", argv, self._env(), self.root / "logs" / f"worker{i}.log")

    def restart_worker(self, i: int) -> None:
        """Replace a killed worker with a fresh one and wait until the master counts two again."""
        self.workers[i].stop()
        self.workers[i] = self._worker(i)
        self.workers[i].start()
        self.wait(lambda: self.alive_workers() == 2, 90, f"worker{i} registered again")

    def state(self) -> dict | None:
        """The master's state from its web UI's JSON endpoint; None until it answers with JSON (right after the
        UI starts, Jetty may serve the HTML page for /json/ before the JSON handler is attached)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.master_ui_port}/json/", timeout=2) as r:
                return json.load(r)
        except (OSError, ValueError):  # ValueError: json.JSONDecodeError, an HTML page
            return None

    def alive_workers(self) -> int:
        st = self.state() or {}
        return sum(w.get("state") == "ALIVE" for w in st.get("workers", []))

    def python_workers(self) -> list[str]:
        """argv[0] of every PySpark Python process (pyspark.daemon and its forked workers) descending from the
        workers (the daemon puts itself in a process group of its own, so parents are followed)."""
        parent: dict[int, int] = {}
        argvs: dict[int, list[bytes]] = {}
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                parent[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
                argvs[int(p)] = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
        roots = {w.proc.pid for w in self.workers if w.proc is not None}

        def under_worker(pid: int) -> bool:
            for _ in range(64):
                if pid in roots:
                    return True
                pid = parent.get(pid, 0)
                if pid <= 1:
                    return False
            return False

        return [argv[0].decode() for pid, argv in argvs.items()
                if (b"pyspark.daemon" in argv or b"pyspark.worker" in argv) and under_worker(pid)]

    def wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            dead = [d for d in [self.master, *self.workers] if d is not None and d.proc and not d.alive()]
            if dead:
                raise AssertionError(f"Spark {dead[0].name} exited ({dead[0].proc.returncode}) while waiting for "
                                     f"{what}: {dead[0].log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; master log: "
                                     f"{self.master.log_tail() if self.master else ''}")
            time.sleep(0.2)

    def stop(self) -> None:
        for d in [*self.workers, self.master]:
            if d is not None:
                d.stop()


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory) -> SparkCluster:
    root = tmp_path_factory.mktemp("spark-cluster")
    cluster = SparkCluster(root, make_worker_python(root / "worker-venv"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":  # a manual check: python tests/sparkcluster.py
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        c = SparkCluster(Path(d), make_worker_python(Path(d) / "venv"))
        t0 = time.monotonic()
        try:
            c.start()
            print(f"cluster {c.url} up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        finally:
            c.stop()
