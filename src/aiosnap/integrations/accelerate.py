"""Accelerate: ``AiosnapAccelerator``, an ``accelerate.Accelerator`` whose ``save_state``
and ``load_state`` go through aiosnap.

Accelerate's pre-hooks can take over the model weights only; the optimizer (about two
thirds of an Adam state) would still be ``torch.save``\\ d synchronously. So
``save_state`` is replaced whole: it captures the models, optimizers, schedulers,
stateful data loaders, scaler, RNG states and registered objects into one aiosnap file
and returns the checkpoint's directory, which appears -- renamed from a temp directory
(``.aiosnap-tmp-*``) in the same parent -- once every file in it is durable. A save into
an existing folder renames the old one aside, then the new one into place: a process
killed between the two leaves the old one aside, put back by the next ``load_state`` or
``save_state``.
``total_limit`` deletes old folders only after the new one is durable, and only folders
aiosnap wrote. ``load_state()`` takes the newest complete checkpoint (an older one if the
newest fails its checksums) and restores the naming counter, so the next ``save_state``
gets a fresh name. ``end_training()`` waits for every pending save.

In a multi-process DDP run every rank saves its part of each ``checkpoint_N`` through a
``CheckpointManager`` on the run's group, which commits it once every part is durable
(see ``_group_save`` and ``_group``).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

import aiosnap
from aiosnap._format.manifest import MANIFEST_NAME

from ._bridge import SyncWriter, check_options, run_sync
from ._files import (
    discard,
    is_aiosnap_dir,
    publish_dir,
    remove_dir,
    repair_publishes,
    sweep_temps,
    temp_dir,
)
from ._group import GroupSaver, in_a_group, rank

__all__ = ["STATE_NAME", "AiosnapAccelerator"]

logger = logging.getLogger(__name__)

STATE_NAME = "state.aiosnap"
"""The aiosnap file of a checkpoint directory."""
_FOLDER = re.compile(r"^checkpoint_(\d+)$")
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
#: What the main process alone saves in Accelerate's own format: written once, by rank 0.
_REPLICATED = ("models", "optimizers", "schedulers", "scaler", "custom")


class AiosnapAccelerator(Accelerator):  # type: ignore[misc]  # accelerate ships no types
    """An ``accelerate.Accelerator`` checkpointing through aiosnap (see the module
    docstring). ``aiosnap_options`` are ``aiosnap.QueueWriter``'s (``max_pending``,
    ``when_full``, ``offload``, ``max_host_bytes``, ``allow_pickle``); every other
    argument is Accelerator's.

    One process, or several in a DDP run (``MULTI_CPU``, ``MULTI_GPU``: see
    ``_group_save``); not DeepSpeed, FSDP, Megatron-LM or XLA (``save_state`` raises
    NotImplementedError for them, naming what to use). A folder of Accelerate's own format
    is still read by ``load_state``, through Accelerator's own code.
    """

    def __init__(self, *args: Any, aiosnap_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._aiosnap = SyncWriter(**check_options(aiosnap_options))
        #: Checkpoint folders accepted but maybe not published yet.
        self._aiosnap_dirs: set[str] = set()
        self._aiosnap_swept: set[str] = set()
        self._aiosnap_options = check_options(aiosnap_options)
        self._aiosnap_group: GroupSaver | None = None

    def _aiosnap_check(self) -> None:
        if self.distributed_type not in _SUPPORTED:
            raise NotImplementedError(
                f"AiosnapAccelerator does not save {self.distributed_type} runs (it saves one process "
                "and multi-process DDP: NO, MULTI_CPU, MULTI_GPU); use accelerate.Accelerator's own "
                "save_state for this run, or aiosnap.integrations.dcp to save its sharded state"
            )

    @property
    def _aiosnap_multi(self) -> bool:
        return self.num_processes > 1 and in_a_group()

    # -- saving ---------------------------------------------------------------------------
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Path:
        """Capture the state and return the directory it will appear as, once durable.
        ``safe_serialization`` and ``kwargs`` (DeepSpeed's) have nothing to choose here."""
        self._aiosnap_check()
        if self._aiosnap_multi:
            return self._group_save(output_dir)
        final = self._aiosnap_target(output_dir)
        parent, name = os.path.split(final)
        if parent not in self._aiosnap_swept:
            self._aiosnap_swept.add(parent)
            sweep_temps(parent, STATE_NAME)
        tmp = temp_dir(parent, name)
        weights = [self.get_state_dict(model, unwrap=False) for model in self._models]
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, weights, tmp)  # files a hook writes there are published with it
        limit = self.project_configuration.total_limit if self._naming else None
        self._aiosnap.save(
            os.path.join(tmp, STATE_NAME),
            self._aiosnap_state(weights),
            then=functools.partial(_publish, tmp, final, limit),
            on_failure=functools.partial(discard, tmp),
        )
        self._aiosnap_dirs.add(final)
        self.project_configuration.iteration += 1
        return Path(final)

    def _aiosnap_state(self, weights: list[Any]) -> dict[str, Any]:
        """What a checkpoint holds (of this process, in a multi-process run)."""
        return {
            "models": weights,
            "optimizers": [opt.state_dict() for opt in self._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in self._schedulers],
            "dataloaders": [
                dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
                for dl in self._dataloaders
            ],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": _rng_states(self.step),
            "custom": [obj.state_dict() for obj in self._custom_objects],
        }

    def _group_save(self, output_dir: str | None) -> Path:
        """A multi-process run: every rank saves its part of ``checkpoint_N`` through the
        group's manager (``_group``). The main process's models, optimizers, schedulers,
        scaler and registered objects are written once, by rank 0; each rank's RNG states
        and data loaders' positions are its own. The step commits once every rank's part
        is durable; ``total_limit`` keeps the newest committed ones."""
        if not self._naming or output_dir is not None:
            raise ValueError(
                "a multi-process AiosnapAccelerator saves with automatic checkpoint naming only: pass "
                "ProjectConfiguration(automatic_checkpoint_naming=True) and call save_state() without "
                "a folder (each step is a directory the whole group commits)"
            )
        if self._save_model_state_pre_hook:
            raise NotImplementedError(
                "save_state pre-hooks are not run in a multi-process AiosnapAccelerator (the "
                "checkpoint directory is the group's): save what the hook writes as a registered object"
            )
        saver = self._group_saver()
        step = self.save_iteration
        saver.save(step, self._aiosnap_state([self.get_state_dict(m, unwrap=False) for m in self._models]))
        self.project_configuration.iteration += 1
        return Path(saver.directory, f"checkpoint_{step}")

    def _group_saver(self) -> GroupSaver:
        if self._aiosnap_group is None:
            limit = self.project_configuration.total_limit
            self._aiosnap_group = GroupSaver(
                os.path.join(os.path.abspath(self.project_dir), "checkpoints"),
                "checkpoint_{step}",
                keep=limit if limit is not None and limit > 0 else None,
                replicated=_REPLICATED,
                options=self._aiosnap_options,
            )
        return self._aiosnap_group

    @property
    def _naming(self) -> bool:
        return bool(self.project_configuration.automatic_checkpoint_naming)

    def _aiosnap_target(self, output_dir: str | None) -> str:
        if not self._naming:
            if output_dir is None:
                raise ValueError("save_state needs an output_dir where automatic checkpoint naming is off")
            return os.path.abspath(os.path.expanduser(output_dir))
        final = os.path.join(
            os.path.abspath(self.project_dir), "checkpoints", f"checkpoint_{self.save_iteration}"
        )
        if os.path.exists(final) or final in self._aiosnap_dirs:
            raise ValueError(
                f"Checkpoint directory {final} ({self.save_iteration}) already exists. Please manually "
                "override `self.save_iteration` with what iteration to start with."
            )
        return final

    def flush(self) -> None:
        """Wait until every checkpoint saved so far is published (durable, in place);
        raise the first failure not reported yet."""
        self._aiosnap.flush()
        if self._aiosnap_group is not None:
            self._aiosnap_group.flush()

    def end_training(self) -> None:
        """Wait for every pending save (raising a failure), then Accelerator's own."""
        group, self._aiosnap_group = self._aiosnap_group, None
        try:
            self._aiosnap.close()
        finally:
            try:
                if group is not None:
                    group.close()
            finally:
                super().end_training()

    # -- loading ---------------------------------------------------------------------------
    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Restore the newest complete checkpoint (or ``input_dir``), verifying checksums,
        and set the naming counter past every existing checkpoint."""
        self._aiosnap.flush()  # a pending save is loaded only once it is published
        if self._aiosnap_multi:
            self._group_load(input_dir, load_kwargs, kwargs)
            return
        if input_dir is not None:
            input_dir = os.path.expanduser(input_dir)
            repair_publishes(*os.path.split(os.path.abspath(input_dir)))  # a save into it cut short
            if not os.path.isdir(input_dir):
                raise ValueError(f"Tried to find {input_dir} but folder does not exist")
            if not os.path.isfile(os.path.join(input_dir, STATE_NAME)):
                super().load_state(input_dir, load_kwargs, **kwargs)  # Accelerate's own format
                return
            self._aiosnap_restore(input_dir, kwargs)
        elif self._naming:
            self._aiosnap_restore_newest(kwargs)
        else:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        if self._naming:
            numbers = [n for n, _ in _folders(os.path.join(self.project_dir, "checkpoints"), ours=False)]
            self.project_configuration.iteration = max(numbers, default=-1) + 1

    def _aiosnap_restore_newest(self, kwargs: dict[str, Any]) -> None:
        repair_publishes(os.path.join(self.project_dir, "checkpoints"))
        found = _folders(os.path.join(self.project_dir, "checkpoints"), ours=True)
        for _number, folder in reversed(found):
            try:
                self._aiosnap_restore(folder, dict(kwargs))
                return
            except aiosnap.errors.CorruptCheckpointError as exc:
                logger.warning("load_state skips %s: %s", folder, exc)
        raise aiosnap.errors.CheckpointNotFoundError(
            os.path.join(self.project_dir, "checkpoints"), "no complete aiosnap checkpoint to load"
        )

    def _group_load(
        self, input_dir: str | None, load_kwargs: dict[str, Any] | None, kwargs: dict[str, Any]
    ) -> None:
        """A multi-process run: every rank reads its part of the newest step the group
        committed (of ``input_dir``, a step directory, if given): rank 0's replicated
        state and its own RNG states."""
        saver = self._group_saver()
        saver.flush()
        if input_dir is None:
            if not self._naming:
                raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
            restored = saver.restore()
            if restored is None:
                raise aiosnap.errors.CheckpointNotFoundError(
                    saver.directory, "no committed aiosnap checkpoint to load"
                )
            directory, state = restored.path, restored.state
        elif not os.path.isfile(os.path.join(input_dir, MANIFEST_NAME)):
            super().load_state(input_dir, load_kwargs, **kwargs)  # Accelerate's own
            return
        else:
            directory = os.path.abspath(os.path.expanduser(input_dir))
            state = run_sync(
                aiosnap.load,
                directory,
                rank=rank(),
                map_location="cpu",
                allow_pickle=self._aiosnap.allow_pickle,
            )
        self._aiosnap_apply(directory, state, kwargs)
        if self._naming:
            self.project_configuration.iteration = max(saver.steps(), default=-1) + 1

    def _aiosnap_restore(self, directory: str, kwargs: dict[str, Any]) -> None:
        state = run_sync(
            aiosnap.load,
            os.path.join(directory, STATE_NAME),
            map_location="cpu",
            allow_pickle=self._aiosnap.allow_pickle,
        )
        self._aiosnap_apply(directory, state, kwargs)

    def _aiosnap_apply(self, directory: str, state: dict[str, Any], kwargs: dict[str, Any]) -> None:
        logger.info("Loading states from %s", directory)
        for hook in self._load_model_state_pre_hook.values():
            hook(self._models, directory)
        kwargs.pop("map_location", None)  # read to the CPU; load_state_dict moves the state
        _check_counts(directory, state, self)
        for model, weights in zip(self._models, state["models"], strict=True):
            model.load_state_dict(weights, **kwargs)
        for opt, saved in zip(self._optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        for scheduler, saved in zip(self._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        for dl, saved in zip(self._dataloaders, state["dataloaders"], strict=False):
            if saved is not None and getattr(dl, "use_stateful_dataloader", False):
                dl.load_state_dict(saved)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step = _set_rng_states(state["rng"])
        for obj, saved in zip(self._custom_objects, state["custom"], strict=True):
            obj.load_state_dict(saved)


def _check_counts(directory: str, state: dict[str, Any], accelerator: Any) -> None:
    """What the checkpoint holds must match what is registered, as Accelerate checks."""
    pairs = {
        "models": accelerator._models,
        "optimizers": accelerator._optimizers,
        "schedulers": accelerator._schedulers,
        "custom": accelerator._custom_objects,
    }
    for key, registered in pairs.items():
        if len(state[key]) != len(registered):
            raise ValueError(
                f"{directory} holds {len(state[key])} {key} but {len(registered)} are registered: load "
                "a checkpoint saved with the same set of prepared and registered objects"
            )


def _rng_states(step: int) -> dict[str, Any]:
    """The generators Accelerate saves for one process (``save_accelerator_state``)."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> int:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    step: int = states["step"]
    return step


def _folders(parent: str, *, ours: bool) -> list[tuple[int, str]]:
    """The ``checkpoint_N`` folders of ``parent`` by number (only aiosnap's if ``ours``)."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _FOLDER.match(name)
        path = os.path.join(parent, name)
        if match and os.path.isdir(path) and (not ours or is_aiosnap_dir(path, STATE_NAME)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _publish(tmp: str, final: str, limit: int | None) -> None:
    """In the background, once the state file is durable: the rename into place, then
    ``total_limit`` over the folders aiosnap wrote, the new one included."""
    try:
        publish_dir(tmp, final, STATE_NAME)
    except BaseException:
        discard(tmp)
        raise
    if limit is None or limit <= 0:
        return
    found = _folders(os.path.dirname(final), ours=True)
    for _number, folder in found[: max(0, len(found) - limit)]:
        remove_dir(folder, STATE_NAME)
