"""What leaves a run for the repository or the device: the shipped default model and heads, their reports,
the device call's preparation.

- `ship_default.py`: a pre-trained model as the repository's default (`mtpc/default_model/`)
- `ship_head.py`: a trained head beside the default backbone (`mtpc/default_heads/`)
- `default_report.py`: the shipped default's degeneracy on the fixed report set, and sample answers
- `device_prep.py`: the GPU device call's preparation under `.device/`
"""
