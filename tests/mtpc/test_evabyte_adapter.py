"""EvaByte adapter against an in-process stand-in with EvaByte's module layout (not the real model).

Window 8 bytes, chunks of 2: sequences here cross several windows, so the chunk summaries, the
multi-byte mask, window-boundary splitting and commit-on-crop are all exercised.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from mtpc.backbones import EvaByteAdapter, load_backbone
from tests.backbone_helpers import randomize_lora
from tests.evabyte_standin.modeling_evabyte import EvaByteConfig, EvaByteForCausalLM

L = 4


def standin(seed=0):
    torch.manual_seed(seed)
    return EvaByteForCausalLM(EvaByteConfig(num_hidden_layers=L)).double().eval()


def ids(T, seed=0, B=1):
    return torch.randint(64, 320, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [0, 2, L])
def test_split_forward_equals_model_forward(k):
    model = standin()
    bb = EvaByteAdapter.from_hf(model, lora_depth=k, lora_rank=4)
    x = ids(21, B=2)
    out = bb(x)
    assert_close(bb.stp_logits(out.verify_hidden), model(x).logits, rtol=0, atol=1e-10)
    assert_close(out.draft_hidden, out.verify_hidden, rtol=0, atol=1e-12)  # LoRA B = 0


def test_unembeddings_and_facts():
    model = standin()
    bb = EvaByteAdapter.from_hf(model, lora_depth=1, lora_rank=4)
    W = bb.mtp_unembeddings()
    assert W.shape == (8, 320, 32) and bb.lm_head_weight.shape == (320, 32)
    assert torch.equal(W[0], bb.lm_head_weight) and torch.equal(W[3], model.lm_head.weight[3 * 320 : 4 * 320])
    assert (bb.vocab_size, bb.hidden_size, bb.num_layers, bb.max_context) == (320, 32, L, 256)
    trainable = [n for n, p in bb.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("k", [0, 2, L])
def test_incremental_steps_equal_full(k):
    bb = EvaByteAdapter.from_hf(standin(), lora_depth=k, lora_rank=4)
    randomize_lora(bb)
    x = ids(30)
    full = bb(x)
    cache = bb.new_cache()
    outs, a = [], 0
    for n in [11, 3, 1, 5, 4, 6]:  # prefill crosses a window; later steps cross boundaries too
        outs.append(bb(x[:, a : a + n], cache))
        a += n
        assert cache.length == a
    for field in ("verify_hidden", "draft_hidden"):
        got = torch.cat([getattr(o, field) for o in outs], 1)
        assert_close(got, getattr(full, field), rtol=0, atol=1e-10)
    if k:
        assert (full.draft_hidden - full.verify_hidden).abs().max() > 1e-3


@pytest.mark.parametrize("crop_back", [2, 6, 9])
def test_crop_then_refeed_equals_never_fed(crop_back):
    """Feed prompt (10), drafts (5), crop, feed the real continuation: same as never feeding drafts.

    crop_back 2: inside the last step (commit 3 of 5); 6: before the last step (rebuild);
    9 with a step crossing the window boundary at 16: into its committed first part (rebuild).
    """
    bb = EvaByteAdapter.from_hf(standin(), lora_depth=2, lora_rank=4)
    randomize_lora(bb)
    prompt, drafts, real = ids(10, 1), ids(5 if crop_back != 9 else 8, 2), ids(4, 3)
    cache = bb.new_cache()
    bb(prompt, cache)
    if crop_back == 9:
        bb(ids(3, 4), cache)  # 13 bytes; next step 13..21 crosses the boundary at 16
    bb(drafts, cache)
    keep = cache.length - crop_back
    cache.crop(keep)
    assert cache.length == keep
    got = bb(real, cache)
    seq = torch.cat([prompt, ids(3, 4)] if crop_back == 9 else [prompt], 1)
    seq = torch.cat([seq, drafts], 1)[:, :keep]
    want = bb(torch.cat([seq, real], 1))
    assert_close(got.verify_hidden, want.verify_hidden[:, keep:], rtol=0, atol=1e-10)
    assert_close(got.draft_hidden, want.draft_hidden[:, keep:], rtol=0, atol=1e-10)


def test_bad_input():
    with pytest.raises(ValueError, match=r"lora_depth=5.*num_layers=4"):
        EvaByteAdapter.from_hf(standin(), lora_depth=5)
    bb = EvaByteAdapter.from_hf(standin())
    with pytest.raises(ValueError, match="max_context=256"):
        bb(ids(257))
    with pytest.raises(ValueError, match="EvaByte"):
        EvaByteAdapter.from_hf(torch.nn.Linear(2, 2))


def test_load_backbone_dispatches_to_evabyte(tmp_path):
    """Saved with an auto_map and loaded with trust_remote_code, like the real checkpoint."""
    model = standin()
    out = tmp_path / "evabyte"
    model.save_pretrained(out)
    src = Path(__file__).parents[1] / "evabyte_standin"
    for f in ("modeling_evabyte.py", "eva_cache.py"):
        shutil.copy(src / f, out / f)
    cfg = json.loads((out / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "modeling_evabyte.EvaByteConfig", "AutoModelForCausalLM": "modeling_evabyte.EvaByteForCausalLM"}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="ships its own modelling code"):
        load_backbone(str(out), lora_depth=1)  # its code runs only with consent
    bb = load_backbone(str(out), lora_depth=1, dtype=torch.float64, trust_remote_code=True)
    assert isinstance(bb, EvaByteAdapter) and bb.vocab_size == 320
    x = ids(12)
    assert_close(bb.stp_logits(bb(x).verify_hidden), model(x).logits, rtol=0, atol=1e-10)


def test_ff_head_with_window_16_starts_from_evabyte_heads():
    """Cross-check with mtpc.heads: positions 1-8 copy EvaByte's 8 heads, 9-16 the last one."""
    from mtpc.heads import HeadConfig, MtpcHead

    bb = EvaByteAdapter.from_hf(standin())
    W = bb.mtp_unembeddings().float()  # (8, 320, 32)
    head = MtpcHead(HeadConfig(kind="ff", window=16, rank=1, vocab=320, hidden=32))
    head.init_from_unembeddings(W, noise=0.0)
    e = torch.randn(3, 32)
    leaves = head(e)["leaves"]  # (3, 16, 1, 320)
    for i in range(16):
        assert_close(leaves[:, i, 0], e @ W[min(i, 7)].T, rtol=1e-5, atol=1e-5)
    assert_close(leaves[:, 0, 0], bb.stp_logits(e.double()).float(), rtol=1e-5, atol=1e-5)


def test_plain_baseline_runs_no_draft_top_layer():
    """generate_plain is the STP baseline: with k > 0 it must not run the k LoRA draft-top layers
    (else every stp_* metric pays for them and speedup_vs_stp is inflated)."""
    from mtpc import MtpcModel

    bb = EvaByteAdapter.from_hf(standin(), lora_depth=2, lora_rank=4)
    randomize_lora(bb)
    model = MtpcModel.from_components(bb, {"kind": "cp", "window": 4, "rank": 2, "lora_depth": 2, "seed": 0})
    calls = []
    for layer in bb.draft_top.layers.values():
        layer.register_forward_hook(lambda *args: calls.append(1))
    prompt = ids(5)[0]
    plain = model.generate_plain(prompt, max_new_tokens=6, ban_eos=True)
    assert len(calls) == 0
    fast = model.generate(prompt, max_new_tokens=6, ban_eos=True)
    assert len(calls) > 0  # the hooks do see the draft top when it runs
    assert fast.ids.tolist() == plain.ids.tolist()  # greedy: the same bytes
