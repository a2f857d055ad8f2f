"""Sinusoidal positional encoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import zeros_for_empty
from ..core.checks import check_array, check_dropout, check_positive_int
from ..types import Array, ModuleOptions
from .base import Module

if TYPE_CHECKING:
    from typing_extensions import Unpack


class PositionalEncoding(Module):
    """Sinusoidal positional encoding added to ``X`` (batch, steps, num_hiddens)."""

    P: Array  # (1, max_len, num_hiddens), a buffer

    def __init__(
        self,
        num_hiddens: int,
        dropout: float,
        max_len: int = 1000,
        **options: Unpack[ModuleOptions],
    ) -> None:
        num_hiddens = check_positive_int("num_hiddens", num_hiddens)
        dropout = check_dropout("dropout", dropout)
        max_len = check_positive_int("max_len", max_len)
        self._start(**options)
        self.num_hiddens, self.max_len, self.dropout = num_hiddens, max_len, dropout
        self._add_buffer(
            "P",
            self._backend.asarray(sinusoid_table(max_len, num_hiddens), self._dtype, self._device),
        )

    def forward(self, X: Array, *, key: Any = None) -> Array:
        """``X`` (batch, steps, num_hiddens) plus the encoding of its steps,
        then dropout; ``key``: the JAX dropout key in training mode."""
        xp = self._backend
        check_array(xp, "X", X, 3, "(batch, steps, num_hiddens)")
        if X.shape[2] != self.num_hiddens:
            raise ValueError(
                f"X has feature size {X.shape[2]} (shape "
                f"{tuple(X.shape)}) but num_hiddens={self.num_hiddens}"
            )
        if X.shape[1] > self.max_len:
            raise ValueError(
                f"X has {X.shape[1]} steps (shape {tuple(X.shape)}), "
                f"more than max_len={self.max_len}"
            )
        P = self.P[:, : X.shape[1], :]
        if xp.dtype_name(X) != xp.dtype_name(P):
            raise TypeError(
                f"X is {xp.dtype_name(X)} but the encoding is "
                f"{xp.dtype_name(P)}; build it with dtype= or cast X"
            )
        if 0 in tuple(X.shape):
            return zeros_for_empty(xp, tuple(X.shape), X)
        return self._dropout(X + xp.to_device(P, xp.device_of(X)), self.dropout, key)


def sinusoid_table(max_len: int, num_hiddens: int) -> np.ndarray:
    """(1, max_len, num_hiddens) float64: sin on even, cos on odd features."""
    position = np.arange(max_len, dtype=np.float64).reshape(-1, 1)
    angles = position / np.power(10000, np.arange(0, num_hiddens, 2) / num_hiddens)
    P = np.zeros((1, max_len, num_hiddens))
    P[0, :, 0::2] = np.sin(angles)
    P[0, :, 1::2] = np.cos(angles[:, : num_hiddens // 2])  # odd sizes: one fewer cos
    return P
