"""Adapters: each framework's own attention, driven by a conformance case.

An adapter translates a case into the framework's own arguments (lengths may
become the key-padding mask every user builds from them; a ``mask_mod`` or
``segment_ids`` the boolean mask they mean, where the API takes no function),
runs it, and returns NumPy. What the framework cannot express natively raises
``NotSupported`` with the reason: such a case is never a pass. Arrays and
gradients of each framework come from ``attention_multi.testing.frameworks``;
ours and a user's function are graded through ``run_case`` (``Function``);
``OnnxRuntime`` exports a torch adapter to ONNX and runs it in ONNX Runtime.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_multi.backends.capabilities import opt

from ...testing import frameworks
from ...testing.conformance import (
    FORMS,
    Case,
    NotSupported,
    Result,
    decode_steps,
    grade,
    run_case,
)
from ...testing.forms import materialized
from ...testing.frameworks import numpy_dtype


def _eagerly(call: Callable, q: Any, k: Any, v: Any, kw: dict) -> Any:
    return call(q, k, v, kw)


class Adapter:
    """``result(case) -> Result``; most adapters implement ``run(case) ->
    (output, gradients or None)`` as float64 NumPy, graded here."""

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

    # How the last call, ``call(q, k, v, kw)``, runs: eagerly (OnnxRuntime sets an exported run).
    through: Callable[..., Any] = staticmethod(_eagerly)

    def result(self, case: Case) -> Result:
        """The raw result of one case: agrees, differs, not supported or error."""
        if case.grad and not self.grads:
            return Result("not supported", None, "no gradients")
        try:
            out, grads = self.run(case)
        except NotSupported as exc:
            return Result("not supported", None, str(exc))
        except Exception as exc:  # a case it should express: a difference
            return Result("error", None, f"raises {type(exc).__name__}: {first_line(exc)}")
        return grade(case, out, grads)


def first_line(exc):
    """The message's first informative line (MXNet's start with a traceback)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if "Error" in ln and not ln.startswith(("Traceback", "File "))]
    return ((useful or lines or [""])[0])[:160]


class Native(Adapter):
    """A function on the framework's arrays: ``call(q, k, v, kw)`` with the
    keywords from ``translate``; decoding cases run ``call`` once per step.
    ``framework`` names its arrays and autodiff (``testing.frameworks``). A
    ``mask_mod`` or ``segment_ids`` reaches ``translate`` as the boolean mask
    it means (``plain``); a ``score_mod`` is not supported."""

    framework = "numpy"

    def setup(self) -> None:
        self.fw = frameworks.get(self.framework)

    def array(self, x: np.ndarray, dtype: str) -> Any:
        return self.fw.array(x, dtype)

    def translate(self, case: Case, shape: tuple, forms: dict, dtype: str) -> dict:
        raise NotImplementedError

    def call(self, q: Any, k: Any, v: Any, kw: dict) -> Any:
        raise NotImplementedError

    def numpy(self, x: Any) -> np.ndarray:
        return self.fw.numpy(x)

    def plain(self, shape: tuple, forms: dict) -> dict:
        """The forms an API without functions can be given: ``mask_mod`` and
        ``segment_ids`` as the mask a user builds from them, ANDed with ``mask``."""
        unknown = sorted(set(forms) - set(FORMS))
        if unknown:
            raise NotSupported(f"no {', '.join(unknown)}")
        if "score_mod" in forms:
            raise NotSupported("no score_mod (a function of the score)")
        if "mask_mod" not in forms and "segment_ids" not in forms:
            return forms
        forms = dict(forms)
        dense = materialized(shape, forms.pop("mask_mod", None), forms.pop("segment_ids", None))
        forms["mask"] = dense & np.asarray(forms["mask"], bool) if "mask" in forms else dense
        return forms

    def run(self, case):
        self.setup()
        dtype = case.dtype

        def once(q, k, v, **forms):
            B, H, Q, d = q.shape
            shape = (B, H, k.shape[1], Q, k.shape[2], d)
            kw = self.translate(case, shape, self.plain(shape, forms), dtype)
            return self.through(self.call, *(self.array(x, dtype) for x in (q, k, v)), kw)

        if case.decode:
            return decode_steps(case, lambda q, k, v, **f: self.numpy(once(q, k, v, **f))), None
        if not case.grad:
            return self.numpy(once(case.queries, case.keys, case.values, **case.forms())), None
        forms = self.plain(case.shape, case.forms())
        kw = self.translate(case, case.shape, forms, dtype)
        q, k, v, g = (
            self.array(x, dtype) for x in (case.queries, case.keys, case.values, case.grad_out)
        )
        out, grads = self.fw.gradients(lambda q, k, v: self.call(q, k, v, kw), [q, k, v], g)
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
    framework = "torch"
    grads = True

    def setup(self):
        super().setup()
        import torch

        self.torch = torch


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

    def __init__(self) -> None:
        self.modules: dict[tuple, Any] = {}

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
        kw["need_weights"] = True  # the module's default (pytorch/pytorch#99282: the weights' path)
        kw["dropout"] = 0.5 if "dropout" in case.hints else 0.0  # in eval mode: not applied
        return kw

    def call(self, q, k, v, kw):
        kw = dict(kw)
        B, H, Q, d = q.shape
        if v.shape[-1] != d:
            raise NotSupported("values of another size than the keys (one embed_dim)")
        mha = self.module(H * d, kw.pop("heads"), kw.pop("dropout"), q.dtype)

        def tokens(x):  # (B, H, n, d) -> (B, n, H * d)
            return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)

        out, _ = mha(tokens(q), tokens(k), tokens(v), **kw)
        return out.reshape(B, Q, H, d).transpose(1, 2)

    def module(self, E, heads, dropout, dtype):
        """The module, identity projections, in eval mode: one per size, built
        outside any call (an exported call must not build it)."""
        torch = self.torch
        key = (E, heads, dropout, dtype)
        if key not in self.modules:
            mha = torch.nn.MultiheadAttention(
                E, heads, dropout=dropout, bias=False, batch_first=True
            )
            with torch.no_grad():
                mha.in_proj_weight.copy_(torch.eye(E).repeat(3, 1))
                mha.out_proj.weight.copy_(torch.eye(E))
            self.modules[key] = mha.to(dtype).eval()
        return self.modules[key]


class Flex(_Torch):
    """flex_attention, compiled (CPU: only compiled, forward only). One generic
    mask_mod and score_mod read the case's forms from tensors, so that the
    compiled graph depends only on the shapes and the dtype; a case's own
    ``mask_mod``/``score_mod`` (and ``segment_ids``, as the document mask
    flex_attention's users write) are applied inside them, a compile per
    function."""

    name = "flex"
    title = "torch flex_attention (torch.compile, CPU), float32"
    grads = False
    # each shape compiles (about 30 s): --quick keeps two shapes
    quick_patterns = ("*/q<k/*", "*/q=k/*", "regression/*")
    shapes: set | None = None  # compiled shapes so far (one per shape and dtype)
    _compiled: Any = None

    def plain(self, shape, forms):
        return forms  # takes the functions as they are

    def translate(self, case, shape, forms, dtype):
        torch = self.torch
        B, H, Hkv, Q, K, d = shape
        unknown = sorted(set(forms) - set(FORMS))
        if unknown:
            raise NotSupported(f"no {', '.join(unknown)}")
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
        ids = forms.get("segment_ids")
        if ids is None:
            q_ids, k_ids = np.zeros((B, Q)), np.zeros((B, K))
        elif isinstance(ids, tuple):
            q_ids, k_ids = ids
        else:
            q_ids, k_ids = ids[:, np.arange(Q) + K - Q], ids
        t = {
            "lens": torch.tensor(np.ascontiguousarray(lens), dtype=torch.int64),
            "allowed": torch.tensor(np.ascontiguousarray(allowed)),
            "ints": torch.tensor([K - Q, shift, left, right], dtype=torch.int64),
            "bias": self.array(np.ascontiguousarray(np.where(np.isfinite(bias), bias, 0.0)), dtype),
            "q_ids": torch.tensor(np.ascontiguousarray(q_ids), dtype=torch.int64),
            "k_ids": torch.tensor(np.ascontiguousarray(k_ids), dtype=torch.int64),
        }
        mods = {
            n: forms[n].function(self.fw, dtype) for n in ("mask_mod", "score_mod") if n in forms
        }
        return {"t": t, "scale": forms.get("scale"), "gqa": H != Hkv, "shape": shape, **mods}

    def call(self, q, k, v, kw):
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        t = kw["t"]
        lens, allowed, ints, bias = t["lens"], t["allowed"], t["ints"], t["bias"]
        q_ids, k_ids = t["q_ids"], t["k_ids"]
        own_mask, own_score = kw.get("mask_mod"), kw.get("score_mod")

        def mask_mod(b, h, q_idx, kv_idx):
            p = q_idx + ints[0]  # the query's position among the keys (bottom-right)
            seen = (
                (kv_idx < lens[b, q_idx])
                & allowed[b, h, q_idx, kv_idx]
                & (kv_idx <= q_idx + ints[1])
                & (kv_idx >= p - ints[2])
                & (kv_idx <= p + ints[3])
                & (q_ids[b, q_idx] == k_ids[b, kv_idx])
                & (q_ids[b, q_idx] >= 0)
            )
            return seen if own_mask is None else seen & own_mask(b, h, q_idx, kv_idx)

        def score_mod(score, b, h, q_idx, kv_idx):
            score = score + bias[b, h, q_idx, kv_idx]
            return score if own_score is None else own_score(score, b, h, q_idx, kv_idx)

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
    """(Arrays in jax.nn's layout: (B, n, heads, d).)"""

    name = "jax"
    title = "jax.nn.dot_product_attention"
    needs = ("jax",)
    framework = "jax"
    grads = True

    def setup(self):
        super().setup()
        self.jax, self.jnp = self.fw.jax, self.fw.jnp

    def array(self, x, dtype):
        return self.fw.array(x, dtype).transpose(0, 2, 1, 3)

    def numpy(self, x):
        return self.fw.numpy(x).transpose(0, 2, 1, 3)

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


# -- attention-multi -----------------------------------------------------------------------------


class Function(Adapter):
    """A function with the grid's signature (``attention_multi.testing.conformance``)
    on one framework's arrays, graded through ``run_case``: the forward pass,
    and the gradients where the framework has autodiff."""

    def __init__(self, name: str, title: str, function: Callable | None, framework: str):
        self.name, self.title, self.function, self.framework = name, title, function, framework
        self.needs = (framework,)
        self.grads = framework != "numpy"

    def attention(self) -> Callable:
        assert self.function is not None
        return self.function

    def result(self, case):
        if case.grad and not self.grads:
            return Result("not supported", None, "no gradients")
        attention = self.attention()

        def call(q: Any, k: Any, v: Any, kw: dict) -> Any:
            return attention(q, k, v, **kw)

        @functools.wraps(attention)  # (its signature: the keywords it takes)
        def through(q: Any, k: Any, v: Any, **kw: Any) -> Any:
            return self.through(call, q, k, v, kw)

        return run_case(case, through, self.framework)


class Ours(Function):
    """``attention_multi.dot_product_attention`` on one backend: the grid's
    causal alignments as ``causal=True`` (bottom-right; top-left only when Q == K)."""

    def __init__(self, backend):
        super().__init__(
            f"am-{backend}",
            f"attention_multi.dot_product_attention, {backend} backend",
            None,
            backend,
        )

    def missing(self):
        from attention_multi import backends

        if self.framework not in backends.available_backends():
            return f"{self.framework} is not installed"
        return None

    def attention(self):
        if self.function is None:
            import attention_multi as am

            B = am.get_backend(self.framework)
            opt(B).enable_float64()

            def attention(q, k, v, *, causal=None, **forms):
                dtype = B.dtype_name(q)
                if dtype not in B.float_dtypes:
                    raise NotSupported(f"no {dtype} on the {B.name} backend")
                if causal == "top-left":
                    _only_q_eq_k(
                        "top-left causal: causal=True is bottom-right", q.shape[2], k.shape[2]
                    )
                return am.dot_product_attention(q, k, v, causal=causal is not None, **forms)

            self.function = attention
        return self.function


# -- MXNet's length softmax, and d2l's code ---------------------------------------------------


class MXNetSoftmax(Native):
    """``softmax(q k^T / sqrt(d), length=valid_lens, use_length=True) v``, heads
    folded into the batch (MXNet's own masked softmax)."""

    name = "mxnet-softmax"
    title = "mxnet.nd.softmax(use_length=True) + batch_dot"
    needs = ("mxnet",)

    def setup(self):
        super().setup()
        self.mx = frameworks.get("mxnet").mx  # (numpy.bool for MXNet on numpy 1.26)

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
        super().setup()
        os.environ.setdefault("KERAS_BACKEND", "jax")
        import keras

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
        if "weights" in case.hints:  # keras-team/keras#23038
            kw["return_attention_scores"] = True
        kw["dropout"] = 0.5 if "dropout" in case.hints else 0.0  # inference: no dropout applied
        return kw

    def call(self, q, k, v, kw):
        kw = dict(kw)
        B, H, Hkv, Q, K, d = kw.pop("shape")
        dtype, dropout = kw.pop("dtype"), kw.pop("dropout")
        if v.shape[-1] != d:
            raise NotSupported("values of another size than the keys (identity projections)")
        layers = self.keras.layers
        if H == Hkv:
            layer = layers.MultiHeadAttention(H, d, use_bias=False, dropout=dropout, dtype=dtype)
        else:
            layer = layers.GroupQueryAttention(
                d, H, Hkv, use_bias=False, dropout=dropout, dtype=dtype
            )
        flat = [x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3]) for x in (q, k, v)]
        layer.build(flat[0].shape, flat[2].shape, flat[1].shape)
        for w in layer.weights:
            w.assign(_identity(tuple(w.shape)))
        out = layer(flat[0], flat[2], key=flat[1], training=False, **kw)
        if isinstance(out, tuple):  # (output, scores)
            out = out[0]
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
    framework = "jax"
    grads = True

    def setup(self):
        super().setup()
        self.jax, self.jnp = self.fw.jax, self.fw.jnp
        from flax import nnx

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


# -- a user's function -------------------------------------------------------------------------


class UserFunction(Function):
    """``module:function`` with the signature of ``attention_multi.testing.conformance``,
    handed ``framework``'s arrays."""

    def __init__(self, spec: str, function: Callable, framework: str = "numpy"):
        super().__init__(spec, f"{spec} (a user's function, {framework})", function, framework)


# -- ONNX Runtime --------------------------------------------------------------------------------


class OnnxRuntime(Adapter):
    """A torch adapter's attention exported to ONNX (``torch.onnx.export(...,
    dynamo=True)``, arrays as graph inputs) and run in ONNX Runtime on the CPU,
    on the grid's forward cases. The eager adapter translates the case as
    always (what it cannot say stays "not supported"); only its last call
    runs in ONNX Runtime. One export per shape, dtype and static argument."""

    needs = ("torch", "onnxscript", "onnxruntime")
    grads = False

    def __init__(self, name: str, eager: Callable[[], Adapter], opset: int | None = None):
        self.name, self.eager, self.opset = name, eager(), opset
        at = f" at opset {opset}" if opset else ""
        self.title = f"{self.eager.title}, exported to ONNX{at} and run in ONNX Runtime (CPU)"
        self.graphs: dict[Any, Any] = {}  # cached sessions
        self.exports = 0
        self.eager.through = self.exported

    def missing(self):
        return Adapter.missing(self) or self.eager.missing()

    def result(self, case):
        if case.grad:
            return Result("not supported", None, "forward only (an exported graph)")
        return self.eager.result(case)

    def exported(self, call: Callable, q: Any, k: Any, v: Any, kw: dict) -> Any:
        """``call(q, k, v, kw)`` exported and run in ONNX Runtime (after it ran
        eagerly, so that what it cannot express says so)."""
        import torch

        call(q, k, v, kw)
        layout = [(n, isinstance(x, tuple), len(_tensors(x))) for n, x in kw.items() if _tensors(x)]
        tensors = [t for x in kw.values() for t in _tensors(x)]
        statics = {n: x for n, x in kw.items() if not _tensors(x)}
        key = None
        if not any(callable(x) or hasattr(x, "shape") for x in statics.values()):
            shapes = [(tuple(t.shape), t.dtype) for t in (q, k, v, *tensors)]
            key = (repr(sorted(statics.items())), tuple(layout), tuple(shapes))
        session = self.graphs.get(key) if key is not None else None
        if session is None:
            session = self._session(torch, call, (q, k, v, *tensors), kw, layout)
            if key is not None:
                self.graphs[key] = session
        feeds = [_feed(torch, t) for t in (q, k, v, *tensors)]
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(feeds):
            raise RuntimeError(f"the exported graph takes {len(names)} inputs, not {len(feeds)}")
        try:
            out = session.run(None, dict(zip(names, feeds)))[0]
        except Exception as exc:  # ONNX Runtime's message: the kernel's check, after its C++ frame
            raise RuntimeError(f"ONNX Runtime: {_runtime_reason(exc)}") from None
        return torch.from_numpy(np.asarray(out, np.float64)).to(q.dtype)

    def _session(self, torch, call, inputs, kw, layout):
        import logging

        import onnxruntime  # type: ignore[import-not-found]

        class Graph(torch.nn.Module):
            def forward(self, q, k, v, *tensors):
                given, rest = dict(kw), list(tensors)
                for name, pair, count in layout:  # a pair of segment ids stays a pair
                    taken, rest = rest[:count], rest[count:]
                    given[name] = tuple(taken) if pair else taken[0]
                return call(q, k, v, given)

        for logger in ("torch.onnx", "onnxscript"):
            logging.getLogger(logger).setLevel(logging.ERROR)
        onnxruntime.set_default_logger_severity(4)  # its errors come back as exceptions
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                Graph(), inputs, dynamo=True, verbose=False, opset_version=self.opset
            )
        self.exports += 1
        try:
            return onnxruntime.InferenceSession(
                program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            if "NOT_IMPLEMENTED" in str(exc):  # no kernel for a node of this dtype
                raise NotSupported(f"ONNX Runtime: {first_line(exc)}") from exc
            raise


def _tensors(x: Any) -> list:
    """The plain tensors a keyword holds, itself or a pair's (segment ids): the
    graph's inputs. (torch's CausalBias, a tensor subclass, stays in the graph.)"""
    items = x if isinstance(x, tuple) else (x,)
    return [t for t in items if type(t).__name__ == "Tensor" and hasattr(t, "shape")]


def _runtime_reason(exc: Exception) -> str:
    """'running <op> node: <why>' of an ONNX Runtime failure (its message
    carries a C++ signature between the two)."""
    text = " ".join(str(exc).split())
    node = text.split("while running ", 1)[-1].split(" node", 1)[0] if "running " in text else ""
    why = text.rsplit(" was false. ", 1)[-1] if " was false. " in text else text.rsplit(": ", 1)[-1]
    return f"{node}: {why}"[:200] if node else why[:200]


def _feed(torch: Any, t: Any) -> np.ndarray:
    """ONNX Runtime's input of a tensor (bfloat16 as ml_dtypes')."""
    if t.dtype == torch.bfloat16:
        return t.detach().view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.detach().numpy()


ADAPTERS: dict[str, Callable[[], Adapter]] = {
    "torch-sdpa": TorchSDPA,
    "torch-mha": TorchMHA,
    "flex": Flex,
    "jax": Jax,
    **{f"am-{name}": functools.partial(Ours, name) for name in frameworks.FRAMEWORKS},
    "mxnet-softmax": MXNetSoftmax,
    "d2l": D2L,
    "keras": Keras,
    "flax": Flax,
    "onnx-am": lambda: OnnxRuntime("onnx-am", lambda: Ours("torch")),
    "onnx-torch-sdpa": lambda: OnnxRuntime("onnx-torch-sdpa", TorchSDPA),
    "onnx-torch-sdpa-opset23": lambda: OnnxRuntime("onnx-torch-sdpa-opset23", TorchSDPA, 23),
    "onnx-torch-mha": lambda: OnnxRuntime("onnx-torch-mha", TorchMHA),
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
