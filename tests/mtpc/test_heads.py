"""Tests for mtpc/heads.py: config validation, forward shapes and values, initialisation from
unembeddings (cp copy == ff exactly, symmetry breaking, hmm/btree near cp within the stated
bound), the App. G low-rank delta option, and export round trips / bad exports."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch

from mtpc import MtpcModel
from mtpc.heads import FORMAT_VERSION, HeadConfig, MtpcHead, load_head, random_head, save_head
from mtpc.names import CIRCUIT_KINDS

KINDS = CIRCUIT_KINDS


def make_head(kind, n=4, r=3, v=7, d=5, **kw):
    return MtpcHead(HeadConfig(kind, n, 1 if kind == "ff" else r, v, d, **kw))


def all_windows(v, n):
    return torch.tensor(list(itertools.product(range(v), repeat=n)))  # (v^n, n)


def joint(head, e, v, n):
    """log q(x) of every window for one context e (d,) -> (v^n,), via the circuit's log_prob."""
    x = all_windows(v, n)
    params = {k: t.expand(x.shape[0], *t.shape) for k, t in head(e).items()}
    return head.circuit.log_prob(params, x)


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kind="tree"), "kind"),
        (dict(window=0), "window"),
        (dict(window=65), "window"),
        (dict(rank=0), "rank"),
        (dict(kind="ff", rank=4), "rank"),
        (dict(vocab=1), "vocab"),
        (dict(hidden=0), "hidden"),
        (dict(lora_depth=-1), "lora_depth"),
        (dict(leaf_delta_rank=-2), "leaf_delta_rank"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    base = dict(kind="cp", window=4, rank=3, vocab=7, hidden=5)
    with pytest.raises(ValueError, match=rf"^{field}: .*expected"):
        HeadConfig(**{**base, **kwargs})


def test_check_compatible_names_field_and_expected_value():
    cfg = HeadConfig("cp", 4, 3, 320, 64)
    cfg.check_compatible(64, 320)
    with pytest.raises(ValueError, match=r"^hidden: .*expected hidden=128"):
        cfg.check_compatible(128, 320)
    with pytest.raises(ValueError, match=r"^vocab: .*expected vocab=256"):
        make_head("cp", v=320, d=64).check_compatible(64, 256)


# --- forward --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_forward_shapes_follow_param_shapes(kind):
    head = make_head(kind)
    e = torch.randn(2, 6, 5)
    out = head(e)
    assert set(out) == set(head.circuit.param_shapes)
    for name, shape in head.circuit.param_shapes.items():
        assert out[name].shape == (2, 6, *shape), name


@pytest.mark.parametrize("kind", ["cp", "hmm"])
def test_forward_values_are_linear_maps_of_e(kind):
    head = make_head(kind)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    e = torch.randn(3, 5)
    out = head(e)
    torch.testing.assert_close(out["leaves"], torch.einsum("nrvd,bd->bnrv", head.leaf_weight, e))
    for name in head.sum_names:
        w, b = head.sum_weight[name], head.sum_bias[name]
        torch.testing.assert_close(out[name], torch.einsum("...d,bd->b...", w, e) + b)


def test_bf16_input_is_upcast_to_head_dtype():
    head = make_head("cp")
    e = torch.randn(2, 5)
    torch.testing.assert_close(head(e.bfloat16())["leaves"], head(e.bfloat16().float())["leaves"])


# --- initialisation -------------------------------------------------------------------------


def test_init_positions_past_m_repeat_the_last_unembedding_and_ff_reproduces_stp():
    n, v, d = 5, 7, 4
    W0 = torch.randn(2, v, d)
    head = make_head("ff", n=n, v=v, d=d)
    head.init_from_unembeddings(W0)
    for i in range(n):
        torch.testing.assert_close(head.leaf_weight[i, 0], W0[min(i, 1)])
    e = torch.randn(3, d)
    x = torch.randint(0, v, (3, n))
    q = head.circuit.normalize(head(e))
    first = head.circuit._prefix_log_marginals(q, x)[:, 0]
    stp = torch.log_softmax(e @ W0[0].T, -1).gather(-1, x[:, :1]).squeeze(-1)
    torch.testing.assert_close(first, stp)


@pytest.mark.parametrize("delta_rank", [0, 2])
def test_cp_copy_is_exactly_ff(delta_rank):
    n, r, v, d = 3, 4, 5, 6
    W0 = torch.randn(n, v, d, dtype=torch.float64)
    ff = make_head("ff", n=n, v=v, d=d).double()
    cp = make_head("cp", n=n, r=r, v=v, d=d, leaf_delta_rank=delta_rank).double()
    ff.init_from_unembeddings(W0)
    cp.init_from_unembeddings(W0, noise=0.0)
    e = torch.randn(d, dtype=torch.float64)
    a, b = joint(ff, e, v, n), joint(cp, e, v, n)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    assert abs(a.exp().sum().item() - 1) < 1e-12


def _train_cp(noise, steps=5):
    n, r, v, d = 3, 3, 6, 8
    torch.manual_seed(1)
    head = make_head("cp", n=n, r=r, v=v, d=d)
    head.init_from_unembeddings(torch.randn(n, v, d), noise=noise)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    e = torch.randn(32, d)
    x = torch.randint(0, v, (32, n))
    for _ in range(steps):
        opt.zero_grad()
        (-head.circuit.log_prob(head(e), x).mean()).backward()
        opt.step()
    W = head.leaf_weight.detach()  # (n, r, v, d)
    return (W[:, 1:] - W[:, :1]).norm().item()


def test_identical_components_stay_identical_and_noise_breaks_symmetry():
    assert _train_cp(noise=0.0, steps=20) < 1e-6  # the reason the noise option exists
    # with noise, gradients differ per component, so the spread grows beyond the initial noise
    assert _train_cp(noise=0.05, steps=20) > 2 * _train_cp(noise=0.05, steps=0)


@pytest.mark.parametrize("kind", ["hmm", "btree"])
def test_near_identity_tables_start_as_cp_within_bound(kind):
    n, r, v, d = 4, 3, 3, 5
    W0 = torch.randn(n, v, d, dtype=torch.float64)
    e = torch.randn(d, dtype=torch.float64)
    cp = make_head("cp", n=n, r=r, v=v, d=d).double()
    torch.manual_seed(3)
    cp.init_from_unembeddings(W0, noise=0.5)
    ref = joint(cp, e, v, n)
    tvs = []
    for b in (2.0, 4.0, 8.0):
        head = make_head(kind, n=n, r=r, v=v, d=d).double()
        torch.manual_seed(3)
        head.init_from_unembeddings(W0, noise=0.5, transition_bias=b)
        torch.testing.assert_close(head.leaf_weight, cp.leaf_weight)  # same noisy copies
        tables = sum(
            s[0] for name, s in head.circuit.param_shapes.items() if len(s) == 3 and name != "leaves"
        )
        eps = (r - 1) * math.exp(-b)  # per table: probability of leaving the parent's state <= eps
        got = joint(head, e, v, n)
        tv = 0.5 * (got.exp() - ref.exp()).abs().sum().item()
        assert tv <= tables * eps, (b, tv, tables * eps)
        # one-sided pointwise bound: the all-stay path alone has weight (1 - eps)^tables
        assert (got - ref).min().item() >= tables * math.log1p(-eps) - 1e-12
        tvs.append(tv)
    assert tvs[0] > tvs[1] > tvs[2] > 0  # really a perturbation that vanishes as b grows


def test_default_transition_bias_makes_tables_near_identity():
    head = make_head("hmm", r=5)
    head.init_from_unembeddings(torch.randn(4, 7, 5))
    t = torch.softmax(head(torch.randn(5))["transitions"], -1)  # (n-1, r, r)
    assert torch.all(torch.diagonal(t, dim1=-2, dim2=-1) > 0.98)


def test_init_rejects_bad_unembeddings():
    head = make_head("cp", v=7, d=5)
    with pytest.raises(ValueError, match=r"^W: expected shape"):
        head.init_from_unembeddings(torch.randn(2, 8, 5))
    with pytest.raises(ValueError, match=r"^noise"):
        head.init_from_unembeddings(torch.randn(7, 5), noise=-1.0)


def test_low_rank_delta_equals_materialised_unembedding():
    head = make_head("cp", leaf_delta_rank=2)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    W = head.leaf_base.unsqueeze(1) + torch.einsum("nrvk,nrkd->nrvd", head.leaf_delta_out, head.leaf_delta_in)
    e = torch.randn(2, 3, 5)
    torch.testing.assert_close(head(e)["leaves"], torch.einsum("nrvd,...d->...nrv", W, e))
    full = make_head("cp", n=16, r=32, v=320, d=256)
    small = make_head("cp", n=16, r=32, v=320, d=256, leaf_delta_rank=8)
    assert sum(p.numel() for p in small.parameters()) * 5 < sum(p.numel() for p in full.parameters())


# --- export ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip_gives_identical_outputs(tmp_path, kind):
    head = make_head(kind, backbone="tiny-llama")
    head.init_from_unembeddings(torch.randn(2, 7, 5), noise=0.1)
    with torch.no_grad():
        for p in head.sum_weight.values():
            p.normal_()
    lora = {"base_model.layers.1.q_proj.lora_A.weight": torch.randn(4, 5)}
    save_head(tmp_path, head, lora_state=lora)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        config["kind"] == kind
        and config["backbone"] == "tiny-llama"
        and config["format_version"] == FORMAT_VERSION == 2
    )
    loaded, lora_loaded = load_head(tmp_path)
    assert loaded.config == head.config
    e = torch.randn(3, 5)
    for name, t in head(e).items():
        assert torch.equal(loaded(e)[name], t), name
    assert set(lora_loaded) == set(lora) and torch.equal(
        next(iter(lora_loaded.values())), next(iter(lora.values()))
    )
    save_head(tmp_path, head)  # re-saving without an adapter removes the stale one
    assert load_head(tmp_path)[1] is None


def test_export_paths_expand_the_home_directory(tmp_path, monkeypatch):
    # README usage: MtpcModel.from_pretrained("~/.cache/mtpc/heads/...")
    monkeypatch.setenv("HOME", str(tmp_path))
    head = make_head("cp", r=2)
    save_head("~/heads/cp", head)
    assert (tmp_path / "heads" / "cp" / "config.json").is_file()
    assert load_head("~/heads/cp")[0].config == head.config
    # a path that is no directory says so (not "missing config.json"), through MtpcModel too
    with pytest.raises(
        FileNotFoundError,
        match="^" + re.escape(f"head directory {tmp_path}/heads/none does not exist (a head export is"),
    ):
        MtpcModel.from_pretrained("~/heads/none")


def test_export_config_not_matching_tensors_is_a_clear_error(tmp_path):
    save_head(tmp_path, make_head("cp", r=3))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rank": 4}))
    with pytest.raises(
        ValueError, match=r"tensor 'leaf_weight' has shape \(4, 3, 7, 5\).*implies \(4, 4, 7, 5\)"
    ):
        load_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "kind": "hmm"}))
    with pytest.raises(ValueError, match=r"missing \['sum_bias.initial'.*unexpected \['sum_bias.mixture'"):
        load_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "rnak": 4}))
    with pytest.raises(ValueError, match=r"unknown head config keys \['rnak'\]"):
        load_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(ValueError, match=r"format_version 99"):
        load_head(tmp_path)
    (tmp_path / "head.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing head.safetensors"):
        load_head(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config.json is a file, not a directory"):
        load_head(tmp_path / "config.json")


@pytest.mark.parametrize("cut", [5, 0.5])
def test_truncated_export_is_a_one_line_error_naming_the_file(tmp_path, cut):
    save_head(tmp_path, make_head("cp", r=3), lora_state={"x.lora_A": torch.zeros(2, 2)})
    for name in ("head.safetensors", "lora.safetensors"):
        path = tmp_path / name
        whole = path.read_bytes()
        path.write_bytes(whole[: cut if isinstance(cut, int) else int(len(whole) * cut)])
        with pytest.raises(ValueError) as err:
            load_head(tmp_path)
        assert str(path) in str(err.value) and "\n" not in str(err.value), str(err.value)
        path.write_bytes(whole)


def test_overwritten_tensors_are_caught_by_the_export_checksum(tmp_path):
    save_head(tmp_path, make_head("cp", r=3), lora_state={"x.lora_A": torch.zeros(2, 2)})
    for name in ("head.safetensors", "lora.safetensors"):
        path = tmp_path / name
        whole = bytearray(path.read_bytes())
        good = bytes(whole)
        whole[-8:] = b"\x7f" * 8  # garbage in the last tensor's data: still a readable safetensors file
        path.write_bytes(bytes(whole))
        with pytest.raises(ValueError, match=rf"{path}: SHA-256 differs from the one in config\.json"):
            load_head(tmp_path)
        path.write_bytes(good)
    load_head(tmp_path)


def test_an_unlisted_adapter_beside_the_head_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_head(tmp_path, make_head("cp", r=3))
    save_file({"x.lora_A": torch.zeros(2, 2)}, str(tmp_path / "lora.safetensors"))
    with pytest.raises(ValueError, match=r"lora\.safetensors: not listed in config\.json"):
        load_head(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_head_with_non_finite_parameters_is_refused_naming_the_file(tmp_path, bad):
    head = make_head("cp", r=3)
    with torch.no_grad():
        head.leaf_weight[0, 0, 0, 0] = bad
    save_head(tmp_path, head)  # a diverged run exports what it has; loading it is what must refuse
    with pytest.raises(
        ValueError, match=rf"{tmp_path / 'head.safetensors'}: tensor 'leaf_weight' holds non-finite"
    ):
        load_head(tmp_path)


def _other_head(head):
    other = make_head("cp", r=3)
    other.load_state_dict({k: v + 1 for k, v in head.state_dict().items()})
    return other


def test_a_full_disk_during_a_re_export_keeps_the_previous_head(tmp_path, monkeypatch):
    from tests.faults import full_disk

    first = make_head("cp", r=3)
    save_head(tmp_path, first)
    full_disk(monkeypatch, tmp_path, after=100)  # ENOSPC at write(2) after a short write
    with pytest.raises(OSError, match=rf"{tmp_path / 'head.safetensors'}: no space left"):
        save_head(tmp_path, _other_head(first))
    monkeypatch.undo()
    loaded, _ = load_head(tmp_path)
    torch.testing.assert_close(loaded.state_dict(), first.state_dict(), rtol=0, atol=0)


def test_on_a_real_full_tmpfs_the_previous_head_stays_loadable():
    from tests.faults import fill, small_tmpfs

    with small_tmpfs("256k") as d:
        first = make_head("cp", r=3)
        save_head(d / "head", first)
        fill(d, leave=1024)  # less than one head file
        with pytest.raises(OSError, match="no space left"):
            save_head(d / "head", _other_head(first))
        loaded, _ = load_head(d / "head")
        torch.testing.assert_close(loaded.state_dict(), first.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("init", ["reset", "unembedding"])
def test_random_head_is_seeded(init):
    cfg = HeadConfig("cp", 3, 2, 5, 4, leaf_delta_rank=1)
    torch.manual_seed(0)  # the constructor's own reset draws from the global generator
    a = random_head(cfg, 1, init=init, sum_std=0.5)
    torch.manual_seed(0)
    b = random_head(cfg, 1, init=init, sum_std=0.5)
    assert not a.training
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    sums = a.sum_bias["mixture"] if init == "reset" else a.sum_weight["mixture"]
    assert float(sums.abs().sum()) > 0
    with pytest.raises(ValueError, match="init: expected one of"):
        random_head(cfg, init="zeros")


def test_an_export_without_checksums_is_refused_unless_allowed_and_migrates(tmp_path):
    """sha256 stripped from config.json and the tensors replaced loaded silently as "an older export"."""
    from mtpc.heads import migrate_head

    save_head(tmp_path, make_head("cp", r=3))
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    del config["sha256"]
    config_path.write_text(json.dumps(config))
    other = make_head("cp", r=3)
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(0.5)  # replaced tensors, as a tamperer would
    save_head(tmp_path / "other", other)
    (tmp_path / "head.safetensors").write_bytes((tmp_path / "other" / "head.safetensors").read_bytes())
    for load in (lambda: load_head(tmp_path), lambda: MtpcModel.from_pretrained(tmp_path, backbone=None)):
        with pytest.raises(ValueError) as err:
            load()
        msg = str(err.value)
        assert msg.startswith(f"{config_path}: no 'sha256'") and "\n" not in msg
        assert "migrate_head" in msg and "allow_unverified=True" in msg
    assert load_head(tmp_path, allow_unverified=True)[0].config == other.config  # the user's explicit choice
    migrate_head(tmp_path)  # re-exported with checksums: loads without the opt-in
    assert "sha256" in json.loads(config_path.read_text())
    loaded, _ = load_head(tmp_path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.state_dict().values(), other.state_dict().values(), strict=True)
    )
