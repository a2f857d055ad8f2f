"""The conformance grid's programmable forms: ``mask_mod`` and ``score_mod``
functions (FlexAttention's signatures), each written once for every framework.

A ``Mod`` holds a maker and the arrays its function closes over; ``function(framework,
arrays)`` builds the function on that framework's arrays (``frameworks.py``):
a document mask, a sliding window with sink tokens, a prefix-LM; ALiBi,
soft-capping and a learnable relative-position bias table, whose gradient is
graded with the queries', keys' and values'. The oracle evaluates the NumPy
build on index arrays broadcasting to (B, H, Q, K).

A new form is one maker function and one ``Mod`` in ``conformance._specs``;
learnable arrays need ``param_grads`` (from the score's gradient) and a
``score_mod`` needs ``derivative`` (of its output with respect to the score).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .frameworks import Framework

__all__ = [
    "Mod",
    "alibi",
    "bias_table",
    "document",
    "materialized",
    "prefix_lm",
    "sliding_window_with_sinks",
    "softcap",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Mod:
    """A ``mask_mod`` or ``score_mod`` of the grid.

    ``make(framework, **arrays)`` returns the function; ``arrays`` are what it
    closes over (NumPy: int, or float64 holding values rounded to the case's
    dtype). ``learnable``: the float arrays whose gradient is graded (they go
    to a framework as float32, float64 in float64 cases, and are
    differentiated like the queries). ``derivative(score, b, h, q_idx,
    kv_idx)``: NumPy, d score_mod / d score (the oracle's chain rule);
    ``param_grads(dscore)``: NumPy, the learnable arrays' gradients from the
    gradient with respect to the score (B, H, Q, K) (additive score_mods
    only: theirs is also the gradient of their output).
    """

    kind: str  # "mask_mod" or "score_mod"
    name: str
    make: Callable[..., Callable]
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    learnable: tuple[str, ...] = ()
    derivative: Callable | None = None
    param_grads: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None

    def __repr__(self) -> str:
        return f"{self.kind} {self.name}"

    def function(
        self, framework: Framework, dtype: str = "float64", learned: Any = None
    ) -> Callable:
        """The function on ``framework``'s arrays; float arrays in the compute
        dtype of ``dtype`` (float64 for float64, else float32); ``learned``:
        the learnable arrays already on the framework, in ``learnable``'s order."""
        given = dict(zip(self.learnable, learned or ()))
        arrays = {
            name: given[name] if name in given else self.framework_array(framework, x, dtype)
            for name, x in self.arrays.items()
        }
        return self.make(framework, **arrays)

    @staticmethod
    def framework_array(framework: Framework, x: np.ndarray, dtype: str) -> Any:
        if x.dtype.kind in "iu":
            return framework.ints(x)
        return framework.array(x, "float64" if dtype == "float64" else "float32")

    def numpy_function(self) -> Callable:
        """The oracle's: NumPy, float64."""
        return self.make(Framework(), **self.arrays)


# -- mask_mods: True where the query may see the key ---------------------------------------------


def _document(framework: Framework, doc: Any) -> Callable:
    def document(
        b: Any, h: Any, q_idx: Any, kv_idx: Any
    ) -> Any:  # same document; negative ids are padding
        return (doc[b, q_idx] == doc[b, kv_idx]) & (doc[b, q_idx] >= 0)

    return document


def document(ids: np.ndarray) -> Mod:
    """Packed documents as a function: ids (B, Q == K), negative = padding."""
    return Mod("mask_mod", "document", _document, {"doc": np.asarray(ids, np.int32)})


def _sliding_window_with_sinks(framework: Framework, width: int, sinks: int) -> Callable:
    def sliding_window_with_sinks(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        near = (kv_idx <= q_idx) & (q_idx - kv_idx <= width)
        return near | (kv_idx < sinks)

    return sliding_window_with_sinks


def sliding_window_with_sinks(width: int, sinks: int) -> Mod:
    """Causal, ``width`` keys back, and the first ``sinks`` keys for everyone."""

    def make(framework: Framework) -> Callable:
        return _sliding_window_with_sinks(framework, width, sinks)

    return Mod("mask_mod", f"sliding window {width} + {sinks} sinks", make)


def _prefix_lm(framework: Framework, prefix: Any) -> Callable:
    def prefix_lm(
        b: Any, h: Any, q_idx: Any, kv_idx: Any
    ) -> Any:  # bidirectional over each row's prefix
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])

    return prefix_lm


def prefix_lm(prefix: np.ndarray) -> Mod:
    """Causal, except the first ``prefix[b]`` keys, seen by every query of row b."""
    return Mod("mask_mod", "prefix-LM", _prefix_lm, {"prefix": np.asarray(prefix, np.int32)})


# -- score_mods: what is done to the scaled score -------------------------------------------------


def _alibi(framework: Framework, slopes: Any) -> Callable:
    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # (TensorFlow's tensors: no indexing by a tensor, no int-by-float product)
        return score + framework.take(slopes, h) * framework.like(kv_idx - q_idx, score)

    return alibi


def _one(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return np.ones_like(score)


def alibi(slopes: np.ndarray) -> Mod:
    """ALiBi: a per-head slope times the key's distance (slopes (H,))."""
    return Mod("score_mod", "ALiBi", _alibi, {"slopes": np.asarray(slopes, np.float64)}, (), _one)


def _softcap(framework: Framework, cap: float) -> Callable:
    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * framework.tanh(score / cap)

    return softcap


def softcap(cap: float) -> Mod:
    """Soft-capping (Gemma 2): ``cap * tanh(score / cap)``."""

    def make(framework: Framework) -> Callable:
        return _softcap(framework, cap)

    def derivative(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return 1.0 - np.tanh(score / cap) ** 2

    return Mod("score_mod", f"soft-capping {cap:g}", make, {}, (), derivative)


def _bias_table(framework: Framework, table: Any, offset: int) -> Callable:
    def relative_bias(
        score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any
    ) -> Any:  # one learnable bias per head and distance
        return score + table[h, kv_idx - q_idx + offset]

    return relative_bias


def bias_table(table: np.ndarray, queries: int) -> Mod:
    """A learnable bias per head and relative position (T5's, unbucketed):
    ``table`` (H, Q + K - 1), entry ``kv_idx - q_idx + Q - 1``; its gradient is graded."""
    table = np.asarray(table, np.float64)
    offset = queries - 1

    def make(framework: Framework, table: Any) -> Callable:
        return _bias_table(framework, table, offset)

    def param_grads(dscore: np.ndarray) -> dict[str, np.ndarray]:
        B, H, Q, K = dscore.shape
        grad = np.zeros_like(table)
        rel = np.arange(K)[None, :] - np.arange(Q)[:, None] + offset
        for h in range(H):
            np.add.at(grad[h], rel, dscore[:, h].sum(0))
        return {"table": grad}

    return Mod(
        "score_mod", "relative bias table", make, {"table": table}, ("table",), _one, param_grads
    )


# -- for the frameworks that take a mask, not a function ----------------------------------------


def materialized(shape: tuple, mask_mod: Mod | None = None, segment_ids: Any = None) -> np.ndarray:
    """(B, H, Q, K) boolean of a ``mask_mod`` and ``segment_ids`` (True = may
    attend; (B, 1, Q, K) when it is the same for every head), as a user of an
    API that takes a mask builds it: the function
    evaluated on the index grid; segment ids (B, K), queries taking the id at
    their position ``i + K - Q``, or a pair ((B, Q), (B, K)): same id, not negative."""
    B, H, _, Q, K, _ = shape
    allowed = np.ones((B, H, Q, K), bool)
    if mask_mod is not None:
        grid = np.ix_(np.arange(B), np.arange(H), np.arange(Q), np.arange(K))
        allowed &= np.asarray(mask_mod.numpy_function()(*grid), bool)
    if segment_ids is not None:
        if isinstance(segment_ids, tuple):
            q_ids, k_ids = (np.asarray(x) for x in segment_ids)
        else:
            k_ids = np.asarray(segment_ids)
            q_ids = k_ids[:, np.arange(Q) + K - Q]
        same = (q_ids[:, :, None] == k_ids[:, None, :]) & (q_ids[:, :, None] >= 0)
        allowed &= same[:, None]
    return allowed[:, :1] if (allowed == allowed[:, :1]).all() else allowed
