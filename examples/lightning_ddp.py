"""DDP training with Lightning that checkpoints through aiosnap, and resumes on every rank.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --out /tmp/lightning-ddp --epochs 2
    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --out /tmp/lightning-ddp --epochs 4

Rank 0 writes a checkpoint each epoch (the top one and ``last.ckpt``) through aiosnap; the
second run (or a run started again after a kill) resumes from ``last.ckpt`` on every rank
and goes on with the losses of a run that never stopped. Runs on CPUs with gloo.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from aiosnap.integrations.lightning import AiosnapCheckpointIO


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        print(f"rank {self.global_rank} step {self.global_step + 1}: loss {loss.item():.6f}", flush=True)
        return loss

    def on_train_start(self) -> None:
        if self.global_step:
            print(f"rank {self.global_rank}: resumed at step {self.global_step}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main(out: str, epochs: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_epochs=epochs,
        plugins=[AiosnapCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), data, ckpt_path="last")  # returns once rank 0's checkpoints are durable
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()
    main(args.out, args.epochs)
