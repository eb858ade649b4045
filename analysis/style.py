"""The look of every figure: paper-column size, rc settings, one colour and marker per circuit
(Okabe–Ito, colour-blind safe), rate labels, title wrapping, box overlap, and `save` (PNG at
300 dpi, at most 1600 px wide, + PDF). No figure is drawn here.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # noqa: E402 - headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mtpc.names import CIRCUIT_KINDS  # noqa: E402
from tracking.schema import EVABYTE_MTP  # noqa: E402

COLUMN_WIDTH_IN = 3.3
HEIGHT_IN = 2.5
#: PNG resolution: a 3.3 in column comes out ~990 px wide; no PNG is wider than MAX_PNG_PX
PNG_DPI = 300
MAX_PNG_PX = 1600
#: Okabe–Ito colours (colour-blind safe) and distinct markers per circuit
CIRCUIT_STYLE: dict[str, tuple[str, str]] = {
    "ff": ("#0072B2", "o"),
    "cp": ("#E69F00", "s"),
    "hmm": ("#009E73", "^"),
    "btree": ("#CC79A7", "D"),
    EVABYTE_MTP: ("#D55E00", "P"),  # EvaByte's own multi-byte decoding, a baseline
}
_OTHER_STYLE = ("#555555", "x")
#: a reference head measured outside the sweep (analysis/reference.py): a black-edged yellow star,
#: larger than STP's black one
REFERENCE_STYLE = ("#F0E442", "*")
PAPER_RC = {
    "font.size": 7,
    "axes.titlesize": 7,
    "axes.labelsize": 7,
    "xtick.labelsize": 6,
    "ytick.labelsize": 6,
    "legend.fontsize": 6,
    "lines.linewidth": 0.9,
    "axes.linewidth": 0.6,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "pdf.fonttype": 42,  # embed TrueType: editable text in the PDF
    "ps.fonttype": 42,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.02,
}


@contextmanager
def paper_style() -> Iterator[None]:
    with plt.rc_context(PAPER_RC):
        yield


def circuit_style(circuit: str) -> tuple[str, str]:
    return CIRCUIT_STYLE.get(circuit, _OTHER_STYLE)


def circuits_in(part: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(part["circuit"]))
    return [c for c in CIRCUIT_KINDS if c in present] + [c for c in present if c not in CIRCUIT_KINDS]


def nan0(a: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(a), a, 0.0)


def format_rate(t: float) -> str:
    """A throughput in bytes/s for a label: '85 B/s', '1.2 kB/s', '2.5 MB/s'."""
    for scale, unit in ((1e6, "MB/s"), (1e3, "kB/s")):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t:.3g} B/s"


def wrap_title(title: str, width: int = 58) -> str:
    """Titles carry the hardware string; wrap them so they fit a 3.3 in column."""
    return textwrap.fill(title, width=width, break_long_words=False)


def overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def png_dpi(fig: Figure) -> float:
    """PNG_DPI, or less when the figure's tight box would come out wider than MAX_PNG_PX."""
    with paper_style():
        fig.canvas.draw()
        width_in = fig.get_tightbbox(fig.canvas.get_renderer()).width + 2 * PAPER_RC["savefig.pad_inches"]
    return min(PNG_DPI, MAX_PNG_PX / width_in) if width_in > 0 else PNG_DPI


def save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    """Write ``stem``.png (PNG_DPI, at most MAX_PNG_PX wide) and ``stem``.pdf under out_dir, each
    rendered in memory and written atomically (`mtpc.atomic`: a full disk raises OSError naming the
    file, "no space left"); close the figure."""
    from mtpc.atomic import write_bytes

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    try:
        for path, kw in ((paths[0], {"dpi": png_dpi(fig)}), (paths[1], {})):
            buf = io.BytesIO()
            with paper_style():
                fig.savefig(buf, format=path.suffix[1:], **kw)
            write_bytes(path, buf.getvalue())
    finally:
        plt.close(fig)
    return paths
