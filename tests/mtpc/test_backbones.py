"""Backbone adapter on tiny in-process Llama configs: split == plain HF forward, caches, LoRA, bad input."""

import pytest
import torch
from torch.testing import assert_close

from mtpc.backbones import BackboneAdapter, load_backbone
from tests.backbone_helpers import randomize_lora, tiny_backbone, tiny_llama

L = 4


def _ids(B=2, T=9, vocab=16, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [0, 1, 2, L])
def test_split_forward_equals_hf_forward(k):
    bb = tiny_backbone(lora_depth=k)
    ids = _ids()
    out = bb(ids)
    ref = bb.model(ids).logits
    assert_close(bb.stp_logits(out.verify_hidden), ref, rtol=0, atol=1e-10)
    # fresh LoRA (B = 0): the draft top is the verifier top
    assert_close(out.draft_hidden, out.verify_hidden, rtol=0, atol=1e-12)
    if k == 0:
        assert out.draft_hidden is out.verify_hidden


def test_tiny_vocab_and_tied_and_sdpa():
    bb = tiny_backbone(lora_depth=1, vocab=4, tie=True)
    ids = _ids(vocab=4)
    assert bb.vocab_size == 4 and bb.lm_head_weight.shape == (4, 32)
    assert_close(bb.stp_logits(bb(ids).verify_hidden), bb.model(ids).logits, rtol=0, atol=1e-10)
    sd = tiny_backbone(lora_depth=2, dtype=torch.float32, attn="sdpa")
    cache = sd.new_cache()
    sd(ids[:, :5], cache)
    inc = sd(ids[:, 5:], cache).verify_hidden
    assert_close(sd.stp_logits(inc), sd.model(ids).logits[:, 5:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [0, 2, L])
def test_incremental_equals_full(k):
    # sdpa: float64 throughout (HF's eager attention takes its softmax in float32, whose rounding
    # depends on the key count: cached + new vs all at once differ by ~1e-6 with transformers 5.24)
    bb = tiny_backbone(lora_depth=k, attn="sdpa")
    randomize_lora(bb)
    ids = _ids(T=12)
    full = bb(ids)
    cache = bb.new_cache()
    pieces = []
    for a, b in [(0, 5), (5, 6), (6, 9), (9, 12)]:
        pieces.append(bb(ids[:, a:b], cache))
        assert cache.length == b
    assert_close(torch.cat([p.verify_hidden for p in pieces], 1), full.verify_hidden, rtol=0, atol=1e-10)
    assert_close(torch.cat([p.draft_hidden for p in pieces], 1), full.draft_hidden, rtol=0, atol=1e-10)
    # HF's own cached logits agree too
    assert_close(bb.stp_logits(pieces[-1].verify_hidden), bb.model(ids).logits[:, 9:], rtol=0, atol=1e-10)


def test_lora_changes_only_the_draft_top():
    bb = tiny_backbone(lora_depth=2)
    ids = _ids()
    before = bb(ids)
    randomize_lora(bb)
    after = bb(ids)
    assert_close(after.verify_hidden, before.verify_hidden, rtol=0, atol=0)  # verifier untouched
    assert_close(bb.stp_logits(after.verify_hidden), bb.model(ids).logits, rtol=0, atol=1e-10)
    assert (after.draft_hidden - after.verify_hidden).abs().max() > 1e-2
    # zeroing B again restores draft == verifier exactly
    with torch.no_grad():
        for n, p in bb.draft_top.named_parameters():
            if "lora_B" in n:
                p.zero_()
    assert_close(bb(ids).draft_hidden, before.verify_hidden, rtol=0, atol=1e-12)


def test_lora_targets_only_top_layers_and_share_weights():
    bb = tiny_backbone(lora_depth=2)
    names = [n for n, _ in bb.draft_top.named_parameters() if "lora_A" in n]
    assert {n.split(".")[1] for n in names} == {"2", "3"}
    assert len(names) == 2 * 7  # q k v o gate up down in each of the two top layers
    base = bb.model.model.layers[3].self_attn.q_proj.weight
    assert bb.draft_top.layers["3"].self_attn.q_proj.base_layer.weight is base  # no weight copy


def test_only_lora_trainable_and_gets_gradients():
    bb = tiny_backbone(lora_depth=2)
    randomize_lora(bb)
    trainable = [n for n, p in bb.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {id(p) for p in bb.lora_parameters()} == {id(p) for p in bb.parameters() if p.requires_grad}
    out = bb(_ids())
    bb.stp_logits(out.draft_hidden).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in bb.lora_parameters())
    assert all(p.grad is None for n, p in bb.named_parameters() if "lora_" not in n)
    assert [p for p in tiny_backbone(lora_depth=0).parameters() if p.requires_grad] == []


@pytest.mark.parametrize("k", [0, 2, L])
def test_crop_and_refeed_equals_never_fed(k):
    bb = tiny_backbone(lora_depth=k)
    randomize_lora(bb)
    prompt, junk, real = _ids(T=6, seed=1), _ids(T=4, seed=2), _ids(T=3, seed=3)
    clean = bb.new_cache()
    bb(prompt, clean)
    want = bb(real, clean)
    dirty = bb.new_cache()
    bb(prompt, dirty)
    bb(junk, dirty)
    dirty.crop(6)
    got = bb(real, dirty)
    assert_close(got.verify_hidden, want.verify_hidden, rtol=0, atol=1e-12)
    assert_close(got.draft_hidden, want.draft_hidden, rtol=0, atol=1e-12)
    for seg in ("trunk", "verify", "draft"):
        a, b = getattr(clean, seg), getattr(dirty, seg)
        assert a.keys.keys() == b.keys.keys()
        for i in a.keys:
            assert a.keys[i].shape[-2] == 9
            assert_close(a.keys[i], b.keys[i], rtol=0, atol=1e-12)
            assert_close(a.values[i], b.values[i], rtol=0, atol=1e-12)
    assert bool(clean.draft.keys) == (k > 0) and bool(clean.trunk.keys) == (k < L)


def test_lora_state_dict_round_trip():
    a, b = tiny_backbone(lora_depth=2), tiny_backbone(lora_depth=2)
    randomize_lora(a)
    b.load_lora_state_dict(a.lora_state_dict())
    ids = _ids()
    assert_close(b(ids).draft_hidden, a(ids).draft_hidden, rtol=0, atol=0)
    with pytest.raises(ValueError, match="keys differ"):
        tiny_backbone(lora_depth=1).load_lora_state_dict(a.lora_state_dict())


def test_half_precision_backbone_keeps_lora_in_float32():
    bb = tiny_backbone(lora_depth=1, dtype=torch.bfloat16)
    assert {p.dtype for p in bb.lora_parameters()} == {torch.float32}
    randomize_lora(bb)
    out = bb(_ids())
    assert out.draft_hidden.dtype == torch.bfloat16 and (out.draft_hidden != out.verify_hidden).any()


def test_facts():
    bb = tiny_backbone(lora_depth=1, max_context=64)
    assert (bb.num_layers, bb.hidden_size, bb.vocab_size, bb.max_context) == (L, 32, 16, 64)
    assert (bb.eos_token_id, bb.bos_token_id, bb.lora_depth) == (1, 0, 1)
    assert bb.mtp_unembeddings() is None and bb.dtype == torch.float64


def test_bad_input():
    with pytest.raises(ValueError, match=r"lora_depth=5.*num_layers=4"):
        tiny_backbone(lora_depth=5)
    bb = tiny_backbone(lora_depth=1, max_context=10)
    with pytest.raises(ValueError, match="max_context=10"):
        bb(_ids(T=11))
    cache = bb.new_cache()
    bb(_ids(T=8), cache)
    with pytest.raises(ValueError, match=r"8 cached \+ 3 new.*max_context=10"):
        bb(_ids(T=3), cache)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(9)
    with pytest.raises(ValueError, match="input_ids"):
        bb(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="Llama-architecture"):
        BackboneAdapter.from_hf(torch.nn.Linear(2, 2))
    flash = tiny_llama()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2.*sdpa"):
        BackboneAdapter.from_hf(flash)


def test_load_backbone_from_directory(tmp_path, monkeypatch):
    model = tiny_llama(dtype=torch.float32)
    model.save_pretrained(tmp_path / "tiny")
    bb = load_backbone(str(tmp_path / "tiny"), lora_depth=1, dtype=torch.float64, attn_implementation="eager")
    assert bb.dtype == torch.float64 and bb.tokenizer is None and bb.name == str(tmp_path / "tiny")
    ids = _ids()
    assert_close(bb.stp_logits(bb(ids).verify_hidden), model.double()(ids).logits, rtol=0, atol=1e-8)
    big = tiny_llama(vocab=600, hidden=8, layers=1, heads=2, kv_heads=1)
    big.save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match=r"vocab_size=600.*512"):
        load_backbone(str(tmp_path / "big"))
    assert load_backbone(str(tmp_path / "big"), allow_non_byte=True).vocab_size == 600
    with pytest.raises(ValueError, match="unknown name"):
        load_backbone("no-such-backbone")
    import mtpc.backbones as backbones

    monkeypatch.setattr(
        backbones, "SHIPPED_DIR", tmp_path / "no_default"
    )  # a clone without the shipped files
    with pytest.raises(ValueError, match=r"no_default/MANIFEST.json is missing"):
        load_backbone("default")


def _with_auto_map(directory):
    import json

    cfg = json.loads((directory / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (directory / "config.json").write_text(json.dumps(cfg))


def test_remote_code_runs_only_with_consent(tmp_path):
    """transformers' default: no checkpoint code without trust_remote_code; a hub id must also pin a commit."""
    from mtpc.backbones import check_remote_code

    tiny_llama(dtype=torch.float32).save_pretrained(tmp_path / "code")
    _with_auto_map(tmp_path / "code")  # a checkpoint that ships its own modelling file
    with pytest.raises(
        ValueError, match=r"ships its own modelling code.*trust_remote_code=True.*model\.revision"
    ):
        load_backbone(str(tmp_path / "code"))  # refused before any of its code is imported
    with pytest.raises(
        ValueError, match=r"trust_remote_code=True.*revision='<40-hex commit hash>'.*got None"
    ):
        load_backbone("some-org/some-model", trust_remote_code=True)  # unpinned: refused before any download
    with pytest.raises(ValueError, match=r"got 'main'"):
        check_remote_code("evabyte", True, "main")  # an alias is a hub id; a branch can move
    check_remote_code("some-org/some-model", True, "0123456789abcdef0123456789abcdef01234567")
    check_remote_code(str(tmp_path / "code"), True)  # a local directory: the code is the one on disk
    check_remote_code(
        "some-org/some-model", False, None, {"model_type": "llama"}
    )  # no code shipped: nothing to allow
