"""The conformance grid: attention cases graded by the float64 oracle.

``conformance_cases()`` generates the cases (every mask form, empty rows and
empty axes, NaN and ``±inf`` in positions nobody may see, four dtypes,
gradients); ``run_case(case, attention)`` runs one against your function and
grades it. ``attention-multi conform`` runs the same grid against the
frameworks' own attention (docs/guide/conformance.md).

Your function's signature (NumPy in, array-like out)::

    attention(q, k, v, *, valid_lens=None, mask=None, bias=None,
              causal=None, window=None, scale=None) -> output

- ``q`` (B, H, Q, d), ``k`` (B, H_kv, K, d), ``v`` (B, H_kv, K, dv), NumPy
  arrays of the case's dtype (bfloat16: ``ml_dtypes.bfloat16``), ``H % H_kv
  == 0`` (grouped-query: kv head ``h // (H // H_kv)`` serves query head h).
- ``valid_lens``: int64 (B,) or (B, Q): query i sees keys ``j < length``.
- ``mask``: bool, True = may attend, broadcastable to (B, H, Q, K).
- ``bias``: float of the case's dtype, added to the scaled scores; ``-inf``
  masks.
- ``causal``: ``"bottom-right"`` (query i sits at key position i + K - Q, so
  it sees ``j <= i + K - Q``) or ``"top-left"`` (``j <= i``, torch's
  ``is_causal``).
- ``window``: (left, right), bottom-right aligned, None = unbounded side:
  query i at ``p = i + K - Q`` sees ``p - left <= j <= p + right``.
- ``scale``: multiplies ``q k^T``; default ``1 / sqrt(d)``.

Only the keywords a case uses are passed: a case whose keyword your function
does not accept, or for which it raises ``NotImplementedError``, is "not
supported" (never a pass). Everything combines by AND; a query with no
visible key must give a zero output. Decoding cases call the function once
per step (one query, the keys seen so far). Gradients are graded by the
command's adapters, not through this signature.

This module imports NumPy and the oracle only.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference as ref

__all__ = [
    "DTYPES",
    "TOLERANCES",
    "Case",
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


class NotSupported(Exception):
    """Raised by an implementation (or adapter) that cannot express a case."""


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One attention case and its float64 expectation.

    ``queries``/``keys``/``values`` are float64 holding values already rounded
    to ``dtype`` (so the oracle sees exactly what the implementation sees);
    they may hold NaN or ``±inf`` where no query may look. ``decode``: None,
    ``"growing"`` (step t: query t against keys ``[:t + 1]``) or ``"static"``
    (step t: query t against the whole cache, ``valid_lens = t + 1``, NaN in
    the slots not written yet); either is graded against one causal pass.
    ``grad``: also grade the gradients of ``sum(output * grad_out)``.
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
    decode: str | None = None
    grad: bool = False
    grad_out: np.ndarray | None = None
    expected: np.ndarray | None = None
    expected_grads: tuple | None = None
    quick: bool = False

    def __str__(self) -> str:
        return self.id

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(B, H, H_kv, Q, K, d)."""
        B, H, Q, d = self.queries.shape
        return B, H, self.keys.shape[1], Q, self.keys.shape[2], d

    def forms(self) -> dict[str, Any]:
        """The keywords this case passes (those that are set)."""
        names = ("valid_lens", "mask", "bias", "causal", "window", "scale")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

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


def numpy_dtype(dtype: str) -> Any:
    """The NumPy dtype of a dtype name (bfloat16 from ``ml_dtypes``)."""
    if dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as exc:  # it comes with jax
            raise NotSupported("bfloat16 needs the ml_dtypes package") from exc
        return ml_dtypes.bfloat16
    return np.dtype(dtype)


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
    """(output, (dq, dk, dv)) of the oracle; top-left causal as its boolean mask."""
    forms = dict(forms)
    Q, K = q.shape[2], k.shape[2]
    if forms.get("causal") == "top-left":
        tril = np.arange(K)[None, :] <= np.arange(Q)[:, None]
        mask = forms.get("mask")
        forms["mask"] = tril if mask is None else np.asarray(mask, bool) & tril
        forms["causal"] = False
    else:
        forms["causal"] = forms.get("causal") == "bottom-right"
    if q.size == 0 or k.shape[2] == 0:  # nothing to see: zeros (the oracle needs a key)
        return np.zeros(q.shape[:3] + v.shape[3:]), forms
    out, _ = ref.attention(q, k, v, **forms)
    return out, forms


def _oracle_grads(q: Any, k: Any, v: Any, g: Any, forms: dict) -> tuple:
    if q.size == 0 or k.shape[2] == 0:
        return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    return ref.attention_gradients(q, k, v, g, **forms)[:3]


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


def _poisoned(k: np.ndarray, v: np.ndarray, forms: dict, poison: Any) -> tuple:
    """Keys and values with ``poison`` where no query may look."""
    if poison is None:
        return k, v
    k, v = k.copy(), v.copy()
    K = k.shape[2]
    if "valid_lens" in forms:
        lens = np.asarray(forms["valid_lens"])
        hidden = np.arange(K)[None, :] >= (lens if lens.ndim == 1 else lens.max(1))[:, None]
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
        forms["bias"] = _round(np.asarray(forms["bias"], np.float64), dtype)
    want, _ = _oracle(q, k, v, forms)
    return Case(
        id=id, family=family, dtype=dtype, queries=q, keys=k, values=v, expected=want, **forms
    )


def conformance_cases(
    quick: bool = False, dtypes: tuple[str, ...] = DTYPES, seed: int = 0
) -> list[Case]:
    """The grid: each mask form (lengths 1-D/2-D, boolean, bias, causal in both
    alignments, window, grouped-query heads, KV-cache decoding), empty rows and
    empty axes, NaN and ``±inf`` where nobody may look, in ``dtypes``, with
    gradients for the non-decoding cases. ``quick``:
    about 50 of them (each family once in float32, a few in every dtype)."""
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
        q64, k64, v64 = normal3 = (
            rng.standard_normal((B, H, Q, d)),
            rng.standard_normal((B, Hkv, K, d)),
            rng.standard_normal((B, Hkv, K, d)),
        )
        del normal3
        g64 = rng.standard_normal((B, H, Q, d))
        base = "/".join(p for p in (family, variant, label) if p)
        quick_family = family not in first
        first.add(family)
        for dtype in dtypes:
            q, k, v, g = (_round(x, dtype) for x in (q64, k64, v64, g64))
            f: dict[str, Any] = {
                n: (_round(x, dtype) if n == "bias" else x) for n, x in forms.items()
            }
            if decode:  # graded against one causal pass
                want, oracle_forms = _oracle(q, k, v, {"causal": "bottom-right"})
            else:
                want, oracle_forms = _oracle(q, k, v, f)
            kp, vp = _poisoned(k, v, f, poison)
            grads = [False] if decode else [False, True]
            for grad in grads:
                expected_grads = None
                if grad:
                    expected_grads = _oracle_grads(q, k, v, g, oracle_forms)
                is_quick = (
                    dtype == "float32"
                    and (quick_family or base in _QUICK_FLOAT32)
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
    """Grade an output (and gradients ``(dq, dk, dv)`` for a ``grad`` case)."""
    try:
        errors = [_max_error(output, np.asarray(case.expected))]
        atol, rtol = case.tolerance()
        want = np.asarray(case.expected)
        ok = errors[0] <= atol + rtol * float(np.max(np.abs(want), initial=0.0))
        if case.grad:
            if grads is None:
                raise NotSupported("no gradients")
            gatol, grtol = case.tolerance(grads=True)
            for got, want in zip(grads, case.expected_grads or ()):
                err = _max_error(got, want)
                errors.append(err)
                ok = ok and err <= gatol + grtol * float(np.max(np.abs(want), initial=0.0))
    except ValueError as exc:
        return Result("differs", None, str(exc))
    err = max(errors, key=lambda e: np.inf if np.isnan(e) else e)
    if ok:
        return Result("agrees", err)
    nan = [n for n, e in zip(("output", "dq", "dk", "dv"), errors) if np.isnan(e)]
    if nan:
        return Result("differs", err, f"NaN in {', '.join(nan)}")
    worst = ("output", "dq", "dk", "dv")[errors.index(err)]
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


def run_case(case: Case, attention: Callable[..., Any]) -> Result:
    """Run ``attention`` (the signature in this module's docstring) on
    ``case`` and grade its output against the oracle. Gradient cases are "not
    supported" here (the function gives no gradients)."""
    if case.grad:
        return Result("not supported", None, "gradients are not graded through a function")
    try:
        dtype = numpy_dtype(case.dtype)
        params = inspect.signature(attention).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        needed = set(case.forms()) | ({"valid_lens"} if case.decode == "static" else set())
        missing = sorted(n for n in needed if not takes_all and n not in params)
        if missing:
            raise NotSupported(f"takes no {', '.join(missing)}")

        def call(q: Any, k: Any, v: Any, **forms: Any) -> Any:
            forms = {n: np.asarray(x, dtype) if n == "bias" else x for n, x in forms.items()}
            return attention(
                np.asarray(q, dtype), np.asarray(k, dtype), np.asarray(v, dtype), **forms
            )

        if case.decode:
            out = decode_steps(case, call)
        else:
            out = _as_numpy(call(case.queries, case.keys, case.values, **case.forms()))
    except NotSupported as exc:
        return Result("not supported", None, str(exc))
    except NotImplementedError as exc:
        return Result("not supported", None, str(exc) or "NotImplementedError")
    except Exception as exc:
        return Result("error", None, f"{type(exc).__name__}: {exc}"[:300])
    return grade(case, out)
