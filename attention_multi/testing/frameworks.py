"""The frameworks a conformance case can be handed to: NumPy, PyTorch, JAX,
MXNet and TensorFlow, each as arrays of a dtype, back to NumPy, and the gradients of
``sum(f(*inputs) * grad_out)``.

``get(name)`` returns one (imported when first asked for); ``detect(function)``
guesses a function's framework from the modules its module imports. The
conformance grid (``conformance.run_case``) and the ``conform`` command's
adapters hand cases to a framework through these, so a function of any of them
is graded with its gradients. The list of frameworks and the detection of a
function's are the backends' table's (``attention_multi.backends.table``); the
arrays and gradients here do not go through attention-multi's backends.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attention_multi.backends.table import BACKEND_NAMES, framework_of

__all__ = ["FRAMEWORKS", "Framework", "detect", "get"]

FRAMEWORKS = BACKEND_NAMES


class NotSupported(Exception):
    """Raised by an implementation (or adapter) that cannot express a case."""


def numpy_dtype(dtype: str) -> Any:
    """The NumPy dtype of a dtype name (bfloat16 from ``ml_dtypes``)."""
    if dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as exc:  # it comes with jax
            raise NotSupported("bfloat16 needs the ml_dtypes package") from exc
        return ml_dtypes.bfloat16
    return np.dtype(dtype)


class Framework:
    """NumPy: arrays of the case's dtype, no gradients. The other frameworks
    override the same few methods."""

    name = "numpy"
    autodiff = False

    def array(self, x: Any, dtype: str) -> Any:
        """Floats of ``dtype`` (a name: float32, float16, bfloat16, float64)."""
        return np.asarray(x, numpy_dtype(dtype))

    def ints(self, x: Any) -> Any:
        return np.asarray(x, np.int32)

    def bools(self, x: Any) -> Any:
        return np.asarray(x, bool)

    def numpy(self, x: Any) -> np.ndarray:
        """float64 NumPy of an array of this framework."""
        return np.asarray(x).astype(np.float64)

    def tanh(self, x: Any) -> Any:
        return np.tanh(x)

    def take(self, table: Any, index: Any) -> Any:
        """``table[index]``, ``index`` an integer array of this framework."""
        return table[index]

    def like(self, x: Any, other: Any) -> Any:
        """``x`` where it meets ``other`` in an operation (a framework that does
        not promote integers to floats casts it)."""
        return x

    def gradients(self, f: Callable, inputs: Sequence[Any], grad_out: Any) -> tuple:
        """``(f(*inputs), gradients of sum(f(*inputs) * grad_out) for each input)``,
        the product summed in float64."""
        raise NotSupported("NumPy gives no gradients")


class Torch(Framework):
    name = "torch"
    autodiff = True

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def array(self, x: Any, dtype: str) -> Any:
        return self.torch.tensor(np.asarray(x, np.float64), dtype=getattr(self.torch, dtype))

    def ints(self, x: Any) -> Any:
        return self.torch.tensor(np.asarray(x, np.int32))

    def bools(self, x: Any) -> Any:
        return self.torch.tensor(np.asarray(x, bool))

    def numpy(self, x: Any) -> np.ndarray:
        return x.detach().cpu().to(self.torch.float64).numpy()

    def tanh(self, x: Any) -> Any:
        return self.torch.tanh(x)

    def gradients(self, f: Callable, inputs: Sequence[Any], grad_out: Any) -> tuple:
        torch = self.torch
        inputs = [x.detach().requires_grad_(True) for x in inputs]
        out = f(*inputs)
        (out.to(torch.float64) * grad_out.to(torch.float64)).sum().backward()
        # None: no path from the loss (an empty output): torch's zero gradient
        return out, tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in inputs)


class Jax(Framework):
    """JAX with ``jax_enable_x64`` (float64 cases; float32 stays float32)."""

    name = "jax"
    autodiff = True

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_enable_x64", True)
        self.jax, self.jnp = jax, jnp

    def array(self, x: Any, dtype: str) -> Any:
        return self.jnp.asarray(np.asarray(x, numpy_dtype(dtype)))

    def ints(self, x: Any) -> Any:
        return self.jnp.asarray(np.asarray(x, np.int32))

    def bools(self, x: Any) -> Any:
        return self.jnp.asarray(np.asarray(x, bool))

    def numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x.astype(self.jnp.float64))

    def tanh(self, x: Any) -> Any:
        return self.jnp.tanh(x)

    def gradients(self, f: Callable, inputs: Sequence[Any], grad_out: Any) -> tuple:
        jnp = self.jnp

        def loss(*xs: Any) -> tuple:
            out = f(*xs)
            return jnp.sum(out.astype(jnp.float64) * grad_out.astype(jnp.float64)), out

        argnums = tuple(range(len(inputs)))
        (_, out), grads = self.jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*inputs)
        return out, grads


class MXNet(Framework):
    """MXNet's NumPy-compatible arrays (``mxnet.np``, after ``npx.set_np()``); no bfloat16."""

    name = "mxnet"
    autodiff = True

    def __init__(self) -> None:
        from attention_multi.backends import load

        load("mxnet")  # (the one place that makes MXNet 1.9 importable on numpy 1.26)
        import mxnet

        mxnet.npx.set_np()
        self.mx = mxnet

    def array(self, x: Any, dtype: str) -> Any:
        if dtype == "bfloat16":
            raise NotSupported("MXNet has no bfloat16")
        return self.mx.np.array(np.asarray(x, np.float64), dtype=dtype)

    def ints(self, x: Any) -> Any:
        return self.mx.np.array(np.asarray(x, np.int32), dtype="int32")

    def bools(self, x: Any) -> Any:
        return self.mx.np.array(np.asarray(x, bool), dtype=bool)

    def numpy(self, x: Any) -> np.ndarray:
        return x.asnumpy().astype(np.float64)

    def tanh(self, x: Any) -> Any:
        return self.mx.np.tanh(x)

    def gradients(self, f: Callable, inputs: Sequence[Any], grad_out: Any) -> tuple:
        autograd = self.mx.autograd
        for x in inputs:
            x.attach_grad()
        with autograd.record():
            out = f(*inputs)
            loss = (out.astype("float64") * grad_out.astype("float64")).sum()
        loss.backward()
        return out, tuple(x.grad for x in inputs)


class TensorFlow(Framework):
    """TensorFlow's tensors; gradients by ``tf.GradientTape``."""

    name = "tensorflow"
    autodiff = True

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf

    def array(self, x: Any, dtype: str) -> Any:
        return self.tf.constant(np.asarray(x, numpy_dtype(dtype)))

    def ints(self, x: Any) -> Any:
        return self.tf.constant(np.asarray(x, np.int32))

    def bools(self, x: Any) -> Any:
        return self.tf.constant(np.asarray(x, bool))

    def numpy(self, x: Any) -> np.ndarray:
        return np.asarray(self.tf.cast(x, self.tf.float64).numpy())

    def tanh(self, x: Any) -> Any:
        return self.tf.tanh(x)

    def take(self, table: Any, index: Any) -> Any:
        return self.tf.gather(table, index)

    def like(self, x: Any, other: Any) -> Any:
        return self.tf.cast(x, other.dtype)

    def gradients(self, f: Callable, inputs: Sequence[Any], grad_out: Any) -> tuple:
        tf = self.tf
        with tf.GradientTape() as tape:
            tape.watch(list(inputs))
            out = f(*inputs)
            loss = tf.reduce_sum(tf.cast(out, tf.float64) * tf.cast(grad_out, tf.float64))
        zero = tf.UnconnectedGradients.ZERO  # (no path from the loss: a zero gradient)
        return out, tuple(tape.gradient(loss, list(inputs), unconnected_gradients=zero))


_CLASSES: dict[str, type[Framework]] = {
    c.name: c for c in (Framework, Torch, Jax, MXNet, TensorFlow)
}


@functools.cache
def get(name: str) -> Framework:
    """The framework ``name`` (one of ``FRAMEWORKS``); ImportError when it is
    not installed, ValueError for another name."""
    if name not in FRAMEWORKS:
        raise ValueError(f"framework {name!r}: expected one of {', '.join(FRAMEWORKS)}")
    if name not in _CLASSES:
        raise NotSupported(f"the conformance grid has no arrays and gradients of {name} yet")
    return _CLASSES[name]()


def detect(function: Callable) -> str:
    """The framework a function is written in: the one framework (of the
    backends' table) that its module imports (NumPy when none). ValueError when it imports
    several (say which with ``--framework``)."""
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    names = dict(vars(module)) if module is not None else {}
    names.update(inspect.getclosurevars(function).globals if inspect.isfunction(function) else {})
    found = set()
    for value in names.values():
        name = framework_of(getattr(value, "__name__", "")) if inspect.ismodule(value) else None
        if name is not None:
            found.add(name)
    if len(found) > 1:
        raise ValueError(
            f"{getattr(function, '__qualname__', function)!r} imports {' and '.join(sorted(found))}"
            ": say which framework it takes"
        )
    return found.pop() if found else "numpy"
