"""The command line on what the trainer integrations write, and its exit codes.

Real runs of the integrations (a Hugging Face Trainer, Lightning with ModelCheckpoint,
Accelerate with automatic naming), made once for the module: ``ls``, ``inspect`` and
``verify`` find their checkpoints without a ``--name``, ``verify`` takes several
targets, every command follows one exit-code convention (0 ok, 1 a check found a
problem, 2 the command could not do what was asked), and a long entry name wraps
between words, never inside one.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap

from .test_cli import cli, one_error_line


def _hugging_face(out: Path) -> None:
    from tests import test_integration_transformers as hf

    hf._trainer(str(out), epochs=1).train()  # saves at steps 4 and 8


def _lightning(out: Path) -> None:
    from aiosnap.integrations.lightning import AiosnapCheckpointIO
    from tests import test_integration_lightning as lt

    torch.manual_seed(0)
    trainer, _ = lt._trainer(str(out), 2, AiosnapCheckpointIO())
    trainer.fit(lt._Module(), lt._data())  # epoch=0-step=8, epoch=1-step=16, last


def _accelerate(project: Path) -> None:
    from tests import test_integration_accelerate as acc

    accelerator = acc._setup(str(project))[0]
    for _ in range(2):
        accelerator.save_state()  # project/checkpoints/checkpoint_0, checkpoint_1
    accelerator.end_training()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trained")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trainers' own (deprecations, tips)
        _hugging_face(root / "hf")
        _lightning(root / "lightning")
        _accelerate(root / "accelerate")
    return {"hf": root / "hf", "lightning": root / "lightning", "accelerate": root / "accelerate"}


def _listed(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = cli(capsys, "ls", *args, "--json")
    assert (code, err) == (0, ""), err
    return json.loads(out)  # type: ignore[no-any-return]


# -- ls, inspect, verify find the integrations' checkpoints -----------------------------------------


def test_ls_finds_a_hugging_face_trainers_checkpoint_folders(
    trained: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    listed = _listed(capsys, str(trained["hf"]))
    rows = listed["checkpoints"]
    assert listed["layout"] == "transformers" and listed["latest"] == 8
    assert [(r["file"], r["step"], r["latest"]) for r in rows] == [
        ("checkpoint-4", 4, False),
        ("checkpoint-8", 8, True),
    ]
    assert [r["epoch"] for r in rows] == [0.5, 1.0]  # the Trainer's own, from trainer_state.json
    assert all(r["bytes"] == (trained["hf"] / r["file"] / "state.aiosnap").stat().st_size for r in rows)
    assert "loss" in rows[1]["metrics"]  # what it logged at that step
    code, out, err = cli(capsys, "ls", str(trained["hf"]))
    assert (code, err) == (0, "") and "checkpoint-8" in out and "(Hugging Face Trainer)" in out


def test_ls_with_the_trainers_folder_name_lists_them_and_warns_of_nothing(
    trained: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    listed = _listed(capsys, str(trained["hf"]), "--name", "checkpoint-{step}")
    assert [r["step"] for r in listed["checkpoints"]] == [4, 8]  # no "aiosnap did not write them"


def test_ls_finds_lightnings_ckpt_files_with_their_steps_and_epochs(
    trained: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    listed = _listed(capsys, str(trained["lightning"]))
    assert listed["layout"] == "lightning"
    found = {r["file"]: (r["step"], r["epoch"], r["latest"]) for r in listed["checkpoints"]}
    # read off each file's header: last.ckpt's name says neither
    assert found == {
        "epoch=0-step=8.ckpt": (8, 0, False),
        "epoch=1-step=16.ckpt": (16, 1, True),
        "last.ckpt": (16, 1, True),
    }


def test_ls_finds_accelerates_folders_under_the_project_directory(
    trained: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    listed = _listed(capsys, str(trained["accelerate"]))  # the project_dir: its checkpoints/ folder
    assert listed["layout"] == "accelerate"
    assert listed["directory"] == str(trained["accelerate"] / "checkpoints")
    assert [(r["file"], r["step"]) for r in listed["checkpoints"]] == [
        ("checkpoint_0", 0),
        ("checkpoint_1", 1),
    ]


def test_inspect_and_verify_take_a_trainers_checkpoint_folder(
    trained: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = trained["hf"] / "checkpoint-8"
    code, out, err = cli(capsys, "inspect", str(folder), "--json")
    assert (code, err) == (0, "")
    described = json.loads(out)
    assert described["path"] == str(folder / "state.aiosnap")
    assert {"optimizer", "scheduler", "rng"} == {e["path"].split(".")[0] for e in described["entries"]}
    code, out, err = cli(capsys, "inspect", str(folder / "model.safetensors"), "--json")
    assert (code, err) == (0, "")  # the weights, under the model's own names
    assert "classifier.weight" in {e["path"] for e in json.loads(out)["entries"]}
    code, out, err = cli(capsys, "verify", str(folder))
    assert (code, err) == (0, "") and out.startswith(f"ok      {folder / 'state.aiosnap'} (")
    code, _, err = cli(capsys, "ls", str(folder))
    assert code == 2 and "is one checkpoint (a trainer's checkpoint folder" in one_error_line(err)


def test_ls_inspect_and_verify_find_checkpoints_of_the_weights_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # save_only_model: model.safetensors, config.json and trainer_state.json, no state.aiosnap.
    from tests import test_integration_transformers as hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf._gpt2_trainer(str(tmp_path), save_only_model=True).train()  # checkpoint-2, checkpoint-4
    capsys.readouterr()  # what the Trainer said
    plain = tmp_path / "checkpoint-1"  # the Trainer's own: a plain model.safetensors, not aiosnap's
    plain.mkdir()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({"w": torch.zeros(2)}, str(plain / "model.safetensors"))
    listed = _listed(capsys, str(tmp_path))
    assert [row["file"] for row in listed["checkpoints"]] == ["checkpoint-2", "checkpoint-4"]
    folder = tmp_path / "checkpoint-4"
    code, out, err = cli(capsys, "inspect", str(folder), "--json")
    assert (code, err) == (0, "") and json.loads(out)["path"] == str(folder / "model.safetensors")
    code, out, err = cli(capsys, "verify", str(tmp_path))
    assert (code, err) == (0, "") and out.splitlines()[-1].endswith("all verified")


def test_verify_takes_several_targets_and_every_layout(
    trained: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    targets = [str(trained["hf"] / "checkpoint-4"), str(trained["lightning"]), str(trained["accelerate"])]
    code, out, err = cli(capsys, "verify", *targets)
    assert (code, err) == (0, "")
    ok = [line.split()[1] for line in out.splitlines() if line.startswith("ok ")]
    assert len(ok) == 1 + 3 + 2 and out.splitlines()[-1] == "6 checkpoint(s) in 3 targets: all verified"


def test_verify_of_several_targets_goes_on_past_one_that_fails_or_is_missing(
    trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "lightning"
    shutil.copytree(trained["lightning"], run)
    damaged = run / "epoch=0-step=8.ckpt"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(data)
    code, out, err = cli(capsys, "verify", str(run))
    assert code == 1 and f"FAILED  {damaged}" in out and err == ""
    code, out, err = cli(capsys, "verify", str(run), str(tmp_path / "nothing"), str(trained["hf"]))
    # the missing one is said (exit 2: it could not be read), the others all verified
    assert code == 2 and one_error_line(err).endswith("nothing: no such file or directory")
    assert "FAILED" in out and out.splitlines()[-1] == "5 checkpoint(s) in 3 targets: 1 of 5 FAILED"


# -- one exit-code convention -------------------------------------------------------------------------


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    empty, run = tmp_path / "empty", tmp_path / "run"
    empty.mkdir()
    (empty / "notes.txt").write_text("no checkpoints here")
    aiosnap.save_sync(str(run / "snapshot_iter_1"), {"w": torch.zeros(4)})
    aiosnap.save_sync(str(run / "snapshot_iter_2"), {"w": torch.ones(4)})
    damaged = tmp_path / "damaged"
    data = bytearray((run / "snapshot_iter_1").read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(data)
    return {"empty": empty, "run": run, "damaged": damaged}


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["ls", "{run}"], 0),
        (["ls", "{empty}"], 2),  # nothing found: 0 before, while verify said 2
        (["ls", "{empty}", "--json"], 2),
        (["verify", "{run}"], 0),
        (["verify", "{empty}"], 2),
        (["verify", "{damaged}"], 1),
        (["verify", "{run}", "{damaged}"], 1),
        (["inspect", "{run}/snapshot_iter_1"], 0),
        (["inspect", "{empty}/notes.txt"], 2),
        (["diff", "{run}/snapshot_iter_1", "{run}/snapshot_iter_1"], 0),
        (["diff", "{run}/snapshot_iter_1", "{run}/snapshot_iter_2"], 1),
        (["prune", "{run}", "--keep-last", "1", "--dry-run"], 0),
        (["prune", "{empty}", "--keep-last", "1"], 2),  # 0 before ("removed 0 checkpoint(s)")
        (["ls", "{run}", "--bogus"], 2),
    ],
)
def test_every_command_follows_one_exit_code_convention(
    dirs: dict[str, Path], capsys: pytest.CaptureFixture[str], args: list[str], code: int
) -> None:
    got, _, err = cli(capsys, *[a.format(**dirs) for a in args])
    assert got == code, err
    if code == 2 and "--bogus" not in args:
        assert one_error_line(err)  # said in one line
    if args[:2] == ["ls", "{empty}"]:
        assert "none of the trainer integrations' checkpoints" in err and "--name" in err


def test_the_exit_codes_are_documented_as_tested() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    section = text[text.index("**Exit codes**") :].split("\n\n")[0]
    for words in ("`0`", "`1`", "`2`", "nothing found", "`130`"):
        assert words in section, words


# -- names wrap between words ----------------------------------------------------------------------------


def test_a_long_name_wraps_between_words_never_inside_one(
    trained: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's checkpoint holds its callbacks' states under keys such as
    ``ModelCheckpoint{'monitor': 'step', 'mode': 'max', ...}``: at 80 columns the key
    wrapped inside words (``{'mo`` / ``nitor': ...``)."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli(capsys, "inspect", str(trained["lightning"] / "last.ckpt"))
    assert code == 0
    cells = [line.split("│")[1] for line in out.splitlines() if line.startswith("│")]
    start = next(i for i, c in enumerate(cells) if c.strip().startswith("ModelCheckpoint"))
    indent = len(cells[start]) - len(cells[start].lstrip())
    lines = [cells[start].rstrip()]
    for cell in cells[start + 1 :]:
        if cell.strip().startswith("monitor"):  # the first entry under the key
            break
        assert cell[: indent + 2].isspace()  # a continuation, under the key's start
        lines.append(cell[indent + 2 :].rstrip())
    saved = aiosnap.load_sync(str(trained["lightning"] / "last.ckpt"), keys=["callbacks"])["callbacks"]
    key = next(k for k in saved if k.startswith("ModelCheckpoint"))
    assert len(lines) > 2 and "".join(lines).replace(" ", "") == key.replace(" ", "")
    for before, after in itertools.pairwise(lines):
        assert not (before[-1].isalnum() and after[0].isalnum()), (before, after)  # never inside a word


def test_integration_constants_match_what_the_cli_looks_for() -> None:
    from aiosnap._cli import layouts
    from aiosnap.integrations import accelerate, transformers

    assert layouts.STATE_NAME == transformers.STATE_NAME == accelerate.STATE_NAME
    assert layouts.MODEL_NAME == transformers.MODEL_NAME
    assert os.path.basename(layouts.TRAINER_STATE) == transformers.TRAINER_STATE_NAME
