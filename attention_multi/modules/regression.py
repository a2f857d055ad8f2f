"""Nadaraya-Watson kernel regression, trainable (seed 003)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..backends.capabilities import opt, value_and_grad
from ..core import masked_softmax, zeros_for_empty
from ..core.checks import check_array
from ..types import Array, ModuleOptions
from .base import Module

if TYPE_CHECKING:
    from typing_extensions import Unpack


class NWKernelRegression(Module):
    """Trainable Nadaraya-Watson regression: one parameter ``w`` of shape (1,)."""

    def __init__(self, **options: Unpack[ModuleOptions]) -> None:
        self._start(**options)
        self._new_param("w", (1,), 0.0, 1.0)  # as torch.rand((1,)) in d2l

    def forward(self, queries: Array, keys: Array, values: Array) -> Array:
        """``queries`` (n,), ``keys`` and ``values`` (n, m) -> (n,): query ``i``
        attends its own row of keys and values."""
        xp = self._backend
        check_array(xp, "queries", queries, 1, "(n,)")
        for name, x in (("keys", keys), ("values", values)):
            check_array(xp, name, x, 2, "(n, m)")
        if keys.shape != values.shape or keys.shape[0] != queries.shape[0]:
            raise ValueError(
                f"keys and values must both be (n, m) with n = "
                f"len(queries); got queries {tuple(queries.shape)}, "
                f"keys {tuple(keys.shape)}, values {tuple(values.shape)}"
            )
        n, m = keys.shape
        w = self._param("w")
        if n * m == 0:  # no query, or no key: zero output
            empty = zeros_for_empty(xp, (n, m), queries, keys, w)
            self._keep_attention(lambda: empty)  # a thunk: torch.export warns of tensor attributes
            return zeros_for_empty(xp, (n,), queries, keys, values, w)
        rs = opt(xp).reshape
        d = (rs(queries, (n, 1)) - keys) * w
        weights = masked_softmax(xp, -(d * d) / 2, None)
        self._keep_attention(lambda: weights)  # a thunk, as above
        return rs(xp.matmul(rs(weights, (n, 1, m)), rs(values, (n, m, 1))), (n,))


def train_kernel_regression(
    net: NWKernelRegression, x_train: Array, y_train: Array, epochs: int = 5, lr: float = 0.5
) -> list[float]:
    """Seed 003's loop: SGD on the summed squared error, leave-one-out keys.

    Uses the backend's own autodiff (torch, jax, mxnet). Returns the loss of
    each epoch, measured before that epoch's update.
    """
    xp = net.backend
    x, y = xp.to_numpy(x_train), xp.to_numpy(y_train)
    n = x.shape[0]
    others = ~np.eye(n, dtype=bool)
    device = xp.device_of(x_train)
    keys = xp.asarray(np.tile(x, (n, 1))[others].reshape(n, -1), device=device)
    values = xp.asarray(np.tile(y, (n, 1))[others].reshape(n, -1), device=device)

    def loss_fn(model: NWKernelRegression) -> Array:
        err = model(x_train, keys, values) - y_train
        return xp.sum(err * err, axis=0)

    losses = []
    for _ in range(epochs):
        loss, grads = value_and_grad(xp, net, loss_fn)
        params = net.named_arrays()
        for name, grad in grads.items():
            net._assign_param(name, params[name] - lr * grad)
        losses.append(loss)
    return losses
