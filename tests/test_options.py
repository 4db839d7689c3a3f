"""What the constructors' options resolve to, and the errors they raise: pinned.

Each case gives a constructor's options and what they resolve to (the manager's site,
group, remote tier, writer and capture; a writer's incremental options) or the
ValueError they raise, word for word. The expectations are data, written once before the
options were grouped (issue 41): the grouped spelling keeps every resolved configuration,
and every message but three, which name the options they check by their new names
(``level``, ``incremental=`` beside a writer, the ``Remote``'s ``storage=``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import aiosnap
from aiosnap._manager.port import WriterPort
from aiosnap._manager.tiers import TwoTiers

OTHER = aiosnap.storage.LocalStorage()
FAR = aiosnap.storage.LocalStorage()

DEFAULT_WRITER = {
    "type": "QueueWriter",
    "capture": "eager",
    "offload": "thread",
    "pipeline": True,
    "incremental": None,
    "storage": "the directory's",
}
DEFAULT_GROUP = {"rank": 0, "size": 1, "world_size": None, "replicated": (), "timeout": 300.0}
DEFAULT: dict[str, Any] = {
    "name": "snapshot_iter_{step}",
    "keep": "None",
    "trigger": "None",
    "storage": "LocalStorage",
    "read_only": False,
    "lease_ttl": 60.0,
    "allow_pickle": False,
    "group": DEFAULT_GROUP,
    "capture": "eager",
    "writer": DEFAULT_WRITER,
    "remote": None,
}
DEFAULT_REMOTE: dict[str, Any] = {
    "directory": "<far>",
    "storage": "LocalStorage",
    "keep": "None",
    "upload": "every",
    "uploader": {"max_pending": 2, "retries": 5, "backoff": 1.0, "max_backoff": 60.0},
    "read_timeout": 30.0,
}


@dataclass(frozen=True)
class Case:
    options: dict[str, Any]
    #: What differs from DEFAULT (a dict), or the ValueError's message (a str).
    expect: dict[str, Any] | str
    writer: dict[str, Any] = field(default_factory=dict)


def remote(**changes: Any) -> dict[str, Any]:
    return {**DEFAULT_REMOTE, **changes}


def writer(**changes: Any) -> dict[str, Any]:
    return {**DEFAULT_WRITER, **changes}


MANAGER: dict[str, Case] = {
    "defaults": Case({}, {}),
    "the directory's own options": Case(
        {
            "name": "ckpt_{epoch}_{step}",
            "keep": aiosnap.retention.KeepLast(2),
            "save_every": 5,
            "storage": OTHER,
            "allow_pickle": True,
            "read_only": True,
            "lease_ttl": 9.0,
        },
        {
            "name": "ckpt_{epoch}_{step}",
            "keep": "KeepLast(n=2)",
            "trigger": "EveryNSteps(n=5)",
            "storage": "given",
            "allow_pickle": True,
            "read_only": True,
            "lease_ttl": 9.0,
        },
    ),
    "a rank of its own": Case({"ranks": "Ranks(rank=3)"}, {"group": {**DEFAULT_GROUP, "rank": 3}}),
    "no group, a deadline": Case(
        {"ranks": "Ranks(False, timeout=12.0)"}, {"group": {**DEFAULT_GROUP, "timeout": 12.0}}
    ),
    "lazy": Case({"capture": "lazy"}, {"capture": "lazy"}),
    "incremental": Case(
        {"incremental": True},
        {"writer": writer(incremental={"frozen": (), "compression": None, "level": 3})},
    ),
    "incremental, all its options": Case(
        {"incremental": "Incremental(frozen=['model.*'], compression='zstd', level=7)"},
        {"writer": writer(incremental={"frozen": ("model.*",), "compression": "zstd", "level": 7})},
    ),
    "a remote tier": Case({"remote": "<far>"}, {"remote": remote()}),
    "a remote tier, all its options": Case(
        {
            "remote": lambda far: aiosnap.Remote(
                far,
                storage=FAR,
                keep=aiosnap.retention.KeepLast(5),
                upload="manual",
                uploader=aiosnap.UploadWriter(retries=2, max_pending=4),
                timeout=5.0,
            )
        },
        {
            "remote": remote(
                storage="given",
                keep="KeepLast(n=5)",
                upload="manual",
                uploader={"max_pending": 4, "retries": 2, "backoff": 1.0, "max_backoff": 60.0},
                read_timeout=5.0,
            )
        },
    ),
    "a remote tier read without a bound": Case(
        {"remote": lambda far: aiosnap.Remote(far, timeout=None)}, {"remote": remote(read_timeout=None)}
    ),
    "a writer of one's own": Case(
        {"writer": "SimpleWriter(capture='lazy')"},
        {"writer": writer(type="SimpleWriter", capture="lazy", storage=None), "capture": "lazy"},
    ),
    "the manager's capture over the writer's": Case(
        {"writer": "QueueWriter(capture='lazy')", "capture": "eager"},
        {"writer": writer(capture="lazy", storage=None)},
    ),
    # The errors, word for word.
    "a capture that is none": Case({"capture": "later"}, "capture must be 'eager' or 'lazy', not 'later'"),
    "an upload mode that is none": Case(
        {"remote": lambda far: aiosnap.Remote(far, upload="sometimes")},  # type: ignore[arg-type]
        "upload must be 'every' or 'manual', not 'sometimes'",
    ),
    "replicated without a group": Case(
        {"ranks": "Ranks(replicated=['model.*'])"}, "replicated= needs a process group"
    ),
    "a rank's name in a group": Case(
        {"ranks": lambda far: aiosnap.Ranks(object()), "name": "s_{step}_{rank}"},
        "name 's_{step}_{rank}': in a group each step is a directory; drop {rank}",
    ),
    "incremental beside a writer": Case(
        {"writer": "QueueWriter()", "incremental": True},
        "incremental= goes to the writer when one is given",
    ),
    "an uploader on another storage": Case(
        {
            "remote": lambda far: aiosnap.Remote(
                far, storage=FAR, uploader=aiosnap.UploadWriter(storage=OTHER)
            )
        },
        "the uploader's storage= is not the Remote's storage=",
    ),
    "a compression that is none": Case(
        {"incremental": "Incremental(compression='lz4')"}, "compression must be None or \"zstd\", not 'lz4'"
    ),
    "a compression level out of range": Case(
        {"incremental": "Incremental(compression='zstd', level=30)"},
        "level must be 1..22 for zstd, not 30",
    ),
}

WRITER: dict[str, Case] = {
    "defaults": Case({}, {"incremental": None}),
    "incremental": Case(
        {"incremental": True}, {"incremental": {"frozen": (), "compression": None, "level": 3}}
    ),
    "incremental, all its options": Case(
        {"incremental": "Incremental(frozen=('a.*', 'b'), compression='zstd', level=19)"},
        {"incremental": {"frozen": ("a.*", "b"), "compression": "zstd", "level": 19}},
    ),
    "lazy, in a process": Case(
        {"capture": "lazy", "offload": "process", "pipeline": False},
        {"incremental": None, "capture": "lazy", "offload": "process", "pipeline": False},
    ),
    "an offload that is none": Case({"offload": "gpu"}, "offload must be 'thread' or 'process', not 'gpu'"),
    "a capture that is none": Case({"capture": "later"}, "capture must be 'eager' or 'lazy', not 'later'"),
    "a budget too small": Case({"max_host_bytes": 1024}, f"max_host_bytes must be at least {1 << 20}"),
    "device staging with a copier": Case(
        {"device_staging": True, "device_copier": "a copier"},
        "device_staging= applies to the default CUDA copier, not to a device_copier",
    ),
    "a queue of none": Case({"max_pending": 0}, "max_pending must be at least 1, not 0"),
    "a full queue's policy that is none": Case(
        {"when_full": "wait"}, "when_full must be 'block', 'skip' or 'replace', not 'wait'"
    ),
    "a compression that is none": Case(
        {"incremental": "Incremental(compression='lz4')"}, "compression must be None or \"zstd\", not 'lz4'"
    ),
}


def _built(value: Any) -> Any:
    """The objects a case names by their spelling (each case gets fresh ones)."""
    if value == "a group":
        return object()
    if value == "a copier":
        from .fake_device import FakeDevice

        return FakeDevice([])
    if isinstance(value, str) and value.endswith(")") and value.split("(")[0].isidentifier():
        return eval(value, {**vars(aiosnap), "OTHER": OTHER})
    return value


def options(case: Case, far: Path) -> dict[str, Any]:
    """A case's options: "<far>" is the remote directory; a function is given it."""
    return {
        k: str(far) if v == "<far>" else v(str(far)) if callable(v) else _built(v)
        for k, v in case.options.items()
    }


def _incremental(writer: Any) -> dict[str, Any] | None:
    dedup = writer._dedup
    if dedup is None:
        return None
    return {"frozen": dedup.frozen, "compression": dedup.compression, "level": dedup.level}


def _writer(writer: Any, directory_storage: Any) -> dict[str, Any]:
    storage = writer._storage
    return {
        "type": type(writer).__name__,
        "capture": writer.capture,
        "offload": writer.offload,
        "pipeline": writer._pipeline,
        "incremental": _incremental(writer),
        "storage": None
        if storage is None
        else "the directory's"
        if storage is directory_storage
        else "given",
    }


def resolved(manager: aiosnap.CheckpointManager, given: dict[str, Any], far: Path) -> dict[str, Any]:
    """What the manager made of its options."""
    site, group = manager._site, manager._group
    out: dict[str, Any] = {
        "name": site.naming.name,
        "keep": repr(site.keep),
        "trigger": repr(manager._schedule.trigger),
        "storage": "given" if site.storage is given.get("storage") else type(site.storage).__name__,
        "read_only": site.read_only,
        "lease_ttl": site.lease_ttl,
        "allow_pickle": site.allow_pickle,
        "group": {
            "rank": group.rank,
            "size": group.size,
            "world_size": group.world_size,
            "replicated": group.replicated,
            "timeout": group.timeout,
        },
        "capture": manager._writer.capture,
        "writer": _writer(manager._writer.writer, site.storage),
        "remote": None,
    }
    tiers = manager._tiers
    if isinstance(tiers, TwoTiers):
        tier = tiers.tier
        uploader = tier.uploader
        assert uploader._storage is tier.site.storage  # uploads go to the remote tier's storage
        out["remote"] = {
            "directory": "<far>" if tier.directory == str(far) else tier.directory,
            "storage": "given" if tier.site.storage is FAR else type(tier.site.storage).__name__,
            "keep": repr(tier.site.keep),
            "upload": "every" if tiers.every_save else "manual",
            "uploader": {
                "max_pending": uploader.max_pending,
                "retries": uploader.retries,
                "backoff": uploader.backoff,
                "max_backoff": uploader.max_backoff,
            },
            "read_timeout": tier.read_timeout,
        }
    return out


@pytest.mark.parametrize("name", sorted(MANAGER))
async def test_what_a_managers_options_resolve_to(tmp_path: Path, name: str) -> None:
    case = MANAGER[name]
    far = tmp_path / "far"
    if isinstance(case.expect, str):
        with pytest.raises(ValueError) as caught:  # from the option objects, or the manager
            aiosnap.CheckpointManager(str(tmp_path / "run"), **options(case, far))
        assert str(caught.value) == case.expect
        return
    given = options(case, far)
    manager = aiosnap.CheckpointManager(str(tmp_path / "run"), **given)
    assert resolved(manager, given, far) == {**DEFAULT, **case.expect}


#: The options only a queue takes.
QUEUE_ONLY = {"max_pending", "when_full"}


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        (kind, name)
        for name in sorted(WRITER)
        for kind in ("SimpleWriter", "StandardWriter", "QueueWriter")
        if kind == "QueueWriter" or not QUEUE_ONLY & set(WRITER[name].options)
    ],
)
async def test_what_a_writers_options_resolve_to(kind: str, name: str) -> None:
    case = WRITER[name]
    cls = getattr(aiosnap, kind)
    if isinstance(case.expect, str):
        with pytest.raises(ValueError) as caught:  # from the option objects, or the writer
            cls(**{k: _built(v) for k, v in case.options.items()})
        assert str(caught.value) == case.expect
        return
    made = cls(**{k: _built(v) for k, v in case.options.items()})
    expect = {**DEFAULT_WRITER, "type": kind, "storage": None, **case.expect}
    assert _writer(made, None) == expect


@pytest.mark.parametrize(
    "kind",
    [
        n
        for n in aiosnap.__all__
        if n.endswith("Writer") and n not in ("Writer", "ManagedWriter", "UploadWriter")
    ],
)
def test_every_writer_of_aiosnap_offers_what_a_manager_uses(kind: str) -> None:
    """The manager's port looks once at its writer: each of aiosnap's is a ManagedWriter
    (lazy capture, incremental saves into step directories, a durable return), and the
    port takes the writer's own capture and durability from it."""
    writer = getattr(aiosnap, kind)(capture="lazy")
    assert isinstance(writer, aiosnap.ManagedWriter)
    port = WriterPort(writer, storage=OTHER, incremental=None, capture=None, read_only=False)
    assert port.capture == "lazy" and port.returns_durable is (kind == "SimpleWriter")


def test_a_writer_of_ones_own_is_called_and_saves_eagerly() -> None:
    """A writer that offers only a call is no ManagedWriter: eager, not durable, and an
    incremental save into step directories needs one of aiosnap's writers."""

    class Own:
        async def __call__(self, filename: str, out_dir: str, target: object) -> Any:
            raise AssertionError("not called here")

    port = WriterPort(Own(), storage=OTHER, incremental=None, capture=None, read_only=False)  # type: ignore[arg-type]
    assert (port.capture, port.returns_durable, port.incremental) == ("eager", False, False)
    with pytest.raises(ValueError, match="need one of aiosnap's writers"):
        port.blobs_by_rank("rank_00000")
