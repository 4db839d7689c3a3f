"""Hugging Face Trainer DDP training on CPUs (gloo) that checkpoints with aiosnap and resumes
after a kill.

    torchrun --standalone --nproc-per-node 2 examples/transformers_ddp.py --out /tmp/hf-ddp --epochs 2

Kill it at any point (Ctrl-C, or a SIGKILL of every rank), then run the same command again:
every rank resumes from the newest checkpoint the whole group committed and trains on with the
losses of a run that never stopped.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback, TrainingArguments

from aiosnap.integrations.transformers import AiosnapTrainer


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (size, 12), generator=g)
        self.labels = torch.randint(0, 2, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Show(TrainerCallback):
    """Prints what each rank does."""

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print(f"resumed rank {args.process_index}: {state.global_step}", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            print(f"loss rank {args.process_index}: {state.global_step} {logs['loss']}", flush=True)

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print(f"saved rank {args.process_index}: {state.global_step}", flush=True)


def trainer(out: str, epochs: int, callback: TrainerCallback) -> AiosnapTrainer:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
    )
    args = TrainingArguments(
        out,
        per_device_train_batch_size=4,  # each rank its 4 of every 8 samples
        num_train_epochs=epochs,
        save_steps=2,
        save_total_limit=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        disable_tqdm=True,
    )
    model = BertForSequenceClassification(config)  # dropout: each rank's RNG state is saved
    return AiosnapTrainer(model=model, args=args, train_dataset=Data(), callbacks=[callback])


def train(out: str, epochs: int, callback: TrainerCallback | None = None) -> None:
    run = trainer(out, epochs, callback or Show())
    try:
        run.train(resume_from_checkpoint=True)  # every rank: the newest step the group committed
    except ValueError as exc:
        if "No valid checkpoint" not in str(exc):
            raise
        run.train()  # a fresh start: nothing committed yet


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    train(args.out, args.epochs)
