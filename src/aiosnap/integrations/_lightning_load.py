"""Reading an aiosnap ``.ckpt`` outside the Trainer, for both Lightning packages: a
module built from it (``load_module``, and ``LoadMixinBehaviour``, which makes the
class method users call, ``MyModule.load_from_checkpoint(path)``, read aiosnap files),
and its weights exported to a plain safetensors file (``export_safetensors``)."""

from __future__ import annotations

import importlib
import os
from typing import Any, ClassVar, Self, TypeVar

import torch

import aiosnap

from .._base import offload
from .._base.errors import ForeignFileError
from .._cli.safetensors import write_safetensors
from ._bridge import run_sync
from ._files import is_aiosnap_file
from ._lightning_io import map_location_of, settle

M = TypeVar("M")


def load_module(
    framework: str,
    cls: type[M],
    checkpoint_path: str | os.PathLike[str],
    map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    allow_pickle: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> M:
    """What Lightning's ``load_from_checkpoint`` does (``core.saving._load_from_checkpoint``
    of package ``framework``) once it has the checkpoint dict, which comes from aiosnap:
    migrated to this Lightning version, ``hyper_parameters`` replaced by ``hparams_file``
    and updated by ``kwargs``, the module built by Lightning's ``_load_state`` and moved
    to the device of the saved tensors."""
    pl = importlib.import_module(framework)
    saving = importlib.import_module(f"{framework}.core.saving")
    migration = importlib.import_module(f"{framework}.utilities.migration.utils")
    kwargs = dict(kwargs or {})
    path = os.fspath(checkpoint_path)
    settle(path)
    checkpoint = run_sync(
        aiosnap.load, path, map_location=map_location_of(map_location), allow_pickle=allow_pickle
    )
    checkpoint = migration._pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY  # type: ignore[attr-defined]
    if hparams_file is not None:
        checkpoint[key] = _hparams(saving, os.fspath(hparams_file))
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        datamodule: M = saving._load_state(cls, checkpoint, **kwargs)
        return datamodule
    module: M = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = [t for t in checkpoint["state_dict"].values() if isinstance(t, torch.Tensor)]
    if not tensors:
        pl.utilities.rank_zero.rank_zero_warn(f"The state dict in {path!r} contains no parameters.")
        return module
    moved: M = module.to(tensors[0].device)  # type: ignore[attr-defined]
    return moved


def _hparams(saving: Any, hparams_file: str) -> Any:
    extension = hparams_file.rsplit(".", 1)[-1].lower()
    if extension == "csv":
        return saving.load_hparams_from_tags_csv(hparams_file)
    if extension in ("yml", "yaml"):
        return saving.load_hparams_from_yaml(hparams_file)
    raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")


class LoadMixinBehaviour:
    """``load_from_checkpoint`` that reads an aiosnap checkpoint through aiosnap and any
    other file through Lightning's own; see ``aiosnap.integrations.lightning.AiosnapLoadMixin``."""

    #: The Lightning package of the module classes it is mixed into: set by each twin.
    framework: ClassVar[str]

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: str | os.PathLike[str] | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """Lightning's ``load_from_checkpoint``, same arguments. An aiosnap file is read
        through aiosnap, its checksums verified; it unpickles nothing unless
        ``weights_only=False`` (Lightning's own opt-in to unpickling) and the file holds
        pickled values. Anything else (a ``torch.save`` file, a URL, a file object) goes
        to Lightning's, which calls ``torch.load``."""
        local = isinstance(checkpoint_path, str | os.PathLike)
        if local:
            settle(checkpoint_path)  # a save of it still committing: read once durable
        if local and is_aiosnap_file(os.fspath(checkpoint_path)):
            return load_module(
                cls.framework,
                cls,
                checkpoint_path,
                map_location,
                hparams_file,
                strict,
                weights_only is False,
                kwargs,
            )
        lightning: Any = super()
        loaded: Self = lightning.load_from_checkpoint(
            checkpoint_path,
            map_location=map_location,
            hparams_file=hparams_file,
            strict=strict,
            weights_only=weights_only,
            **kwargs,
        )
        return loaded


def export_safetensors(
    checkpoint_path: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    key: str = "state_dict",
    strip_prefix: str = "",
    allow_pickle: bool = False,
    overwrite: bool = False,
) -> list[str]:
    """Write the weights of a Lightning checkpoint (its ``state_dict``, or the entry
    ``key``) to ``dst`` as a plain safetensors file: one tensor per name, ``"format":
    "pt"`` in its metadata, as ``safetensors.torch.load_file`` and ``from_pretrained``
    expect; durable and atomic. ``strip_prefix`` is taken off the names that start with
    it (``"model."`` for a module wrapping a Hugging Face model). A weight tied to another
    is written under each name. Only the weights are read. An existing ``dst`` is
    refused unless ``overwrite``; a ``torch.save`` checkpoint needs ``allow_pickle``
    (``torch.load`` runs its pickled code). Returns the names written, in order."""
    path, out = os.fspath(checkpoint_path), os.fspath(dst)
    settle(path)
    if os.path.lexists(out) and not overwrite:
        raise ForeignFileError(out, "an existing file (pass overwrite=True to replace it)")
    loaded = run_sync(aiosnap.load, path, keys=[key], map_location="cpu", allow_pickle=allow_pickle)
    weights = _named_tensors(loaded[key], strip_prefix)
    run_sync(offload.run_io, write_safetensors, out, weights)
    return list(weights)


def _named_tensors(state: Any, strip_prefix: str) -> dict[str, torch.Tensor]:
    """``state``'s tensors by name, a prefix stripped; a tensor met twice (tied) copied,
    so that each name has its own entry in the file."""
    seen: set[int] = set()
    named: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        if name in named:
            raise ValueError(f"two weights are named {name!r} once {strip_prefix!r} is stripped")
        named[name] = value.clone() if id(value) in seen else value
        seen.add(id(value))
    return named
