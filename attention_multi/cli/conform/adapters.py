"""Adapters: each framework's own attention, driven by a conformance case.

An adapter translates a case into the framework's own arguments (lengths may
become the key-padding mask every user builds from them), runs it, and
returns NumPy. What the framework cannot express natively raises
``NotSupported`` with the reason: such a case is never a pass.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ...testing.conformance import Case, NotSupported, decode_steps, numpy_dtype, run_case


class Adapter:
    """``run(case) -> (output, (dq, dk, dv) or None)`` as float64 NumPy."""

    name = ""
    title = ""  # what is graded, in words
    needs: tuple[str, ...] = ()  # importable modules
    grads = False  # whether it gives gradients
    quick_patterns: tuple[str, ...] = ()  # --quick: only these case ids (when compiling is dear)

    def missing(self) -> str | None:
        """Why this adapter cannot run here (a package not installed), or None."""
        for module in self.needs:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        return None

    def run(self, case: Case) -> tuple[np.ndarray, Any]:
        raise NotImplementedError


class Native(Adapter):
    """A function on the framework's arrays: ``call(q, k, v, kw)`` with the
    keywords from ``translate``; decoding cases run ``call`` once per step."""

    def setup(self) -> None:
        pass

    def array(self, x: np.ndarray, dtype: str) -> Any:
        raise NotImplementedError

    def translate(self, case: Case, shape: tuple, forms: dict, dtype: str) -> dict:
        raise NotImplementedError

    def call(self, q: Any, k: Any, v: Any, kw: dict) -> Any:
        raise NotImplementedError

    def numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def gradients(self, f: Callable, q: Any, k: Any, v: Any, g: Any) -> tuple:
        raise NotSupported("no gradients")

    def run(self, case):
        self.setup()
        dtype = case.dtype

        def once(q, k, v, **forms):
            B, H, Q, d = q.shape
            shape = (B, H, k.shape[1], Q, k.shape[2], d)
            kw = self.translate(case, shape, forms, dtype)
            return self.call(*(self.array(x, dtype) for x in (q, k, v)), kw)

        if case.decode:
            return decode_steps(case, lambda q, k, v, **f: self.numpy(once(q, k, v, **f))), None
        if not case.grad:
            return self.numpy(once(case.queries, case.keys, case.values, **case.forms())), None
        kw = self.translate(case, case.shape, case.forms(), dtype)
        q, k, v, g = (
            self.array(x, dtype) for x in (case.queries, case.keys, case.values, case.grad_out)
        )
        out, grads = self.gradients(lambda q, k, v: self.call(q, k, v, kw), q, k, v, g)
        return self.numpy(out), tuple(self.numpy(x) for x in grads)


def _lens_mask(lens, Q, K):
    """(B, 1, Q or 1, K) boolean: key j < length (the mask users build from lengths)."""
    lens = np.asarray(lens)
    lens = lens[:, None] if lens.ndim == 1 else lens
    return (np.arange(K) < lens[:, :, None])[:, None]


def _only_q_eq_k(what, Q, K):
    if Q != K:
        raise NotSupported(f"{what} (the alignments agree only when Q == K)")


# -- torch ---------------------------------------------------------------------------------------


class _Torch(Native):
    needs: tuple[str, ...] = ("torch",)
    grads = True

    def setup(self):
        import torch

        self.torch = torch

    def array(self, x, dtype):
        return self.torch.tensor(x, dtype=getattr(self.torch, dtype))

    def numpy(self, x):
        return x.detach().to(self.torch.float64).numpy()

    def gradients(self, f, q, k, v, g):
        torch = self.torch
        for x in (q, k, v):
            x.requires_grad_(True)
        out = f(q, k, v)
        (out.to(torch.float64) * g.to(torch.float64)).sum().backward()
        # None: no path from the loss (an empty output): torch's zero gradient
        return out, tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in (q, k, v))


class TorchSDPA(_Torch):
    name = "torch-sdpa"
    title = "torch.nn.functional.scaled_dot_product_attention"

    def translate(self, case, shape, forms, dtype):
        torch = self.torch
        B, H, Hkv, Q, K, d = shape
        kw: dict[str, Any] = {"enable_gqa": H != Hkv} if H != Hkv else {}
        if "window" in forms:
            raise NotSupported("no sliding window")
        masks = []
        if "valid_lens" in forms:
            masks.append(_lens_mask(forms["valid_lens"], Q, K))
        if "mask" in forms:
            masks.append(np.asarray(forms["mask"], bool))
        if "bias" in forms:
            if masks:
                raise NotSupported("a float and a boolean attn_mask at once")
            kw["attn_mask"] = self.array(forms["bias"], dtype)
        elif masks:
            kw["attn_mask"] = torch.tensor(np.logical_and.reduce(np.broadcast_arrays(*masks)))
        causal = forms.get("causal")
        if causal and "attn_mask" in kw:
            raise NotSupported("is_causal/causal_lower_right with an attn_mask")
        if causal == "top-left":
            kw["is_causal"] = True
        elif causal == "bottom-right":
            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings():  # "will produce NaNs" for Q > K: graded, not warned
                warnings.simplefilter("ignore", UserWarning)
                kw["attn_mask"] = causal_lower_right(Q, K)
        if "scale" in forms:
            kw["scale"] = forms["scale"]
        return kw

    def call(self, q, k, v, kw):
        return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


class TorchMHA(_Torch):
    name = "torch-mha"
    title = "torch.nn.MultiheadAttention (identity projections)"

    def translate(self, case, shape, forms, dtype):
        torch = self.torch
        B, H, Hkv, Q, K, d = shape
        if H != Hkv:
            raise NotSupported("no grouped-query heads")
        for name in ("window", "scale"):
            if name in forms:
                raise NotSupported(f"no {name}")
        kw: dict[str, Any] = {"heads": H}
        lens = forms.get("valid_lens")
        if lens is not None and np.ndim(lens) == 1:
            kw["key_padding_mask"] = torch.tensor(np.arange(K)[None, :] >= lens[:, None])
        masks = []
        if lens is not None and np.ndim(lens) == 2:
            masks.append(_lens_mask(lens, Q, K))
        if "mask" in forms:
            masks.append(np.asarray(forms["mask"], bool))
        causal = forms.get("causal")
        if causal:
            _only_q_eq_k("causal: a square mask only", Q, K)
            kw["is_causal"] = True
            kw["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(
                Q, dtype=getattr(torch, dtype)
            )
        if "bias" in forms:
            if masks or causal:
                raise NotSupported("a float and a boolean attn_mask at once")
            bias = np.broadcast_to(forms["bias"], (B, H, Q, K)).reshape(B * H, Q, K)
            kw["attn_mask"] = self.array(bias, dtype)
        elif masks:
            if causal:
                raise NotSupported("a causal mask and another attn_mask at once")
            allowed = np.logical_and.reduce(np.broadcast_arrays(*masks, np.ones((B, H, Q, K))))
            kw["attn_mask"] = torch.tensor(~allowed.astype(bool).reshape(B * H, Q, K))
        return kw

    def call(self, q, k, v, kw):
        torch = self.torch
        kw = dict(kw)
        B, H, Q, d = q.shape
        if v.shape[-1] != d:
            raise NotSupported("values of another size than the keys (one embed_dim)")
        E = H * d
        mha = torch.nn.MultiheadAttention(E, kw.pop("heads"), bias=False, batch_first=True)
        with torch.no_grad():
            mha.in_proj_weight.copy_(torch.eye(E).repeat(3, 1))
            mha.out_proj.weight.copy_(torch.eye(E))
        mha = mha.to(q.dtype).eval()

        def tokens(x):  # (B, H, n, d) -> (B, n, H * d)
            return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)

        out, _ = mha(tokens(q), tokens(k), tokens(v), **kw)
        return out.reshape(B, Q, H, d).transpose(1, 2)


class Flex(_Torch):
    """flex_attention, compiled (CPU: only compiled, forward only). One generic
    mask_mod and score_mod read the case's forms from tensors, so that the
    compiled graph depends only on the shapes and the dtype."""

    name = "flex"
    title = "torch flex_attention (torch.compile, CPU), float32"
    grads = False
    # each shape compiles (about 30 s): --quick keeps two shapes
    quick_patterns = ("*/q<k/*", "*/q=k/*")
    shapes: set | None = None  # compiled shapes so far (one per shape and dtype)
    _compiled: Any = None

    def translate(self, case, shape, forms, dtype):
        torch = self.torch
        B, H, Hkv, Q, K, d = shape
        if dtype != "float32":
            raise NotSupported("float32 only here (each dtype and shape compiles anew)")
        if case.decode:
            raise NotSupported("decoding steps: one compile per step's shape")
        if 0 in shape:
            raise NotSupported("empty axes: a compile per shape")
        big = Q + K + 1
        lens = forms.get("valid_lens")
        lens = (
            np.full((B, Q), K)
            if lens is None
            else np.broadcast_to(np.asarray(lens)[:, None] if np.ndim(lens) == 1 else lens, (B, Q))
        )
        mask = np.broadcast_to(forms.get("mask", True), (B, H, Q, K))
        causal = forms.get("causal")
        shift = {"bottom-right": K - Q, "top-left": 0, None: big}[causal]
        left, right = forms.get("window") or (None, None)
        left, right = (big if x is None else x for x in (left, right))
        bias = np.broadcast_to(forms.get("bias", 0.0), (B, H, Q, K))
        allowed = mask & np.isfinite(bias) | (bias > 0)  # -inf bias masks (its block too)
        t = {
            "lens": torch.tensor(np.ascontiguousarray(lens), dtype=torch.int64),
            "allowed": torch.tensor(np.ascontiguousarray(allowed)),
            "ints": torch.tensor([K - Q, shift, left, right], dtype=torch.int64),
            "bias": self.array(np.ascontiguousarray(np.where(np.isfinite(bias), bias, 0.0)), dtype),
        }
        return {"t": t, "scale": forms.get("scale"), "gqa": H != Hkv, "shape": shape}

    def call(self, q, k, v, kw):
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        t = kw["t"]
        lens, allowed, ints, bias = t["lens"], t["allowed"], t["ints"], t["bias"]

        def mask_mod(b, h, q_idx, kv_idx):
            p = q_idx + ints[0]  # the query's position among the keys (bottom-right)
            return (
                (kv_idx < lens[b, q_idx])
                & allowed[b, h, q_idx, kv_idx]
                & (kv_idx <= q_idx + ints[1])
                & (kv_idx >= p - ints[2])
                & (kv_idx <= p + ints[3])
            )

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, q_idx, kv_idx]

        B, H, _, Q, K, _ = kw["shape"]
        block = create_block_mask(mask_mod, B, H, Q, K, device="cpu")
        if Flex._compiled is None:
            Flex._compiled = torch.compile(flex_attention, dynamic=False)
            Flex.shapes = set()
        Flex.shapes.add((kw["shape"], q.dtype))
        return Flex._compiled(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block,
            scale=kw["scale"],
            enable_gqa=kw["gqa"],
        )


# -- jax -----------------------------------------------------------------------------------------


class Jax(Native):
    name = "jax"
    title = "jax.nn.dot_product_attention"
    needs = ("jax",)
    grads = True

    def setup(self):
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_enable_x64", True)  # float64 cases; float32 stays float32
        self.jax, self.jnp = jax, jnp

    def array(self, x, dtype):
        return self.jnp.asarray(np.asarray(x, numpy_dtype(dtype))).transpose(0, 2, 1, 3)

    def numpy(self, x):
        return np.asarray(x.astype(self.jnp.float64)).transpose(0, 2, 1, 3)

    def translate(self, case, shape, forms, dtype):
        jnp = self.jnp
        B, H, Hkv, Q, K, d = shape
        kw: dict[str, Any] = {}
        lens = forms.get("valid_lens")
        masks = []
        if lens is not None and np.ndim(lens) == 1:
            kw["key_value_seq_lengths"] = jnp.asarray(lens, jnp.int32)
        elif lens is not None:
            masks.append(_lens_mask(lens, Q, K))
        if "mask" in forms:
            masks.append(np.asarray(forms["mask"], bool))
        if masks:
            kw["mask"] = jnp.asarray(np.logical_and.reduce(np.broadcast_arrays(*masks)))
        if "bias" in forms:
            kw["bias"] = jnp.asarray(np.asarray(forms["bias"], numpy_dtype(dtype)))
        causal = forms.get("causal")
        if causal == "bottom-right":
            _only_q_eq_k("bottom-right causal: is_causal is top-left", Q, K)
        if causal:
            kw["is_causal"] = True
        if "window" in forms:
            _only_q_eq_k("window: local_window_size is top-left aligned", Q, K)
            kw["local_window_size"] = tuple(Q + K if s is None else s for s in forms["window"])
        if "scale" in forms:
            kw["scale"] = forms["scale"]
        return kw

    def call(self, q, k, v, kw):
        if v.shape[-1] != q.shape[-1]:
            raise NotSupported("values of another size than the queries and keys")
        return self.jax.nn.dot_product_attention(q, k, v, **kw)

    def gradients(self, f, q, k, v, g):
        jnp = self.jnp

        def loss(q, k, v):
            out = f(q, k, v)
            return jnp.sum(out.astype(jnp.float64) * g.astype(jnp.float64)), out

        (_, out), grads = self.jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads


# -- attention-multi -----------------------------------------------------------------------------


class Ours(Native):
    """``attention_multi.dot_product_attention`` on one backend."""

    title = "attention_multi.dot_product_attention"

    def __init__(self, backend):
        self.backend_name = backend
        self.name = f"am-{backend}"
        self.title = f"attention_multi.dot_product_attention, {backend} backend"
        self.needs = ("numpy",) if backend == "numpy" else (backend,)
        self.grads = backend != "numpy"

    def missing(self):
        import backends

        if self.backend_name not in backends.available_backends():
            return f"{self.backend_name} is not installed"
        return None

    def setup(self):
        import attention_multi as am

        self.am, self.B = am, am.get_backend(self.backend_name)
        self.B.enable_float64()

    def array(self, x, dtype):
        if dtype not in self.B.float_dtypes:
            raise NotSupported(f"no {dtype} on the {self.B.name} backend")
        return self.am.asarray(x, dtype, backend=self.B)

    def numpy(self, x):
        return np.asarray(self.B.to_numpy(x), np.float64)

    def translate(self, case, shape, forms, dtype):
        B, H, Hkv, Q, K, d = shape
        kw = dict(forms)
        for name, kind in (("valid_lens", "int32"), ("mask", "bool")):
            if name in kw:
                kw[name] = self.am.asarray(kw[name], kind, backend=self.B)
        if "bias" in kw:
            kw["bias"] = self.array(kw["bias"], dtype)
        if kw.get("causal") == "top-left":
            _only_q_eq_k("top-left causal: causal=True is bottom-right", Q, K)
        if "causal" in kw:
            kw["causal"] = True
        return kw

    def call(self, q, k, v, kw):
        return self.am.dot_product_attention(q, k, v, **kw)

    def gradients(self, f, q, k, v, g):
        name = self.backend_name
        if name == "torch":
            return _Torch.gradients(self._torch(), f, q, k, v, g)
        if name == "jax":
            jax = Jax()
            jax.setup()
            return Jax.gradients(jax, f, q, k, v, g)
        from mxnet import autograd

        for x in (q, k, v):
            x.attach_grad()
        with autograd.record():
            out = f(q, k, v)
            loss = (out.astype("float64") * g.astype("float64")).sum()
        loss.backward()
        return out, (q.grad, k.grad, v.grad)

    def _torch(self):
        t = _Torch()
        t.setup()
        return t


# -- MXNet's length softmax, and d2l's code ---------------------------------------------------


class MXNetSoftmax(Native):
    """``softmax(q k^T / sqrt(d), length=valid_lens, use_length=True) v``, heads
    folded into the batch (MXNet's own masked softmax)."""

    name = "mxnet-softmax"
    title = "mxnet.nd.softmax(use_length=True) + batch_dot"
    needs = ("mxnet",)

    def setup(self):
        import attention_multi as am

        am.get_backend("mxnet")  # numpy.bool for MXNet on numpy 1.26
        import mxnet

        self.mx = mxnet

    def array(self, x, dtype):
        if dtype == "bfloat16":
            raise NotSupported("no bfloat16")
        return self.mx.nd.array(x, dtype=dtype)

    def numpy(self, x):
        return x.asnumpy().astype(np.float64)

    def translate(self, case, shape, forms, dtype):
        B, H, Hkv, Q, K, d = shape
        extra = set(forms) - {"valid_lens", "scale"}
        if extra or H != Hkv:
            raise NotSupported(f"only lengths ({', '.join(sorted(extra)) or 'grouped heads'})")
        lens = forms.get("valid_lens")
        if lens is not None:  # one length per row: (B * H, Q)
            lens = np.broadcast_to(
                np.asarray(lens)[:, None] if np.ndim(lens) == 1 else lens, (B, Q)
            )
            lens = self.mx.nd.array(np.repeat(lens, H, axis=0), dtype="int32")
        return {"lens": lens, "scale": forms.get("scale", 1 / math.sqrt(d))}

    def call(self, q, k, v, kw):
        nd = self.mx.nd
        B, H, Q, d = q.shape
        if B == 0:  # checked: it would end this process
            raise RuntimeError("not run: MXNet 1.9.1 dies of SIGFPE on an empty batch")
        fold = [x.reshape((B * H, x.shape[2], x.shape[3])) for x in (q, k, v)]
        scores = nd.batch_dot(fold[0], fold[1], transpose_b=True) * kw["scale"]
        if kw["lens"] is None:
            w = nd.softmax(scores, axis=-1)
        else:
            w = nd.softmax(scores, length=kw["lens"], use_length=True, axis=-1)
        return nd.batch_dot(w, fold[2]).reshape((B, H, Q, -1))


class D2L(_Torch):
    """d2l's ``DotProductAttention`` (PyTorch edition), heads folded into the
    batch with the lengths repeated, as d2l's ``MultiHeadAttention`` does."""

    name = "d2l"
    title = "d2l.torch.DotProductAttention"
    needs: tuple[str, ...] = ("d2l", "torch")

    def __init__(self, module: Any = None):
        self.module = module  # a module with d2l's DotProductAttention (default: d2l.torch)

    def setup(self):
        super().setup()
        if self.module is None:
            self.module = importlib.import_module("d2l.torch")

    def translate(self, case, shape, forms, dtype):
        B, H, Hkv, Q, K, d = shape
        extra = set(forms) - {"valid_lens"}
        if extra or H != Hkv:
            raise NotSupported(f"only lengths ({', '.join(sorted(extra)) or 'grouped heads'})")
        lens = forms.get("valid_lens")
        if lens is not None:
            lens = self.torch.tensor(np.repeat(np.asarray(lens), H, axis=0))
        return {"lens": lens}

    def call(self, q, k, v, kw):
        B, H, Q, d = q.shape
        fold = [x.reshape(B * H, x.shape[2], x.shape[3]) for x in (q, k, v)]
        net = self.module.DotProductAttention(0.0).eval()
        return net(*fold, kw["lens"]).reshape(B, H, Q, -1)


# -- Keras 3 and flax nnx ------------------------------------------------------------------------


class Keras(Native):
    """Keras 3 ``MultiHeadAttention`` (``GroupQueryAttention`` for grouped
    heads), identity projections, on the JAX backend unless KERAS_BACKEND says
    otherwise."""

    name = "keras"
    title = "keras.layers.MultiHeadAttention / GroupQueryAttention (identity projections)"
    needs = ("keras", "jax")

    def setup(self):
        os.environ.setdefault("KERAS_BACKEND", "jax")
        import keras  # type: ignore[import-not-found]

        self.keras = keras

    def array(self, x, dtype):
        return np.asarray(x, numpy_dtype(dtype)).transpose(0, 2, 1, 3)  # (B, n, H, d)

    def numpy(self, x):  # (B, Q, H, d) -> (B, H, Q, d)
        x = self.keras.ops.convert_to_numpy(self.keras.ops.cast(x, "float32"))
        return np.asarray(x, np.float64).transpose(0, 2, 1, 3)

    def translate(self, case, shape, forms, dtype):
        B, H, Hkv, Q, K, d = shape
        for name in ("window", "scale", "bias"):
            if name in forms:
                raise NotSupported(f"no {name}")
        kw: dict[str, Any] = {"shape": shape, "dtype": dtype}
        masks = []
        if "valid_lens" in forms:
            masks.append(_lens_mask(forms["valid_lens"], Q, K)[:, 0])
        if "mask" in forms:
            m = np.asarray(forms["mask"], bool)
            if m.shape[1] != 1:
                raise NotSupported("attention_mask is (B, Q, K): one mask for every head")
            masks.append(m[:, 0])
        if masks:
            kw["attention_mask"] = np.logical_and.reduce(
                np.broadcast_arrays(*masks, np.ones((B, Q, K), bool))
            )
        causal = forms.get("causal")
        if causal == "bottom-right":
            _only_q_eq_k("bottom-right causal: use_causal_mask is top-left", Q, K)
        if causal:
            kw["use_causal_mask"] = True
        return kw

    def call(self, q, k, v, kw):
        kw = dict(kw)
        B, H, Hkv, Q, K, d = kw.pop("shape")
        dtype = kw.pop("dtype")
        if v.shape[-1] != d:
            raise NotSupported("values of another size than the keys (identity projections)")
        layers = self.keras.layers
        if H == Hkv:
            layer = layers.MultiHeadAttention(H, d, use_bias=False, dtype=dtype)
        else:
            layer = layers.GroupQueryAttention(d, H, Hkv, use_bias=False, dtype=dtype)
        flat = [x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3]) for x in (q, k, v)]
        layer.build(flat[0].shape, flat[2].shape, flat[1].shape)
        for w in layer.weights:
            w.assign(_identity(tuple(w.shape)))
        out = layer(flat[0], flat[2], key=flat[1], training=False, **kw)
        return self.keras.ops.reshape(out, (B, Q, H, d))


def _identity(shape):
    """An identity as a projection kernel: (n, n), (E, heads, d) or (heads, d, E)."""
    if len(shape) == 3 and shape[0] * shape[1] == shape[2]:  # (heads, d, E)
        return np.eye(shape[2]).reshape(shape)
    return np.eye(shape[0]).reshape(shape)  # (E, heads, d) with E = heads * d, or (n, n)


class Flax(Native):
    """flax ``nnx.MultiHeadAttention``, identity projections."""

    name = "flax"
    title = "flax.nnx.MultiHeadAttention (identity projections)"
    needs = ("flax", "jax")
    grads = True

    def setup(self):
        Jax.setup(self)
        from flax import nnx  # type: ignore[import-not-found]

        self.nnx = nnx

    array = Jax.array
    numpy = Jax.numpy

    def translate(self, case, shape, forms, dtype):
        B, H, Hkv, Q, K, d = shape
        if H != Hkv:
            raise NotSupported("no grouped-query heads")
        for name in ("window", "scale", "bias", "causal"):
            if name in forms:
                raise NotSupported(f"no {name} (only a boolean mask)")
        masks = []
        if "valid_lens" in forms:
            masks.append(_lens_mask(forms["valid_lens"], Q, K))
        if "mask" in forms:
            masks.append(np.asarray(forms["mask"], bool))
        kw: dict[str, Any] = {"shape": shape, "dtype": dtype}
        if masks:
            kw["mask"] = self.jnp.asarray(
                np.logical_and.reduce(np.broadcast_arrays(*masks, np.ones((B, H, Q, K), bool)))
            )
        return kw

    def call(self, q, k, v, kw):
        kw = dict(kw)
        B, H, Hkv, Q, K, d = kw.pop("shape")
        dtype = kw.pop("dtype")
        if v.shape[-1] != d:
            raise NotSupported("values of another size than the keys (identity projections)")
        E = H * d
        jnp = self.jnp
        layer = self.nnx.MultiHeadAttention(
            H,
            E,
            E,
            E,
            use_bias=False,
            decode=False,
            dtype=getattr(jnp, dtype),
            param_dtype=getattr(jnp, dtype),
            rngs=self.nnx.Rngs(0),
        )
        for proj in (layer.query, layer.key, layer.value):
            proj.kernel.value = jnp.eye(E, dtype=getattr(jnp, dtype)).reshape(E, H, d)
        layer.out.kernel.value = jnp.eye(E, dtype=getattr(jnp, dtype)).reshape(H, d, E)
        flat = [x.reshape(B, x.shape[1], -1) for x in (q, k, v)]
        out = layer(*flat, deterministic=True, **kw)
        return out.reshape(B, Q, H, d)

    def gradients(self, f, q, k, v, g):
        return Jax.gradients(self, f, q, k, v, g)


# -- a user's function -------------------------------------------------------------------------


class UserFunction(Adapter):
    """``module:function`` with the signature of ``attention_multi.testing.conformance``."""

    def __init__(self, spec: str, function: Callable):
        self.name = spec
        self.title = f"{spec} (a user's function)"
        self.function = function

    def run(self, case):
        raise AssertionError("graded through run_case")

    def result(self, case):
        return run_case(case, self.function)


ADAPTERS: dict[str, Callable[[], Adapter]] = {
    "torch-sdpa": TorchSDPA,
    "torch-mha": TorchMHA,
    "flex": Flex,
    "jax": Jax,
    "am-numpy": lambda: Ours("numpy"),
    "am-torch": lambda: Ours("torch"),
    "am-jax": lambda: Ours("jax"),
    "am-mxnet": lambda: Ours("mxnet"),
    "mxnet-softmax": MXNetSoftmax,
    "d2l": D2L,
    "keras": Keras,
    "flax": Flax,
}


def load_function(spec: str) -> Callable:
    """``module:function`` imported (ValueError naming what is wrong); the
    current directory is searched first, as ``python -m`` does."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--impl {spec!r}: expected NAME or module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--impl {spec!r}: cannot import {module_name!r} ({exc})") from None
    function: Any = module
    for part in attr.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise ValueError(f"--impl {spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(function):
        raise ValueError(f"--impl {spec!r}: {attr!r} is not callable")
    return function
