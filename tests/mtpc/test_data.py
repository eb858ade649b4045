"""Chat data: loader formats and malformed input, the ShareGPT build (synthetic and real), packing."""

import json
import threading

import pytest
import torch

import mtpc.data as data
from mtpc.data import PackedData, build_sharegpt, chat_key, is_heldout, load_messages, pack, sharegpt_corpus
from mtpc.tokenizer import EOS_ID, PAD_ID, ByteTokenizer

GOOD = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_jsonl_and_json(tmp_path):
    rows = [GOOD, {"messages": GOOD["messages"]}]
    got = load_messages(_jsonl(tmp_path / "d.jsonl", rows))
    assert got[0] == GOOD and got[1]["id"] == "d.jsonl:2"
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=2))
    got = load_messages(tmp_path / "d.json")
    assert [g["messages"] for g in got] == [GOOD["messages"]] * 2 and got[1]["id"] == "d.json:15"


def test_sharegpt_style_records_are_converted(tmp_path):
    rec = {"id": "x_0", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    (got,) = load_messages(_jsonl(tmp_path / "s.jsonl", [rec]))
    assert got == {
        "id": "x_0",
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    }


@pytest.mark.parametrize(
    "bad, match",
    [
        ('{"id": "b", "messages": [', r"b\.jsonl:2: invalid JSON"),
        ({"id": "b", "text": "no messages"}, r"b\.jsonl:2: record has no 'messages'"),
        ({"id": "b", "messages": [{"role": "user", "content": "  "}]}, r"b\.jsonl:2: messages\[0\].*empty"),
        (
            {"id": "b", "messages": [{"role": "robot", "content": "x"}]},
            r"b\.jsonl:2: messages\[0\] has role 'robot'",
        ),
        ({"id": "b", "messages": []}, r"b\.jsonl:2: 'messages' must be a non-empty list"),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path, bad, match):
    path = _jsonl(tmp_path / "b.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=match):
        load_messages(path)
    with pytest.warns(UserWarning, match=r"skipped 1 malformed record\(s\), kept 2"):
        assert load_messages(path, on_error="skip") == [GOOD, GOOD]


def test_malformed_json_list_names_line(tmp_path):
    path = tmp_path / "l.json"
    path.write_text('[\n {"messages": [{"role": "user", "content": "x"}]},\n {"messages": 3}\n]')
    with pytest.raises(ValueError, match=r"l\.json:3: 'messages' must be a non-empty list"):
        load_messages(path)
    with pytest.raises(ValueError, match="expected a .json or .jsonl"):
        (tmp_path / "x.txt").write_text("")
        load_messages(tmp_path / "x.txt")
    with pytest.raises(ValueError, match="not loadable by datasets"):
        load_messages(tmp_path / "missing-dir-or-hub-name")
    with pytest.raises(ValueError, match="on_error"):
        load_messages(path, on_error="ignore")


def test_load_through_hf_datasets(tmp_path):
    d = tmp_path / "hfds"
    d.mkdir()
    _jsonl(d / "train.jsonl", [GOOD, {**GOOD, "id": "b"}])
    got = load_messages(str(d))
    assert [g["id"] for g in got] == ["a", "b"] and got[0]["messages"] == GOOD["messages"]


def _sharegpt_file(path, n_chats=40, cut=True):
    recs = []
    for c in range(n_chats):
        for piece in range(2):
            user = f"question number {c} piece {piece}, long enough"
            recs.append(
                {
                    "id": f"chat{c}_{piece}",
                    "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "ok"}],
                }
            )
    recs.append(
        {
            "id": "fr_0",
            "conversations": [{"from": "human", "value": "é" * 40}, {"from": "gpt", "value": "ça"}],
        }
    )
    recs.append({"id": "empty_0", "conversations": []})
    recs.append(
        {
            "id": "dup_0",
            "conversations": [
                {"from": "human", "value": "question number 0 piece 0, long enough"},
                {"from": "gpt", "value": "x"},
            ],
        }
    )
    text = json.dumps(recs, indent=1)
    if cut:
        text = text[:-1] + ',\n {"id": "cut_0", "conversations": [{"from": "human", "value": "trunc'
    path.write_text(text)
    return path


def test_build_sharegpt_synthetic(tmp_path):
    corpus = build_sharegpt(_sharegpt_file(tmp_path / "sg.json"), progress=False)
    s = corpus.stats
    assert s["records"] == 83 and s["truncated_tail"] == 1 and s["non_english"] == 1 and s["malformed"] == 1
    assert s["train"] + s["heldout"] == 81 and s["heldout"] > 0 and s["train"] > 0
    # pieces of one chat stay on one side; the split is a pure function of the chat id
    sides = {}
    for conv, held in [(c, False) for c in corpus.train] + [(c, True) for c in corpus.heldout]:
        assert sides.setdefault(chat_key(conv["id"]), held) == held == is_heldout(conv["id"])
    # prompts: first user turn of held-out first pieces, never a training user turn
    train_users = {m["content"] for c in corpus.train for m in c["messages"] if m["role"] == "user"}
    expected = [c["messages"][0]["content"] for c in corpus.heldout if c["id"].endswith("_0")]
    expected = [p for p in expected if p not in train_users]
    assert corpus.heldout_prompts == expected and len(set(expected)) == len(expected)
    assert build_sharegpt(_sharegpt_file(tmp_path / "sg2.json"), progress=False).heldout_prompts == expected


def test_is_heldout_is_stable():
    # sha1-based, so fixed across processes and Python versions (hash() is salted)
    assert [is_heldout(f"c{i}_3") for i in range(12)] == [is_heldout(f"c{i}_0") for i in range(12)]
    assert sum(is_heldout(f"chat{i}") for i in range(4000)) in range(340, 460)  # ~10 %


def test_corpus_cache_builds_once_under_lock(tmp_path, monkeypatch):
    src = _sharegpt_file(tmp_path / "sg.json")
    monkeypatch.setattr(data, "sharegpt_file", lambda: src)
    calls = []
    real_build = data.build_sharegpt
    monkeypatch.setattr(data, "build_sharegpt", lambda *a, **k: calls.append(1) or real_build(*a, **k))
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(sharegpt_corpus(tmp_path / "cache", progress=False)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3
    assert all(
        r.train == results[0].train and r.heldout_prompts == results[0].heldout_prompts for r in results
    )
    assert (tmp_path / "cache" / "data" / data.CORPUS_VERSION / "stats.json").is_file()


@pytest.mark.slow
def test_real_sharegpt_counts():
    """The bundled corpus (built once into MTPC_CACHE_DIR / ~/.cache/mtpc, then reused)."""
    corpus = sharegpt_corpus(progress=False)
    assert corpus.stats["records"] == 17671 and corpus.stats["truncated_tail"] == 1
    assert len(corpus.train) == 15491 and len(corpus.heldout) == 1761
    assert len(corpus.heldout_prompts) == 783
    assert all(16 <= len(p) <= 2000 for p in corpus.heldout_prompts)
    train_users = {m["content"].strip() for c in corpus.train for m in c["messages"] if m["role"] == "user"}
    assert not train_users.intersection(corpus.heldout_prompts)
    assert {chat_key(c["id"]) for c in corpus.train}.isdisjoint(chat_key(c["id"]) for c in corpus.heldout)


def test_pack_layout():
    tok = ByteTokenizer()
    convs = [
        GOOD,
        {
            "id": "b",
            "messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "defgh"}],
        },
    ]
    stream, smask = [], []
    for c in convs:
        ids, m = tok.apply_chat_template(c["messages"])
        stream += ids
        smask += m
    packed = pack(convs, tok, seq_len=8)
    assert isinstance(packed, PackedData) and len(packed) == 3  # 9 + 13 = 22 ids -> 3 rows of 8
    assert packed.input_ids.dtype == torch.long and packed.score_mask.dtype == torch.bool
    flat = packed.input_ids.flatten().tolist()
    assert flat[:22] == stream and flat[22:] == [PAD_ID, PAD_ID]
    assert packed.score_mask.flatten().tolist() == smask + [False, False]
    assert packed.doc_ids.tolist() == [
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 1, 1],  # conv a ends at index 8; conv b starts in row 1
        [0, 0, 0, 0, 0, 0, -1, -1],  # b continues as a new document of row 2, then padding
    ]
    assert packed.input_ids[0, 0] != EOS_ID
    assert len(pack(convs * 10, tok, seq_len=8, max_rows=2)) == 2
    with pytest.raises(ValueError, match="seq_len"):
        pack(convs, tok, seq_len=1)
    with pytest.raises(ValueError, match="no conversations"):
        pack([], tok, seq_len=8)


def test_byte_stream_packs_exactly_like_pack(tmp_path):
    """write_stream -> read_stream -> pack_stream is pack (ids, assistant mask, documents, cuts),
    for system/user/assistant turns, multi-byte UTF-8, rows that cut documents, and padding."""
    convs = [
        {
            "id": f"c{i}",
            "messages": [
                *([{"role": "system", "content": "be brief"}] if i % 3 == 0 else []),
                {"role": "user", "content": f"question {i} — ünïcödé?"},
                {"role": "assistant", "content": "answer " * (i % 5 + 1)},
                *(
                    [{"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
                    if i % 2
                    else []
                ),
            ],
        }
        for i in range(23)
    ]
    path = tmp_path / "s.u8.xz"
    n = data.write_stream(convs, path)
    ids = data.read_stream(path)
    assert len(ids) == n and ids.dtype.name == "int64"
    for seq_len, max_rows in ((37, None), (64, 5), (1000, None)):
        a = pack(convs, ByteTokenizer(), seq_len, max_rows=max_rows)
        b = data.pack_stream(ids, seq_len, max_rows=max_rows)
        for f in ("input_ids", "score_mask", "doc_ids"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (seq_len, f)
        assert a.cut_documents == b.cut_documents


def test_byte_stream_refuses_bytes_in_the_special_range(tmp_path):
    bad = [
        {
            "id": "x",
            "messages": [{"role": "user", "content": b"\xff\xfe"}, {"role": "assistant", "content": "a"}],
        }
    ]
    with pytest.raises(ValueError, match="0xFF is in the special range"):
        data.write_stream(bad, tmp_path / "b.u8.xz")
    (tmp_path / "junk.u8.xz").write_bytes(b"not xz")
    with pytest.raises(ValueError, match="junk.u8.xz: not an xz byte stream"):
        data.read_stream(tmp_path / "junk.u8.xz")


def test_corpus_cache_cut_at_a_line_boundary_is_refused(tmp_path, monkeypatch):
    src = _sharegpt_file(tmp_path / "sg.json")
    monkeypatch.setattr(data, "sharegpt_file", lambda: src)
    full = sharegpt_corpus(tmp_path / "cache", progress=False)
    cached = tmp_path / "cache" / "data" / data.CORPUS_VERSION / "train.jsonl"
    lines = cached.read_text().splitlines(keepends=True)
    cached.write_text("".join(lines[: len(lines) // 3]))  # cut at a line boundary: still valid JSONL
    with pytest.raises(ValueError, match=r"train\.jsonl: sha256 differs .*stats\.json.*delete .* to rebuild"):
        sharegpt_corpus(tmp_path / "cache", progress=False)
    # a cache from before the checksums: the row count in stats.json still catches the cut
    stats_path = cached.parent / "stats.json"
    stats = json.loads(stats_path.read_text())
    del stats["sha256"]
    stats_path.write_text(json.dumps(stats))
    with pytest.raises(
        ValueError, match=rf"train\.jsonl: {len(lines) // 3} rows, but .* says {len(full.train)}"
    ):
        sharegpt_corpus(tmp_path / "cache", progress=False)


def test_a_killed_build_leaves_no_temporary_behind_the_next_build(tmp_path, monkeypatch):
    import subprocess
    import sys

    src = _sharegpt_file(tmp_path / "sg.json")
    monkeypatch.setattr(data, "sharegpt_file", lambda: src)
    root = tmp_path / "cache" / "data"
    pid = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )
    stale = root / f"{data.CORPUS_VERSION}.tmp{pid}"  # what kill -9 during a build leaves
    stale.mkdir(parents=True)
    (stale / "train.jsonl").write_text("{}\n" * 1000)
    sharegpt_corpus(tmp_path / "cache", progress=False)
    assert not stale.exists()
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [data.CORPUS_VERSION, f"{data.CORPUS_VERSION}.lock"]
    )
