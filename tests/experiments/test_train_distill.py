"""Distillation in training (experiments/training/module.py, train.py): model.kl_beta / model.kl_temperature
are validated with the key named; the teacher is the backbone's STP distribution of the verifier top
(the loss equals window_loss with those logits); validation logs the KL; a distilled debug head ends
closer to the backbone than a cross-entropy head after the same steps."""

from __future__ import annotations

import pytest
import torch

from experiments.training.config import CONFIG_DIR
from experiments.training.fit import check_config, train_head
from experiments.training.module import MtpcTrainModule
from mtpc.losses import window_loss


@pytest.mark.parametrize(
    "override, key",
    [
        ({"model.kl_beta": 1.5}, "model.kl_beta"),
        ({"model.kl_beta": True}, "model.kl_beta"),
        ({"model.kl_temperature": 0}, "model.kl_temperature"),
        ({"model.kl_temperature": "hot"}, "model.kl_temperature"),
    ],
)
def test_bad_distillation_settings_name_key_and_file(override, key):
    with pytest.raises(ValueError) as err:
        check_config(CONFIG_DIR / "debug.yaml", override)
    assert key in str(err.value) and "debug.yaml" in str(err.value), str(err.value)


def test_teacher_is_the_verifier_tops_stp_distribution():
    m = MtpcTrainModule(
        backbone="tiny",
        circuit="cp",
        window=4,
        rank=2,
        lora_depth=1,
        chunk_size=8,
        kl_beta=0.7,
        kl_temperature=0.5,
    )
    ids = torch.randint(0, 256, (2, 24))
    score = torch.rand(2, 24) < 0.7
    docs = torch.zeros(2, 24, dtype=torch.long)
    res, out, logits = m._loss((ids, score, docs), grad_backbone=False)
    teacher = m.backbone.stp_logits(out.verify_hidden)
    ref = window_loss(
        m.head,
        out.draft_hidden,
        ids,
        score,
        docs,
        chunk_size=None,
        teacher_logits=teacher,
        kl_beta=0.7,
        kl_temperature=0.5,
    )
    torch.testing.assert_close(res.loss.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, teacher)
    assert res.per_position_kl is not None and (res.per_position_kl > 0).all()
    m.config.kl_beta = 0.0  # CE: no teacher in training, but validation asks for it
    assert m._loss((ids, score, docs), grad_backbone=False)[2] is None
    assert m._loss((ids, score, docs), grad_backbone=False, teacher=True)[0].window_kl is not None


def test_distilled_head_ends_closer_to_the_backbone(tmp_path):
    over = {"trainer.max_epochs": 1, "model.lr": 3e-2}
    ce = train_head("debug", over, run_dir=tmp_path / "ce")
    kl = train_head("debug", {**over, "model.kl_beta": 1.0}, run_dir=tmp_path / "kl")
    assert ce.config["model"]["kl_beta"] == 0.0 and kl.config["model"]["kl_beta"] == 1.0
    assert kl.metrics["val_window_kl"] < 0.9 * ce.metrics["val_window_kl"], (kl.metrics, ce.metrics)
    assert kl.metrics["val_window_nll"] > ce.metrics["val_window_nll"]  # it learnt the teacher, not the data
    assert "train_window_kl" in kl.metrics and "train_window_kl" not in ce.metrics


def test_convergence_rule_on_histories():
    from experiments.training.trial import convergence

    flat = [(0, 3.0), (40, 2.0), (80, 1.5), (160, 1.2), (200, 1.195)]
    c = convergence(flat)
    assert c["converged"] == 1.0 and c["val_nll_change_last_fifth"] == pytest.approx(0.005 / 1.195)
    falling = [(0, 3.0), (80, 1.5), (160, 1.3), (200, 1.2)]
    assert convergence(falling)["converged"] == 0.0  # 8 % over the last fifth: undertrained
    late = [(170, 1.3), (200, 1.3)]  # no validation before step 160: unknown, counts as undertrained
    assert (
        convergence(late)["converged"] == 0.0
        and convergence(late)["val_nll_change_last_fifth"] != convergence(late)["val_nll_change_last_fifth"]
    )
    assert convergence([(200, 1.0)])["converged"] == 0.0
