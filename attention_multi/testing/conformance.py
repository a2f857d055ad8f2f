"""The conformance grid: attention cases graded by the float64 oracle.

``conformance_cases()`` generates the cases (every mask form, programmable
ones included, empty rows and empty axes, NaN and ``±inf`` in positions nobody
may see, four dtypes, gradients, and the peers' public bugs as named cases);
``run_case(case, attention, framework)`` runs one against your function and
grades it. ``attention-multi conform`` runs the same grid against the
frameworks' own attention (docs/guide/conformance.md).

Your function's signature::

    attention(q, k, v, *, valid_lens=None, mask=None, bias=None, causal=None,
              window=None, scale=None, mask_mod=None, score_mod=None,
              segment_ids=None) -> output

Arrays are the framework's (``framework="numpy"``, ``"torch"``, ``"jax"`` or
``"mxnet"``: ``frameworks.py``):

- ``q`` (B, H, Q, d), ``k`` (B, H_kv, K, d), ``v`` (B, H_kv, K, dv) of the
  case's dtype (NumPy's bfloat16: ``ml_dtypes.bfloat16``), ``H % H_kv == 0``
  (grouped-query: kv head ``h // (H // H_kv)`` serves query head h).
- ``valid_lens``: int32 (B,) or (B, Q): query i sees keys ``j < length``.
- ``mask``: bool, True = may attend, broadcastable to (B, H, Q, K).
- ``bias``: float of the case's dtype, added to the scaled scores; ``-inf``
  masks.
- ``causal``: ``"bottom-right"`` (query i sits at key position i + K - Q, so
  it sees ``j <= i + K - Q``) or ``"top-left"`` (``j <= i``, torch's
  ``is_causal``).
- ``window``: (left, right), bottom-right aligned, None = unbounded side:
  query i at ``p = i + K - Q`` sees ``p - left <= j <= p + right``.
- ``scale``: multiplies ``q k^T``; default ``1 / sqrt(d)``.
- ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend) and
  ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (applied to the scaled
  score, after ``bias``): FlexAttention's functions, called with integer index
  arrays that broadcast to (B, H, Q, K) (or scalars, as flex_attention does);
  ``q_idx`` counts the queries from 0. They close over arrays of your
  framework (int32; float32, float64 in float64 cases), and a learnable one's
  gradient is graded too (``forms.py``).
- ``segment_ids``: int32 (B, K), queries taking the id at their position
  ``i + K - Q``, or a pair ((B, Q), (B, K)): a query sees the keys of its
  own segment; negative ids are padding (seen by nobody, seeing nothing).

Only the keywords a case uses are passed: a case whose keyword your function
does not accept, or for which it raises ``NotImplementedError`` (or
``NotSupported``), is "not supported" (never a pass). Everything combines by
AND; a query with no visible key must give a zero output. Decoding cases call
the function once per step (one query, the keys seen so far). Gradient cases
(of ``sum(output * grad_out)`` with respect to queries, keys, values and the
learnable arrays) need a framework with autodiff.

This module imports NumPy and the oracle only (a framework when asked for one).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference as ref
from . import forms, frameworks
from .forms import Mod
from .frameworks import NotSupported

__all__ = [
    "DTYPES",
    "FORMS",
    "TOLERANCES",
    "Case",
    "Mod",
    "NotSupported",
    "Result",
    "conformance_cases",
    "grade",
    "make_case",
    "run_case",
]

DTYPES = ("float32", "float16", "bfloat16", "float64")
# (atol, rtol): ok when max |got - want| <= atol + rtol * max |want|.
TOLERANCES = {
    "float64": (1e-10, 1e-10),
    "float32": (2e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}
GRAD_TOLERANCES = {
    "float64": (1e-9, 1e-9),
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (6e-2, 6e-2),
}
CAUSAL = ("bottom-right", "top-left")
# The keywords a case may pass, in the signature's order. A new form (say
# ``sinks``) is a Case field of this name, an entry here, the oracle's support,
# and the specs that use it; adapters that do not know it must decline it
# (``Adapter.forms`` lists what each one translates).
FORMS = (
    "valid_lens",
    "mask",
    "bias",
    "causal",
    "window",
    "scale",
    "mask_mod",
    "score_mod",
    "segment_ids",
)


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One attention case and its float64 expectation.

    ``queries``/``keys``/``values`` are float64 holding values already rounded
    to ``dtype`` (so the oracle sees exactly what the implementation sees);
    they may hold NaN or ``±inf`` where no query may look. ``decode``: None,
    ``"growing"`` (step t: query t against keys ``[:t + 1]``) or ``"static"``
    (step t: query t against the whole cache, ``valid_lens = t + 1``, NaN in
    the slots not written yet); either is graded against one causal pass.
    ``grad``: also grade the gradients of ``sum(output * grad_out)`` (and of
    the learnable arrays of a ``score_mod``, after dq, dk, dv). ``reports``:
    the upstream bug reports a named regression case reproduces; ``hints``:
    how a named case calls a peer whose API has the option (``"weights"``: ask
    for the attention weights too; ``"dropout"``: a layer with dropout, run in
    inference), ignored by the others.
    """

    id: str
    family: str
    dtype: str
    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    valid_lens: np.ndarray | None = None
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    causal: str | None = None
    window: tuple | None = None
    scale: float | None = None
    mask_mod: Mod | None = None
    score_mod: Mod | None = None
    segment_ids: Any = None
    decode: str | None = None
    grad: bool = False
    grad_out: np.ndarray | None = None
    expected: np.ndarray | None = None
    expected_grads: tuple | None = None
    quick: bool = False
    reports: tuple[str, ...] = ()
    hints: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.id

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(B, H, H_kv, Q, K, d)."""
        B, H, Q, d = self.queries.shape
        return B, H, self.keys.shape[1], Q, self.keys.shape[2], d

    def forms(self) -> dict[str, Any]:
        """The keywords this case passes (those that are set; NumPy, and the
        programmable forms as ``Mod``: see ``framework_forms``)."""
        return {n: getattr(self, n) for n in FORMS if getattr(self, n) is not None}

    @property
    def learnable(self) -> list[np.ndarray]:
        """The learnable arrays of its score_mod (NumPy), graded after dq, dk, dv."""
        mod = self.score_mod
        return [mod.arrays[n] for n in mod.learnable] if mod is not None else []

    def tolerance(self, grads: bool = False) -> tuple[float, float]:
        return (GRAD_TOLERANCES if grads else TOLERANCES)[self.dtype]


@dataclasses.dataclass
class Result:
    """``status``: ``"agrees"``, ``"differs"``, ``"not supported"`` or
    ``"error"`` (raised on a case it claims to support); ``error``: the max
    abs error (output, and gradients when graded); ``detail``: why."""

    status: str
    error: float | None = None
    detail: str = ""


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits, without ml_dtypes
        bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # type: ignore[assignment]
        out = bits.astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isnan(x), x, out)
    return np.asarray(x).astype(dtype).astype(np.float64)


# -- the grid -----------------------------------------------------------------------------------

# (B, H, H_kv, Q, K, d) by name: fewer queries than keys, as many, more.
SHAPES = {
    "q<k": (2, 2, 2, 3, 5, 4),
    "q=k": (2, 2, 2, 4, 4, 4),
    "q>k": (2, 2, 2, 5, 3, 4),
}


def _oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, forms: dict) -> tuple:
    """(output, the oracle's keywords); top-left causal as its boolean mask,
    the programmable forms as NumPy functions."""
    forms = dict(forms)
    Q, K = q.shape[2], k.shape[2]
    if forms.get("causal") == "top-left":
        tril = np.arange(K)[None, :] <= np.arange(Q)[:, None]
        mask = forms.get("mask")
        forms["mask"] = tril if mask is None else np.asarray(mask, bool) & tril
        forms["causal"] = False
    else:
        forms["causal"] = forms.get("causal") == "bottom-right"
    for name in ("mask_mod", "score_mod"):
        if forms.get(name) is not None:
            mod = forms[name]
            forms[name] = mod.numpy_function()
            if name == "score_mod":
                forms["score_mod_derivative"] = mod.derivative
    if q.size == 0 or k.shape[2] == 0:  # nothing to see: zeros (the oracle needs a key)
        return np.zeros(q.shape[:3] + v.shape[3:]), forms
    out, _ = ref.attention(q, k, v, **_without(forms, "score_mod_derivative"))
    return out, forms


def _without(forms: dict, name: str) -> dict:
    return {n: x for n, x in forms.items() if n != name}


def _oracle_grads(q: Any, k: Any, v: Any, g: Any, forms: dict, mod: Mod | None) -> tuple:
    """(dq, dk, dv, *the score_mod's learnable arrays' gradients)."""
    if q.size == 0 or k.shape[2] == 0:
        return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dq, dk, dv, dscore = ref.attention_gradients(q, k, v, g, **forms)
    extra = []
    if mod is not None and mod.learnable:
        found = mod.param_grads(dscore)  # type: ignore[misc]
        extra = [found[n] for n in mod.learnable]
    return (dq, dk, dv, *extra)


def _specs(rng: np.random.Generator) -> Any:
    """(family, variant, shape name or tuple, forms builder) of every forward case."""
    normal = rng.standard_normal
    S = SHAPES

    def lens1(shape: tuple, zero: bool = True) -> dict:
        B, _, _, _, K, _ = shape
        lens = rng.integers(1, K + 1, B)
        if zero:
            lens[-1] = 0
        return {"valid_lens": lens}

    def lens2(shape: tuple) -> dict:
        B, _, _, Q, K, _ = shape
        lens = rng.integers(0, K + 1, (B, Q))
        lens[0, 0], lens[-1, -1] = 0, K
        return {"valid_lens": lens}

    def bool_mask(shape: tuple, heads: bool = True) -> dict:
        B, H, _, Q, K, _ = shape
        m = rng.random((B, H if heads else 1, Q, K)) < 0.6
        m[0, 0, 0] = False  # an empty row
        m[..., -1] = False  # a key nobody may see
        return {"mask": m}

    def bias(shape: tuple) -> dict:
        B, H, _, Q, K, _ = shape
        b = np.where(rng.random((B, H, Q, K)) < 0.25, -np.inf, normal((B, H, Q, K)))
        b[-1, -1, 0] = -np.inf  # a row nobody may see
        return {"bias": b}

    yield "plain", "", "q<k", lambda s: {}
    yield "plain", "", "q=k", lambda s: {}
    yield "plain", "", "q>k", lambda s: {}
    yield "plain", "scale", "q<k", lambda s: {"scale": 0.5}
    for name in S:
        yield "lens-1d", "empty-row", name, lens1
    yield "lens-1d", "full", "q<k", lambda s: lens1(s, zero=False)
    for name in S:
        yield "lens-2d", "empty-row", name, lens2
    for name in S:
        yield "mask", "empty-row", name, bool_mask
    yield "mask", "broadcast-heads", "q<k", lambda s: bool_mask(s, heads=False)
    for name in S:
        yield "bias", "-inf", name, bias
    for align in CAUSAL:
        for name in S:
            yield f"causal-{align}", "", name, lambda s, a=align: {"causal": a}
    yield "causal-bottom-right", "lens-1d", "q=k", lambda s: {"causal": "bottom-right", **lens1(s)}
    yield "causal-top-left", "lens-1d", "q=k", lambda s: {"causal": "top-left", **lens1(s)}
    yield "window", "(1,0)", "q=k", lambda s: {"window": (1, 0)}
    yield "window", "(1,1)", "q=k", lambda s: {"window": (1, 1)}
    yield "window", "(2,0)", "q<k", lambda s: {"window": (2, 0)}
    yield "window", "(1,None)", "q=k", lambda s: {"window": (1, None)}
    yield "window", "(1,0)+lens-1d", "q=k", lambda s: {"window": (1, 0), **lens1(s)}
    yield "window", "(2,0)+causal", "q=k", lambda s: {"window": (2, 0), "causal": "bottom-right"}
    gqa2, gqa1 = (2, 4, 2, 4, 4, 4), (2, 4, 1, 3, 5, 4)
    yield "gqa", "kv2", gqa2, lambda s: {}
    yield "gqa", "kv1", gqa1, lambda s: {}
    yield "gqa", "kv2+causal", gqa2, lambda s: {"causal": "bottom-right"}
    yield "gqa", "kv1+lens-1d", gqa1, lens1
    yield "poison", "nan+lens-1d", "q<k", lambda s: {**lens1(s), "poison": np.nan}
    yield "poison", "+inf+lens-1d", "q<k", lambda s: {**lens1(s), "poison": np.inf}
    yield "poison", "-inf+lens-1d", "q<k", lambda s: {**lens1(s), "poison": -np.inf}
    yield "poison", "nan+mask", "q<k", lambda s: {**bool_mask(s), "poison": np.nan}
    yield "decode", "growing", (2, 2, 2, 5, 5, 4), lambda s: {"decode": "growing"}
    yield "decode", "growing-gqa", (2, 4, 1, 5, 5, 4), lambda s: {"decode": "growing"}
    yield "decode", "static", (2, 2, 2, 5, 5, 4), lambda s: {"decode": "static"}
    yield "decode", "static-gqa", (2, 4, 1, 5, 5, 4), lambda s: {"decode": "static"}
    yield "empty-axis", "Q=0", (2, 2, 2, 0, 5, 4), lambda s: {}
    yield "empty-axis", "K=0", (2, 2, 2, 3, 0, 4), lambda s: {}
    yield "empty-axis", "B=0", (0, 2, 2, 3, 5, 4), lambda s: {}
    # the programmable forms (appended: the cases above keep their inputs)
    yield from _programmable_specs(rng)
    yield from _regression_specs()


GQA = (2, 4, 2, 4, 4, 4)  # four query heads, two kv heads, Q = K = 4
# packed rows of Q = K = 4: row 0 ends with a padding position (an empty row)
DOCUMENTS = np.array([[0, 0, 1, -1], [0, 1, 1, 1]])
SEGMENT_PAIR = (np.array([[0, 1, -1], [1, 1, 2]]), np.array([[0, 0, 1, 1, -1], [0, 1, 1, 2, 2]]))


def _programmable_specs(rng: np.random.Generator) -> Any:
    """mask_mod, score_mod and segment_ids cases, each also with grouped heads."""

    def table(shape: tuple) -> dict:
        B, H, _, Q, K, _ = shape
        return {"score_mod": forms.bias_table(rng.standard_normal((H, Q + K - 1)), Q)}

    def slopes(shape: tuple) -> np.ndarray:
        return 2.0 ** -np.arange(1, shape[1] + 1)

    mods: list[tuple[str, Callable[[tuple], dict]]] = [
        ("document", lambda s: {"mask_mod": forms.document(DOCUMENTS)}),
        ("sliding-window+sinks", lambda s: {"mask_mod": forms.sliding_window_with_sinks(1, 1)}),
        ("prefix-lm", lambda s: {"mask_mod": forms.prefix_lm(np.array([2, 0]))}),
    ]
    for variant, build in mods:
        yield "mask_mod", variant, "q=k", build
        yield "mask_mod", f"{variant}+gqa", GQA, build
    yield (
        "mask_mod",
        "document+causal",
        "q=k",
        lambda s: {
            "mask_mod": forms.document(DOCUMENTS),
            "causal": "bottom-right",
        },
    )
    scores: list[tuple[str, Callable[[tuple], dict]]] = [
        ("alibi+causal", lambda s: {"score_mod": forms.alibi(slopes(s)), "causal": "bottom-right"}),
        ("softcap", lambda s: {"score_mod": forms.softcap(1.0)}),
        ("bias-table", table),
    ]
    for variant, build in scores:
        yield "score_mod", variant, "q=k", build
        yield "score_mod", f"{variant}+gqa", GQA, build
    yield (
        "score_mod",
        "softcap+lens-1d",
        "q=k",
        lambda s: {
            "score_mod": forms.softcap(1.0),
            "valid_lens": np.array([3, 0]),
        },
    )
    yield (
        "score_mod",
        "bias-table+document",
        "q=k",
        lambda s: {
            **table(s),
            "mask_mod": forms.document(DOCUMENTS),
        },
    )
    for variant, extra in (("padding", {}), ("padding+causal", {"causal": "bottom-right"})):
        yield "segment_ids", variant, "q=k", lambda s, e=extra: {"segment_ids": DOCUMENTS, **e}
        yield (
            "segment_ids",
            f"{variant}+gqa",
            GQA,
            lambda s, e=extra: {"segment_ids": DOCUMENTS, **e},
        )
    yield "segment_ids", "pair", "q<k", lambda s: {"segment_ids": SEGMENT_PAIR}
    yield "poison", "nan+segment_ids", "q=k", lambda s: {"segment_ids": DOCUMENTS, "poison": np.nan}


# The peers' public bugs, each a case named after what goes wrong, with the reports.
REGRESSIONS = {
    "causal-dropped-with-weights": (
        "q=k",
        {"causal": "bottom-right", "hints": ("weights",)},
        (
            "https://github.com/keras-team/keras/issues/23038",
            "https://github.com/pytorch/pytorch/issues/99282",
        ),
    ),
    "causal-dropped-with-dropout": (
        "q=k",
        {"causal": "bottom-right", "hints": ("dropout",)},
        ("https://github.com/keras-team/keras/issues/23038",),
    ),
    "window-alone-ignored": (
        "q=k",
        {"window": (1, 0)},
        ("https://github.com/jax-ml/jax/issues/32300",),
    ),
    "zero-length-uniform-weights": (
        "q=k",
        {"valid_lens": np.array([4, 0])},
        ("https://github.com/d2l-ai/d2l-en/pull/2423",),
    ),
    "empty-row-nan": (
        "q=k",
        {
            "mask": np.array([[True] * 4, [False] * 4, [True, True, False, False], [True] * 4])[
                None, None
            ]
        },
        (
            "https://github.com/pytorch/pytorch/issues/103749",
            "https://github.com/pytorch/pytorch/pull/159973",
            "https://github.com/microsoft/onnxscript/pull/2479",
        ),
    ),
    "gqa-kv-head-order": (
        GQA,
        {},
        (
            "https://github.com/onnx/onnx/pull/7274",
            "https://github.com/microsoft/onnxscript/pull/2408",
        ),
    ),
}


def _regression_specs() -> Any:
    for name, (shape, spec, reports) in REGRESSIONS.items():
        yield "regression", name, shape, lambda s, f=spec, r=reports: {**f, "reports": r}


def _poisoned(k: np.ndarray, v: np.ndarray, forms: dict, poison: Any) -> tuple:
    """Keys and values with ``poison`` where no query may look."""
    if poison is None:
        return k, v
    k, v = k.copy(), v.copy()
    K = k.shape[2]
    if "valid_lens" in forms:
        lens = np.asarray(forms["valid_lens"])
        hidden = np.arange(K)[None, :] >= (lens if lens.ndim == 1 else lens.max(1))[:, None]
    elif "segment_ids" in forms:  # padding: negative ids
        ids = forms["segment_ids"]
        hidden = np.asarray(ids[1] if isinstance(ids, tuple) else ids) < 0
    else:  # a boolean mask: the keys no query of any head may see
        hidden = ~np.asarray(forms["mask"]).any(axis=(1, 2))  # type: ignore[assignment]
    k[np.broadcast_to(hidden[:, None], k.shape[:3])] = poison
    v[np.broadcast_to(hidden[:, None], v.shape[:3])] = poison
    return k, v


# Quick grid: these forward cases in every dtype (float32 has all families' first variant).
_QUICK_ALL_DTYPES = {"plain/q<k", "lens-1d/empty-row/q<k", "mask/empty-row/q<k", "window/(1,0)/q=k"}


def make_case(
    id: str, family: str, dtype: str, queries: Any, keys: Any, values: Any, **forms: Any
) -> Case:
    """A case of your own (float64 inputs, rounded to ``dtype`` here), with the
    oracle's expectation; ``forms`` as in the signature above."""
    q, k, v = (_round(np.asarray(x, np.float64), dtype) for x in (queries, keys, values))
    if "bias" in forms:
        forms["bias"] = np.asarray(forms["bias"], np.float64)
    forms = _rounded_forms(forms, dtype)
    want, _ = _oracle(q, k, v, forms)
    return Case(
        id=id, family=family, dtype=dtype, queries=q, keys=k, values=v, expected=want, **forms
    )


def _rounded_forms(forms: dict, dtype: str) -> dict:
    """The forms with their float arrays rounded to ``dtype`` (bias, and what a Mod closes over)."""
    out: dict[str, Any] = {}
    for name, x in forms.items():
        if name == "bias":
            x = _round(x, dtype)
        elif isinstance(x, Mod):
            arrays = {
                n: _round(a, dtype) if a.dtype.kind == "f" else a for n, a in x.arrays.items()
            }
            x = dataclasses.replace(x, arrays=arrays)
        out[name] = x
    return out


def conformance_cases(
    quick: bool = False, dtypes: tuple[str, ...] = DTYPES, seed: int = 0
) -> list[Case]:
    """The grid: each mask form (lengths 1-D/2-D, boolean, bias, causal in both
    alignments, window, grouped-query heads, KV-cache decoding, mask_mod,
    score_mod, segment_ids), empty rows and empty axes, NaN and ``±inf`` where
    nobody may look, in ``dtypes``, with gradients for the non-decoding cases,
    and the named regression cases (forward). ``quick``: about 70 of them (each
    family once in float32, a few in every dtype, the regression cases)."""
    cases, first = [], set()
    rng = np.random.default_rng(seed)
    for family, variant, shape_name, build in _specs(rng):
        shape = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
        B, H, Hkv, Q, K, d = shape
        label = (
            shape_name if isinstance(shape_name, str) else "B{}-H{}-Hkv{}-Q{}-K{}".format(*shape)
        )
        forms = build(shape)
        poison = forms.pop("poison", None)
        decode = forms.pop("decode", None)
        named = {n: forms.pop(n) for n in ("reports", "hints") if n in forms}
        q64, k64, v64 = normal3 = (
            rng.standard_normal((B, H, Q, d)),
            rng.standard_normal((B, Hkv, K, d)),
            rng.standard_normal((B, Hkv, K, d)),
        )
        del normal3
        g64 = rng.standard_normal((B, H, Q, d))
        base = "/".join(p for p in (family, variant, label) if p)
        if family == "regression":  # named after the bug: no shape in the id
            base = f"{family}/{variant}"
        quick_family = family not in first
        first.add(family)
        for dtype in dtypes:
            q, k, v, g = (_round(x, dtype) for x in (q64, k64, v64, g64))
            f = _rounded_forms(forms, dtype)
            if decode:  # graded against one causal pass
                want, oracle_forms = _oracle(q, k, v, {"causal": "bottom-right"})
            else:
                want, oracle_forms = _oracle(q, k, v, f)
            kp, vp = _poisoned(k, v, f, poison)
            grads = [False] if decode or family == "regression" else [False, True]
            for grad in grads:
                expected_grads = None
                if grad:
                    expected_grads = _oracle_grads(q, k, v, g, oracle_forms, f.get("score_mod"))
                is_quick = (
                    dtype == "float32"
                    and (quick_family or base in _QUICK_FLOAT32 or family == "regression")
                    and (not grad or family in _QUICK_GRAD)
                ) or (not grad and base in _QUICK_ALL_DTYPES)
                if quick and not is_quick:
                    continue
                cases.append(
                    Case(
                        id=f"{base}/{dtype}" + ("/grad" if grad else ""),
                        family=family,
                        dtype=dtype,
                        queries=q,
                        keys=kp,
                        values=vp,
                        decode=decode,
                        grad=grad,
                        grad_out=g if grad else None,
                        expected=want,
                        expected_grads=expected_grads,
                        quick=is_quick,
                        **named,
                        **f,
                    )
                )
    return cases


_QUICK_FLOAT32 = {
    "causal-bottom-right/q>k",
    "causal-top-left/q>k",
    "window/(1,0)+lens-1d/q=k",
    "gqa/kv1/B2-H4-Hkv1-Q3-K5",
    "poison/+inf+lens-1d/q<k",
    "poison/nan+mask/q<k",
    "decode/static/B2-H2-Hkv2-Q5-K5",
    "empty-axis/K=0/B2-H2-Hkv2-Q3-K0",
    "lens-2d/empty-row/q>k",
    "mask_mod/document+gqa/B2-H4-Hkv2-Q4-K4",
    "score_mod/bias-table/q=k",
    "segment_ids/padding+causal+gqa/B2-H4-Hkv2-Q4-K4",
}
_QUICK_GRAD = {
    "plain",
    "lens-1d",
    "lens-2d",
    "mask",
    "bias",
    "causal-bottom-right",
    "causal-top-left",
    "window",
    "gqa",
    "poison",
    "empty-axis",
    "mask_mod",
    "score_mod",
    "segment_ids",
}


def select(cases: list[Case], patterns: list[str]) -> list[Case]:
    """The cases whose id matches any of the ``fnmatch`` patterns."""
    return [c for c in cases if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


# -- grading -------------------------------------------------------------------------------------


def _max_error(got: Any, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shape {got.shape}, expected {want.shape}")
    if got.size == 0:
        return 0.0
    diff = np.abs(got - want)
    return float("nan") if np.isnan(diff).any() else float(diff.max())


def grade(case: Case, output: Any, grads: Any = None) -> Result:
    """Grade an output (and for a ``grad`` case the gradients: dq, dk, dv, then
    the learnable arrays' of its score_mod)."""
    names = ["output", "dq", "dk", "dv"]
    if case.score_mod is not None:
        names += [f"d {n}" for n in case.score_mod.learnable]
    try:
        errors = [_max_error(output, np.asarray(case.expected))]
        atol, rtol = case.tolerance()
        want = np.asarray(case.expected)
        ok = errors[0] <= atol + rtol * float(np.max(np.abs(want), initial=0.0))
        if case.grad:
            if grads is None:
                raise NotSupported("no gradients")
            grads = list(grads)
            wanted = list(case.expected_grads or ())
            if len(grads) != len(wanted):
                raise ValueError(f"{len(grads)} gradients, expected {len(wanted)}")
            gatol, grtol = case.tolerance(grads=True)
            for got, want in zip(grads, wanted):
                err = _max_error(got, want)
                errors.append(err)
                ok = ok and err <= gatol + grtol * float(np.max(np.abs(want), initial=0.0))
    except ValueError as exc:
        return Result("differs", None, str(exc))
    err = max(errors, key=lambda e: np.inf if np.isnan(e) else e)
    if ok:
        return Result("agrees", err)
    nan = [n for n, e in zip(names, errors) if np.isnan(e)]
    if nan:
        return Result("differs", err, f"NaN in {', '.join(nan)}")
    worst = names[errors.index(err)]
    return Result("differs", err, f"largest error in {worst}")


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().float() if str(x.dtype) == "torch.bfloat16" else x.detach().cpu()
    if hasattr(x, "asnumpy"):  # an MXNet NDArray
        x = x.asnumpy()
    return np.asarray(x).astype(np.float64)


def decode_steps(case: Case, step: Callable[..., Any], **forms: Any) -> np.ndarray:
    """Run a decoding case: ``step(q_t, k_seen, v_seen, **forms_t)`` for each
    query t; returns the outputs concatenated along the queries axis."""
    q, k, v = case.queries, case.keys, case.values
    outs = []
    for t in range(q.shape[2]):
        if case.decode == "growing":
            outs.append(_as_numpy(step(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])))
        else:
            kt, vt = k.copy(), v.copy()
            kt[:, :, t + 1 :] = np.nan  # not written yet
            vt[:, :, t + 1 :] = np.nan
            lens = np.full(q.shape[0], t + 1, np.int64)
            outs.append(_as_numpy(step(q[:, :, t : t + 1], kt, vt, valid_lens=lens)))
    return np.concatenate(outs, axis=2)


def framework_forms(case: Case, framework: Any, learned: Any = None) -> dict[str, Any]:
    """The case's keywords on a framework (``frameworks.get(name)``): lengths
    and segment ids int32, masks bool, the bias in the case's dtype, the
    programmable forms as functions on its arrays (``learned``: the learnable
    arrays, already the framework's, to differentiate through them)."""
    fw, dtype = framework, case.dtype
    out: dict[str, Any] = {}
    for name, x in case.forms().items():
        if name in ("valid_lens", "segment_ids"):
            x = tuple(fw.ints(i) for i in x) if isinstance(x, tuple) else fw.ints(x)
        elif name == "mask":
            x = fw.bools(x)
        elif name == "bias":
            x = fw.array(x, dtype)
        elif isinstance(x, Mod):
            x = x.function(fw, dtype, learned if name == "score_mod" else None)
        out[name] = x
    return out


def learnable_arrays(case: Case, framework: Any) -> list:
    """The score_mod's learnable arrays on the framework (differentiated like q, k, v)."""
    mod = case.score_mod
    return [Mod.framework_array(framework, x, case.dtype) for x in case.learnable] if mod else []


def takes(function: Callable, names: Any) -> None:
    """NotSupported naming the keywords ``function`` does not accept."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin: let it say
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = sorted(n for n in names if n not in params)
    if missing:
        raise NotSupported(f"takes no {', '.join(missing)}")


def run_case(case: Case, attention: Callable[..., Any], framework: str = "numpy") -> Result:
    """Run ``attention`` (the signature in this module's docstring) on
    ``case``, handing it ``framework``'s arrays (``"numpy"``, ``"torch"``,
    ``"jax"``, ``"mxnet"``), and grade its output, and for a gradient case the
    gradients through the framework's autodiff, against the oracle. NumPy gives
    no gradients: those cases are "not supported"."""
    try:
        fw = frameworks.get(framework)
        if case.grad and not fw.autodiff:
            raise NotSupported(f"{fw.name} gives no gradients")
        takes(attention, set(case.forms()) | ({"valid_lens"} if case.decode == "static" else set()))
        dtype = case.dtype

        def call(q: Any, k: Any, v: Any, learned: Any = None, **step: Any) -> Any:
            kw = framework_forms(case, fw, learned)
            kw.update({n: fw.ints(x) for n, x in step.items()})  # a decoding step's lengths
            return attention(q, k, v, **kw)

        def arrays(*xs: np.ndarray) -> list:
            return [fw.array(x, dtype) for x in xs]

        grads = None
        if case.decode:
            out = decode_steps(case, lambda q, k, v, **f: fw.numpy(call(*arrays(q, k, v), **f)))
        elif not case.grad:
            out = fw.numpy(call(*arrays(case.queries, case.keys, case.values)))
        else:
            inputs = arrays(case.queries, case.keys, case.values) + learnable_arrays(case, fw)
            out, found = fw.gradients(
                lambda q, k, v, *learned: call(q, k, v, learned),
                inputs,
                fw.array(case.grad_out, dtype),
            )
            out, grads = fw.numpy(out), [fw.numpy(x) for x in found]
    except NotSupported as exc:
        return Result("not supported", None, str(exc))
    except NotImplementedError as exc:
        return Result("not supported", None, str(exc) or "NotImplementedError")
    except Exception as exc:
        return Result("error", None, f"{type(exc).__name__}: {exc}"[:300])
    return grade(case, out, grads)
