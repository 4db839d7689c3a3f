"""RNGState: every global random generator a training run draws from, as one Stateful."""

from __future__ import annotations

import random
from typing import Any, final

import numpy as np
import torch


@final
class RNGState:
    """Python's ``random``, NumPy's global generator, torch's CPU generator and every
    CUDA generator. Put it in the checkpointed state so a resumed run draws the same
    numbers (dropout masks, augmentations) as the run that never stopped."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {"kind": kind, "keys": keys, "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
