"""The project's matplotlib set-up, shared by every figure it writes (sweeps, evaluation,
routing comparison, analyses, the synthetic suite): one place for the headless backend,
distinct styles per run, legends that never cover data, integer ticks for counts, and
saving.

Imported lazily by the plotting functions (matplotlib is not needed to train).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from moe_jax import storage

LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A distinct ``{"color", "linestyle", "marker"}`` per name, in order: the 10 colours of
    ``tab10``, then the same colours with the next line style and marker, so that 11 or
    more runs never share a look."""
    colours = pyplot().get_cmap("tab10").colors
    styles = itertools.product(range(len(LINE_STYLES)), range(len(colours)))
    return {
        name: {
            "color": colours[c],
            "linestyle": LINE_STYLES[s],
            "marker": MARKERS[s % len(MARKERS)],
        }
        for name, (s, c) in zip(names, styles, strict=False)  # 40 styles: names past them get none
    }


def legend_outside(ax, **kwargs: Any):
    """The legend of ``ax`` to the right of its axes, where it cannot cover data
    (:func:`save` keeps it inside the image)."""
    return ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        fontsize=kwargs.pop("fontsize", 7),
        **kwargs,
    )


def integer_ticks(ax, axis: str = "both") -> None:
    """Ticks at integers only on ``axis`` (``x``, ``y`` or ``both``): counts, expert indices."""
    from matplotlib.ticker import MaxNLocator

    for name in ("x", "y") if axis == "both" else (axis,):
        getattr(ax, f"{name}axis").set_major_locator(MaxNLocator(integer=True))


def save(fig, path: str, dpi: int = 110, *, fixed_size: bool = False) -> str:
    """Writes ``fig`` to ``path``, closes it and returns ``path``. The image is cropped to
    what is drawn (outside legends included) unless ``fixed_size``: then it is the figure's
    own size (its legends must lie inside)."""
    plt = pyplot()
    fig.tight_layout()
    with storage.writing(path) as f:  # a local path or gs://
        fig.savefig(f, format="png", dpi=dpi, bbox_inches=None if fixed_size else "tight")
    plt.close(fig)
    return path
