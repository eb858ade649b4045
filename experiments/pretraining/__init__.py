"""Pre-training of the embedded default backbone, one job per module; the CLI is `experiments/pretrain.py`.

- `config.py`: `PretrainConfig`, its checks (`<file>: <key>: ...; expected ...`), `load_config`, the shipped YAMLs
- `data.py`: the training rows and their resumable order, the fixed held-out slice and its score
- `files.py`: what a run writes and reads back: the resumable snapshot (`state.pt`) and the output model folder
- `loop.py`: `pretrain`: the plain PyTorch training loop (phases, learning rate, active-time budget, signals)
"""
