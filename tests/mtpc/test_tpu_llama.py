"""tokenkit's byte Llama (`tpu_llama`, expanded input ids) natively: the suite's engines against tokenkit's own code.

A tiny TPULlamaForCausalLM checkpoint (tests/tpu_llama_helpers.py: llama3 RoPE scaling, grouped
queries, untied embeddings, float64, a hand-made expand dictionary with multi-byte entries that
fire on the prompts) is loaded twice: natively by `load_backbone` (no remote code) and by tokenkit's
modelling file (`realmodel` tests: transformers 4.x only, `make test-compat`; under 5.x they skip
saying so). Checked against tokenkit: the expanded ids; next-byte logits of the compact engine and
of the HF-layer adapter over prefill, 1-byte steps, n-byte verifies and crops (k in {0, 1, L}) to
1e-10; plain and speculative greedy = tokenkit's `generate`; a checkpoint without expanded ids.
Without tokenkit's code (any transformers): the table's semantics on hand-worked cases, the engines
against the native model, sampling exactness by enumeration, the refusals.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.testing import assert_close

from mtpc import MtpcModel
from mtpc.backbones import check_remote_code, load_backbone, make_engine
from mtpc.backbones.tpu_llama import ExpandTable, tpu_llama_config
from tests.backbone_helpers import randomize_lora
from tests.third_party import third_party
from tests.tpu_llama_helpers import (
    BYTE_TOKENS,
    CODE_FILES,
    byte_expand,
    expand_dict,
    tokenkit_model,
    write_tpu_llama,
)

SPECIALS = [256, 257, 258]  # bos, eos, another special (direct entries of the dictionary)
BOS, EOS = 256, 257
LAYERS = 3
PROMPTS = [b"hello the world and the thing", b" and then caf\xc3\xa9 \xff the world, hello", b"wor ing and"]
# (bytes fed, crop length after the call or None): prefill, steps, verifies, rejected drafts whose
# bytes are replaced (the next bytes' expanded ids must follow the new history), a full crop-back
SCRIPT = [([BOS, *b"hello the"], None), (b" ", None), (b"wor", 12), (b"orld a", None), (b"n", None),
          (b"d the t", 23), (b"hing, wo", None), (b"r", 0), ([BOS, *b"caf\xc3\xa9 and the world"], None),
          (b"he", None)]  # fmt: skip


def _ids(b: bytes | list[int]) -> list[int]:
    return list(b)


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    return third_party("tokenkit_hf", required=CODE_FILES)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The byte fixture (tokenkit's code copied beside it when MTPC_THIRD_PARTY is set)."""
    import os

    exp, n = byte_expand(SPECIALS)
    src = None
    if os.environ.get("MTPC_THIRD_PARTY"):
        src = third_party("tokenkit_hf", required=CODE_FILES)
    return write_tpu_llama(tmp_path_factory.mktemp("tpu"), expand=exp, expand_size=n, layers=LAYERS, code=src)


def _native(ckpt, k=0, engine="auto"):
    bb = load_backbone(str(ckpt), lora_depth=k, dtype=torch.float64, engine=engine, lora_rank=4)
    if k:
        randomize_lora(bb, seed=1)
    return bb


# ------------------------------------------------------------------------------ the table itself


def test_table_finds_the_longest_suffix_by_hand():
    # tokens (forward): 0:"a" 1:"b" 2:"ab" 3:"cab" 4:"dcab" (maxlen 3: never) 5:"xb" with no "x" alone; 9 direct
    t = ExpandTable(
        expand_dict([[0], [1], [0, 1], [2, 0, 1], [3, 2, 0, 1], [7, 1], [9]], [9]), maxlen=3, size=7
    )
    ids = [2, 0, 1, 0, 5, 7, 1, 9, 1]
    #       c  a  b  a  ?  x  b  D  b
    assert t.expand(ids) == [0, 0, 3, 0, 0, 0, 5, 6, 1]
    # "cab" at 2 (longest, within maxlen 3); "?" and "x" alone have no key -> 0; "xb" via a node with no key;
    # the direct id 9 takes its single entry; after it "b" alone ("9b" is no key)
    assert ExpandTable(t_raw := expand_dict([[3, 2, 0, 1], [1]], []), maxlen=4, size=2).expand(
        [3, 2, 0, 1]
    ) == [0, 0, 0, 0]
    assert ExpandTable(t_raw, maxlen=3, size=2).expand([3, 2, 0, 1]) == [0, 0, 0, 1]  # maxlen cuts "dcab"


def test_state_is_incremental_and_follows_crops():
    from mtpc.backbones.tpu_llama import ExpandState

    exp, n = byte_expand(SPECIALS)
    t = ExpandTable(exp, maxlen=6, size=n)
    full = [BOS, *b"hello the world"]
    s = ExpandState(t)
    got = s.feed(full[:5]) + s.feed(full[5:6]) + s.feed(full[6:11])
    s.crop(9)
    got = got[:9] + s.feed(full[9:])
    assert got == t.expand(full) == s.eids
    s.feed(_ids(b"xyz"), start=3)  # a rejected draft replaced: later ids recomputed from the new history
    assert s.eids == t.expand(full[:3] + _ids(b"xyz"))


@pytest.mark.parametrize(
    "raw,match",
    [
        ([{"2,1": 0}, []], r"maps to 0"),
        ([{"2,1": 9}, []], r"\[1, 3\]"),
        ([{"2": 1}, [5]], r"direct ids"),
        ({}, "expected"),
    ],
)
def test_bad_dictionaries_are_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        ExpandTable(raw, maxlen=2, size=3)


# ------------------------------------------------------------------------------ loading, refusals


def test_loads_without_remote_code_and_refuses_what_it_does_not_implement(ckpt, tmp_path):
    import json

    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["auto_map"] and raw["model_type"] == "tpu_llama"
    check_remote_code(str(ckpt), False, None, raw)  # the auto_map code is never run: no consent needed
    bb = load_backbone(str(ckpt), dtype=torch.float64)  # trust_remote_code defaults to False
    assert bb.engine == "compact" and type(bb.model).__name__ == "ExpandedLlamaForCausalLM"
    assert bb.model.expand.table.entries == len(BYTE_TOKENS) + len(SPECIALS)
    cfg = bb.model.config
    assert (cfg.num_key_value_heads, cfg.tie_word_embeddings) == (2, False)
    assert not torch.equal(bb.model.lm_head.weight, bb.model.model.embed_tokens.weight)
    for field, value, match in [
        ("add_qk_norm", True, "add_qk_norm=True"), ("skip_out_norm", True, "skip_out_norm=True"),
        ("hidden_act", "gelu", "hidden_act='gelu'"), ("sliding_window", 8, r"\['sliding_window'\]"),
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type='linear'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            tpu_llama_config({**raw, field: value})
    bad = tmp_path / "bad"
    write_tpu_llama(bad, expand=[{"2": 1}, []], expand_size=1, layers=1, add_qk_norm=True)
    with pytest.raises(
        ValueError,
        match=r"^backbone '.*bad': config field add_qk_norm=True is not implemented \(tokenkit's modelling code ignores it\)$",
    ):
        load_backbone(str(bad), dtype=torch.float64)


def test_without_expanded_ids_it_is_a_stock_llama(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    d = write_tpu_llama(tmp_path / "plain", expand=None, layers=2)
    bb = load_backbone(str(d), dtype=torch.float64)
    assert bb.model.expand is None and bb.engine == "compact"
    stock = LlamaForCausalLM(bb.model.config).double().eval()
    stock.load_state_dict(load_file(str(d / "model.safetensors")))
    x = torch.tensor([[BOS] + _ids(PROMPTS[0])])
    with torch.inference_mode():
        ref = stock(x).logits[0]
        assert_close(bb.model(x).logits[0], ref, rtol=0, atol=1e-12)
        assert_close(make_engine(bb, 64).feed(x[0]).p_logits, ref, rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------ engines (native reference)


def _run_script(engine, reference, atol=1e-10):
    """Feeds SCRIPT; after each call the engine's logits equal `reference(held ids (1, S))[-T:]`."""
    held: list[int] = []
    for chunk, crop in SCRIPT:
        ids = _ids(chunk)
        held += ids
        with torch.inference_mode():
            out = engine.feed(torch.tensor(ids))
            ref = reference(torch.tensor([held]))[0, -len(ids) :]
        assert_close(out.p_logits, ref, rtol=0, atol=atol)
        if crop is not None:
            engine.crop(crop)
            held = held[:crop]
    return held


@pytest.mark.parametrize("engine", ["compact", "hf"])
@pytest.mark.parametrize("k", [0, 1, LAYERS])
def test_engines_equal_the_native_forward_and_the_expansion_matters(ckpt, k, engine):
    bb = _native(ckpt, k, engine)
    _run_script(make_engine(bb, 96), lambda x: bb.model(x).logits)
    x = torch.tensor([[BOS] + _ids(PROMPTS[1])])
    with torch.inference_mode():
        with_e = bb.model(x).logits
        w = bb.model.expand.weight
        saved = w.detach().clone()
        w.data.zero_()
        without = bb.model(x).logits
        w.data.copy_(saved)
    assert (with_e - without).abs().max() > 1e-2  # not vacuous: the expanded embedding moves the logits


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_batched_plain_decoding_feeds_each_rows_expanded_ids(ckpt, mode):
    """The offline evaluation's batched continuations (LlamaBatchEngine, rows in groups) equal
    batch-1 plain decoding on the byte Llama: every step adds each row's own expanded-id embedding."""
    from mtpc.speculative.loop import DecodeConfig
    from mtpc.speculative.offline import continuations

    bb = _native(ckpt, 0, "compact")
    prompts = [torch.tensor([BOS, *_ids(p)]) for p in PROMPTS]
    cfg = DecodeConfig(max_new_tokens=20, mode=mode, eos_id=EOS, ban_eos=True)
    one = continuations(bb, prompts, cfg, seeds=[3, 4, 5], batch_size=1)
    assert continuations(bb, prompts, cfg, seeds=[3, 4, 5], batch_size=3) == one
    assert (
        continuations(bb, prompts, cfg, seeds=[3, 4, 5], batch_size=3, slot_budget=1) == one
    )  # a batch per row


def test_sampling_is_exact_by_enumeration(tmp_path):
    """keep decoding's distribution = plain decoding's, every random path enumerated (tiny vocab 4)."""
    from tests.mtpc import test_decoding_engines as tde
    from tests.mtpc.test_decoding_engines import _program, _sparse_head
    from tests.speculative_helpers import enumerate_outcomes, total_variation

    exp = expand_dict([[0], [1], [2], [3], [2, 0], [0, 3], [3, 2, 0], [0, 0]], [1])
    d = write_tpu_llama(tmp_path / "v4", vocab=4, hidden=16, layers=2, heads=2, kv_heads=1, bos=0, eos=1,
                        expand=exp, expand_size=8, maxlen=3)  # fmt: skip
    for engine in ("compact", "hf"):
        bb = _native(d, 1, engine)
        m = MtpcModel.from_components(
            bb, {"kind": "btree", "window": 3, "rank": 2, "lora_depth": 1, "seed": 1}
        )
        prompt = torch.tensor([2, 0, 3])
        head_fn = _sparse_head(m, allowed=(0, 3))
        tde._seen.clear()
        plain = enumerate_outcomes(_program(m, head_fn, engine, prompt, 4, True, 0.9))
        keep = enumerate_outcomes(_program(m, head_fn, engine, prompt, 4, False, 0.9))
        assert abs(sum(plain.values()) - 1) < 1e-12 and len(plain) > 4
        assert total_variation(keep, plain) < 1e-10
        assert {s for s, _ in tde._seen} == {
            0,
            1,
            2,
        }  # full acceptance, rejections (crops) and s = 1 all occur


# ------------------------------------------------------------------------------ against tokenkit's code


@pytest.mark.realmodel
def test_expanded_ids_equal_tokenkits_and_multi_byte_entries_fire(ckpt, code):
    tk = tokenkit_model(ckpt)
    mod = sys.modules[type(tk).__module__]
    bb = _native(ckpt)
    fired = 0
    for p in PROMPTS + [[i for c, _ in SCRIPT for i in c]]:
        x = torch.tensor([[BOS] + _ids(p)])
        ref = mod.torch_expand_input_ids(x, tk.model.expand_input_ids_dict, tk.config.expand_input_ids_maxlen)
        assert torch.equal(bb.model.expand.rows(x), ref)
        one = mod.torch_expand_input_ids(x, tk.model.expand_input_ids_dict, 1)
        fired += int((ref != one).sum())  # positions whose id came from a multi-byte entry
    assert fired >= 40, fired


@pytest.mark.realmodel
@pytest.mark.parametrize("engine", ["compact", "hf"])
@pytest.mark.parametrize("k", [0, 1, LAYERS])
def test_engine_logits_equal_tokenkits_over_prefill_steps_verifies_and_crops(ckpt, code, k, engine):
    tk = tokenkit_model(ckpt)
    bb = _native(ckpt, k, engine)
    eng = make_engine(bb, 96)
    _run_script(eng, lambda x: tk(x).logits)
    if k:  # the draft top's hidden state: the adapter's HF layers on the whole sequence
        held = _ids(SCRIPT[-2][0]) + _ids(SCRIPT[-1][0])
        with torch.inference_mode():
            eng.crop(0)
            out = eng.feed(torch.tensor(held))
            assert_close(out.draft_hidden, bb(torch.tensor([held])).draft_hidden[0], rtol=0, atol=1e-10)


@pytest.mark.realmodel
def test_tokenkits_cached_generation_equals_its_full_forward(ckpt, code):
    """The oracle itself: tokenkit's cached forward with past_input_ids = its uncached one."""
    from transformers import DynamicCache

    tk = tokenkit_model(ckpt)
    x = torch.tensor([[BOS] + _ids(PROMPTS[0])])
    with torch.inference_mode():
        cache = DynamicCache()
        tk(x[:, :10], past_key_values=cache, use_cache=True)
        step = tk(x[:, 10:], past_key_values=cache, use_cache=True, past_input_ids=x).logits
        assert_close(step, tk(x).logits[:, 10:], rtol=0, atol=1e-10)


@pytest.mark.realmodel
@pytest.mark.parametrize("engine", ["compact", "hf"])
def test_plain_and_speculative_greedy_equal_tokenkits_generate(ckpt, code, engine):
    tk = tokenkit_model(ckpt)
    bb = _native(ckpt, 1, engine)
    from mtpc.heads import HeadConfig, MtpcHead

    head = MtpcHead(HeadConfig("cp", 3, 2, bb.vocab_size, bb.hidden_size, lora_depth=1), dtype=bb.dtype)
    head.init_from_unembeddings(bb.lm_head_weight.detach(), noise=0.5)
    m = MtpcModel.from_components(bb, head)
    for p in PROMPTS:
        x = torch.tensor([[BOS] + _ids(p)])
        with torch.inference_mode():
            ref = tk.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                              suppress_tokens=[EOS], pad_token_id=EOS)[0, x.shape[1]:]  # fmt: skip
        plain = m.generate_plain(x[0], max_new_tokens=24, ban_eos=True)
        spec = m.generate(x[0], max_new_tokens=24, ban_eos=True)
        assert plain.ids.tolist() == ref.tolist() == spec.ids.tolist()
        assert spec.stats.cycles > 0  # every cycle verified drafted bytes (rejected here: crops after them)


# ------------------------------------------------------------------------------ the chat path


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """A vocab-512 byte Llama with a byte-converted Llama-3 tokenizer saved beside it."""
    from tests.tpu_llama_helpers import llama3_byte_tokenizer

    exp, n = byte_expand([256, 265])
    d = write_tpu_llama(tmp_path_factory.mktemp("chat"), vocab=512, bos=256, eos=[257, 265], expand=exp,
                        expand_size=n, layers=2)  # fmt: skip
    llama3_byte_tokenizer().save_pretrained(d)
    return d


def test_byte_llama3_tokenizer_template_mask_and_raw_bytes(chat_ckpt):
    from mtpc.tokenizer import HFChatTokenizer

    bb = load_backbone(str(chat_ckpt), dtype=torch.float64)  # tokenizer without remote code too
    tok = bb.tokenizer
    assert isinstance(tok, HFChatTokenizer) and tok.byte_ids == list(range(256))
    BOT, SH, EH, EOT = 256, 262, 263, 265
    assert bb.eos_token_id == EOT and bb.bos_token_id == BOT  # turns end with <|eot_id|>, not <|end_of_text|>
    raw = b"caf\xc3\xa9 \xff\xfe\x80 \x00end"  # invalid UTF-8 and a NUL, byte for byte
    assert tok.encode(raw) == list(raw) and tok.decode(tok.encode(raw)) == raw
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": raw},
            {"role": "assistant", "content": b"ok \xff"}, {"role": "user", "content": "again"}]  # fmt: skip

    def turn(role, body):
        return [SH, *role.encode(), EH, *b"\n\n", *body, EOT]

    ids, mask = tok.apply_chat_template(msgs)
    assert ids == [
        BOT,
        *turn("system", b"Be brief."),
        *turn("user", raw),
        *turn("assistant", b"ok \xff"),
        *turn("user", b"again"),
    ]
    start = (
        1
        + len(turn("system", b"Be brief."))
        + len(turn("user", raw))
        + len([SH, *b"assistant", EH, *b"\n\n"])
    )
    assert [i for i, m in enumerate(mask) if m] == list(
        range(start, start + 5)
    )  # "ok \xff" and its <|eot_id|>
    assert ids[start + 4] == EOT
    prompt = tok.render_prompt("hi")
    assert prompt == [BOT, *turn("user", b"hi"), SH, *b"assistant", EH, *b"\n\n"]
    valid = [
        *msgs[:1],
        {"role": "user", "content": raw.decode("utf-8", "replace")},
        {"role": "assistant", "content": "é"},
    ]
    text = tok.hf.apply_chat_template(valid, tokenize=False)
    assert (
        tok.apply_chat_template(valid)[0] == tok.hf(text, add_special_tokens=False).input_ids
    )  # = HF's own ids
    assert tok.decode(ids, keep_special=True).startswith(b"<|begin_of_text|><|start_header_id|>system")


def test_generation_stops_on_eot(chat_ckpt):
    bb = load_backbone(str(chat_ckpt), dtype=torch.float64)
    m = MtpcModel.from_components(bb, {"kind": "cp", "window": 3, "rank": 2, "seed": 0})
    free = m.generate_plain("hi", max_new_tokens=40).ids.tolist()
    assert len(free) == 40 and 265 not in free
    with (
        torch.no_grad()
    ):  # <|eot_id|> wins wherever the third generated byte did (its logit is positive there)
        bb.model.lm_head.weight[265] = bb.model.lm_head.weight[free[2]] * 1.01
    for out in (m.generate_plain("hi", max_new_tokens=40), m.generate("hi", max_new_tokens=40)):
        ids = out.ids.tolist()
        assert ids[-1] == 265 and len(ids) <= 3 and ids[:-1] == free[: len(ids) - 1]  # stopped on <|eot_id|>
