"""Fixtures (a pytest plugin): a real S3-compatible object server for the session, and a fresh
bucket on it for a test.

The server is SeaweedFS's `weed server` (master, volume server, filer and S3 gateway in one
process), its binary installed once outside the clone by scripts/seaweedfs/install.sh (under
$SEAWEEDFS_DIR, default ~/.cache/seaweedfs). It runs in a new session on free loopback ports,
its data in a temporary directory, with S3 authentication on (one identity, from an s3 config
file), and is stopped with its process group at the session's end. What it would write to /tmp
goes to that directory (TMPDIR: its glog files), except the gRPC sockets that it names itself
(/tmp/seaweedfs-KIND-grpc-PORT.sock, on our ports): those are removed once it is stopped.
An install or a start that fails fails the tests that use it, with the reason and the log's
tail: they are never skipped. Started, it answers in ~4-8 s and holds ~120 MB.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import botocore.session
import httpx
import pytest
from aiobotocore.config import AioConfig
from botocore.exceptions import BotoCoreError, ClientError

from tests.support.processes import free_ports, stop_group, tail

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "seaweedfs" / "install.sh"
INSTALL_TIMEOUT_S = 20 * 60  # a cached binary: instant; a first install fetches ~48 MB
START_TIMEOUT_S = 60  # ~4-8 s on two cores
# `weed server` exits on SIGTERM only after its filer's 15 s wait for the S3 gateway's metadata
# stream to close; the data is thrown away, so it gets a shorter grace before SIGKILL.
STOP_GRACE_S = 5
REGION = "us-east-1"
ACTIONS = ("Admin", "Read", "Write", "List", "Tagging")
# Read by the master from its working directory: each bucket (a collection) grows one volume at
# a time instead of seven, and a volume holds at most VOLUME_MB; VOLUMES is the server's total.
MASTER_TOML = "[master.volume_growth]\ncopy_1 = 1\n"
VOLUME_MB = 32
VOLUMES = 32


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    region: str


class SyncS3(Protocol):
    """What the fixtures call on botocore's S3 client (its stubs type it as a bare BaseClient)."""

    def create_bucket(self, *, Bucket: str) -> object: ...
    def delete_bucket(self, *, Bucket: str) -> object: ...
    def list_buckets(self) -> object: ...


def client_config() -> AioConfig:
    """How a client talks to the server: signature v4, the bucket in the path (not the host).
    An AioConfig, for aiobotocore's clients, is a botocore Config too, for the sync one."""
    return AioConfig(signature_version="s3v4", s3={"addressing_style": "path"},
                     retries={"max_attempts": 1})  # a test sees the server's first answer


def sync_client(server: S3Server) -> SyncS3:
    """A botocore (sync) S3 client signed with the server's identity."""
    return cast(SyncS3, botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, region_name=server.region,
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        config=client_config()))


def install() -> Path:
    """The `weed` binary: scripts/seaweedfs/install.sh prints its path (installing it first)."""
    try:
        done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True,
                              env={**os.environ, "PYTHON": sys.executable},  # its pip
                              timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{INSTALL} took over {INSTALL_TIMEOUT_S} s", pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"{INSTALL} failed (exit {done.returncode}):\n{done.stderr[-4000:]}",
                    pytrace=False)
    return Path(done.stdout.strip().splitlines()[-1])


def server_args(weed: Path, data: Path, config: Path, ports: list[int]) -> list[str]:
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    return [
        str(weed), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-master.volumeSizeLimitMB={VOLUME_MB}", "-master.telemetry=false",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-volume.max={VOLUMES}", "-volume.preStopSeconds=0",
        "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={data / 'filer.sock'}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
        f"-s3.localSocket={data / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]


def grpc_sockets(ports: list[int]) -> list[Path]:
    """The Unix sockets `weed server` opens for its own gRPC calls, in /tmp whatever TMPDIR is."""
    _, master_grpc, _, volume_grpc, _, filer_grpc, _, s3_grpc = ports
    return [Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock") for kind, port in
            (("master", master_grpc), ("volume", volume_grpc), ("filer", filer_grpc),
             ("s3", s3_grpc))]


def _ready(server: S3Server, master_url: str) -> bool:
    """The S3 gateway accepts the identity, and a volume server has joined the master (before
    that a bucket's first write finds no volume to grow)."""
    try:
        topology = httpx.get(f"{master_url}/dir/status", timeout=1).json()["Topology"]
        if not topology.get("Max"):
            return False
        sync_client(server).list_buckets()
    except (httpx.HTTPError, ValueError, KeyError, BotoCoreError, ClientError):
        return False
    return True


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real SeaweedFS S3 server for the session (installed on first use)."""
    weed = install()
    home = tmp_path_factory.mktemp("seaweedfs")
    data = home / "data"
    data.mkdir()
    (data / "master.toml").write_text(MASTER_TOML)
    ports = free_ports(8)  # server_args' order: the S3 gateway's HTTP port is the 7th
    server = S3Server(endpoint=f"http://127.0.0.1:{ports[6]}",
                      access_key=f"AK{secrets.token_hex(8).upper()}",
                      secret_key=secrets.token_urlsafe(30), region=REGION)
    config = home / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "tests",
        "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}],
        "actions": list(ACTIONS)}]}))
    log = home / "weed.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(server_args(weed, data, config, ports), cwd=data,
                                env={**os.environ, "TMPDIR": str(home)},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.monotonic()
        while not _ready(server, f"http://127.0.0.1:{ports[0]}"):
            if proc.poll() is not None:
                pytest.fail(f"weed server exited during startup (exit {proc.returncode}); "
                            f"log {log}:\n{tail(log)}", pytrace=False)
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"weed server's S3 endpoint not ready after {START_TIMEOUT_S} s; "
                            f"log {log}:\n{tail(log)}", pytrace=False)
            time.sleep(0.1)
        yield server
    finally:
        stop_group(proc, STOP_GRACE_S)
        for socket in grpc_sockets(ports):
            socket.unlink(missing_ok=True)


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[tuple[S3Server, str]]:
    """A new, empty bucket on the session's server, removed (with what is in it) afterwards."""
    client = sync_client(s3_server)
    bucket = f"test-{uuid.uuid4().hex}"
    client.create_bucket(Bucket=bucket)
    yield s3_server, bucket
    client.delete_bucket(Bucket=bucket)  # objects and all (-s3.allowDeleteBucketNotEmpty)
