"""Reference points of the Pareto figure (analysis/reference.py, `pareto_figure(references=)`): a
head measured outside the sweep is drawn as a labelled star where a sweep point with the same
measurements would sit, with its error bars, inside the box, on the iso-line of its own throughput
and off the front; a reference file round-trips into the points of the settings it was measured in
(the same aggregation as the sweep's runs) and nowhere else; no reference: the figure as without."""

from dataclasses import replace

import numpy as np
import pytest

from analysis import pareto_plot, style
from analysis.aggregate import aggregate, split_settings
from analysis.filters import Filters
from analysis.load import AnalysisError
from analysis.reference import (
    ReferencePoint,
    points_for,
    read_reference,
    reference_points,
    unmatched_note,
    write_reference,
)
from tests.analysis_helpers import evaluation_result, frame_from_evaluations, synthetic_evaluations


@pytest.fixture(scope="module")
def setting_part():
    evals = synthetic_evaluations(circuits=("cp", "btree"), windows=(8,), prompt_sets=("chat", "code"))
    ((setting, part),) = split_settings(aggregate(frame_from_evaluations(evals)))
    return setting, part


def _reference(part, **kw) -> ReferencePoint:
    """A reference beyond the sweep's points: slower per cycle, more bytes accepted."""
    lat = float(part["mu_lat_mean"].max()) * 1.5
    values = dict(label="shipped btree-n8-r16-known (m=4)", text="8/16/0", mu_acc=2.4, mu_acc_std=0.1,
                  mu_lat=lat, mu_lat_std=0.001, throughput=3.5 / lat, prompt_sets="chat,code")  # fmt: skip
    return ReferencePoint(**{**values, **kw})


def _by_gid(ax, gid):
    return [a for a in ax.collections if a.get_gid() == gid]


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_reference_is_a_labelled_star_placed_as_the_points_are(setting_part):
    setting, part = setting_part
    ref = _reference(part)
    fig = pareto_plot.pareto_figure(setting, part, references=[ref])
    ax = fig.axes[0]
    (star,) = _by_gid(ax, "reference")
    x, y = ref.throughput * ref.mu_lat - 1, ref.mu_lat * 1000  # x: bytes as returned, as every point's
    np.testing.assert_allclose(star.get_offsets(), [[x, y]])
    assert star.get_label() == ref.label and ref.label in _legend(ax)
    assert star.get_sizes()[0] > _by_gid(ax, "stp")[0].get_sizes()[0]  # not the STP star
    assert 1000 * (x + 1) / y == pytest.approx(ref.throughput)  # on the iso-line of its own throughput
    # its error bars (std over prompt sets), inside the box with the point
    (eb,) = [c for c in ax.containers if c.get_label() == "_errorbar-reference"]
    _, _, (xbars, ybars) = eb.lines
    assert xbars.get_gid() == "errorbar-reference"
    (xseg,), (yseg,) = xbars.get_segments(), ybars.get_segments()
    assert xseg[1, 0] - xseg[0, 0] == pytest.approx(2 * ref.mu_acc_std)
    assert yseg[1, 1] - yseg[0, 1] == pytest.approx(2 * ref.mu_lat_std * 1000)
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    assert x0 < x - ref.mu_acc_std and x + ref.mu_acc_std < x1 and y0 < y - 1 and y + 1 < y1
    # never on the front; its n/r/k label beside it; the iso-lines span its throughput too
    (front,) = [ln for ln in ax.lines if ln.get_gid() == "pareto-front"]
    assert len(front.get_xdata()) == int(part["on_front"].sum()) and x not in front.get_xdata()
    assert ref.text in [t.get_text() for t in ax.texts if t.get_gid() == "point-label"]
    levels = [
        1000 * (ln.get_xdata()[0] + 1) / ln.get_ydata()[0]
        for ln in ax.lines
        if ln.get_gid() == "iso-throughput"
    ]
    assert max(levels) >= ref.throughput / 1.3
    style.plt.close(fig)


def _artists(fig):
    """What a figure shows, comparable between two drawings."""
    ax = fig.axes[0]
    return (
        [(c.get_gid(), np.asarray(c.get_offsets()).round(9).tolist()) for c in ax.collections],
        [(ln.get_gid(), np.asarray(ln.get_xydata()).round(9).tolist()) for ln in ax.lines],
        sorted(t.get_text() for t in ax.texts),
        _legend(ax),
        ax.get_xlim(),
        ax.get_ylim(),
    )


def test_no_reference_draws_the_figure_as_before(setting_part):
    """No reference, an empty list, or one that cannot be placed (no throughput): the same figure,
    with nothing of a reference in it."""
    setting, part = setting_part
    before = pareto_plot.pareto_figure(setting, part)
    ax = before.axes[0]
    assert not _by_gid(ax, "reference") and not [c for c in ax.containers if "reference" in c.get_label()]
    assert set(_legend(ax)) == {"cp", "btree", "Pareto front", "STP"}
    for refs in ([], [_reference(part, throughput=float("nan"))]):
        fig = pareto_plot.pareto_figure(setting, part, references=refs)
        assert _artists(fig) == _artists(before)
        style.plt.close(fig)
    style.plt.close(before)


def test_a_reference_file_round_trips_into_the_points_of_its_settings(tmp_path):
    results = evaluation_result(modes=("greedy", "sample"), prompt_sets=("0", "1"))
    path = write_reference(tmp_path / "ref.json", "shipped h (m=4)", results, "measured so")
    ref = read_reference(path)
    assert ref.label == "shipped h (m=4)" and ref.path == path and len(ref.runs) == 4
    points = reference_points(ref)
    assert {s.mode for s in points} == {"greedy", "sample"}
    for setting, point in points.items():
        assert (
            setting.acceptance_method == "offline"
            and setting.hardware == "cpu-test"
            and setting.eos == "banned"
        )
        runs = [r["metrics"] for r in results["runs"] if r["mode"] == setting.mode]
        assert point.label == "shipped h (m=4)" and point.text == "8/16/0" and point.prompt_sets == "0,1"
        assert point.mu_lat == pytest.approx(np.mean([m["mu_lat"] for m in runs]))
        assert point.mu_acc == pytest.approx(np.mean([m["mu_acc"] for m in runs]))
        assert point.mu_acc_std == pytest.approx(np.std([m["mu_acc"] for m in runs], ddof=1))
        # offline: the derived throughput, as the setting's points and tables use it
        assert point.throughput == pytest.approx(np.mean([m["derived_throughput"] for m in runs]))
    # the analysis's filters pick settings and prompt sets, not configurations
    assert {
        s.mode for s in reference_points(ref, Filters(mode=("sample",), window=(4,), circuit=("cp",)))
    } == {"sample"}
    assert reference_points(ref, Filters(prompt_sets="dev")) == {}


def test_a_reference_is_drawn_only_in_its_setting_on_its_prompt_sets(tmp_path):
    ref = read_reference(
        write_reference(tmp_path / "r.json", "ref", evaluation_result(prompt_sets=("0",)), "about")
    )
    points = reference_points(ref)
    ((setting, point),) = points.items()
    part = aggregate(ref.runs)  # stands in for a sweep's part: the same setting and prompt sets
    assert points_for(setting, part, [points]) == [point]
    assert points_for(replace(setting, hardware="another machine"), part, [points]) == []
    assert points_for(replace(setting, acceptance_method="online"), part, [points]) == []
    assert points_for(setting, part.assign(prompt_sets="0,1"), [points]) == []  # other prompts
    assert unmatched_note(ref, points, drawn=1) is None
    note = unmatched_note(ref, points, drawn=0)
    assert (
        "'ref'" in note
        and "measured in no setting" in note
        and "cpu-test" in note
        and "prompt sets 0" in note
    )


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "no such file"),
        ("{not json", "not a readable JSON file"),
        ('{"label": "x", "evaluation": {}}', "expected an object with format"),
        ('{"format": "mtpc-reference/1", "label": "x", "evaluation": {"runs": []}}', "non-empty 'runs'"),
    ],
)
def test_an_unusable_reference_file_is_one_error_naming_it(tmp_path, content, says):
    path = tmp_path / "ref.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AnalysisError, match=says) as err:
        read_reference(path)
    assert str(err.value).startswith(f"--reference {path}")


def test_a_reference_file_holds_one_head_with_the_pareto_metrics(tmp_path):
    two = evaluation_result()
    two["runs"] += evaluation_result(head="other")["runs"]
    with pytest.raises(ValueError, match="holds heads \\['other', 'shipped'\\]"):
        write_reference(tmp_path / "r.json", "x", two, "about")
    broken = evaluation_result()
    del broken["runs"][1]["metrics"]["mu_lat"]
    with pytest.raises(ValueError, match=r"runs\[1\]: missing mu_lat"):
        write_reference(tmp_path / "r.json", "x", broken, "about")
    assert not (tmp_path / "r.json").exists()  # nothing written
