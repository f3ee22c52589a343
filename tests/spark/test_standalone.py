"""The audit jobs on a real Spark standalone cluster: a master and two workers started from the pyspark package
(`spark-class ...deploy.master.Master` / `...deploy.worker.Worker`), the report and the stream submitted to it
through `tridentmq audit ... --master spark://...`, both reading one shared audit folder. Slow (three more JVMs
and a driver per job): run with `-m slow`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest
from pyspark.sql import SparkSession
from tests.spark.conftest import ClusterAudit

from tridentmq_spark.segments import list_segments

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

SPARK_HOME = Path(pyspark.__file__).parent
_MASTER_URL = re.compile(rb"Starting Spark master at (spark://\S+)")
_REGISTERED = re.compile(rb"(Registering worker )")


def _spark_class(cls: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
    }
    with log.open("wb") as f:  # spark-class execs java: this pid is the JVM's
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), cls, *args], stdout=f, stderr=subprocess.STDOUT, env=env
        )


def _wait_for(log: Path, pattern: re.Pattern[bytes], process: subprocess.Popen[bytes], count: int = 1) -> bytes:
    """The first match of ``pattern`` in the log, once it matched ``count`` times (a started JVM logs it)."""
    deadline = time.monotonic() + 300
    while len(found := pattern.findall(log.read_bytes())) < count:
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return bytes(found[0])


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Path]]]:
    """A master and two one-core workers on 127.0.0.1, on ports of the system's choosing (port 0)."""
    tmp = tmp_path_factory.mktemp("standalone")
    processes = []
    try:
        master = _spark_class(
            "org.apache.spark.deploy.master.Master",
            tmp / "master.log",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--webui-port",
            "0",
        )
        processes.append(master)
        url = _wait_for(tmp / "master.log", _MASTER_URL, master).decode()
        work_dirs = [tmp / f"work-{i}" for i in range(2)]
        for i, work in enumerate(work_dirs):
            processes.append(
                _spark_class(
                    "org.apache.spark.deploy.worker.Worker",
                    tmp / f"worker-{i}.log",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--webui-port",
                    "0",
                    "--cores",
                    "1",
                    "--memory",
                    "1g",
                    "--work-dir",
                    str(work),
                    url,
                )
            )
        _wait_for(tmp / "master.log", _REGISTERED, master, count=2)
        yield url, work_dirs
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _audit(*args: str) -> str:
    command = [sys.executable, "-m", "tridentmq_shared.cli", "audit", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_report_and_stream_run_on_a_standalone_cluster(
    spark: SparkSession, cluster_audit: ClusterAudit, standalone: tuple[str, list[Path]], tmp_path: Path
) -> None:
    url, work_dirs = standalone
    records = {
        (node, segment.first_seq + i)
        for node in cluster_audit.node_ids
        for segment in list_segments(cluster_audit.audit_dir / node)
        for i in range(len(segment.path.read_bytes().splitlines()))
    }

    out = _audit("report", "--master", url, "--audit-dir", str(cluster_audit.audit_dir), "--out", str(tmp_path / "r"))
    assert out.splitlines()[0] == f"{len(records)} events, 0 bad records", out
    assert (tmp_path / "r" / "report.html").is_file()

    _audit(
        "stream",
        "--master",
        url,
        "--audit-dir",
        str(cluster_audit.audit_dir),
        "--once",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "s"),
    )
    rows = spark.read.parquet(str(tmp_path / "s" / "events")).select("node_id", "seq").collect()
    assert sorted((r.node_id, r.seq) for r in rows) == sorted(records)

    # The executors ran on the workers: each application left its folder in a worker's work dir.
    apps = {p.name for work in work_dirs if work.is_dir() for p in work.iterdir() if p.name.startswith("app-")}
    assert len(apps) == 2, apps
