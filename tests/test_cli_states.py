"""The command line on a real training state (a small transformer, AdamW, LambdaLR,
GradScaler, an AsyncLoader and RNGState, saved at two steps): inspect and diff as
golden files at 80 columns, with --keys/--exclude/--depth/--expand/--wide; inspect and
verify agreeing on counts; convert to torch.save and through safetensors and back
without loss; the help. Golden files: see ``test_cli.GOLDEN`` (``AIOSNAP_REGOLDEN=1``
rewrites them).

A golden holds only what every machine computes alike. The state's structure comes from
real steps (AdamW's state, the scheduler's and the scaler's values, the loader's and the
generators' states), but its float tensors are then set to constructed values: the same
AdamW update rounds its last bits differently on an Intel and an AMD CPU (other vector
kernels), and a golden of the trained values failed on the other machine."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import aiosnap

from .test_cli import cli, golden, normal, one_error_line

LONG_NAME = "enc.layers.0.self_attn.in_proj_weight"


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 3)


def _ramp(t: torch.Tensor, offset: int) -> torch.Tensor:
    """Values any machine computes alike: ``offset + k / 1024`` for the k-th element, each
    exact in float32 (integers and a power of two: no rounding anywhere)."""
    ramp = torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape) / 1024 + offset
    return ramp.to(t.dtype)


def _set_constructed(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Every float tensor of the model and of AdamW's moments set to a ramp (AdamW's
    ``step`` counts are whole numbers, alike everywhere, and stay)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(_ramp(p, i + step))
            for j, moment in enumerate((optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])):
                moment.copy_(_ramp(moment, 2 * i + j + step))


def _train_state(directory: Path) -> None:
    """Two checkpoints of one run: real steps for the state's structure, then constructed
    values in its float tensors (see the module's text)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    scaler = torch.amp.GradScaler("cpu")
    data = TensorDataset(torch.arange(32).reshape(16, 2))
    loader = aiosnap.AsyncLoader(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator()))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    state |= {"loader": loader, "rng": aiosnap.RNGState(), "step": 0}
    for step in (1, 2):
        scaler.scale(torch.zeros(()))  # the scaler's first scale() sets its scale up
        for i, p in enumerate(model.parameters()):  # gradients as scaled ones are: times the scale
            p.grad = torch.full_like(p, 0.01 * (i + step)) * scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        _set_constructed(model, optimizer, step)
        [random.random() for _ in range(700)]  # an augmentation's draws: Python's MT state turns over
        state["step"] = step
        aiosnap.save_sync(str(directory / f"step{step}"), state)


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("train")
    _train_state(directory)
    return directory


@pytest.fixture(autouse=True)
def _columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("FORCE_COLOR", raising=False)


@pytest.fixture
def columns80(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


# -- inspect -------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("columns80")
def test_inspect_a_training_state(train_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(train_dir / "step2")
    code, out, err = cli(capsys, "inspect", path)
    assert (code, err) == (0, "")
    golden("inspect-train-80", normal(out, train_dir))
    assert max(len(line) for line in out.splitlines() if line[0] in "┏┃┡│└") == 80  # the table fits
    # 625 ints of Python's RNG state are one row; --expand lists them
    assert "│     1   " in out and "625 x int" in out and "rng.python.1" not in out
    _, expanded, _ = cli(capsys, "inspect", path, "--expand")
    assert len(expanded.splitlines()) > len(out.splitlines()) + 625
    # a long name wraps, at its dots, indented under its start; --wide keeps it on one line
    assert LONG_NAME not in out and re.search(r"│   enc\.layers\.0\.\s+│.*\n│     self_attn\.", out)
    _, wide, _ = cli(capsys, "inspect", path, "--wide")
    assert f"│   {LONG_NAME} " in wide and max(len(line) for line in wide.splitlines() if line[0] == "│") > 80
    code, out, _ = cli(capsys, "inspect", path, "--depth", "1")
    golden("inspect-train-depth1", normal(out, train_dir))


def test_inspect_keys_and_exclude_select_by_glob(train_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(train_dir / "step2")
    _, out, _ = cli(capsys, "inspect", path, "--json")
    every = [e["path"] for e in json.loads(out)["entries"]]
    select = ["-k", "optimizer.state", "-k", "*.exp_avg", "-x", "optimizer.state.1*", "--json"]
    _, out, _ = cli(capsys, "inspect", path, *select)
    chosen = [e["path"] for e in json.loads(out)["entries"]]
    expected = [
        p
        for p in every
        if (p.startswith("optimizer.state.") or p.endswith(".exp_avg"))
        and not p.startswith("optimizer.state.1")
    ]
    assert chosen == expected and "optimizer.state.0.step" in chosen and len(chosen) > 10
    code, out, _ = cli(capsys, "inspect", path, "-k", "rng", "-x", "rng.python")
    assert code == 0 and f"showing 6 of {len(every)} entries" in out and "python" not in out


def test_inspect_and_verify_count_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tied tensor is two leaves of the tree and one stored entry: inspect says both,
    and its stored count and bytes are verify's, for a file and for a step directory."""
    weight = torch.zeros(4, 4)
    state = {"encoder": weight, "decoder": weight, "bias": torch.ones(3), "n": 1}
    aiosnap.save_sync(str(tmp_path / "tied"), state)

    async def step_dir() -> None:
        async with aiosnap.CheckpointManager(str(tmp_path / "run")) as manager:
            await (await manager.save(7, state)).wait()

    import anyio

    anyio.run(step_dir)
    for path in (tmp_path / "tied", tmp_path / "run" / "snapshot_iter_7"):
        _, described, _ = cli(capsys, "inspect", str(path))
        _, verified, _ = cli(capsys, "verify", str(path))
        stored = re.search(r"stored: \d+ tensor\(s\), [\d.]+ \w+ of data", described)
        assert stored is not None and f"({stored.group()}; checksums match)" in verified
        assert "4 entries: 3 tensor(s) and array(s), 1 plain value(s); stored: 2 tensor(s), 76 B" in described


# -- diff ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("columns80")
def test_diff_two_steps_of_a_training_state(train_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(train_dir / "step1"), str(train_dir / "step2")
    code, out, err = cli(capsys, "diff", a, b)
    assert (code, err) == (1, "")
    golden("diff-train-80", out)
    assert "│ changed │ rng.python.1 " in out and "625 changed (of 625" in out and "rng.python.1.0" not in out
    _, expanded, _ = cli(capsys, "diff", a, b, "--expand")
    assert "rng.python.1.0 " in expanded and len(expanded.splitlines()) > len(out.splitlines()) + 600
    code, out, _ = cli(capsys, "diff", a, b, "--depth", "1", "--all")
    golden("diff-train-depth1", out)
    code, out, _ = cli(capsys, "diff", a, b, "-k", "loader", "-k", "scaler.*", "-x", "*._growth_tracker")
    assert (
        code == 0 and out == "0 added, 0 removed, 0 changed, 0 close, 7 equal\n"
    )  # what differs is left out
    code, out, _ = cli(capsys, "diff", a, b, "-x", "rng", "--json")
    assert code == 1 and not any(e["path"].startswith("rng") for e in json.loads(out)["entries"])


# -- convert -------------------------------------------------------------------------------------------


def _same(x: Any, y: Any) -> bool:
    """Equal, and of the same types all the way down (a tuple is not a list)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return (
            list(x) == list(y)
            and all(type(k) is type(j) for k, j in zip(x, y, strict=True))
            and all(_same(x[k], y[k]) for k in x)
        )
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, torch.Tensor):
        bits = (x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(*bits)
    if isinstance(x, (np.ndarray, np.generic)):
        return x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
    if isinstance(x, float) and math.isnan(x):
        return math.isnan(y)
    return bool(x == y)


def _awkward() -> dict[str, Any]:
    tied = torch.arange(6.0).reshape(2, 3)
    return {
        "model": {"w": tied, "w_again": tied, "half": torch.ones(3, dtype=torch.bfloat16)},
        "ids": {0: "zero", 1.5: None, True: (1, 2.5, "x"), None: [b"\x00raw", float("nan"), -0.0]},
        "np": {"keys": np.arange(5, dtype=np.uint32), "scalar": np.float64(0.25), "flag": np.bool_(True)},
        "empty": {"list": [], "tuple": (), "dict": {}},
        "size": (3, 4),
    }


def test_aiosnap_to_safetensors_and_back_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    src, st, back = tmp_path / "src", tmp_path / "x.safetensors", tmp_path / "back"
    aiosnap.save_sync(str(src), _awkward())
    assert cli(capsys, "convert", str(src), str(st))[0] == 0
    with safe_open(str(st), "pt") as f:  # a plain file: every tensor by its dotted path, the tree as text
        assert set(f.keys()) == {"model.w", "model.half", "np.keys", "np.scalar", "np.flag"}
        assert set(f.metadata()) == {"format", "aiosnap_tree"}
    code, out, _ = cli(capsys, "convert", str(st), str(back))
    assert code == 0 and "(safetensors with its tree) ->" in out
    original, restored = aiosnap.load_sync(str(src)), aiosnap.load_sync(str(back))
    assert _same(original, restored)
    assert restored["model"]["w"] is restored["model"]["w_again"]  # tied: stored once, one tensor
    for other in (st, back):
        code, out, _ = cli(capsys, "diff", str(src), str(other))
        assert (code, out) == (0, "0 added, 0 removed, 0 changed, 0 close, 19 equal\n")
    code, out, _ = cli(capsys, "inspect", str(st))
    assert "safetensors with its tree" in out and "│   w_again │ tensor float32" in out


def test_values_safetensors_cannot_hold_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.ones(2), "args": Path("/x")}, tmp_path / "a.pt")
    code, _, err = cli(
        capsys, "convert", str(tmp_path / "a.pt"), str(tmp_path / "a.safetensors"), "--allow-pickle"
    )
    assert code == 0 and err == "note: left out 1 value(s) of no state type, None in the file's tree: args\n"
    assert cli(capsys, "convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b"))[0] == 0
    assert _same(aiosnap.load_sync(str(tmp_path / "b")), {"w": torch.ones(2), "args": None})


def test_convert_to_torch_save(train_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out_path = str(train_dir / "step2"), tmp_path / "out.pt"
    code, out, err = cli(capsys, "convert", src, str(out_path))  # .pt: torch.save, without --to
    assert code == 0 and out.endswith(f"-> {out_path} (torch): 63 tensor(s), 48.4 KiB\n")
    assert err == (
        "note: 1 value(s) are NumPy values or objects (rng.numpy.keys): torch.load refuses them with its "
        "default weights_only=True; pass weights_only=False if you trust the file\n"
    )
    assert _same(torch.load(out_path, weights_only=False), aiosnap.load_sync(src))
    code, out, _ = cli(capsys, "diff", src, str(out_path), "--allow-pickle")
    assert code == 0 and " 0 changed" in out
    plain = tmp_path / "model.pth"
    # A fresh optimizer's empty state, an empty list and tuple: torch.load's
    # weights_only takes them, so no note names them (it did: "NumPy values or objects").
    plain_state = {"w": torch.ones(2), "step": 3, "optim": {"state": {}, "groups": [], "t": ()}}
    aiosnap.save_sync(str(tmp_path / "model"), plain_state)
    code, _, err = cli(capsys, "convert", str(tmp_path / "model"), str(plain), "--to", "torch")
    assert (code, err) == (0, "")
    assert _same(torch.load(plain), plain_state)  # weights_only=True takes it


@pytest.mark.parametrize(
    ("dst", "to", "refused"),
    [
        ("out.pt", "aiosnap", "out.pt ends in .pt, the extension of a torch.save file, but --to aiosnap"),
        ("out.bin", "safetensors", "out.bin ends in .bin, the extension of a torch.save file"),
        ("out.safetensors", "torch", "the extension of a plain safetensors file, but --to torch writes"),
        (
            "out.safetensors",
            "dcp",
            "--to dcp writes a DCP directory: name it otherwise, or pass --to safetensors",
        ),
        ("out.safetensors", "aiosnap", None),  # an aiosnap file is a safetensors file
        ("out.ckpt", "torch", None),
    ],
)
def test_an_extension_that_contradicts_to_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dst: str, to: str, refused: str | None
) -> None:
    aiosnap.save_sync(str(tmp_path / "src"), {"w": torch.ones(2)})
    code, _, err = cli(capsys, "convert", str(tmp_path / "src"), str(tmp_path / dst), "--to", to)
    if refused is None:
        assert (code, err) == (0, "")
    else:
        assert code == 2 and refused in one_error_line(err) and not (tmp_path / dst).exists()


# -- help ----------------------------------------------------------------------------------------------


def test_help_shows_flags_as_flags_and_arguments_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "<bool>" not in out and "{" not in out
    panel = [line for line in out[out.index("Commands") :].splitlines() if line.startswith("│")]
    commands = ("ls", "inspect", "verify", "diff", "prune", "convert", "bench")
    assert [line.split()[1] for line in panel] == list(commands)  # one line each: no mid-sentence breaks
    for command in commands:
        code, out, _ = cli(capsys, command, "--help")
        usage = next(line for line in out.splitlines() if "Usage:" in line)
        assert code == 0 and "<bool>" not in out and "{" not in usage, command
    _, out, _ = cli(capsys, "diff", "--help")
    assert "Usage: aiosnap diff [OPTIONS] A B" in out and re.search(r"│ --json\s+Print JSON", out)
    code, _, err = cli(capsys, "diff", "a", "b", "--json", "true")
    assert code == 2 and "unexpected extra argument" in err.lower()  # a flag takes no value


# -- the demo's last words -----------------------------------------------------------------------------


def test_the_demo_ends_with_where_its_code_is_and_three_commands_that_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiosnap import demo
    from aiosnap.cli import main

    async def two_runs() -> None:
        for run in ("reference", "run"):
            torch.manual_seed(0)
            async with aiosnap.CheckpointManager(str(tmp_path / run)) as manager:
                for step in (7, 8):
                    await manager.save(step, {"w": torch.ones(3) * step, "rng": aiosnap.RNGState()})

    import anyio

    anyio.run(two_runs)
    root = Path(demo.__file__).resolve().parents[2]
    demo.next_steps(tmp_path, [p.name for p in (tmp_path / "run").iterdir()], Path(demo.__file__), root)
    out = capsys.readouterr().out
    assert "The code of this demo: src/aiosnap/demo.py\n" in out
    commands = re.findall(r"^  (?:aiosnap|\S+ -m aiosnap) (.+)$", out, re.M)
    assert [c.split()[0] for c in commands] == ["ls", "inspect", "diff"] and "snapshot_iter_8" in commands[1]
    for command in commands:
        assert main(command.split()) == 0, command  # the diff too: the two runs are equal
        capsys.readouterr()
