"""EvaByte adapter against EvaByte's own model code (tiny random-weight checkpoints, tests/evabyte_real.py).

Every checkpoint is written from EvaByte's unchanged files (found through MTPC_THIRD_PARTY) and
loaded as a user's run would: `load_backbone(dir, trust_remote_code=True)`, i.e.
`AutoModelForCausalLM.from_pretrained`. Window 16 bytes, chunks of 4: sequences here cross several
windows, so chunk summaries, the multi-byte mask, window-boundary splits and commit-on-crop all run.

TEST-ONLY WORKAROUND in use throughout: `triton_shim` (a `triton` stand-in module so EvaByte's code
imports, plus pure-PyTorch ports of its two triton kernels); the first tests check those ports
against EvaByte's own pure-PyTorch reference `eva_pt_ref.py`.
"""

from __future__ import annotations

import collections
import copy
import importlib
import random

import pytest
import torch
from torch.testing import assert_close

from mtpc import MtpcModel
from mtpc.backbones import EvaByteAdapter, load_backbone, make_engine
from mtpc.heads import HeadConfig, MtpcHead
from mtpc.speculative.loop import DecodeConfig, plain_decode
from tests.backbone_helpers import randomize_lora
from tests.evabyte_real import load_tiny_evabyte, real_greedy, real_logits, write_tiny_evabyte

pytestmark = pytest.mark.realmodel  # `make test-compat` runs them under transformers 4.48.3 too

L = 4
# Cached and uncached calls reach the same values through differently ordered float32 sums
# (multi-byte steps: SDPA over [chunk summaries | window | new]; prefill: the kernel's window +
# chunk softmax), and EvaByte's RMSNorm computes in float32 whatever the dtype: float32 rounding.
# Measured: <= 1.4e-6 (incremental and crop fuzz, LoRA draft top included); the kernel ports vs
# eva_pt_ref.py <= 1.2e-7. Bounds with about 4-8x headroom:
ATOL = 5e-6
PORT_ATOL = 1e-6
KINDS_RANK = {"ff": 1, "cp": 2, "hmm": 2, "btree": 2}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_evabyte(tmp_path_factory.mktemp("evabyte") / "tiny")


def ids(T, seed=0, B=1):
    return torch.randint(64, 320, (B, T), generator=torch.Generator().manual_seed(seed))


# -- the test-only kernel ports against EvaByte's own PyTorch reference ------------------------------
def _pt_ref_twin(model):
    """The same weights with EvaByte's `eva_pt_ref.EvaAttention` in every layer."""
    pkg = type(model).__module__.rsplit(".", 1)[0]
    ref = importlib.import_module(f"{pkg}.eva_pt_ref")
    twin = copy.deepcopy(model)
    for i, layer in enumerate(twin.model.layers):
        attn = ref.EvaAttention(twin.config, layer_idx=i)
        attn.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = attn
    return twin


def _decode_own(model, x, prefill, use_triton, monkeypatch):
    """Logits of EvaByte's own cached decoding: prefill, then 1-byte steps (its generate's calls)."""
    module = importlib.import_module(type(model).__module__)
    monkeypatch.setattr(module, "USE_TRITON_IMPL", use_triton)
    pos = torch.arange(x.shape[1])[None]
    out = model(x[:, :prefill], position_ids=pos[:, :prefill], use_cache=True)
    logits, cache = [out.logits], out.past_key_values
    for t in range(prefill, x.shape[1]):
        out = model(x[:, t : t + 1], position_ids=pos[:, t : t + 1], past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        cache = out.past_key_values
    return torch.cat(logits, 1)


@pytest.mark.parametrize("prefill", [5, 16, 23, 40])
def test_kernel_ports_equal_evabytes_pytorch_reference(ckpt, prefill, monkeypatch):
    """Prefill (agg + prep_kv ports) and 1-byte steps across window folds (prep_kv port) against
    eva_pt_ref.py running the same weights through EvaByte's own non-triton generation path."""
    model = load_tiny_evabyte(ckpt).model
    twin = _pt_ref_twin(model)
    x = ids(
        45
    )  # batch 1: EvaByte's own PyTorch decoding path fails on batch 2 (its cached mask keeps batch 1)
    want = _decode_own(twin, x, prefill, False, monkeypatch)
    got = _decode_own(model, x, prefill, True, monkeypatch)
    assert torch.isfinite(got).all()
    assert_close(got, want, rtol=0, atol=PORT_ATOL)


# -- loading -----------------------------------------------------------------------------------------
def test_loading_repairs_transformers_5_and_refuses_non_finite(ckpt, tmp_path):
    bb = load_tiny_evabyte(ckpt)
    rot = bb.model.model.rotary_emb
    assert torch.isfinite(rot.cos_cached).all() and rot.cos_cached[0].eq(1).all()  # rotary tables rebuilt
    assert bb.model.config.rope_scaling in (None, {})
    assert torch.isfinite(real_logits(bb.model, ids(8))).all()
    bb.model.save_pretrained(tmp_path / "saved")  # _tied_weights_keys repaired where transformers 5 needs it
    from mtpc.backbones.evabyte import prepare_config, repair_loaded

    assert repair_loaded(bb.model) == []  # repairs only what it finds broken: a no-op on a good model
    cfg = copy.copy(bb.model.config)
    assert prepare_config(cfg).rope_scaling is None  # None (EvaByte's own form) stays None
    # a checkpoint whose weights are not finite is refused, never decoded
    bad = write_tiny_evabyte(tmp_path / "bad")
    from safetensors.torch import load_file, save_file

    state = load_file(str(bad / "model.safetensors"))
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("nan"))
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="non-finite logits"):
        load_tiny_evabyte(bad)


def test_return_dict_false_in_the_checkpoint(tmp_path):
    path = write_tiny_evabyte(tmp_path / "nodict", return_dict=False)
    bb = load_tiny_evabyte(path, lora_depth=1, lora_rank=4)
    x = ids(20)
    assert_close(bb.stp_logits(bb(x).verify_hidden), real_logits(bb.model, x), rtol=0, atol=1e-6)


def test_remote_code_needs_consent(ckpt):
    with pytest.raises(ValueError, match="ships its own modelling code"):
        load_backbone(str(ckpt))


# -- conformance -------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 2, L])
def test_segments_and_all_heads_equal_the_real_forward(ckpt, k):
    """Uncached: verifier e_t gives EvaByte's next-byte logits and all 8 heads' logits; the draft top
    (LoRA B = 0) equals it; with LoRA it differs, and only there."""
    bb = load_tiny_evabyte(ckpt, lora_depth=k, lora_rank=4)
    x = ids(37, B=2)
    want = real_logits(bb.model, x, all_heads=True)  # (B, T, 8, v)
    out = bb(x)
    heads = torch.einsum("btd,mvd->btmv", out.verify_hidden, bb.mtp_unembeddings())
    assert_close(heads, want, rtol=0, atol=0)  # the same operations in the same order: bit-identical
    assert_close(bb.stp_logits(out.verify_hidden), want[..., 0, :], rtol=0, atol=0)
    assert_close(out.draft_hidden, out.verify_hidden, rtol=0, atol=0)
    if k:
        randomize_lora(bb)
        out2 = bb(x)
        assert_close(out2.verify_hidden, out.verify_hidden, rtol=0, atol=0)
        assert (out2.draft_hidden - out2.verify_hidden).abs().max() > 1e-3


@pytest.mark.parametrize("k", [0, 2, L])
def test_incremental_steps_equal_full(ckpt, k):
    bb = load_tiny_evabyte(ckpt, lora_depth=k, lora_rank=4)
    randomize_lora(bb, scale=0.1)  # (0.3 makes the draft top's attention so peaked that rounding grows 10x)
    x = ids(58)
    full = bb(x)
    if k:
        assert (full.draft_hidden - full.verify_hidden).abs().max() > 1e-2
    cache = bb.new_cache()
    outs, a = [], 0
    for n in [11, 3, 1, 5, 4, 6, 2, 16, 9, 1]:  # prefill and steps cross windows (16, 32, 48)
        outs.append(bb(x[:, a : a + n], cache))
        a += n
        assert cache.length == a
    for field in ("verify_hidden", "draft_hidden"):
        got = torch.cat([getattr(o, field) for o in outs], 1)
        assert_close(got, getattr(full, field), rtol=0, atol=ATOL)


def test_crop_then_refeed_equals_never_fed_fuzz(ckpt):
    """60 random feeds and crops (drafts rolled back inside and before the last step, across window
    boundaries): every fed position's outputs equal a fresh uncached forward of the kept sequence."""
    bb = load_tiny_evabyte(ckpt, lora_depth=2, lora_rank=4)
    randomize_lora(bb, scale=0.1)
    rng = random.Random(0)
    cache, seq, worst, crops = bb.new_cache(), torch.zeros(1, 0, dtype=torch.long), 0.0, 0
    for op in range(60):
        if seq.shape[1] > 4 and rng.random() < 0.4:
            keep = max(0, seq.shape[1] - rng.randint(1, 10))
            cache.crop(keep)
            seq = seq[:, :keep]
            crops += 1
        else:
            n = rng.randint(1, 9)
            if seq.shape[1] + n > 200:
                cache, seq = bb.new_cache(), seq[:, :0]
            new = ids(n, seed=op + 100)
            got = bb(new, cache)
            seq = torch.cat([seq, new], 1)
            want = bb(seq)
            for field in ("verify_hidden", "draft_hidden"):
                d = (getattr(got, field) - getattr(want, field)[:, -n:]).abs().max().item()
                worst = max(worst, d)
        assert cache.length == seq.shape[1]
    assert crops >= 15 and worst < ATOL, (crops, worst)


def test_bad_input(ckpt):
    with pytest.raises(ValueError, match=r"lora_depth=5.*num_layers=4"):
        load_tiny_evabyte(ckpt, lora_depth=5)
    bb = load_tiny_evabyte(ckpt)
    with pytest.raises(ValueError, match="max_context=256"):
        bb(ids(257))
    with pytest.raises(ValueError, match="EvaByte"):
        EvaByteAdapter.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="compact"):
        load_tiny_evabyte(ckpt, engine="compact")


def test_without_triton_cached_steps_are_refused(ckpt):
    """EvaByte's PyTorch path cannot take cached multi-byte steps: refused naming triton; uncached
    calls and prefills still run (on EvaByte's own EvaCache)."""
    bb = load_tiny_evabyte(ckpt)
    twin = EvaByteAdapter.from_hf(_pt_ref_twin(bb.model))
    twin.triton = False
    twin._cache_cls = importlib.import_module(type(bb.model).__module__).EvaCache
    x = ids(21)
    assert_close(twin.stp_logits(twin(x).verify_hidden), real_logits(bb.model, x), rtol=0, atol=PORT_ATOL)
    cache = twin.new_cache()
    twin(x[:, :10], cache)
    with pytest.raises(ValueError, match="triton"):
        twin(x[:, 10:12], cache)


# -- greedy decoding = EvaByte's own greedy ----------------------------------------------------------
def _copy_heads_ckpt(path):
    """A checkpoint whose 8 heads all copy the next-byte head: drafts of an `init: mtp` head are
    then accepted wherever the greedy output repeats a byte (random tiny models often do)."""
    out = write_tiny_evabyte(path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    w = state["lm_head.weight"].view(8, 320, -1)
    state["lm_head.weight"] = w[:1].expand_as(w).reshape(8 * 320, -1).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_greedy_speculative_equals_evabytes_own_greedy(ckpt, tmp_path):
    n, prompts = 64, [ids(P, seed=s)[0] for s, P in ((0, 20), (1, 7), (2, 20))]
    copy_ckpt = _copy_heads_ckpt(tmp_path / "copyheads")
    mu, compared = {}, []
    for path in (ckpt, copy_ckpt):
        want = {i: real_greedy(load_tiny_evabyte(path).model, p, n) for i, p in enumerate(prompts)}
        for k in (0, 2):
            bb = load_tiny_evabyte(path, lora_depth=k, lora_rank=4)
            randomize_lora(bb)
            heads = {
                kind: {"kind": kind, "window": 4, "rank": r, "lora_depth": k, "seed": 0}
                for kind, r in KINDS_RANK.items()
            }
            mtp = MtpcHead(HeadConfig(kind="ff", window=4, rank=1, vocab=320, hidden=32, lora_depth=k))
            mtp.init_from_unembeddings(bb.mtp_unembeddings().float(), noise=0.0)  # init: mtp
            heads["ff-mtp"] = mtp
            for name, head in heads.items():
                m = MtpcModel.from_components(bb, head)
                for i, p in enumerate(prompts):
                    out = m.generate(p, max_new_tokens=n)
                    plain = m.generate_plain(p, max_new_tokens=n)
                    stop = [j for j, b in enumerate(want[i]) if b in bb.stop_token_ids]
                    ref = want[i][: stop[0] + 1] if stop else want[i]  # decoding stops on a stop id
                    assert out.ids.tolist() == ref == plain.ids.tolist(), (path.name, k, name, i)
                    mu.setdefault((path.name, k, name), []).append(out.stats.mu_acc)
                    compared.append(len(ref))
    accepted = {key: sum(v) / len(v) for key, v in mu.items() if sum(v) > 0}
    print(f"greedy = EvaByte's own: {len(compared)} runs, {sum(compared)} bytes; mu_acc > 0: {accepted}")
    assert any(key[2] == "ff-mtp" and key[0] == "copyheads" for key in accepted)


def test_init_mtp_head_copies_the_real_8_heads(ckpt):
    """`init: mtp` with window 16: positions 1-8 copy EvaByte's 8 heads, 9-16 the last one."""
    bb = load_tiny_evabyte(ckpt)
    W = bb.mtp_unembeddings().float()  # (8, 320, 32)
    assert W.shape == (8, 320, 32) and torch.equal(W[3], bb.model.lm_head.weight[3 * 320 : 4 * 320])
    head = MtpcHead(HeadConfig(kind="ff", window=16, rank=1, vocab=320, hidden=32))
    head.init_from_unembeddings(W, noise=0.0)
    e = torch.randn(3, 32)
    leaves = head(e)["leaves"]  # (3, 16, 1, 320)
    for i in range(16):
        assert_close(leaves[:, i, 0], e @ W[min(i, 7)].T, rtol=1e-5, atol=1e-5)
    assert (bb.vocab_size, bb.hidden_size, bb.num_layers, bb.max_context) == (320, 32, L, 256)


def test_plain_baseline_runs_no_draft_top_layer(ckpt):
    """generate_plain is the STP baseline: with k > 0 it must not run the k LoRA draft-top layers."""
    bb = load_tiny_evabyte(ckpt, lora_depth=2, lora_rank=4)
    randomize_lora(bb, scale=0.1)
    model = MtpcModel.from_components(bb, {"kind": "cp", "window": 4, "rank": 2, "lora_depth": 2, "seed": 0})
    calls = []
    for layer in bb.draft_top.layers.values():
        layer.register_forward_hook(lambda *args: calls.append(1))
    prompt = ids(5)[0]
    plain = model.generate_plain(prompt, max_new_tokens=6, ban_eos=True)
    assert len(calls) == 0
    fast = model.generate(prompt, max_new_tokens=6, ban_eos=True)
    assert len(calls) > 0 and fast.ids.tolist() == plain.ids.tolist()


# -- tokenizer and stop ids --------------------------------------------------------------------------
def test_tokenizer_end_to_end(ckpt):
    """EvaByte's own tokenizer (loaded with the checkpoint): bytes + 64, raw bytes byte for byte,
    its Llama-3 chat template, the assistant mask, and both stop ids (<|eot_id|> and eos)."""
    bb = load_tiny_evabyte(ckpt)
    tok = bb.tokenizer
    assert tok.encode(b"\xff\xfe") == [319, 318]  # invalid UTF-8, byte for byte
    data = bytes(random.Random(0).randrange(256) for _ in range(300))
    assert tok.encode(data) == [b + 64 for b in data] and tok.decode(tok.encode(data)) == data
    assert bb.stop_token_ids == (2, 11) and bb.eos_token_id == 2 and bb.bos_token_id == 1

    def enc(text):
        return [b + 64 for b in text.encode()]

    head = lambda role: [9, *enc(role), 10, *enc("\n\n")]  # noqa: E731  <|start_header_id|>role<|end_header_id|>\n\n
    prompt = tok.render_prompt("Hi")
    assert prompt == [1, *head("system"), 11, *head("user"), *enc("Hi"), 11, *head("assistant")]
    ids, mask = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    )
    assert ids == prompt + [*enc("Yo"), 11]
    assert [i for i, m in zip(ids, mask, strict=True) if m] == [*enc("Yo"), 11]
    m = MtpcModel.from_components(bb, {"kind": "cp", "window": 4, "rank": 2, "seed": 0})
    cfg = m._config(torch.tensor(prompt), 4, max_new_tokens=8)
    assert cfg.stop_ids == [2, 11]
    assert m._config(torch.tensor(prompt), 4, max_new_tokens=8, ban_eos=True).banned == [2, 11]


@pytest.mark.parametrize("speculative", [False, True])
def test_decoding_stops_on_any_stop_id_and_banning_bans_all(ckpt, speculative):
    """Two stop ids taken from the model's own banned-greedy output: decoding stops at the first
    of either; banned, neither appears and every run has the full length."""
    bb = load_tiny_evabyte(ckpt)
    m = MtpcModel.from_components(bb, {"kind": "btree", "window": 4, "rank": 2, "seed": 0})
    prompt = ids(12, seed=5)[0]
    run = m.generate if speculative else m.generate_plain
    free = run(prompt, max_new_tokens=40, ban_eos=True).ids.tolist()
    x, y = free[10], next(t for t in free[25:] if t != free[10])  # two ids greedy decoding emits
    b, a = sorted((x, y), key=free.index)  # eos = a is emitted later than the other stop id b
    first = free.index(b)
    m.backbone.tokenizer.stop_token_ids = (a, b)
    m.backbone.tokenizer.eos_token_id = a
    try:
        out = run(prompt, max_new_tokens=40).ids.tolist()
        assert out == free[: first + 1]
        banned = run(prompt, max_new_tokens=40, ban_eos=True).ids.tolist()
        assert len(banned) == 40 and a not in banned and b not in banned
    finally:
        m.backbone.tokenizer.stop_token_ids, m.backbone.tokenizer.eos_token_id = (2, 11), 2


# -- sampling exactness (the enumeration / chi-square machinery of test_speculative_sampling) ---------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """EvaByte's code with a 4-symbol vocabulary (eos = 2 banned: 3 live ones) so that every path
    of plain sampling can be enumerated; lm_head x 2 for a moderately peaked target."""
    from safetensors.torch import load_file, save_file

    out = write_tiny_evabyte(tmp_path_factory.mktemp("evabyte4") / "v4", tokenizer=False, vocab_size=4)
    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 25.0  # std 0.02 init: peaked, not one-hot
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return load_tiny_evabyte(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS_RANK))
def test_keep_sampling_matches_plain_distribution(small_vocab, kind):
    from tests.mtpc.test_speculative_sampling import ALPHA, N_RUNS, chi_square_pvalue
    from tests.speculative_helpers import enumerate_outcomes

    bb, T, prompt = small_vocab, 3, torch.tensor([1, 0, 3, 3, 0])
    cfg = DecodeConfig(max_new_tokens=T, mode="sample", eos_id=bb.eos_token_id, ban_eos=True)

    def program(choose):
        with torch.inference_mode():
            return tuple(plain_decode(make_engine(bb, len(prompt) + T, draft=False), prompt, cfg, choose)[0])

    exact = enumerate_outcomes(program)
    assert len(exact) == 27 and max(exact.values()) > 0.1  # 3 live symbols, peaked
    m = MtpcModel.from_components(bb, {"kind": kind, "window": 3, "rank": KINDS_RANK[kind], "seed": 1})
    with torch.no_grad():
        m.head.leaf_weight.mul_(10.0)
    counts = collections.Counter(
        tuple(m.generate(prompt, max_new_tokens=T, mode="sample", seed=i, ban_eos=True).ids.tolist())
        for i in range(N_RUNS)
    )
    assert chi_square_pvalue(counts, exact, N_RUNS) > ALPHA


@pytest.mark.slow
def test_drop_sampling_is_flagged(small_vocab):
    """The same check rejects extra_token="drop" (biased when sampling): it can fail."""
    from tests.mtpc.test_speculative_sampling import ALPHA, N_RUNS, chi_square_pvalue
    from tests.speculative_helpers import enumerate_outcomes

    bb, T, prompt = small_vocab, 3, torch.tensor([1, 0, 3, 3, 0])
    cfg = DecodeConfig(max_new_tokens=T, mode="sample", eos_id=bb.eos_token_id, ban_eos=True)

    def program(choose):
        with torch.inference_mode():
            return tuple(plain_decode(make_engine(bb, len(prompt) + T, draft=False), prompt, cfg, choose)[0])

    exact = enumerate_outcomes(program)
    m = MtpcModel.from_components(bb, {"kind": "btree", "window": 3, "rank": 2, "seed": 1})
    with torch.no_grad():
        m.head.leaf_weight.mul_(10.0)
    counts = collections.Counter(
        tuple(
            m.generate(
                prompt, max_new_tokens=T, mode="sample", seed=i, ban_eos=True, extra_token="drop"
            ).ids.tolist()
        )
        for i in range(N_RUNS)
    )
    assert chi_square_pvalue(counts, exact, N_RUNS) < ALPHA
