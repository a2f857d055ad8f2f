"""Gradients through each framework's own autodiff, for the tests."""

import numpy as np

from attention_multi.backends.capabilities import Autodiff, supports


def gradients(backend, module, inputs, loss_weights, lens):
    """``{name: numpy gradient}`` of ``sum(module(*inputs, lens) * loss_weights)``
    w.r.t. every parameter (d2l names) and each input ("input0", ...)."""
    if not supports(backend, Autodiff):
        raise ValueError(f"{backend.name} has no autodiff")
    R = backend.asarray(loss_weights, backend.dtype_name(inputs[0]))

    def loss_fn(m, *xs):
        return backend.sum((m(*xs, lens) * R).reshape((-1,)), 0)

    _, grads, input_grads = backend.gradients(loss_fn, module, *inputs)
    grads = dict(grads)
    grads.update((f"input{i}", g) for i, g in enumerate(input_grads))
    return {n: backend.to_numpy(g).astype(np.float64) for n, g in grads.items()}
