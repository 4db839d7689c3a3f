"""The windowed JSON parser: the same values and the same refusals as json.loads, in C
calls that never see more than a window of text.

White-box: the parser is an internal pure function (``aiosnap._base.json``), tested with
small windows (its ``window=`` argument) so that every path runs on small documents.
"""

from __future__ import annotations

import functools
import json
import json.decoder
import json.scanner
import random
from typing import Any

import pytest

from aiosnap._base import json as _json

_CHARS = ["a", "é", '"', "\\", "\n", "\x01", "\u2028", "\U0001f600", "\ud800", " ", "/", "u", "0"]


def _string(rnd: random.Random) -> str:
    return "".join(rnd.choice(_CHARS) for _ in range(rnd.choice([0, 1, 3, 10, 40, 200])))


def _value(rnd: random.Random, depth: int = 0) -> Any:
    r = rnd.random()
    if depth > 3 or r < 0.3:
        number = rnd.random() * 10.0 ** rnd.randint(-300, 300)
        big = rnd.randint(-(10**20), 10**20)
        scalars = [None, True, False, big, number, float("nan"), float("inf"), -0.0]
        return rnd.choice([*scalars, _string(rnd)])
    if r < 0.65:
        return [_value(rnd, depth + 1) for _ in range(rnd.randint(0, 5))]
    return {_string(rnd): _value(rnd, depth + 1) for _ in range(rnd.randint(0, 5))}


def _outcome(parse: Any, text: str) -> tuple[str, str]:
    try:
        return "ok", json.dumps(parse(text))  # a repr that compares NaN and -0.0 too
    except ValueError:
        return "refused", ""


@pytest.mark.parametrize("seed", range(4))
def test_random_documents_parse_as_json_loads_parses_them(seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(150):
        text = json.dumps(
            _value(rnd),
            ensure_ascii=rnd.random() < 0.5,
            indent=rnd.choice([None, None, 1, "\t"]),
            separators=rnd.choice([None, (",", ":")]),
        )
        if rnd.random() < 0.3:  # damage it
            at = rnd.randrange(len(text))
            damage = rnd.choice(['"', "\\", "]", "}", ",", "x", "", "\\u12", "\x00"])
            text = text[:at] + damage + text[at + 2 :]
        window = rnd.choice([8, 16, 33, 64])
        windowed = functools.partial(_json.loads, window=window)
        assert _outcome(windowed, text) == _outcome(json.loads, text), (window, text)


@pytest.mark.parametrize("window", [8, 9, 10, 11, 12, 13, 16])
def test_no_cut_splits_an_escape(window: int) -> None:
    documents = [
        json.dumps("\\" * 101),  # runs of escaped backslashes, cut after an even count
        json.dumps("\\" * 100 + '"' + "\\"),
        json.dumps("a" * 5 + "\U0001f600" * 30),  # surrogate pairs at every offset
        json.dumps(["x" * k + '\U0001f600é\\"' * 7 for k in range(12)]),
        json.dumps({"k" * 40: "v" * 40, "n": [1.5e-300, -123456789012345678901234567890]}),
        "[" + " \n\t" * 30 + "1" + " " * 30 + "]",
        json.dumps([float("1e" + "1" * 2)] * 5) + "  ",
    ]
    windowed = functools.partial(_json.loads, window=window)
    for text in documents:
        assert _outcome(windowed, text) == _outcome(json.loads, text), text


def test_long_numbers_and_duplicate_keys_behave_as_in_json_loads() -> None:
    assert _json.loads("[" + "1" * 40 + ", 2.5e-7]", window=8) == [int("1" * 40), 2.5e-7]
    assert _json.loads('{"a": 1, "a": ' + '"' + "x" * 20 + '"}', window=8) == {"a": "x" * 20}


def test_large_containers_nested_too_deeply_are_refused() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        _json.loads("[" * 5000 + "]" * 5000, window=8)


def test_no_c_call_sees_more_than_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # What keeps the event loop running while a large header is parsed in a thread.
    seen: list[int] = []
    real_scanner, real_scanstring = json.scanner.make_scanner, json.decoder.scanstring  # type: ignore[attr-defined]

    def scanner(context: Any) -> Any:
        scan = real_scanner(context)

        def counted(text: str, at: int) -> Any:
            seen.append(len(text))
            return scan(text, at)

        return counted

    def scanstring(text: str, at: int) -> tuple[str, int]:
        seen.append(len(text))
        return real_scanstring(text, at)

    # The C functions of the standard library's json, which a parse takes as it starts.
    monkeypatch.setattr(json.scanner, "make_scanner", scanner)
    monkeypatch.setattr(json.decoder, "scanstring", scanstring)
    header = {
        "tensors": {f"w{i}": {"dtype": "F32", "shape": [i, 4], "crc32c": "0" * 8} for i in range(5000)},
        "tree": {"$": "dict", "items": [[i, {"$": "tensor", "n": f"t{i}"}] for i in range(5000)]},
        "blob": 'é\\"' * 100_000,
    }
    text = json.dumps(header)
    assert len(text) > 20 * _json.WINDOW
    assert _json.loads(text) == header
    assert seen and max(seen) <= _json.WINDOW + 2


def test_runs_of_members_are_parsed_a_window_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # One C call per member cost ~10 us of Python each: 0.6 s for a 1 MB list of
    # numbers, 15x json.loads. A run of members up to a comma is parsed in one call; a
    # comma inside a string or a member must never be taken for a cut.
    calls = 0
    real_scanner = json.scanner.make_scanner

    def scanner(context: Any) -> Any:
        scan = real_scanner(context)

        def counted(text: str, at: int) -> Any:
            nonlocal calls
            calls += 1
            return scan(text, at)

        return counted

    monkeypatch.setattr(json.scanner, "make_scanner", scanner)
    numbers = "[" + ",".join(["0"] * 500_000) + "]"
    assert _json.loads(numbers) == [0] * 500_000
    assert calls < 4 * len(numbers) // _json.WINDOW  # not one a member
    # Members that hold lists of their own (an optimizer's state in a tree): a cut is
    # looked for by how members end ("]]}],["), not by a "],[" found inside each of them.
    calls = 0
    leaves = [[key, {"$": "tensor", "n": key}] for key in ("step", "exp_avg", "exp_avg_sq")]
    state = [[i, {"$": "dict", "items": leaves}] for i in range(20_000)]
    nested = json.dumps(state, separators=(",", ":"))
    assert _json.loads(nested) == state
    assert calls < 4 * len(nested) // _json.WINDOW, calls
    for value in [
        ["a,b", "c],[d", "e},{f", '\\",', '",', 1, 2],
        [[1, 2, [3, 4]], {"a,": [5, 6]}, "x", [7], {"b": {"c": 8}}] * 5,
        {"k,": "v,", "k2": [1, ","], "k3": {"x": "],"}, "k": 1},
        [1.5e-300, -(10**30), "\U0001f600,", [[[[",]"]]]]],
    ]:
        for separators in [(",", ":"), (", ", ": ")]:
            text = json.dumps(value, separators=separators)
            for damage in ["", "]", ",", '"']:
                damaged = text[: len(text) // 2] + damage + text[len(text) // 2 :]
                windowed = functools.partial(_json.loads, window=16)
                assert _outcome(windowed, damaged) == _outcome(json.loads, damaged), damaged
