"""Byte tokenizer: round-trips, the chat template's layout and its assistant mask, bad input."""

import random

import pytest

from mtpc.tokenizer import (
    ASSISTANT_ID,
    BOS_ID,
    END_TURN_ID,
    EOS_ID,
    SYSTEM_ID,
    USER_ID,
    VOCAB_SIZE,
    ByteTokenizer,
)


def test_round_trip_random_bytes():
    tok = ByteTokenizer()
    rng = random.Random(1)
    for n in [0, 1, 7, 300]:
        data = bytes(rng.randrange(256) for _ in range(n))  # invalid UTF-8 included
        ids = tok.encode(data)
        assert all(0 <= i < 256 for i in ids) and len(ids) == n
        assert tok.decode(ids) == data


def test_text_round_trip_and_specials_dropped():
    tok = ByteTokenizer()
    text = "héllo wörld ✓"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())
    assert tok.decode_text([BOS_ID] + ids + [EOS_ID]) == text
    assert tok.decode([USER_ID, 104, EOS_ID], keep_special=True) == b"<|user|>h<|eos|>"
    assert tok.decode_text(tok.encode(b"\xff\xfe")) == "\ufffd\ufffd"


def test_chat_template_layout_and_mask():
    tok = ByteTokenizer()
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo!"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "é"},
    ]
    ids, mask = tok.apply_chat_template(msgs)
    expected = (
        [BOS_ID, SYSTEM_ID, ord("S"), END_TURN_ID, USER_ID, ord("h"), ord("i"), END_TURN_ID]
        + [ASSISTANT_ID, ord("y"), ord("o"), ord("!"), EOS_ID]
        + [USER_ID, ord("o"), ord("k"), END_TURN_ID, ASSISTANT_ID, 0xC3, 0xA9, EOS_ID]
    )
    assert ids == expected
    assert len(mask) == len(ids)
    # exactly the assistant content bytes and each assistant turn's closing EOS
    scored = [i for i, m in zip(ids, mask, strict=True) if m]
    assert scored == [ord("y"), ord("o"), ord("!"), EOS_ID, 0xC3, 0xA9, EOS_ID]
    assert [j for j, m in enumerate(mask) if m] == [9, 10, 11, 12, 18, 19, 20]


def test_render_prompt_ends_with_assistant_marker():
    tok = ByteTokenizer()
    ids = tok.render_prompt("Why?")
    assert ids == [BOS_ID, USER_ID, *b"Why?", END_TURN_ID, ASSISTANT_ID]
    gen_ids, gen_mask = tok.apply_chat_template(
        [{"role": "user", "content": "Why?"}], add_generation_prompt=True
    )
    assert gen_ids == ids and not any(gen_mask)


def test_save_and_load(tmp_path):
    ByteTokenizer().save_pretrained(tmp_path)
    assert ByteTokenizer.is_saved_in(tmp_path)
    assert ByteTokenizer.from_pretrained(tmp_path).vocab_size == VOCAB_SIZE
    with pytest.raises(ValueError, match="not an mtpc byte tokenizer"):
        ByteTokenizer.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "list"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": 3}], "content"),
    ],
)
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        ByteTokenizer().apply_chat_template(messages)


def test_bad_ids():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ByteTokenizer().decode([1, VOCAB_SIZE])


def _tiny_hf_tokenizer():
    """A byte-level HF fast tokenizer with a chat template, built in-process (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    hf.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return hf


def test_hf_chat_tokenizer_mask_and_prompt():
    from mtpc.tokenizer import HFChatTokenizer

    hf = _tiny_hf_tokenizer()
    tok = HFChatTokenizer(hf)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
    ]
    ids, mask = tok.apply_chat_template(msgs)
    assert len(ids) == len(mask)
    scored = [i for i, m in zip(ids, mask, strict=True) if m]
    assert hf.decode(scored) == "yo<|end|>"  # the assistant turn and its closing marker only
    prompt = tok.render_prompt("hi")
    assert hf.convert_ids_to_tokens(prompt[-1]) == "<|assistant|>"
    assert tok.decode_text(tok.encode("héllo")) == "héllo"
