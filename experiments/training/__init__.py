"""Training MtPC heads, one job per module; the CLI is `experiments/train.py`.

- `config.py`: the typed training config (`TrainConfig` and its sections), its checks, the fit parser, `apply_point`
- `fit.py`: `train_head`: one run from a config to an exported head (Trainer, checkpoints, stop, export)
- `module.py`, `datamodule.py`: the LightningModule (frozen backbone + head + LoRA) and the chat data
- `callbacks.py`: the stop/checkpoint callback; `hidden_cache.py`: the frozen backbone's reused hidden states
- `mlflow_run.py`: the run's MLflow logger and description
- `trial.py`, `launch.py`: one sweep trial (train, then evaluate) and its multi-rank process group
- `selfdistill.py`: self-distillation data (the backbone's own answers)
- `nll_table.py`: the held-out NLL table of the default model's ff / cp / hmm / btree heads
"""
