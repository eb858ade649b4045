"""The on-disk continuation cache (mtpc/speculative/continuation_cache.py): what its key covers, a
corrupt entry recomputed with a warning, and two processes computing one key once. The evaluation
reusing it across heads is tested in tests/experiments/test_evaluate.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mtpc.speculative import offline
from mtpc.speculative.continuation_cache import (
    cache_root,
    cached_continuations,
    continuation_key,
    weights_fingerprint,
)
from mtpc.speculative.loop import DecodeConfig
from tests.mtpc.test_speculative import _peaked_backbone, _prompts

REPO = Path(__file__).resolve().parents[2]


def _cfg(bb, **kw):
    return DecodeConfig(
        **{"max_new_tokens": 8, "mode": "sample", "eos_id": bb.eos_token_id, "ban_eos": True, **kw}
    )


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = offline.continuations

    def wrapper(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(offline, "continuations", wrapper)
    wrapper.real = real
    wrapper.calls = calls
    return calls


def test_the_key_follows_weights_decode_config_prompts_and_seeds():
    bb = _peaked_backbone(0, vocab=6)
    prompts = _prompts(6, 3, seed=4)
    seeds = [7, 8, 9]
    key = lambda b=bb, p=prompts, s=seeds, **kw: continuation_key(b, p, _cfg(bb, **kw), s)[0]  # noqa: E731
    base = key()
    assert key() == base  # deterministic
    other = _peaked_backbone(0, vocab=6, seed=1)  # other weights, same shapes
    assert weights_fingerprint(other) != weights_fingerprint(bb) and key(b=other) != base
    nudged = _peaked_backbone(0, vocab=6)
    with torch.no_grad():
        nudged.model.model.layers[0].mlp.up_proj.weight.add_(1e-6)  # one tensor, slightly
    assert key(b=nudged) != base
    assert key(temperature=0.8) != base and key(top_p=0.9) != base and key(max_new_tokens=9) != base
    assert key(ban_eos=False) != base
    assert key(p=[prompts[0], prompts[1], torch.cat([prompts[2], prompts[2][:1]])]) != base
    assert key(s=[7, 8, 10]) != base
    # greedy ignores temperature, top_p and seeds: one entry serves every temperature pass
    g = lambda **kw: key(mode="greedy", **kw)  # noqa: E731
    assert g() == g(temperature=0.8, top_p=0.5) == g(s=[1, 2, 3]) != base
    # the verifier's weights only: a LoRA draft top on the same model shares the entry
    with_lora = _peaked_backbone(1, vocab=6)
    assert weights_fingerprint(with_lora) == weights_fingerprint(bb)


def test_large_tensors_are_sampled(monkeypatch):
    """Above SAMPLE elements a tensor contributes evenly spaced elements (first and last included)."""
    from mtpc.speculative import continuation_cache as cc

    bb, other = _peaked_backbone(0, vocab=6), _peaked_backbone(0, vocab=6, seed=1)
    monkeypatch.setattr(cc, "SAMPLE", 5)
    assert (
        weights_fingerprint(bb)
        == weights_fingerprint(_peaked_backbone(0, vocab=6))
        != weights_fingerprint(other)
    )
    before = weights_fingerprint(bb)
    with torch.no_grad():
        bb.model.lm_head.weight.view(-1)[-1] += 1.0  # the last element is always sampled
    assert weights_fingerprint(bb) != before


def test_an_entry_is_computed_once_and_read_back(counted):
    bb = _peaked_backbone(0, vocab=6)
    prompts, cfg = _prompts(6, 3, seed=4), _cfg(bb)
    first = cached_continuations(bb, prompts, cfg, [7, 8, 9])
    assert first == offline.continuations.real(
        bb, prompts, cfg, seeds=[7, 8, 9]
    )  # what it computes, uncached
    again = cached_continuations(bb, prompts, cfg, [7, 8, 9])
    assert again == first and len(counted) == 1
    assert len(list(cache_root().glob("*.json"))) == 1
    assert cached_continuations(bb, prompts, cfg, [7, 8, 9], cache=False) == first and len(counted) == 2
    assert len(list(cache_root().glob("*.json"))) == 1  # cache=False stores nothing


@pytest.mark.parametrize("damage", ["continuations", "checksum", "truncated", "not json"])
def test_a_corrupt_entry_is_recomputed_with_one_warning_naming_the_file(counted, damage):
    bb = _peaked_backbone(0, vocab=6)
    prompts, cfg = _prompts(6, 3, seed=4), _cfg(bb)
    ys = cached_continuations(bb, prompts, cfg, [7, 8, 9])
    (path,) = cache_root().glob("*.json")
    raw = path.read_text()
    entry = json.loads(raw)
    if damage == "continuations":  # a flipped byte the checksum catches
        entry["continuations"][0][0] = (entry["continuations"][0][0] + 1) % 6
        path.write_text(json.dumps(entry))
    elif damage == "checksum":
        entry["sha256"] = "0" * 64
        path.write_text(json.dumps(entry))
    elif damage == "truncated":
        path.write_text(raw[: len(raw) // 2])
    else:
        path.write_bytes(b"\xff\x00garbage")
    with pytest.warns(UserWarning) as rec:
        again = cached_continuations(bb, prompts, cfg, [7, 8, 9])
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and str(path) in msgs[0] and "corrupt" in msgs[0] and "\n" not in msgs[0]
    assert again == ys and len(counted) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten whole: read back without a warning
        assert cached_continuations(bb, prompts, cfg, [7, 8, 9]) == ys and len(counted) == 2


def _rewrite(path, ys):
    """Replace an entry's continuations and recompute its checksum with the module's own function:
    a writer of a shared cache (or a stale tool) the checksum does not stop."""
    from mtpc.speculative import continuation_cache as cc

    entry = json.loads(path.read_text())
    entry["continuations"], entry["sha256"] = ys, cc._checksum(entry["key"], ys)
    path.write_text(json.dumps(entry))


def _plausible(y, vocab, eos):
    """Another text of y's length the config allows (a loop over two ids, EOS avoided)."""
    a, b = [i for i in range(vocab) if i != eos][:2]
    loop = [a if j % 2 else b for j in range(len(y))]
    return loop if loop != y else [b if j % 2 else a for j in range(len(y))]


def _read_back_warns_once(bb, prompts, cfg, seeds, path, expected, counted, calls, phrase, **kw):
    with pytest.warns(UserWarning) as rec:
        again = cached_continuations(bb, prompts, cfg, seeds, **kw)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and str(path) in msgs[0] and phrase in msgs[0] and "\n" not in msgs[0], msgs
    assert again == expected and len(counted) == calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overwritten with the recomputed entry: read back without a warning
        assert cached_continuations(bb, prompts, cfg, seeds, **kw) == expected and len(counted) == calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("engine,batch", [("compact", 1), ("compact", 3), ("hf", 1)])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_genuine_entries_pass_the_verifier_check(counted, mode, engine, batch, dtype):
    """Entries decoded at batch 1 or batched (float32 near-ties) are read back without a warning."""
    bb = _peaked_backbone(0, vocab=6, engine=engine, dtype=dtype)
    prompts, cfg = _prompts(6, 5, seed=4), _cfg(bb, mode=mode, temperature=0.7, top_p=0.9)
    seeds = [7, 8, 9, 10, 11]
    first = cached_continuations(bb, prompts, cfg, seeds, batch_size=batch)
    assert offline.contradiction(bb, prompts, first, cfg, seeds) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_continuations(bb, prompts, cfg, seeds, batch_size=batch) == first and len(counted) == 1


@pytest.mark.parametrize("engine", ["compact", "hf"])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_a_rewritten_entry_with_its_checksum_recomputed_is_caught_by_the_verifier(counted, mode, engine):
    """Plausible text with a recomputed checksum was used silently (mu_acc 0.3953 for 0.3636, a derived
    speed-up of 2.39 for 0.67): each byte is now checked against the verifier's pass (its argmax, or
    the seed's draw), and the entry named, recomputed and overwritten."""
    bb = _peaked_backbone(0, vocab=6, engine=engine)
    prompts, cfg, seeds = _prompts(6, 3, seed=4), _cfg(bb, mode=mode), [7, 8, 9]
    ys = cached_continuations(bb, prompts, cfg, seeds)
    (path,) = cache_root().glob("*.json")
    _rewrite(path, [ys[0], _plausible(ys[1], 6, bb.eos_token_id), ys[2]])
    _read_back_warns_once(bb, prompts, cfg, seeds, path, ys, counted, 2, "prompt 1, byte")


def test_a_rewritten_entry_is_compared_with_the_callers_own_bytes(counted):
    """With `compute` (the evaluation's fused pass already holds the bytes) a hit is compared with them."""
    bb = _peaked_backbone(0, vocab=6)
    prompts, cfg, seeds = _prompts(6, 3, seed=4), _cfg(bb), [7, 8, 9]
    ys = cached_continuations(bb, prompts, cfg, seeds)
    (path,) = cache_root().glob("*.json")
    _rewrite(path, [_plausible(ys[0], 6, bb.eos_token_id), ys[1], ys[2]])
    _read_back_warns_once(bb, prompts, cfg, seeds, path, ys, counted, 1, "differ from the ones computed now",
                          compute=lambda: ys)  # fmt: skip


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("damage", ["id 320", "id 6", "negative id", "longer than asked", "empty"])
def test_an_entry_with_impossible_contents_is_recomputed_not_a_permanent_error(counted, damage, verify):
    """A valid checksum over impossible contents made every later evaluation of the key fail (in
    teacher_force, without naming the cache file); now named, recomputed and overwritten."""
    bb = _peaked_backbone(0, vocab=6)
    prompts, cfg, seeds = _prompts(6, 3, seed=4), _cfg(bb), [7, 8, 9]
    ys = cached_continuations(bb, prompts, cfg, seeds)
    (path,) = cache_root().glob("*.json")
    bad = [list(y) for y in ys]
    if damage.startswith("id"):
        bad[0][2] = int(damage.split()[1])
    elif damage == "negative id":
        bad[0][2] = -1
    elif damage == "empty":
        bad[0] = []
    else:
        bad[0].append(bad[0][0])
    _rewrite(path, bad)
    phrase = "is corrupt" if damage == "empty" else "continuations[0]"
    _read_back_warns_once(bb, prompts, cfg, seeds, path, ys, counted, 2, phrase, verify=verify)
    offline.teacher_force(bb, prompts, ys, cfg)  # what the evaluation does next: no error


@pytest.mark.parametrize("engine", ["compact", "hf"])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_cached_pass_checks_a_hit_on_the_pass_it_returns(counted, monkeypatch, mode, engine):
    """`cached_pass`: the entry read is checked on the teacher-forced pass the evaluation needs anyway
    (one pass a hit); a rewritten entry (top_p 0.5: forged bytes of probability 0, which teacher_force
    alone refuses) is named, recomputed and overwritten, and the pass runs over the recomputed texts."""
    from mtpc.speculative.continuation_cache import cached_pass

    bb = _peaked_backbone(1, vocab=6, engine=engine)
    prompts, cfg, seeds = _prompts(6, 3, seed=4), _cfg(bb, mode=mode, top_p=0.5), [7, 8, 9]
    passes = []
    real = offline._passes
    monkeypatch.setattr(offline, "_passes", lambda *a, **kw: passes.append(1) or real(*a, **kw))
    ys = cached_pass(bb, prompts, cfg, seeds).continuations
    ref = offline.teacher_force(bb, prompts, ys, cfg)
    passes.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf = cached_pass(bb, prompts, cfg, seeds)
    assert len(passes) == 1 and len(counted) == 1 and tf.contradiction is None and tf.continuations == ys
    assert all(torch.equal(a, b) for a, b in zip(tf.hidden, ref.hidden, strict=True))
    (path,) = cache_root().glob("*.json")
    _rewrite(path, [ys[0], ys[1], _plausible(ys[2], 6, bb.eos_token_id)])
    with pytest.warns(UserWarning) as rec:
        tf = cached_pass(bb, prompts, cfg, seeds)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and str(path) in msgs[0] and "prompt 2, byte" in msgs[0], msgs
    assert tf.continuations == ys and len(counted) == 2 and tf.contradiction is None
    assert all(torch.equal(a, b) for a, b in zip(tf.hidden, ref.hidden, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_pass(bb, prompts, cfg, seeds).continuations == ys and len(counted) == 2


_WORKER = """
import sys, time, torch
from mtpc.speculative import offline
from mtpc.speculative.continuation_cache import cached_continuations
from mtpc.speculative.loop import DecodeConfig
from tests.mtpc.test_speculative import _peaked_backbone, _prompts
torch.set_num_threads(1)
real = offline.continuations
def slow(*a, **kw):
    with open(sys.argv[1], "a") as f:
        f.write("computed\\n")
    time.sleep(2.0)  # long enough for the other process to find the lock taken
    return real(*a, **kw)
offline.continuations = slow
bb = _peaked_backbone(0, vocab=6)
cfg = DecodeConfig(max_new_tokens=8, mode="sample", eos_id=bb.eos_token_id, ban_eos=True)
with open(sys.argv[2], "w") as f:  # ready: both processes start asking at about the same moment
    f.write("ready")
import os
while not all(os.path.exists(p) for p in sys.argv[3:]):
    time.sleep(0.01)
print(cached_continuations(bb, _prompts(6, 3, seed=4), cfg, [7, 8, 9]))
"""


def test_two_processes_asking_at_once_compute_once(tmp_path):
    log = tmp_path / "computed.log"
    ready = [tmp_path / "ready0", tmp_path / "ready1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(log), str(ready[i]), *map(str, ready)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert log.read_text().count("computed") == 1
    assert outs[0][0] == outs[1][0] and outs[0][0].startswith("[[")
    assert len(list(cache_root().glob("*.json"))) == 1
