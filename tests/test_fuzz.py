"""The structured fuzzer (tests/fuzz.py), and a regression test for each defect it found.

The fuzzer runs in child processes: each limits its own address space (RLIMIT_AS), so
a size the reader failed to check fails a case instead of the machine, and a hang or a
crash of the interpreter is the test's failure, not the test run's.

White-box: the regression tests edit files behind their checksums with the format's own
pieces (the header's keys, the codec's limits, the manifest), so they import aiosnap's
private modules.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._base.checksums import crc32c
from aiosnap._format.header import CRC_KEY, META_KEY
from aiosnap._format.manifest import Manifest
from aiosnap._manager.catalog import HISTORY_LIMIT
from aiosnap.storage import INDEX_NAME, MANIFEST_NAME

from .hostile import Raw, parse, render

ROOT = Path(__file__).resolve().parents[1]


Child = tuple[subprocess.Popen[str], IO[bytes]]


def fuzz(*runs: str) -> Child:
    """A child running the fuzzer over ``runs`` (KIND:START:COUNT), and the file its
    stderr goes to (a pipe nobody reads yet could fill and stall it)."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by results()
    cmd = [sys.executable, "-m", "tests.fuzz", *runs]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True), log


def results(children: list[Child]) -> list[dict[str, Any]]:
    """The reports of the children, once all have finished; fails on any finding."""
    reports, problems = [], []
    for child, log in children:
        # Not a deadline on the fuzzer's speed (that is the per-case ratio): a guard for a hang.
        out, _ = child.communicate(timeout=3600)
        log.seek(0)
        errors = log.read().decode(errors="replace")
        log.close()
        assert child.returncode == 0, f"the fuzzer died ({child.returncode}):\n{errors[-3000:]}"
        report = json.loads(out.splitlines()[-1])
        reports.append(report)
        problems += [f"pickle ran: {u}" for u in report["unpickled"]]
        problems += [] if report["rlimit_works"] else ["RLIMIT_AS did not stop an allocation past it"]
        for run in report["runs"]:
            problems += [f"{run['kind']}: {json.dumps(f)}" for f in run["distinct"]]
            problems += [f"{run['kind']}: slow case {json.dumps(s)}" for s in run["slow"]]
    for report in reports:
        for run in report["runs"]:
            print(
                f"{run['kind']} cases {run['start']}..{run['start'] + run['count']}: "
                f"{run['findings']} findings, median {run['median_ms']} ms, max {run['max_ms']} ms "
                f"(case {run['slowest_case']}, {run['max_ratio']}x a seed's {run['baseline_ms']} ms); "
                f"RLIMIT_AS {report['rlimit_as_mib']} MiB, peak {report['vm_peak_mib']} MiB"
            )
    assert not problems, "\n".join(problems[:40])
    return reports


def test_3_000_hostile_checkpoints_and_hundreds_of_manifests_and_indexes() -> None:
    # Two children, so a second core shortens the run; the case numbers are fixed. (CI's
    # share, for its 25 minutes; `nox -s slow` runs a million, and the manifests and
    # indexes in proportion.)
    t0 = time.monotonic()
    reports = results(
        [
            fuzz("checkpoint:0:1500", "manifest:0:600"),
            fuzz("checkpoint:1500:1500", "index:0:150"),
        ]
    )
    counted = sum(run["count"] for r in reports for run in r["runs"] if run["kind"] == "checkpoint")
    assert counted == 3_000
    print(f"fuzzing took {time.monotonic() - t0:.1f} s")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@pytest.mark.slow
def test_a_million_hostile_checkpoints() -> None:
    """The stress run: AIOSNAP_FUZZ_CASES checkpoint cases (1,000,000) from
    AIOSNAP_FUZZ_START (0), a fifth as many manifests and a fiftieth as many index
    files, in children of AIOSNAP_FUZZ_CHUNK cases, two at a time. Run it in pieces by
    moving the start; a finding names its case, which `python -m tests.fuzz
    checkpoint:CASE:1 -v` replays."""
    start, count = _env_int("AIOSNAP_FUZZ_START", 0), _env_int("AIOSNAP_FUZZ_CASES", 1_000_000)
    chunk = _env_int("AIOSNAP_FUZZ_CHUNK", 50_000)
    jobs = []
    for at in range(start, start + count, chunk):
        n = min(chunk, start + count - at)
        jobs.append(
            [f"checkpoint:{at}:{n}", f"manifest:{at // 5}:{n // 5}", f"index:{at // 50}:{max(1, n // 50)}"]
        )
    for i in range(0, len(jobs), 2):
        results([fuzz(*job) for job in jobs[i : i + 2]])


# -- regressions: each defect the fuzzer found ----------------------------------------------


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good"
    aiosnap.save_sync(str(path), {"a": torch.arange(4.0), "arr": np.arange(3), "n": 3})
    return path


def _edited(path: Path, edit: Any, *, recompute: bool = False) -> Path:
    parts = parse(path.read_bytes())
    edit(parts)
    path.write_bytes(render(parts, recompute_tensor_crcs=recompute))
    return path


def _refused(
    path: Path, match: str, *, error: type[Exception] = aiosnap.errors.CorruptCheckpointError
) -> None:
    target = {"a": torch.zeros(4), "arr": np.zeros(3, dtype=np.int64), "n": 0}
    for call in (
        lambda: aiosnap.load_sync(str(path)),
        lambda: aiosnap.load_sync(str(path), keys=["a"]),
        lambda: aiosnap.load_into_sync(str(path), target),
        lambda: aiosnap.verify_sync(str(path)),
    ):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("tag", [["tensor"], {"t": 1}])
def test_an_unhashable_node_tag_is_refused(good: Path, tag: Any) -> None:
    # Was: TypeError (unhashable type) from the tag lookup in _tree.check.
    _refused(_edited(good, lambda p: p.meta.update(tree={"$": tag, "v": []})), "unknown node type")


@pytest.mark.parametrize("code", [{"F32": 1}, ["F32"]])
def test_an_unhashable_safetensors_dtype_is_refused(good: Path, code: Any) -> None:
    # Was: TypeError (unhashable type) from `code in ST_ITEMSIZE`.
    _refused(_edited(good, lambda p: p.header["a"].update(dtype=code)), "unknown dtype")


@pytest.mark.parametrize(
    ("shape", "kind"),
    [
        ([0, 2**63 - 1, 2**63 - 1], "tensor"),  # was: RuntimeError "Stride calculation overflowed"
        ([0, 2**62], "ndarray"),  # was: ValueError "array is too big" from numpy.empty
        ([1] * 65, "ndarray"),  # was: ValueError "maximum supported dimension" from numpy.empty
        ([0, 2**64], "tensor"),  # was: TypeError (overflow) from torch.empty
    ],
)
def test_a_shape_torch_or_numpy_cannot_hold_is_refused(tmp_path: Path, shape: list[int], kind: str) -> None:
    path = tmp_path / "c"
    aiosnap.save_sync(str(path), {"e": torch.zeros(0) if kind == "tensor" else np.zeros(0)})
    if shape == [1] * 65:  # one element: give it its 8 bytes
        aiosnap.save_sync(str(path), {"e": np.zeros(1)})

    def edit(p: Any) -> None:
        p.meta["tensors"]["e"]["shape"] = shape
        if p.header["e"]["dtype"] != "U8":
            p.header["e"]["shape"] = shape

    _edited(path, edit)
    for call in (aiosnap.load_sync, aiosnap.verify_sync):
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="shape"):
            call(str(path))


class _Counted(int):
    """An int that counts the multiplications it takes part in."""

    calls = 0

    def __rmul__(self, other: int) -> int:
        _Counted.calls += 1
        return int(other) * int(self)


def test_a_shape_of_huge_numbers_is_not_multiplied_out(good: Path) -> None:
    # Was: 17 s to multiply 300 numbers of 4,000 digits (a 1.2 MB header) before the
    # sizes were compared; the product now stops once it passes what int64 holds.
    from aiosnap._format.codec import nbytes

    assert nbytes([_Counted(10**4000)] * 300, 4) is None
    assert _Counted.calls == 1
    parts = parse(good.read_bytes())
    parts.meta["tensors"]["a"]["shape"] = Raw("[" + ",".join(["9" * 4000] * 300) + "]")
    good.write_bytes(render(parts))
    _refused(good, "shape")


def _with_metadata(path: Path, document: str | None = None, crc: str | None = None) -> Path:
    """``path`` with the raw text of the aiosnap document (or of the header checksum)
    replaced, sealed again."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    if document is not None:
        header["__metadata__"][META_KEY] = document
    header["__metadata__"][CRC_KEY] = crc if crc is not None else "00000000"
    text = json.dumps(header, separators=(",", ":")).encode()
    body = len(text).to_bytes(8, "little") + text
    if crc is None:
        at = body.index(b'"aiosnap_crc32c":"00000000"') + len(CRC_KEY) + 4
        body = body[:at] + f"{crc32c(body):08x}".encode() + body[at + 8 :]
    path.write_bytes(body + raw[8 + n :])
    return path


def test_a_lone_surrogate_in_the_document_text_is_parsed_not_encoded(good: Path) -> None:
    # Was: UnicodeEncodeError from meta["aiosnap"].encode(): the document is a JSON string
    # inside the header, whose escapes can make a lone surrogate.
    document = parse(good.read_bytes()).meta
    document["tree"]["items"].append(["s", "\ud800"])
    _with_metadata(good, json.dumps(document, ensure_ascii=False))
    assert aiosnap.load_sync(str(good))["s"] == "\ud800"
    _refused(_with_metadata(good, "\ud800"), "not valid JSON")


def test_a_lone_surrogate_as_the_header_checksum_is_refused(good: Path) -> None:
    # Was: UnicodeEncodeError from encoding the checksum to find it in the header.
    _refused(_with_metadata(good, crc="\ud800" * 8), "header checksum")


def test_an_entry_used_as_two_kinds_is_refused(good: Path) -> None:
    # Was: only the first reference was checked; the second got the first's object (a
    # tensor where the tree says ndarray), and load returned it.
    tree = {"$": "dict", "items": [["a", {"$": "tensor", "n": "a"}], ["b", {"$": "ndarray", "n": "a"}]]}
    path = _edited(good, lambda p: p.meta.update(tree=tree))
    for call in (aiosnap.load_sync, aiosnap.verify_sync):
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="is a ndarray but 'a' is a tensor"):
            call(str(path))


def test_load_state_dict_failing_any_way_is_a_state_mismatch(tmp_path: Path) -> None:
    # Was: AttributeError ('int' object has no attribute 'startswith') from
    # Module.load_state_dict, given a dict with an int key.
    path = str(tmp_path / "c")
    aiosnap.save_sync(path, {"model": {1: torch.zeros(2)}})
    with pytest.raises(aiosnap.errors.StateMismatchError, match="unexpected keys \\[1\\]"):
        aiosnap.load_into_sync(path, {"model": torch.nn.Linear(2, 1)})  # refused before it is called
    with pytest.raises(aiosnap.errors.StateMismatchError, match="AttributeError"):
        aiosnap.load_into_sync(path, {"model": torch.nn.Linear(2, 1)}, strict=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int6])
def test_a_tuple_item_load_into_would_replace_is_a_state_mismatch(tmp_path: Path, dtype: torch.dtype) -> None:
    # Was (case 247474 of the million): NotImplementedError from comparing an int6
    # tensor with the tuple's old item, a number (``result != old``, elementwise; a float32
    # tensor of two items gave a RuntimeError: its truth value is ambiguous).
    path = str(tmp_path / "c")
    item = (
        torch.zeros(2, dtype=torch.int8).view(dtype) if dtype.itemsize == 1 else torch.zeros(2, dtype=dtype)
    )
    aiosnap.save_sync(path, {"t": (torch.ones(2), item)})
    with pytest.raises(aiosnap.errors.StateMismatchError, match="a tuple cannot be updated in place"):
        aiosnap.load_into_sync(path, {"t": (torch.zeros(2), 0)})


def _manifest(**body: Any) -> bytes:
    valid = Manifest(3, None, 2, ["rank_00000", "rank_00001"], ["0" * 8] * 2, [1, 2], ["m"], "rank_00000")
    outer = json.loads(valid.to_bytes())
    outer["body"].update(body)
    text = json.dumps(outer["body"], sort_keys=True, separators=(",", ":"))
    outer["crc32c"] = f"{crc32c(text.encode('utf-8', 'surrogatepass')):08x}"
    return json.dumps(outer).encode()


def test_a_deeply_nested_manifest_is_refused() -> None:
    # Was: RecursionError from json.loads.
    for raw in (
        b"[" * 100_000 + b"]" * 100_000,
        _manifest(replicated=Raw("x")).replace(b'"x"', b"[" * 5000 + b"]" * 5000),
    ):
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="bad manifest"):
            Manifest.parse("m", raw)


@pytest.mark.parametrize("name", ["rank\x00", "\ud800", "n" * 256, "", ".", "a/b"])
def test_a_manifest_file_name_no_file_system_opens_is_refused(name: str) -> None:
    # Was: ValueError (embedded null byte), UnicodeEncodeError or OSError (name too long)
    # from os.open when a restore opened the file.
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="file name"):
        Manifest.parse("m", _manifest(replicas=name))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="file name"):
        Manifest.parse("m", _manifest(files=["rank_00000", name]))


async def _three_steps(directory: Path) -> dict[str, Any]:
    async with aiosnap.CheckpointManager(str(directory)) as mgr:
        for step in (1, 2, 3):
            await mgr.save(step, {"step": step}, metrics={"loss": 1.0 / step})
    return json.loads((directory / INDEX_NAME).read_text())  # type: ignore[no-any-return]


async def test_a_deeply_nested_index_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Was: RecursionError from json.loads, out of CheckpointManager.__aenter__.
    await _three_steps(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
            assert await mgr.steps() == [1, 2, 3]
    assert "rebuilding it from the directory" in caplog.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("corrupt", 3),  # was: any value hid the checkpoint from steps()
        ("wall_time", "x"),  # was: TypeError from KeepWithin at the next save
        ("wall_time", float("inf")),
        ("step", True),
        ("timings", {"total_s": "x"}),
        ("bytes", -1),
        ("epoch", "1"),
        ("metadata", []),
    ],
)
async def test_a_malformed_index_record_is_dropped(tmp_path: Path, field: str, value: Any) -> None:
    index = await _three_steps(tmp_path)
    index["checkpoints"][0][field] = value  # step 1's record
    index["history"][0][field] = value
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepWithin(3600.0)) as mgr:
        assert await mgr.steps() == [1, 2, 3]
        assert len(await mgr.history()) == 2  # the bad one is gone
        await (await mgr.save(4, {"step": 4})).wait()
        assert await mgr.steps() == [1, 2, 3, 4]
        assert (await mgr.restore(1)).state == {"step": 1}


async def test_an_index_marking_a_checkpoint_corrupt_never_deletes_it(tmp_path: Path) -> None:
    # Was: a step the index called corrupt was deleted at the next save, unverified.
    index = await _three_steps(tmp_path)
    index["checkpoints"][0]["corrupt"] = "the index says so"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(5)) as mgr:
        assert await mgr.steps() == [2, 3]  # the mark still hides it from restore()
        await (await mgr.save(4, {"step": 4})).wait()
        assert (await mgr.restore(1)).state == {"step": 1}  # and it is still there
    assert (tmp_path / "snapshot_iter_1").exists()


async def test_a_long_history_is_cut_to_the_limit_as_it_is_read(tmp_path: Path) -> None:
    # Was: every entry of a hostile history parsed and kept (and written back, with
    # json's pure-Python encoder on the event loop: 2 s for 20,000 entries).
    index = await _three_steps(tmp_path)
    index["history"] = index["history"][:1] * (HISTORY_LIMIT + 2000)
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        assert len(await mgr.history()) == HISTORY_LIMIT
        await (await mgr.save(4, {"step": 4})).wait()
    assert len(json.loads((tmp_path / INDEX_NAME).read_text())["history"]) == HISTORY_LIMIT


# -- the sharded fuzzer (tests/fuzz_sharded.py) and the defects it found ---------------------


def test_300_hostile_sharded_steps() -> None:
    # Two children, as above: ~4 s to import torch and make the seeds, then ~25 ms a
    # case (mutate, write, 6 reads, the oracles); each child keeps more than one core
    # busy. CI's share; `nox -s slow` runs 100,000.
    t0 = time.monotonic()
    reports = results([fuzz("sharded:0:150"), fuzz("sharded:150:150")])
    assert sum(run["count"] for r in reports for run in r["runs"]) == 300
    print(f"fuzzing took {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
def test_100_000_hostile_sharded_steps() -> None:
    """The stress run of the sharded fuzzer: AIOSNAP_FUZZ_SHARDED_CASES cases (100,000)
    from AIOSNAP_FUZZ_SHARDED_START (0), in children of AIOSNAP_FUZZ_CHUNK (10,000) cases,
    two at a time; `python -m tests.fuzz sharded:CASE:1 -v` replays a finding."""
    start = _env_int("AIOSNAP_FUZZ_SHARDED_START", 0)
    count = _env_int("AIOSNAP_FUZZ_SHARDED_CASES", 100_000)
    chunk = _env_int("AIOSNAP_FUZZ_CHUNK", 10_000)
    jobs = [f"sharded:{at}:{min(chunk, start + count - at)}" for at in range(start, start + count, chunk)]
    for i in range(0, len(jobs), 2):
        results([fuzz(job) for job in jobs[i : i + 2]])


@pytest.fixture
async def step(tmp_path: Path) -> Path:
    """The sharded fuzzer's seed: a step of 4 ranks' DTensors, made in one process."""
    from .fuzz_sharded import make_step

    await make_step(tmp_path / "step")
    return tmp_path / "step"


def _resealed(step: Path, edit: Any) -> None:
    """The step's manifest with its body edited, sealed again."""
    outer = json.loads((step / MANIFEST_NAME).read_bytes())
    edit(outer["body"])
    text = json.dumps(outer["body"], sort_keys=True, separators=(",", ":"))
    outer["crc32c"] = f"{crc32c(text.encode()):08x}"
    (step / MANIFEST_NAME).write_text(json.dumps(outer))


def _listed(body: Any, path: str) -> list[Any]:
    """The boxes of DTensor ``path``, listed in place of its grid (format /3 lists them
    where no grid fits): the edits below are of one box."""
    from aiosnap._format.grids import Grid

    saved = body["shards"][path]
    if saved.get("grid") is not None:
        saved["boxes"] = [dataclasses.asdict(b) for b in Grid(**saved["grid"]).every(saved["shape"])]
        saved["grid"] = None
    boxes: list[Any] = saved["boxes"]
    return boxes


def _rank_edited(step: Path, rank: int, edit: Any, *, recompute: bool = False) -> None:
    """Rank ``rank``'s file edited and sealed, and the manifest committing it."""
    path = _edited(step / f"rank_{rank:05d}", edit, recompute=recompute)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    checksum = json.loads(raw[8 : 8 + n])["__metadata__"][CRC_KEY]

    def commit(body: dict[str, Any]) -> None:
        body["checksums"][rank], body["sizes"][rank] = checksum, len(raw)

    _resealed(step, commit)


def _step_refused(step: Path, match: str, ranks: tuple[int, ...] = (0, 1, 2, 3)) -> None:
    """Every rank's load of the DTensors, and verify, refuse the step as corrupt."""
    for rank in ranks:
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=match):
            aiosnap.load_sync(str(step), rank=rank, keys=["dt"])
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=match):
        aiosnap.verify_sync(str(step))


def test_an_empty_dtensor_is_read_at_its_whole_shape(step: Path) -> None:
    # Was: a DTensor with no bytes on any rank (indexed nowhere) read as the rank's own
    # empty box, (0, 1) of a (0, 4), and so differently by each rank.
    for rank in range(4):
        assert aiosnap.load_sync(str(step), rank=rank, keys=["dt"])["dt"]["empty"].shape == (0, 4)


def test_a_dtensor_with_bytes_the_index_lacks_is_refused(step: Path) -> None:
    # Was: read from the rank's own entry as if it were the whole (rank 0's 3 rows of
    # 10); restored into a DTensor target, a RuntimeError from DTensor.copy_.
    _resealed(step, lambda body: body["shards"].pop("dt.row"))
    _step_refused(step, "no boxes of the DTensor at dt.row")


def test_one_dtensor_indexed_as_two_is_refused(step: Path) -> None:
    # Was: the index of the last path read for both; here dt.col's boxes, returned as
    # dt.row and as tied.
    _resealed(step, lambda body: body["shards"].update(tied=body["shards"]["dt.col"]))
    for rank in range(4):
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="indexed as two"):
            aiosnap.load_sync(str(step), rank=rank, keys=["dt", "tied"])
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="indexed as two"):
        aiosnap.verify_sync(str(step))


def test_verify_checks_block_checksums(step: Path) -> None:
    # Was: a bit flipped in the second block of a shard, behind a recomputed whole-entry
    # checksum, passed verify; a restore, which checks blocks, refused it.
    from aiosnap._format.header import BLOCK

    def flip(p: Any) -> None:
        start, _ = p.header["dt.big"]["data_offsets"]
        data = bytearray(p.data)
        data[start + BLOCK + 5] ^= 1
        p.data = bytes(data)

    _rank_edited(step, 0, flip, recompute=True)
    _step_refused(step, r"rank_00000: block checksum mismatch in tensor 'dt\.big'", ranks=())
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="rank_00000"):
        aiosnap.load_sync(str(step), rank=0, keys=["dt.big"])


@pytest.mark.parametrize("shape", [[2**62], [2**63], [0, 2**64], [0, 2**63 - 1, 2**63 - 1]])
def test_a_dtensor_shape_torch_cannot_hold_is_refused(step: Path, shape: list[int]) -> None:
    # Was: RuntimeError (storage size overflowed) or TypeError (overflow) from torch.empty.
    box = {"file": 0, "name": "dt.row", "offsets": [0] * len(shape), "lengths": shape}
    _resealed(
        step,
        lambda body: body["shards"].update(
            {"dt.row": {**body["shards"]["dt.row"], "shape": shape, "boxes": [box]}}
        ),
    )
    _step_refused(step, "'dt.row': bad dtype or shape")


def test_a_whole_the_boxes_entries_do_not_hold_allocates_nothing(step: Path) -> None:
    # Was: torch.empty of the 4 TiB the manifest claimed (one box of 2^40 elements,
    # named for a 60-byte entry), before any box was read: a RuntimeError from the
    # allocator, or the memory, where it is there to take.
    box = {"file": 0, "name": "dt.row", "offsets": [0], "lengths": [2**40]}
    _resealed(
        step,
        lambda body: body["shards"].update(
            {"dt.row": {**body["shards"]["dt.row"], "shape": [2**40], "boxes": [box], "grid": None}}
        ),
    )
    _step_refused(step, "does not hold the box of dt.row")


@pytest.mark.parametrize(("key", "value"), [("lengths", [3]), ("offsets", [0, 0, 0]), ("lengths", [])])
def test_a_box_of_another_number_of_dimensions_is_refused(step: Path, key: str, value: list[int]) -> None:
    # Was: ValueError (zip() argument 2 is shorter than argument 1) from Box.within.
    _resealed(step, lambda body: _listed(body, "dt.row")[1].update({key: value}))
    _step_refused(step, "another number of dimensions")


def test_the_file_of_replicated_entries_is_one_of_the_steps() -> None:
    # Was: accepted; a restore read the replicated entries from a file no checksum
    # of the manifest vouched for.
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="replicated entries is not one of"):
        Manifest.parse("m", _manifest(replicas="rank_00002"))


def test_a_rank_file_is_never_read_as_another_format(step: Path) -> None:
    # Was: sniffed like any file, so a torch.save file in its place was unpickled (with
    # allow_pickle=True) and verified by its zip's CRCs, the manifest's checksum unread.
    torch.save({"w": torch.zeros(2)}, step / "rank_00001")
    with pytest.raises(aiosnap.errors.CheckpointError, match="rank_00001"):
        aiosnap.load_sync(str(step), rank=1, allow_pickle=True)
    with pytest.raises(aiosnap.errors.CheckpointError, match="rank_00001"):
        aiosnap.verify_sync(str(step))


def test_verify_refuses_a_box_that_is_not_the_entry_it_names(step: Path) -> None:
    # Was: verify checked each file alone; a restore refused the box.
    _resealed(step, lambda body: _listed(body, "dt.row")[1].update(name="dt.col"))
    _step_refused(step, "does not hold the box of dt.row")


def test_verify_refuses_a_grid_whose_entry_is_not_the_box_it_names(step: Path) -> None:
    _resealed(step, lambda body: body["shards"]["dt.row"]["grid"].update(name="dt.col"))
    _step_refused(step, "does not hold the box of dt.row")


def test_verify_refuses_a_replicated_entry_the_file_of_them_lacks(step: Path) -> None:
    # Was: verify checked each file alone; rank 1's restore refused it.
    _rank_edited(step, 1, lambda p: p.meta["external"]["shared"].update(shape=[4]))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="replicated entry 'shared'"):
        aiosnap.load_sync(str(step), rank=1, keys=["shared"])
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="replicated entry 'shared'"):
        aiosnap.verify_sync(str(step))


def test_a_bytes_node_that_is_not_strict_base64_is_refused_by_verify_too(good: Path) -> None:
    # Was: verify accepted "AA==\n" (and any text that is not base64), which load
    # refused: the tree check took any string.
    def edit(p: Any) -> None:
        p.meta["tree"]["items"].append(["b", {"$": "bytes", "v": "AA==\n"}])

    _refused(_edited(good, edit), "bad bytes node at b")


def test_a_file_without_a_tree_is_verified_as_it_is_loaded(good: Path) -> None:
    # Was: verify checked the leaves of a tree only if the file had one; load reads a
    # file without one as a dict of its entries, tensors all, and refused the array
    # (found as a rank file of a step whose document lost its tree, a shard among them).
    path = _edited(good, lambda p: p.meta.pop("tree"))
    for call in (aiosnap.load_sync, aiosnap.verify_sync):
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="arr is a tensor but 'arr' is not"):
            call(str(path))


def test_an_empty_dtensor_whose_whole_torch_cannot_hold_is_refused(step: Path) -> None:
    # Was (in the unfinished fix that reads an empty DTensor at its whole shape): a
    # TypeError from torch.empty([0, 2**64]).
    _rank_edited(step, 3, lambda p: p.meta["tensors"]["dt.empty"]["shard"].update(shape=[0, 2**64]))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="torch cannot hold"):
        aiosnap.load_sync(str(step), rank=3, keys=["dt.empty"])


def test_a_manifest_of_many_boxes_resolves_its_types_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Was: the field types of a dataclass resolved for every box: a manifest of 12,800
    # boxes took 19 s to parse (1.3 s now; one run, a loaded machine).
    import typing

    calls = 0
    hints = typing.get_type_hints

    def counted(kind: Any) -> Any:
        nonlocal calls
        calls += 1
        return hints(kind)

    monkeypatch.setattr(typing, "get_type_hints", counted)  # the standard library's, which the parse calls
    n = 2000
    box = {"file": 0, "name": "w", "offsets": [0], "lengths": [1]}
    boxes = [{**box, "offsets": [i]} for i in range(n)]
    Manifest.parse("m", _manifest(shards={"w": {"dtype": "float32", "shape": [n], "boxes": boxes}}))
    assert calls <= 10
