"""One registry of circuit kinds, and docs/circuits.md's "Adding a circuit kind" followed by a test.

`mtpc.names.CIRCUIT_KINDS` (torch-free: configs, specs, analysis) and `mtpc.circuits.CIRCUIT_CLASSES`
(the classes) must agree (`check_registry`, also run at import). A toy kind registered in the
recipe's places, as the `toy` fixture does, reaches: build_circuit and the argument checks
(`check_architecture`), the exactness tests against the brute-force oracle (tests/mtpc/test_circuits.py,
every enumerated case; sampling on one), the contract tests (test_circuits_contract.py), a head
(`MtpcHead` forward + log_prob) and a fixture sweep (spec check, init, a worker in-process, every
trial COMPLETE with its MLflow runs). Not covered: the cirkit cross-check (it builds each kind from
cirkit's own templates), the numerics test at n = 16, r = 128, and training / decoding on a backbone.
"""

from __future__ import annotations

import pytest
import torch

from mtpc import circuits, names
from mtpc.circuits import reference
from mtpc.circuits.cp import CPCircuit
from tests.circuit_helpers import CASES
from tests.mtpc import test_circuits as exactness
from tests.mtpc import test_circuits_contract as contract


class ToyCircuit(CPCircuit):
    """The recipe's toy: a mixture of factorised windows under a new name (the recipe's plumbing,
    not new maths; its oracle line below is written from the definition, not taken from cp's)."""

    kind = "toy"


@pytest.fixture
def toy(monkeypatch) -> str:
    """The toy kind registered where the recipe says (steps 2-4); undone after the test."""
    monkeypatch.setattr(names, "CIRCUIT_KINDS", (*names.CIRCUIT_KINDS, "toy"))  # 2. the name
    monkeypatch.setitem(circuits.CIRCUIT_CLASSES, "toy", ToyCircuit)  # 3. the class
    monkeypatch.setitem(
        reference.LATENT_STRUCTURES, "toy", lambda n: ([("mixture", -1, -1)], [0] * n)
    )  # 4. the oracle
    circuits.check_registry()
    return "toy"


def test_the_two_registries_agree_and_a_kind_named_once_is_caught(monkeypatch):
    circuits.check_registry()
    assert tuple(circuits.CIRCUIT_CLASSES) == names.CIRCUIT_KINDS == tuple(reference.LATENT_STRUCTURES)
    monkeypatch.setattr(names, "CIRCUIT_KINDS", (*names.CIRCUIT_KINDS, "toy"))
    with pytest.raises(
        ImportError, match=r"CIRCUIT_KINDS = \[.*'toy'\], mtpc.circuits.CIRCUIT_CLASSES = \[.*'btree'\]"
    ):
        circuits.check_registry()
    monkeypatch.setitem(circuits.CIRCUIT_CLASSES, "toy", CPCircuit)
    with pytest.raises(ImportError, match=r"CIRCUIT_CLASSES\['toy'\] is CPCircuit, whose kind is 'cp'"):
        circuits.check_registry()


def test_a_fixed_rank_is_a_property_of_the_kind(monkeypatch, toy):
    """The rank rule of a kind without latent states (ff: 1) is its class's `fixed_rank`, mirrored in
    `names.FIXED_RANKS`: build_circuit, check_architecture, default_rank and point_rank read it, and
    the two must agree."""
    assert circuits.CIRCUIT_CLASSES["ff"].fixed_rank == names.FIXED_RANKS["ff"] == 1
    assert names.default_rank("ff") == names.point_rank("ff", 8) == 1 and names.point_rank("cp", 8) == 8
    monkeypatch.setattr(ToyCircuit, "fixed_rank", 2)
    with pytest.raises(
        ImportError, match=r"ToyCircuit.fixed_rank is 2, mtpc.names.FIXED_RANKS gives 'toy' None"
    ):
        circuits.check_registry()
    monkeypatch.setitem(names.FIXED_RANKS, "toy", 2)
    circuits.check_registry()
    with pytest.raises(ValueError, match="rank: toy has no latent states; expected rank 2, got 3"):
        circuits.build_circuit("toy", 4, 3, 5)
    assert circuits.build_circuit("toy", 4, 2, 5).rank == 2
    with pytest.raises(
        names.ArchitectureError, match="rank: toy has no latent states; expected rank 2, got 3"
    ):
        names.check_architecture("toy", 4, 3)
    assert names.default_rank("toy") == names.point_rank("toy", 8) == 2


def test_an_unregistered_kind_is_refused_everywhere():
    with pytest.raises(ValueError, match="kind: expected one of"):
        circuits.build_circuit("toy", 4, 2, 5)
    with pytest.raises(names.ArchitectureError, match="unknown circuit kind 'toy'"):
        names.check_architecture("toy", 4, 2)
    with pytest.raises(ValueError, match="no latent structure for circuit kind 'toy'"):
        reference.dense_joint("toy", {"leaves": torch.zeros(2, 2, 3)})


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_toy_kind_is_exact_against_the_oracle(toy, case):
    exactness.test_queries_match_enumeration(toy, case)
    exactness.test_greedy_is_a_joint_maximiser(toy, case)


def test_the_toy_kind_samples_the_exact_distribution(toy):
    exactness.test_sample_matches_exact_distribution(toy, CASES[2], 1)


def test_the_toy_kind_keeps_the_contract(toy):
    contract.test_broadcasting_of_params_x_and_prefix(toy)
    contract.test_dtype_rules(toy)
    contract.test_random_params_normalised_and_seeded(toy)
    contract.test_bad_arguments_name_the_argument(toy)


def test_the_toy_kind_makes_a_head(toy):
    from mtpc.heads import HeadConfig, MtpcHead

    names.check_architecture(toy, 4, 2, 0, decoding=True)
    head = MtpcHead(HeadConfig(kind=toy, window=4, rank=2, vocab=5, hidden=8))
    assert type(head.circuit) is ToyCircuit
    params = head(torch.randn(3, 8))
    lp = head.circuit.log_prob(params, torch.randint(0, 5, (3, 4)))
    assert lp.shape == (3,) and bool(torch.isfinite(lp).all())


def test_the_toy_kind_runs_in_a_fixture_sweep(toy, tmp_path):
    from sweeps import run
    from sweeps.spec import load_spec
    from tests.sweep_helpers import check_complete_results, fixture_spec, fresh_tracking_uri

    uri = fresh_tracking_uri(tmp_path / "mlflow")
    space = {
        "kind": "grid",
        "slices": {"a": {"circuit": [toy, "cp"], "rank": [2], "window": [4], "lora_depth": [0]}},
    }
    spec = load_spec(fixture_spec(tmp_path, "toy", tracking_uri=uri, space=space), env={})
    assert {p["circuit"] for p in spec.grid} == {toy, "cp"}
    assert run.init(spec)["enqueued"] == 2
    assert run.worker(spec) == 0
    complete = check_complete_results(spec.storage, "toy", uri, "toy")
    assert sorted(t.params["circuit"] for t in complete) == ["cp", toy]
