"""The frozen backbone's hidden-state cache (experiments.training.hidden_cache): a warm cache trains exactly as no
cache does (float64, gradients equal), entries are checked and recomputed when corrupt, and a training
run reuses another run's rows."""

from __future__ import annotations

import warnings

import pytest
import torch

from experiments.training.hidden_cache import HiddenCache, fingerprint
from experiments.training.module import MtpcTrainModule


def _module(**kw) -> MtpcTrainModule:
    torch.manual_seed(0)
    return MtpcTrainModule(
        backbone="tiny", backbone_dtype="float64", circuit="btree", window=4, rank=2, chunk_size=8, **kw
    )


def _grads(module: MtpcTrainModule, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad()
    res, _, _ = module._loss(batch, grad_backbone=False)
    res.loss.backward()
    return res.loss.detach(), {
        n: p.grad.clone() for n, p in module.head.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("kl_beta", [0.0, 0.5])
def test_gradients_through_a_cold_and_a_warm_cache_equal_the_uncached_path_in_float64(tmp_path, kl_beta):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    batch = (ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids))
    plain = _module(kl_beta=kl_beta)
    loss0, grads0 = _grads(plain, batch)
    cached = _module(kl_beta=kl_beta)
    cached.hidden_cache = HiddenCache(tmp_path, cached.backbone)
    for expect_hits in (0, 1):  # cold: fills; warm: reads
        loss, grads = _grads(cached, batch)
        assert cached.hidden_cache.hits == expect_hits
        assert torch.equal(loss, loss0)
        assert grads.keys() == grads0.keys() and all(torch.equal(grads[k], grads0[k]) for k in grads0)
    assert cached.hidden_cache.misses == 1 and cached.hidden_cache.fill_s > 0


def test_a_corrupt_entry_is_named_once_recomputed_and_rewritten(tmp_path):
    module = _module()
    cache = HiddenCache(tmp_path, module.backbone)
    ids = torch.randint(0, 256, (1, 16))
    compute = lambda: module.backbone(ids).verify_hidden  # noqa: E731
    first = cache.get(ids, compute)
    path = cache.path(ids)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the tensor: its checksum no longer matches
    path.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = cache.get(ids, compute)
    assert [str(w.message) for w in caught] == [
        f"hidden-state cache: {path} is corrupt (key or checksum differs); recomputing it"
    ]
    assert torch.equal(again, first) and cache.misses == 2
    assert torch.equal(cache.get(ids, compute), first) and cache.hits == 1  # rewritten: read back


def test_the_folder_is_named_by_the_weights_and_an_unwritable_one_is_skipped(tmp_path):
    a, b = _module(), _module(tiny_seed=1)
    assert fingerprint(a.backbone) == fingerprint(_module().backbone) != fingerprint(b.backbone)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    cache = HiddenCache(blocked, a.backbone)
    ids = torch.randint(0, 256, (1, 8))
    with pytest.warns(UserWarning, match="cannot write under"):
        h = cache.get(ids, lambda: a.backbone(ids).verify_hidden)
    assert h.shape == (1, 8, a.backbone.hidden_size) and cache.misses == 1


def test_a_second_training_run_reads_the_first_runs_rows(tmp_path):
    from experiments.training.fit import train_head

    over = {"run.hidden_cache": str(tmp_path / "hidden"), "run.tracking": False, "trainer.max_epochs": 1}
    first = train_head("debug", over, run_dir=tmp_path / "a")
    second = train_head("debug", {**over, "model.rank": 2}, run_dir=tmp_path / "b")
    assert first.metrics["hidden_cache_hits"] == 0 and first.metrics["hidden_cache_misses"] > 0
    assert second.metrics["hidden_cache_misses"] == 0
    assert second.metrics["hidden_cache_hits"] == first.metrics["hidden_cache_misses"]
