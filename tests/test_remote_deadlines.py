"""How long a user waits on an object store that cannot serve them, and what they are told.

Real endpoints on 127.0.0.1: a port where nothing listens (refused), a server that
accepts and never answers (hung), an instance metadata service that has no credentials
to give (404), moto for the tiered manager's local side. Missing credentials are said at
once, never retried; ``--deadline`` bounds a command; a tiered ``resume()`` on a fresh
start waits ``Remote(timeout=...)`` seconds for a dead remote tier, then says what to do; the
notices and errors name the URL and what the user asked for, never a function of
aiosnap's. Bounds are far above what the calls take (a fraction of the deadline they
used to wait out in full), never raced.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._base import offload
from aiosnap.storage import from_url

from .servers import free_port, unique
from .test_cli import cli, one_error_line

#: The deadline a call used to wait out in full: every bound below is a fraction of it.
LONG = 60.0
#: A function of aiosnap's, as the notices used to name them: ``_locate('s3://...')``,
#: ``_Claim.take(...)``, ``VersionedLease.renew('')``, ``ObjectStorage.stat(...)``.
INTERNAL = re.compile(r"\b_?[A-Za-z_]+(\.[A-Za-z_]+)*\(['\"]")


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An environment with no credentials of any kind and no instance metadata service
    (its address refuses): what a laptop without AWS configured has."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_METADATA_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _with_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


class _Hung:
    """A server that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def hung() -> Iterator[_Hung]:
    server = _Hung()
    try:
        yield server
    finally:
        server.close()


class _NoRole(http.server.BaseHTTPRequestHandler):
    """An instance metadata service with no role to give credentials of (404 to all)."""

    def _missing(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = _missing

    def log_message(self, *args: Any) -> None:
        pass


# -- credentials ---------------------------------------------------------------------------------------


def test_ls_without_credentials_says_so_at_once(
    aws: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{unique('nocreds')}/run"
    t0 = time.monotonic()
    code, out, err = cli(capsys, "ls", url, "--deadline", str(LONG))
    elapsed = time.monotonic() - t0
    line = one_error_line(err)
    assert code == 2 and out == "" and "no credentials" in line and "AWS_ACCESS_KEY_ID" in line
    assert elapsed < LONG / 4, elapsed  # not retried until the deadline


def test_credentials_refused_by_the_metadata_service_are_not_retried(aws: dict[str, str]) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoRole)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        storage = from_url(
            f"s3://{unique('norole')}",
            metadata_endpoint=f"http://127.0.0.1:{server.server_address[1]}",
            deadline=LONG,
        )
        t0 = time.monotonic()
        with pytest.raises(aiosnap.errors.RemoteStorageError, match="no usable credentials") as caught:
            aiosnap.load_sync(f"s3://{storage.bucket}/run/ckpt", storage=storage)  # type: ignore[attr-defined]
        assert caught.value.permanent and time.monotonic() - t0 < LONG / 4
    finally:
        server.shutdown()
        server.server_close()


# -- --deadline -------------------------------------------------------------------------------------------


def test_deadline_bounds_a_command_on_an_endpoint_that_refuses(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _with_keys(monkeypatch)
    url = f"s3://{unique('refused')}/run"
    t0 = time.monotonic()
    code, _, err = cli(capsys, "ls", url, "--deadline", "2")
    elapsed = time.monotonic() - t0
    line = one_error_line(err)
    assert code == 2 and f"{url}: cannot reach the object store at {aws['AWS_ENDPOINT_URL']}" in line
    assert "GenericError" not in line and elapsed < LONG / 4, (line, elapsed)


def test_deadline_bounds_a_command_on_a_store_that_never_answers_and_notices_name_the_url(
    aws: dict[str, str], hung: _Hung, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _with_keys(monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{hung.port}")
    monkeypatch.setattr(offload, "SLOW_REMOTE", 0.2)  # the notice of a call held up, sooner
    url = f"s3://{unique('hung')}/run"
    t0 = time.monotonic()
    code, _, err = cli(capsys, "verify", url, "--deadline", "1")
    elapsed = time.monotonic() - t0
    notices, error = err.splitlines()[:-1], one_error_line(err.splitlines()[-1])
    assert code == 2 and f"verifying {url}: no answer within 6 s" in error and "--deadline" in error
    # obstore's own request timeout (30 s) and retries until the deadline would be longer
    assert elapsed < LONG / 4, elapsed
    assert notices and all(f"aiosnap: warning: verifying {url}: no answer for 0.2 s" in n for n in notices)
    assert not INTERNAL.search(err), err


# -- a tiered resume with the remote tier dead -------------------------------------------------------------


async def test_a_fresh_resume_with_a_dead_remote_tier_says_what_to_do_within_its_timeout(
    aws: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _with_keys(monkeypatch)
    monkeypatch.setattr(offload, "SLOW_REMOTE", 0.2)  # the notices of calls held up, sooner
    remote = f"s3://{unique('deadtier')}/run"
    storage = from_url(remote, deadline=LONG)
    t0 = time.monotonic()
    async with aiosnap.CheckpointManager(
        str(tmp_path / "local"), remote=aiosnap.Remote(remote, storage=storage, timeout=1.0)
    ) as mgr:
        with pytest.raises(aiosnap.errors.RemoteStorageError) as caught:
            await mgr.resume()  # a fresh start: no local step to go on with
        elapsed = time.monotonic() - t0
        await (await mgr.save(1, {"w": torch.ones(3)})).wait()  # the local tier goes on
        with pytest.raises(OSError):
            await mgr.aclose(upload_timeout=0.5)
    message = str(caught.value)
    assert elapsed < LONG / 4, elapsed
    assert f"{remote}: the remote tier is unavailable: it has not answered within 1 s" in message
    assert "Remote(..., timeout=...)" in message and "without remote=" in message
    assert not INTERNAL.search(message) and "GenericError" not in message
    notices = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"opening the remote tier {remote}: no answer for 0.2 s" in n for n in notices), notices
    assert not any(INTERNAL.search(n) for n in notices), notices
