"""What every rank of a large group reports at a save, without a group or a model.

The scale benchmark and tests (issue 42) drive the real commit with the reports a
llama-7B-shaped FSDP2 run would send: 291 parameters, each with AdamW's two moments
(873 DTensors), sharded ``Shard(0)`` over every rank (FSDP) or over groups of 64
ranks with the other mesh dimension replicated (HSDP-64), plus the plain leaves of
such a state (the optimizer's step counts, hyperparameters, each rank's RNG state).

The boxes come from ``aiosnap._format.shards.local_box``, the function a real save
uses, so a rank's report here is the one it would send.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from aiosnap._base.checksums import crc32c
from aiosnap._dist.messages import FileReport, ShardBox
from aiosnap._format.shards import Box

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 4096, 11008, 32000, 32


def llama7b_params() -> list[tuple[str, tuple[int, ...]]]:
    """The 291 parameters of llama-7B, by name and shape."""
    params: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        params += [(f"{p}.self_attn.{x}_proj.weight", (HIDDEN, HIDDEN)) for x in "qkvo"]
        params += [
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
        ]
    params += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return params


def dtensors() -> list[tuple[str, tuple[int, ...]]]:
    """The 873 DTensors of the state: each parameter and its two moments."""
    out = []
    for name, shape in llama7b_params():
        out.append((f"model.{name}", shape))
        out += [(f"optim.state.{name}.{m}", shape) for m in ("exp_avg", "exp_avg_sq")]
    return out


def _chunk(n: int, k: int, c: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``c`` of ``k`` of a dimension of ``n``: (offset, length)."""
    size = -(-n // k)
    start = min(c * size, n)
    return start, min(size, n - start)


@dataclass(frozen=True, slots=True)
class Layout:
    """How the DTensors are sharded: over ``shard`` ranks along dimension 0, replicated
    over ``size // shard`` groups (HSDP); ``shard == size`` is plain FSDP."""

    size: int
    shard: int

    def __post_init__(self) -> None:
        if self.size % self.shard:
            raise ValueError(f"{self.size} ranks do not split into groups of {self.shard}")

    def box(self, shape: tuple[int, ...], rank: int) -> Box | None:
        """The box ``rank`` stores of a DTensor of ``shape``: None if it stores none (it is
        not the first of its replica group, or its chunk is empty)."""
        if rank >= self.shard:  # replicas of the first group store nothing
            return None
        offset, length = _chunk(shape[0], self.shard, rank)
        if length == 0:
            return None
        return Box((offset, *[0] * (len(shape) - 1)), (length, *shape[1:]))

    def report(self, rank: int) -> FileReport:
        """What ``rank`` reports of its durable file."""
        shards = []
        for i, (path, shape) in enumerate(dtensors()):
            box = self.box(shape, rank)
            if box is not None:
                shards.append(
                    ShardBox(path, f"t{i}", "float32", list(shape), list(box.offsets), list(box.lengths))
                )
        size = sum(4 * _numel(b.lengths) for b in shards) + 65536
        return FileReport(
            False, f"{crc32c(str(rank).encode()):08x}", size, ["0", "00000000"], shards, leaves(rank)
        )

    def reports(self) -> Iterator[FileReport]:
        return (self.report(r) for r in range(self.size))


def leaves(rank: int) -> dict[str, str]:
    """Digests of the plain leaves: the same on every rank but the RNG states."""
    same = {f"optim.state.{name}.step": "tensor:float32:[]:3f800000" for name, _ in llama7b_params()}
    same.update(
        {f"optim.param_groups.0.{k}": _digest(v) for k, v in (("lr", 3e-4), ("eps", 1e-8), ("wd", 0.1))}
    )
    same["progress.step"] = _digest(1000)
    own = {
        f"rng.{k}": f"tensor:uint8:[5056]:{crc32c(f'{k}{rank}'.encode()):08x}"
        for k in ("torch", "numpy", "python")
    }
    return {**same, **own}


def _digest(value: object) -> str:
    return f"{crc32c(json.dumps(value).encode()):08x}"


def _numel(lengths: list[int]) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n
