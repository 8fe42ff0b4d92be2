"""Figure settings shared by the training loss curve and the evaluation's Pareto plots (``plots`` in
conf/train.yaml and conf/evaluate.yaml), and how a figure is written.

``plots.format`` is png, pdf or svg; ``plots.dpi`` the resolution of a png (and of raster parts of a
vector file).  ``plots: false`` (or ``plots.enabled=false``) turns the evaluation's plots off.  A figure is
saved with its bounding box fitted to every label (nothing cut at the edges) and written atomically (a
temporary file renamed into place), so a kill mid-write never leaves a torn image.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("png", "pdf", "svg")


@dataclass(frozen=True)
class PlotSettings:
    enabled: bool = True
    format: str = "png"
    dpi: int = 150

    def file_name(self, stem: str) -> str:
        return f"{stem}.{self.format}"


def plot_settings(value: Any) -> PlotSettings:
    """Read and check ``plots`` of a config: a mapping (enabled/format/dpi), a bool, or None (defaults)."""
    if value is None:
        return PlotSettings()
    if isinstance(value, bool):
        return PlotSettings(enabled=value)
    if not hasattr(value, "items"):
        raise ValueError(f"plots must be true, false or a mapping with enabled/format/dpi, got {value!r}")
    given = dict(value.items())
    unknown = sorted(set(given) - {"enabled", "format", "dpi"})
    if unknown:
        raise ValueError(f"plots has unknown keys {unknown}; allowed: enabled, format ({'|'.join(FORMATS)}), dpi")
    enabled = given.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"plots.enabled must be true or false, got {enabled!r}")
    fmt = given.get("format", "png")
    if fmt not in FORMATS:
        raise ValueError(f"plots.format must be one of {'|'.join(FORMATS)}, got {fmt!r}")
    dpi = given.get("dpi", 150)
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 10 <= dpi <= 1200:
        raise ValueError(f"plots.dpi must be an integer in [10, 1200], got {dpi!r}")
    return PlotSettings(enabled=enabled, format=fmt, dpi=dpi)


def figure_bytes(fig, settings: PlotSettings) -> bytes:
    """The figure in ``settings.format``, its box fitted to every text artist, then closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format=settings.format, dpi=settings.dpi, bbox_inches="tight", pad_inches=0.08)
    plt.close(fig)
    return buf.getvalue()


def write_figure(fig, path: str | os.PathLike, settings: PlotSettings) -> Path:
    """Save ``fig`` to ``path`` (atomically: a temporary file in the same folder, renamed)."""
    path = Path(path)
    data = figure_bytes(fig, settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path
