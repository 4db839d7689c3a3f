"""The Hugging Face Trainer: ``AiosnapTrainer`` (or ``AiosnapTrainerMixin`` on a Trainer
subclass of your own).

A callback cannot take over the save (``on_save`` fires after the Trainer wrote
everything synchronously), so the mixin overrides ``_save_checkpoint`` and the loaders.
Each save captures the model's weights into ``checkpoint-N/model.safetensors`` (an aiosnap
file that is the safetensors file ``from_pretrained`` reads, with ``config.json`` beside it:
see ``_hf_export``) and the optimizer, scheduler, scaler and RNG states into
``checkpoint-N/state.aiosnap``, and returns; in the background both files are committed
into a temp directory (``.aiosnap-tmp-new-*-checkpoint-N``), ``trainer_state.json`` is
written durably beside them, and the directory is renamed to ``checkpoint-N`` once every
file in it is durable. Checkpoints of the earlier layout (the model inside
``state.aiosnap``) are still read. So ``train(resume_from_checkpoint=True)``, which takes the
highest-numbered ``checkpoint-N`` without checking it, only ever finds complete ones. A
re-save of an existing ``checkpoint-N`` moves the old one aside first; a process killed
between the two renames leaves it to be put back by the next ``train()``.
``save_total_limit`` rotates after that rename, deleting only directories aiosnap wrote;
``train()`` returns once every save is durable.

In a multi-process DDP run (torchrun), every rank saves its part of each ``checkpoint-N``
through a ``CheckpointManager`` on the run's group (``_group``): rank 0's file holds the
model, optimizer, scheduler and scaler, each rank's its own RNG states, and the step is
committed (its manifest) once every part is durable. See ``AiosnapTrainerMixin._group_save``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy
from transformers.training_args import ParallelMode

import aiosnap
from aiosnap._format.manifest import MANIFEST_NAME

from ._bridge import SyncWriter, check_options, run_sync
from ._files import (
    discard,
    is_aiosnap_dir,
    is_aiosnap_file,
    publish_dir,
    remove_dir,
    repair_publishes,
    sweep_temps,
    temp_dir,
    write_durably,
)
from ._group import GroupSaver, in_a_group, rank
from ._hf_export import MODEL_NAME, Export

__all__ = ["MODEL_NAME", "STATE_NAME", "AiosnapTrainer", "AiosnapTrainerMixin"]

logger = logging.getLogger(__name__)

STATE_NAME = "state.aiosnap"
"""The aiosnap file of a checkpoint directory's training state (and, in checkpoints of
the earlier layout, its model)."""
MARKERS = (STATE_NAME, MODEL_NAME)
"""A checkpoint directory is aiosnap's if one of these is an aiosnap file
(``save_only_model`` writes no ``state.aiosnap``)."""
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
#: What the main process alone saves in the Trainer's own format: written once, by rank 0.
_REPLICATED = ("model", "optimizer", "scheduler", "scaler")
_SUPPORTED = (ParallelMode.NOT_PARALLEL, ParallelMode.NOT_DISTRIBUTED, ParallelMode.DISTRIBUTED)

if TYPE_CHECKING:
    _Base = Trainer
else:
    _Base = object


class AiosnapTrainerMixin(_Base):
    """Saves and loads a ``transformers.Trainer``'s checkpoints through aiosnap (see the
    module docstring). ``aiosnap_options`` are ``aiosnap.QueueWriter``'s (``max_pending``,
    ``when_full``, ``offload``, ``max_host_bytes``, ``allow_pickle``).

    One process, or several in a DDP run (torchrun); not DeepSpeed, FSDP, XLA or SageMaker
    (``train`` raises NotImplementedError for them, naming what to use). A directory of
    the Trainer's own format is still read, by the Trainer's own loaders.
    """

    def __init__(self, *args: Any, aiosnap_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._aiosnap = SyncWriter(**check_options(aiosnap_options))
        #: Checkpoint directories accepted but maybe not published yet.
        self._aiosnap_dirs: set[str] = set()
        self._aiosnap_options = check_options(aiosnap_options)
        self._aiosnap_group: GroupSaver | None = None
        #: A multi-process resume: the folder handed to the Trainer (its trainer_state.json
        #: only) and this rank's part of the checkpoint it stands for.
        self._aiosnap_view: tuple[str, dict[str, Any]] | None = None
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, returning once every checkpoint it saved is durable.
        First puts back a checkpoint whose re-save was cut short (in the output directory,
        and the one named by ``resume_from_checkpoint``), then sweeps temp directories."""
        self._aiosnap_check()
        if self._aiosnap_multi:
            return self._group_train(resume_from_checkpoint, *args, **kwargs)
        if isinstance(resume_from_checkpoint, str):
            repair_publishes(*os.path.split(os.path.abspath(resume_from_checkpoint)))
        if self.args.should_save and self.args.output_dir is not None:
            sweep_temps(self.args.output_dir, MARKERS)
        if not self._aiosnap.is_open:  # max_pending counts checkpoints, of two files each
            self._aiosnap.files_per_save = 1 if self.args.save_only_model else 2
        self._aiosnap.open()
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            try:
                self._aiosnap.close()
            except Exception:
                logger.exception("a background checkpoint save failed too")
            raise
        self._aiosnap.close()
        return output

    def _aiosnap_check(self) -> None:
        unsupported = [
            name
            for name, on in (
                ("DeepSpeed", self.is_deepspeed_enabled),
                ("FSDP", self.is_fsdp_enabled),
                (str(self.args.parallel_mode.value), self.args.parallel_mode not in _SUPPORTED),
            )
            if on
        ]
        if unsupported:
            raise NotImplementedError(
                f"AiosnapTrainer does not save {unsupported} runs (it saves one process and multi-process "
                "DDP); use transformers.Trainer for this run, or aiosnap.integrations.dcp to save a "
                "model's sharded state"
            )

    @property
    def _aiosnap_multi(self) -> bool:
        return self.args.world_size > 1 and in_a_group()

    def _group_train(self, resume_from_checkpoint: str | bool | None, *args: Any, **kwargs: Any) -> Any:
        """``train`` in a multi-process run. A resume reads this rank's part of the newest
        step the group committed (or of the step directory given) on every rank, and hands
        the Trainer a folder of this process holding that step's ``trainer_state.json``
        (the step directory holds only the group's files); the loaders read the rest from
        the part. Returns once the group committed every save, or raises its failure."""
        if self.args.load_best_model_at_end:
            raise NotImplementedError(
                "load_best_model_at_end is not supported by a multi-process AiosnapTrainer (its "
                "save_total_limit keeps the newest steps, not the best): load the best step after "
                "training with aiosnap.load(step_directory, rank=0)"
            )
        saver = self._group_saver()
        try:
            if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
                resume_from_checkpoint = self._group_resume(saver, resume_from_checkpoint)
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            self._aiosnap_group = None
            try:
                saver.close()
            except Exception:
                logger.exception("a background checkpoint save failed too")
            raise
        finally:
            if self._aiosnap_view is not None:
                shutil.rmtree(self._aiosnap_view[0], ignore_errors=True)  # this process's own
                self._aiosnap_view = None
        self._aiosnap_group = None
        saver.close()
        return output

    def _group_saver(self) -> GroupSaver:
        if self._aiosnap_group is None:
            limit = self.args.save_total_limit
            self._aiosnap_group = GroupSaver(
                os.path.abspath(self.args.output_dir or "."),
                f"{PREFIX_CHECKPOINT_DIR}-{{step}}",
                keep=limit if limit is not None and limit > 0 else None,
                replicated=_REPLICATED,
                options=self._aiosnap_options,
            )
        return self._aiosnap_group

    def _group_resume(self, saver: GroupSaver, checkpoint: str | bool) -> str | bool:
        if isinstance(checkpoint, str) and not os.path.isfile(os.path.join(checkpoint, MANIFEST_NAME)):
            return checkpoint  # the Trainer's own format, read by its own loaders
        if isinstance(checkpoint, str):
            pickles = self._aiosnap.allow_pickle
            part = run_sync(aiosnap.load, checkpoint, rank=rank(), map_location="cpu", allow_pickle=pickles)
        else:
            restored = saver.restore()
            if restored is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            part = restored.state
        view = tempfile.mkdtemp(prefix="aiosnap-resume-")
        with open(os.path.join(view, TRAINER_STATE_NAME), "w") as f:
            f.write(part.pop("trainer_state"))
        self._aiosnap_view = (view, part)
        return view

    # -- saving ---------------------------------------------------------------------------
    def _group_save(self, run_dir: str) -> None:
        """Every rank's part of ``checkpoint-N`` (see the module docstring): the Trainer's
        own split, the main process's model and optimizer once and each rank's RNG states,
        with ``trainer_state.json`` held in the files, committed by the group."""
        if self.args.save_only_model or run_dir != os.path.abspath(self.args.output_dir or "."):
            raise NotImplementedError(
                "a multi-process AiosnapTrainer saves the whole training state into output_dir: "
                "save_only_model and hyperparameter-search trials are not supported there"
            )
        assert self.model is not None
        assert self.optimizer is not None
        assert self.lr_scheduler is not None
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict(),
            "rng": _rng_states(),
        }
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        self._aiosnap_export_callbacks()
        state["trainer_state"] = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        self._group_saver().save(self.state.global_step, state)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, name)
        self._aiosnap_track_best(run_dir)
        if self._aiosnap_multi:
            self._group_save(run_dir)
            return
        if not self.args.should_save:
            return
        assert self.model is not None
        export = Export.of(self)
        state: dict[str, Any] = {} if export.weights is not None else {"model": self.model.state_dict()}
        if not self.args.save_only_model:
            assert self.optimizer is not None
            assert self.lr_scheduler is not None
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = _rng_states()
        self._aiosnap_export_callbacks()
        trainer_state = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        tmp = temp_dir(run_dir, name)
        try:
            export.write_config(tmp)
        except BaseException:
            discard(tmp)
            raise
        # The larger file first: the second one's copy overlaps the first one's commit.
        files = [(os.path.join(tmp, STATE_NAME), state)] if state else []
        if export.weights is not None:
            files.append((os.path.join(tmp, MODEL_NAME), export.weights))
        publish = functools.partial(
            self._aiosnap_publish, tmp, output_dir, trainer_state, run_dir, self.state.best_model_checkpoint
        )
        self._aiosnap_dirs.add(output_dir)
        self._aiosnap.save_files(files, then=publish, on_failure=functools.partial(discard, tmp))
        if self.args.push_to_hub:
            self._aiosnap.flush()  # the upload reads the directory: it must be there
            self._push_from_checkpoint(output_dir)

    def _aiosnap_track_best(self, run_dir: str) -> None:
        """As the Trainer does before it saves; a best checkpoint still being committed counts."""
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if self.args.save_strategy in strategies and self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best) or best in self._aiosnap_dirs:
                self.state.best_model_checkpoint = best

    def _aiosnap_export_callbacks(self) -> None:
        """The Trainer's own update of ``ExportableState`` callbacks before it saves its state."""
        from transformers.trainer_callback import ExportableState

        exported: Any = self.state.stateful_callbacks  # a dict, whatever its annotation says
        for cb in [
            c for c in [*self.callback_handler.callbacks, self.control] if isinstance(c, ExportableState)
        ]:
            name = cb.__class__.__name__
            if isinstance(exported[name], list):
                exported[name].append(cb.state())
            else:
                exported[name] = cb.state()

    def _aiosnap_publish(
        self, tmp: str, final: str, trainer_state: str, run_dir: str, best: str | None
    ) -> None:
        """In the background, once the aiosnap files are durable: the Trainer's state file,
        the rename into place (every file made durable first), then rotation."""
        try:
            write_durably(os.path.join(tmp, TRAINER_STATE_NAME), trainer_state.encode())
            publish_dir(tmp, final, MARKERS)
        except BaseException:
            discard(tmp)
            raise
        _rotate(run_dir, self.args.save_total_limit, best)

    def flush(self) -> None:
        """Wait until every checkpoint saved so far is published (durable, in place);
        raise the first failure not reported yet."""
        self._aiosnap.flush()
        if self._aiosnap_group is not None:
            self._aiosnap_group.flush()

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self._aiosnap.flush()  # the best model is loaded from a published directory
        return super()._finalize_training(*args, **kwargs)  # type: ignore[no-untyped-call]

    # -- loading ---------------------------------------------------------------------------
    def _aiosnap_load(self, checkpoint: str, key: str) -> Any:
        """``key`` of the checkpoint's ``state.aiosnap`` (of this rank's part, for a
        multi-process resume); None where that part was not saved."""
        if self._aiosnap_view is not None and checkpoint == self._aiosnap_view[0]:
            return self._aiosnap_view[1].get(key)
        path = os.path.join(checkpoint, STATE_NAME)
        if not os.path.isfile(path):
            return None  # save_only_model: the weights only
        try:
            part = run_sync(
                aiosnap.load, path, keys=[key], map_location="cpu", allow_pickle=self._aiosnap.allow_pickle
            )
        except aiosnap.errors.CheckpointKeyError:
            return None
        return part[key]

    def _aiosnap_model(self, checkpoint: str) -> Any:
        """The model's state dict: ``model.safetensors`` (read and verified by aiosnap), or
        the ``model`` of ``state.aiosnap`` in a checkpoint of the earlier layout."""
        path = os.path.join(checkpoint, MODEL_NAME)
        if not os.path.isfile(path) or self._aiosnap_ours(checkpoint) == "view":
            return self._aiosnap_load(checkpoint, "model")
        return run_sync(aiosnap.load, path, map_location="cpu", allow_pickle=self._aiosnap.allow_pickle)

    def _aiosnap_ours(self, checkpoint: str) -> str | bool:
        """Whether aiosnap wrote ``checkpoint`` ("view": a multi-process resume's folder)."""
        if self._aiosnap_view is not None and checkpoint == self._aiosnap_view[0]:
            return "view"
        return _ours(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._aiosnap_ours(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        model = self.model if model is None else model
        logger.info("Loading model from %s.", resume_from_checkpoint)
        result = model.load_state_dict(self._aiosnap_model(resume_from_checkpoint), False)
        self._issue_warnings_after_load(result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._aiosnap_ours(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer = self._aiosnap_load(checkpoint, "optimizer")
        if optimizer is not None:
            assert self.optimizer is not None
            assert self.lr_scheduler is not None
            self.optimizer.load_state_dict(optimizer)
            self.lr_scheduler.load_state_dict(self._aiosnap_load(checkpoint, "scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._aiosnap_ours(checkpoint):
            super()._load_scaler(checkpoint)
            return
        scaler = self._aiosnap_load(checkpoint, "scaler")
        if scaler is not None:
            self.accelerator.scaler.load_state_dict(scaler)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._aiosnap_ours(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        states = self._aiosnap_load(checkpoint, "rng")
        if states is None:
            logger.info("Didn't find an RNG state, reproducibility is not guaranteed.")
            return
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.random.set_rng_state(states["cuda"])

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not self._aiosnap_ours(best):
            super()._load_best_model()
            return
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        assert self.model is not None
        result = self.model.load_state_dict(self._aiosnap_model(best), False)
        self._issue_warnings_after_load(result)


class AiosnapTrainer(AiosnapTrainerMixin, Trainer):
    """``transformers.Trainer`` saving its checkpoints through aiosnap: construct it as a
    Trainer, plus ``aiosnap_options`` (see ``AiosnapTrainerMixin``)."""


def _rng_states() -> dict[str, Any]:
    """The generators the Trainer saves for one process (``Trainer._save_rng_state``)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state()
    return states


def _ours(checkpoint: str) -> bool:
    """Whether aiosnap wrote ``checkpoint`` (the Trainer's own checkpoints hold a
    ``model.safetensors`` too, a plain one, and no ``state.aiosnap``)."""
    return os.path.isfile(os.path.join(checkpoint, STATE_NAME)) or is_aiosnap_file(
        os.path.join(checkpoint, MODEL_NAME)
    )


def _rotate(run_dir: str, limit: int | None, best: str | None) -> None:
    """The Trainer's ``rotate_checkpoints`` (by step), over directories aiosnap wrote only."""
    if not limit or limit <= 0:
        return
    found = []
    for name in os.listdir(run_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(run_dir, name)
        if match and is_aiosnap_dir(path, MARKERS):
            found.append((int(match.group(1)), path))
    found.sort()
    if len(found) <= limit:
        return
    protected = {found[-1][1]}
    if best is not None:
        protected.add(os.path.normpath(best))
    keep, remaining = max(limit, len(protected)), len(found)
    for _step, path in found:
        if remaining <= keep:
            break
        if os.path.normpath(path) in protected:
            continue
        logger.info("Deleting older checkpoint [%s] due to args.save_total_limit", path)
        remove_dir(path, MARKERS)
        remaining -= 1
