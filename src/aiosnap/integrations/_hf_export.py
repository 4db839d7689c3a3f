"""What makes an ``AiosnapTrainer`` checkpoint one that ``from_pretrained`` reads: the
model's weights as ``model.safetensors`` under the names ``save_pretrained`` gives them,
with the ``config.json`` (and ``generation_config.json``) it writes beside them.

aiosnap's file format is safetensors (docs/format.md), so the weights file is an aiosnap
file: checksummed, committed durably in the background like every other, and read by
safetensors and ``from_pretrained`` as their own. Its entries are the state dict's keys
less the tied copies ``save_pretrained`` leaves out (``lm_head.weight`` of a model that
ties it to its input embeddings): the name kept is the one ``from_pretrained`` expects.

A model whose weights ``save_pretrained`` would rewrite on the way out (a conversion
mapping: fused experts, renamed prefixes), a quantized one or one with adapters loaded
has no export here: its checkpoints keep the model inside ``state.aiosnap``, as before
(say so once), and ``trainer.save_model()`` exports it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict
from transformers.utils import SAFE_WEIGHTS_NAME

logger = logging.getLogger(__name__)

MODEL_NAME: str = SAFE_WEIGHTS_NAME
"""The weights file of a checkpoint directory, ``model.safetensors``."""

#: Per model: whether its state dict is what ``save_pretrained`` writes (decided once).
_exportable: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class Export:
    """One save's model part."""

    #: The state dict to write as ``model.safetensors``; None: it goes into ``state.aiosnap``.
    weights: dict[str, Any] | None
    #: The model whose configuration goes beside it (None: a model that is not a
    #: ``PreTrainedModel``, whose state dict alone the Trainer writes too).
    model: PreTrainedModel | None

    @classmethod
    def of(cls, trainer: Any) -> Export:
        """``trainer``'s model, as its own ``save_model`` would write it."""
        state_dict: dict[str, Any] = trainer.model.state_dict()
        model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
        if not isinstance(model, PreTrainedModel):
            return cls(state_dict, None)
        if not _is_exportable(model, state_dict):
            return cls(None, None)
        for key in model._keys_to_ignore_on_save or ():
            state_dict.pop(key, None)
        return cls(remove_tied_weights_from_state_dict(state_dict, model), model)

    def write_config(self, directory: str) -> None:
        """``save_pretrained``'s configuration files, into ``directory`` (small files; the
        publish makes every file of the directory durable before its rename)."""
        model = self.model
        if model is None:
            return
        # What save_pretrained records of the model before it writes the config.
        model.config.dtype = str(model.dtype).split(".")[1]
        model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
        model.config.save_pretrained(directory)
        if model.can_generate():
            model.generation_config.save_pretrained(directory)


def _is_exportable(model: PreTrainedModel, state_dict: dict[str, Any]) -> bool:
    known = _exportable.get(model)
    if known is None:
        reason = _why_not(model, state_dict)
        if reason is not None:
            logger.warning(
                "%s: %s; its checkpoints keep the model inside state.aiosnap (from_pretrained does "
                "not read them: trainer.save_model() exports it)",
                type(model).__name__,
                reason,
            )
        known = _exportable[model] = reason is None
    return known


def _why_not(model: PreTrainedModel, state_dict: dict[str, Any]) -> str | None:
    """Why ``model``'s state dict is not what ``save_pretrained`` writes; None if it is."""
    if getattr(model, "hf_quantizer", None) is not None:
        return "a quantized model"
    if getattr(model, "_hf_peft_config_loaded", False):
        return "adapters are loaded (save_pretrained writes them alone)"
    reverted = revert_weight_conversion(model, dict(state_dict))
    if reverted.keys() != state_dict.keys() or any(reverted[k] is not v for k, v in state_dict.items()):
        return "save_pretrained converts its weights back to the checkpoint format"
    try:
        remove_tied_weights_from_state_dict(dict(state_dict), model)
    except RuntimeError as exc:
        return f"save_pretrained refuses its shared tensors ({exc})"
    return None
