"""Heatmaps of attention weights (needs the ``plot`` extra: matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import attention_multi.backends as backends


def show_heatmaps(
    matrices: Any,
    xlabel: str,
    ylabel: str,
    titles: Sequence[str] | None = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
    colorbar_label: str = "attention weight",
) -> Any:
    """d2l's heatmap grid for ``matrices`` (rows, cols, height, width), with a
    colorbar labelled ``colorbar_label``.

    Accepts any backend's array (or a NumPy array) and returns the matplotlib
    Figure, laid out so that no title or label is clipped or covered.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            f"show_heatmaps needs matplotlib: {backends.install_hint('plot')}"
        ) from exc
    if not isinstance(matrices, np.ndarray):
        matrices = backends.backend_of_array(matrices).to_numpy(matrices)
    if matrices.ndim != 4:
        raise ValueError(
            f"matrices must be 4-D (rows, cols, height, width), got shape {matrices.shape}"
        )
    num_rows, num_cols = matrices.shape[:2]
    if titles is not None and len(titles) < num_cols:
        raise ValueError(f"titles has {len(titles)} entries for {num_cols} columns")
    fig, axes = plt.subplots(
        num_rows,
        num_cols,
        figsize=figsize,
        sharex=True,
        sharey=True,
        squeeze=False,
        layout="constrained",  # room for the titles, labels and colorbar
    )
    for i, (row_axes, row_matrices) in enumerate(zip(axes, matrices)):
        for j, (ax, matrix) in enumerate(zip(row_axes, row_matrices)):
            pcm = ax.imshow(matrix, cmap=cmap)
            if i == num_rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles:
                ax.set_title(titles[j])
    fig.colorbar(pcm, ax=axes, shrink=0.6, label=colorbar_label)
    return fig
