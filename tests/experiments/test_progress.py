"""The training progress lines (experiments/plumbing/progress.py) on a real Trainer: they name the run, count
the optimizer steps max_steps allows (6/6, not 6/<batches in the epoch>), give an ETA until the end,
and a resumed run counts from its checkpoint's step."""

from __future__ import annotations

import io
import re

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from experiments.plumbing.progress import StepProgress, clock


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.w(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, max_steps: int, ckpt: str | None = None) -> tuple[list[str], L.Trainer]:
    out = io.StringIO()
    trainer = L.Trainer(
        max_steps=max_steps,
        max_epochs=5,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[StepProgress("study/cp-r4-n4-k0", stream=out)],
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
    )
    data = DataLoader(TensorDataset(torch.randn(40, 2)), batch_size=2)  # 20 batches an epoch
    trainer.fit(_Tiny(), data, ckpt_path=ckpt)
    return out.getvalue().splitlines(), trainer


@pytest.mark.filterwarnings(
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"
)  # inside Lightning
@pytest.mark.filterwarnings(
    "ignore:You're resuming from a checkpoint that ended before the epoch ended"
)  # on purpose
def test_lines_count_the_real_steps_and_name_the_run(tmp_path):
    lines, trainer = _fit(tmp_path, 8)
    assert [re.sub(r" in \d+:\d\d.*", "", ln) for ln in lines] == [
        f"[train study/cp-r4-n4-k0] step {s}/8 ({p}%)" for s, p in ((2, 25), (4, 50), (6, 75), (8, 100))
    ]
    assert all(", ETA " in ln for ln in lines[:-1]) and ", ETA" not in lines[-1]
    path = tmp_path / "half.ckpt"
    trainer.save_checkpoint(path)
    lines, _ = _fit(tmp_path, 16, str(path))  # resumed at 8 of 16: 50% is behind it
    assert [ln.split("] ")[1].split(" in ")[0] for ln in lines] == ["step 12/16 (75%)", "step 16/16 (100%)"]


def test_clock():
    assert [clock(s) for s in (0, 59.6, 61, 3600 + 62)] == ["0:00", "1:00", "1:01", "1:01:02"]
