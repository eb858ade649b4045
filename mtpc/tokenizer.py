"""Byte tokenizer (vocab 320) and chat template with an assistant mask.

Holds `ByteTokenizer`, the tokenizer of the embedded default model: ids 0..255 are the raw bytes,
then a few special ids, padded to 320 ids like EvaByte. Any byte string (invalid UTF-8 included)
round-trips through `encode`/`decode`.

Chat template (one conversation = one id list):

    BOS  (ROLE content END)*            ROLE in {SYSTEM, USER, ASSISTANT}

where END is `EOS_ID` after an assistant turn (the stop token: generation ends there) and
`END_TURN_ID` after a system or user turn. The assistant mask is True exactly on the bytes of
assistant contents and their closing EOS (what a chat model must learn to produce); role markers
are written by the template and never scored.

Also holds `HFChatTokenizer`, a thin wrapper that gives a Hugging Face tokenizer (real checkpoints
ship their own tokenizer and template) the same methods. A byte-level one (every ordinary token
one byte in the GPT-2 byte-to-character mapping, as a byte-converted Llama-3 tokenizer: 256 bytes
+ Llama-3 specials) keeps raw bytes exact: bytes map to ids one to one (invalid UTF-8 included),
and the chat template's text is split at special tokens and its other characters turned back
into the bytes they stand for (bytes in message contents pass the template as surrogate escapes).
Leaves out: any learned vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
SYSTEM_ID = 259
USER_ID = 260
ASSISTANT_ID = 261
END_TURN_ID = 262
VOCAB_SIZE = 320  # 256 bytes + specials, padded like EvaByte

ROLE_IDS = {"system": SYSTEM_ID, "user": USER_ID, "assistant": ASSISTANT_ID}
SPECIAL_NAMES = {
    PAD_ID: "<|pad|>",
    BOS_ID: "<|bos|>",
    EOS_ID: "<|eos|>",
    SYSTEM_ID: "<|system|>",
    USER_ID: "<|user|>",
    ASSISTANT_ID: "<|assistant|>",
    END_TURN_ID: "<|end_turn|>",
}
CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_CLASS = "mtpc.ByteTokenizer"


def _check_messages(messages: Sequence[dict]) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(
            f"messages: expected a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLE_IDS:
            raise ValueError(f"messages[{i}]['role'] = {m['role']!r}: expected one of {sorted(ROLE_IDS)}")
        if not isinstance(m["content"], (str, bytes)):
            raise ValueError(
                f"messages[{i}]['content']: expected str or bytes, got {type(m['content']).__name__}"
            )


class ByteTokenizer:
    """Bytes 0..255 plus specials; see the module docstring for the chat template."""

    vocab_size = VOCAB_SIZE
    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID

    def encode(self, text: str | bytes) -> list[int]:
        """Raw bytes of `text` (UTF-8 for str), no special ids added."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        elif not isinstance(text, (bytes, bytearray)):
            raise ValueError(f"text: expected str or bytes, got {type(text).__name__}")
        return list(text)

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> bytes:
        """Bytes of the byte ids; special ids are dropped (or rendered as `<|name|>` with keep_special)."""
        out = bytearray()
        for i in ids.tolist() if hasattr(ids, "tolist") else ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif 256 <= i < VOCAB_SIZE:
                if keep_special:
                    out += SPECIAL_NAMES.get(i, f"<|{i}|>").encode()
            else:
                raise ValueError(f"ids: id {i} is outside the vocabulary [0, {VOCAB_SIZE})")
        return bytes(out)

    def decode_text(self, ids: Sequence[int], keep_special: bool = False) -> str:
        """`decode` as text; invalid UTF-8 becomes U+FFFD."""
        return self.decode(ids, keep_special=keep_special).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]:
        """Render a conversation; returns (ids, assistant_mask) of equal length.

        With `add_generation_prompt` the ids end with the assistant marker (ready to generate).
        """
        _check_messages(messages)
        ids, mask = [BOS_ID], [False]
        for m in messages:
            body = self.encode(m["content"])
            is_assistant = m["role"] == "assistant"
            ids.append(ROLE_IDS[m["role"]])
            mask.append(False)
            ids += body
            ids.append(EOS_ID if is_assistant else END_TURN_ID)
            mask += [is_assistant] * (len(body) + 1)
        if add_generation_prompt:
            ids.append(ASSISTANT_ID)
            mask.append(False)
        return ids, mask

    def render_prompt(self, user_text: str | bytes, system: str | None = None) -> list[int]:
        """A one-turn chat (optional system turn) ending in the assistant marker."""
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_text}
        ]
        return self.apply_chat_template(messages, add_generation_prompt=True)[0]

    # -- files, so a saved default model carries its tokenizer ---------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = {
            "tokenizer_class": TOKENIZER_CLASS,
            "vocab_size": VOCAB_SIZE,
            "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "role_ids": ROLE_IDS,
            "end_turn_id": END_TURN_ID,
            "special_tokens": {str(k): v for k, v in SPECIAL_NAMES.items()},
            "chat_template": "BOS (ROLE content END)*; END = EOS after assistant, END_TURN otherwise",
        }
        (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def is_saved_in(cls, directory: str | Path) -> bool:
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            return False
        try:
            return json.loads(path.read_text()).get("tokenizer_class") == TOKENIZER_CLASS
        except json.JSONDecodeError:
            return False

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ByteTokenizer:
        path = Path(directory) / CONFIG_FILE
        if not cls.is_saved_in(directory):
            raise ValueError(
                f"{path}: not an mtpc byte tokenizer (expected tokenizer_class {TOKENIZER_CLASS!r})"
            )
        cfg = json.loads(path.read_text())
        if cfg.get("vocab_size") != VOCAB_SIZE or cfg.get("eos_token_id") != EOS_ID:
            raise ValueError(
                f"{path}: vocab_size/eos_token_id differ from this mtpc version's byte tokenizer"
            )
        return cls()


def byte_to_char() -> dict[int, str]:
    """The GPT-2 / ByteLevel mapping of the 256 bytes to printable characters (tokenizers' ByteLevel)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _byte_ids(hf: Any) -> list[int] | None:
    """ids of bytes 0..255 when every ordinary token of `hf` is one byte — a ByteLevel byte character
    (tokenkit) or the byte's own code point chr(b) (EvaByte) — else None."""
    try:
        vocab, added = hf.get_vocab(), hf.get_added_vocab()
    except (AttributeError, NotImplementedError):
        return None
    ordinary = {t for t in vocab if t not in added}
    for chars in (byte_to_char(), {b: chr(b) for b in range(256)}):
        if ordinary == set(chars.values()):
            return [vocab[chars[b]] for b in range(256)]
    return None


def _token_id(hf: Any, token: str) -> int | None:
    """The id of a special token the tokenizer knows, else None."""
    tid = dict(hf.get_added_vocab()).get(token) if hasattr(hf, "get_added_vocab") else None
    return tid if isinstance(tid, int) else None


class HFChatTokenizer:
    """A Hugging Face tokenizer behind the `ByteTokenizer` methods (real checkpoints).

    The assistant mask is found by rendering growing prefixes of the conversation with the
    checkpoint's own chat template and marking the ids each assistant turn adds. Unverified on the
    real byte checkpoints (they cannot be downloaded here).
    """

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.pad_token_id = hf_tokenizer.pad_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.byte_ids = _byte_ids(hf_tokenizer)  # byte -> id for a byte-level tokenizer, else None
        eot = _token_id(hf_tokenizer, "<|eot_id|>")  # Llama-3 chat turns end there
        self.stop_token_ids = tuple(t for t in (self.eos_token_id, eot) if t is not None)  # eos first
        self._id_byte = {i: b for b, i in enumerate(self.byte_ids or ())}
        self._specials: dict[str, int] = {}
        self._special_re = None
        if self.byte_ids is not None:
            import re

            self._specials = dict(hf_tokenizer.get_added_vocab())
            names = sorted(self._specials, key=len, reverse=True)
            self._special_re = (
                re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None
            )

    def encode(self, text: str | bytes) -> list[int]:
        if (
            self.byte_ids is not None
        ):  # raw bytes one to one (str: UTF-8, surrogate escapes back to their bytes)
            data = text if isinstance(text, (bytes, bytearray)) else text.encode("utf-8", "surrogateescape")
            return [self.byte_ids[b] for b in data]
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> bytes:
        if self.byte_ids is None:
            return self.decode_text(ids, keep_special).encode("utf-8")
        names = {i: t for t, i in self._specials.items()}
        out = bytearray()
        for i in ids.tolist() if hasattr(ids, "tolist") else ids:
            b = self._id_byte.get(int(i))
            if b is not None:
                out.append(b)
            elif int(i) not in names:
                raise ValueError(f"ids: id {int(i)} is neither a byte nor a special token of this tokenizer")
            elif keep_special:
                out += names[int(i)].encode("utf-8")
        return bytes(out)

    def decode_text(self, ids: Sequence[int], keep_special: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if self.byte_ids is not None:
            return self.decode(ids, keep_special).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=not keep_special)

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
        if self.byte_ids is not None:  # the template's text, split at special tokens, back to bytes
            msgs = [
                {**m, "content": m["content"].decode("utf-8", "surrogateescape")}
                if isinstance(m["content"], (bytes, bytearray)) else m
                for m in messages
            ]  # fmt: skip
            text = self.hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            pieces = self._special_re.split(text) if self._special_re is not None else [text]
            ids: list[int] = []
            for j, piece in enumerate(pieces):
                ids += [self._specials[piece]] if j % 2 else self.encode(piece)
            return ids
        out = self.hf.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]:
        _check_messages(messages)
        ids = self._render(messages, add_generation_prompt)
        mask = [False] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self._render(messages[:i], add_generation_prompt=True))
            end = len(self._render(messages[: i + 1], add_generation_prompt=False))
            for j in range(start, min(end, len(ids))):
                mask[j] = True
        return ids, mask

    def render_prompt(self, user_text: str | bytes, system: str | None = None) -> list[int]:
        if isinstance(user_text, bytes) and self.byte_ids is None:
            user_text = user_text.decode("utf-8", errors="replace")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_text}
        ]
        return self._render(messages, add_generation_prompt=True)
