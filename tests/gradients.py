"""Gradients through each framework's own autodiff, for the tests."""
import numpy as np


def gradients(backend, module, inputs, loss_weights, lens):
    """``{name: numpy gradient}`` of ``sum(module(*inputs, lens) * loss_weights)``
    w.r.t. every parameter (d2l names) and each input ("input0", ...)."""
    if backend.name not in ("torch", "jax", "mxnet"):
        raise ValueError(f"{backend.name} has no autodiff")
    R = backend.asarray(loss_weights, backend.dtype_name(inputs[0]))
    names = [f"input{i}" for i in range(len(inputs))]
    if backend.name == "torch":
        xs = [x.clone().requires_grad_(True) for x in inputs]
        (module(*xs, lens) * R).sum().backward()
        grads = {n: p.grad for n, p in module.named_parameters()}
        grads.update(zip(names, (x.grad for x in xs)))
    elif backend.name == "jax":
        import jax
        g_module, *g_inputs = jax.grad(
            lambda m, *xs: (m(*xs, lens) * R).sum(),
            argnums=tuple(range(len(inputs) + 1)))(module, *inputs)
        grads = dict(g_module.named_arrays())
        grads.update(zip(names, g_inputs))
    else:
        from mxnet import autograd
        for x in inputs:
            x.attach_grad()
        with autograd.record():
            loss = (module(*inputs, lens) * R).sum()
        loss.backward()
        grads = {n: p.grad() for n, p in module._collect_params_with_prefix().items()}
        grads.update(zip(names, (x.grad for x in inputs)))
    return {n: backend.to_numpy(g).astype(np.float64) for n, g in grads.items()}
