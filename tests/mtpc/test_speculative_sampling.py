"""Monte Carlo check of speculative sampling through the public API (real circuit `_draft` sampler).

Setting (on both decoding engines): a tiny float64 Llama (4 symbols, EOS banned: 3 live ones) with a moderately peaked
target (lm_head x2) and random heads of every kind, plus two known-byte heads (`*-known`: their
parameters read the kept byte c), made confident (leaf weights x10), so they are peaked and
mismatched. For each head, N seeded `generate(mode="sample")` runs give the
empirical distribution of the first T = 3 bytes; the exact plain distribution comes from
enumerating every random path of plain sampling. Test: Pearson chi-square goodness of fit,
bins with expected count < 5 merged, significance ALPHA = 1e-3, i.e. a false-alarm rate of
0.1 % per keep check (6 heads: <= 0.6 % per engine; the seeds are fixed, so a given
checkout either passes or fails deterministically). The same test on extra_token="drop"
with the btree head rejects (measured p ~ 1e-7 at N = 600): the check can fail.
"""

from __future__ import annotations

import collections

import pytest
import torch

from mtpc import MtpcModel
from mtpc.backbones import make_engine
from mtpc.circuits import CIRCUIT_KINDS
from mtpc.speculative.loop import DecodeConfig, plain_decode
from tests.backbone_helpers import ENGINES
from tests.mtpc.test_speculative import RANK, _peaked_backbone
from tests.speculative_helpers import enumerate_outcomes

ALPHA = 1e-3
N_RUNS = 600
T = 3
PROMPT = torch.tensor([2, 0, 3])
KNOWN = ("cp", "btree")  # kinds also checked as known-byte heads


def _exact_plain(bb) -> dict:
    cfg = DecodeConfig(max_new_tokens=T, mode="sample", eos_id=bb.eos_token_id, ban_eos=True)

    def program(choose):
        with torch.inference_mode():
            return tuple(plain_decode(make_engine(bb, len(PROMPT) + T, draft=False), PROMPT, cfg, choose)[0])

    return enumerate_outcomes(program)


def chi_square_pvalue(counts: collections.Counter, exact: dict, n: int) -> float:
    """Pearson chi-square of `counts` against `exact`; bins with expected < 5 pooled into one."""
    from scipy import stats

    big = [k for k in exact if exact[k] * n >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [exact[k] * n for k in big]
    rest_exp = n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    elif n - sum(obs) > 0:
        return 0.0  # an outcome of probability ~0 was observed
    return float(stats.chisquare(obs, exp).pvalue)


def _sampled_counts(m, extra_token) -> collections.Counter:
    return collections.Counter(
        tuple(
            m.generate(
                PROMPT, max_new_tokens=T, mode="sample", seed=i, extra_token=extra_token, ban_eos=True
            ).ids.tolist()
        )
        for i in range(N_RUNS)
    )


@pytest.fixture(scope="module", params=ENGINES)
def setting(request):
    bb = _peaked_backbone(0, vocab=4, scale=2.0, engine=request.param)
    models = {}
    for kind in CIRCUIT_KINDS:
        m = MtpcModel.from_components(bb, {"kind": kind, "window": 3, "rank": RANK[kind], "seed": 1})
        with torch.no_grad():
            m.head.leaf_weight.mul_(10.0)
        models[kind] = m
    for kind in KNOWN:
        m = MtpcModel.from_components(
            bb, {"kind": kind, "window": 3, "rank": RANK[kind], "seed": 1, "known_byte": True}
        )
        with torch.no_grad():
            m.head.leaf_weight.mul_(10.0)
        models[f"{kind}-known"] = m
    return bb, models, _exact_plain(bb)


def test_pvalue_helper_flags_a_wrong_distribution():
    exact = {(0,): 0.5, (1,): 0.5}
    assert chi_square_pvalue(collections.Counter({(0,): 300, (1,): 300}), exact, 600) > 0.9
    assert chi_square_pvalue(collections.Counter({(0,): 360, (1,): 240}), exact, 600) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*CIRCUIT_KINDS, *(f"{k}-known" for k in KNOWN)])
def test_keep_sampling_matches_plain_distribution(setting, kind):
    _, models, exact = setting
    counts = _sampled_counts(models[kind], "keep")
    assert chi_square_pvalue(counts, exact, N_RUNS) > ALPHA


@pytest.mark.slow
def test_drop_sampling_is_flagged(setting):
    _, models, exact = setting
    counts = _sampled_counts(models["btree"], "drop")
    assert chi_square_pvalue(counts, exact, N_RUNS) < ALPHA
