"""The masking contract, written once: which keys a query may see, and what
every path must do about what it may not see.

Callers give any mix of d2l's ``valid_lens`` (1-D or 2-D), a boolean ``mask``
(True = may attend), a float ``bias``, ``causal`` and ``window``. ``make_mask``
turns them into one ``Mask``; every path reads it. The rules:

- **Visible keys.** Query ``i`` sits at key position ``p = i + offset``
  (``offset = K - Q`` by default: aligned at the bottom right, as decoding
  needs). It may see key ``j`` when ``lo <= j < hi`` with
  ``lo = max(0, p - left)`` and ``hi = min(K, valid_len, p + 1 if causal,
  p + right + 1)`` for a ``window = (left, right)``, and ``mask`` allows it
  and ``bias`` there is not ``-inf``. All forms combine by AND.
- **Masked scores** are replaced by ``fill_value``, the lowest finite number
  of the compute dtype (never ``-inf``, so nothing becomes NaN), and masked
  weights are exactly 0.
- **Half precision** (float16, bfloat16) is computed in float32.
- **Empty rows**: a query that may see no key gets zero weights and a zero
  output, with finite gradients.
- **NaN**: NaN in the inputs propagates, except from key and value rows that
  no query of that batch element may see; those are zeroed before any kernel
  reads them.

The row intervals ``[lo, hi)`` are kept as integers (``offset``, ``window``,
lengths), not as matrices: the chunked and tiled paths ask for one block, skip
blocks that no query may see, and drop the mask on blocks that every query may
see entirely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, TypedDict

import numpy as np

from backends.protocol import HALF_DTYPES

from . import blocks, mods
from .checks import check_mask_array, check_window, valid_lens_checked

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array, Window


class MaskForms(TypedDict, total=False):
    """The mask keywords of the API, besides ``valid_lens``: what
    ``dot_product_attention`` and the modules' ``forward`` take as
    ``**forms`` and hand, as one dict, to ``make_mask`` (meanings in
    ``dot_product_attention``'s docstring). A new form is one entry here, one
    in ``FORM_DEFAULTS`` and a keyword of ``make_mask``: nothing above the
    core lists them."""

    mask: Array | None
    bias: Array | None
    causal: bool
    window: Window
    mask_mod: Callable[..., Array] | None
    score_mod: Callable[..., Array] | None
    segment_ids: Any


# A form's value that sets nothing (compared by identity: ``causal`` is
# exactly False, the others None).
FORM_DEFAULTS: dict[str, Any] = {
    "mask": None,
    "bias": None,
    "causal": False,
    "window": None,
    "mask_mod": None,
    "score_mod": None,
    "segment_ids": None,
}
assert set(FORM_DEFAULTS) == set(MaskForms.__annotations__)


def checked_forms(function: str, forms: Mapping[str, Any]) -> None:
    """Raise the TypeError Python gives an unknown keyword, naming
    ``function`` and the mask keywords, when a name of ``forms`` is not one."""
    for name in forms:
        if name not in FORM_DEFAULTS:
            raise TypeError(
                f"{function}() got an unexpected keyword argument {name!r} "
                f"(the mask keywords: valid_lens, {', '.join(FORM_DEFAULTS)})"
            )


def no_forms(forms: Mapping[str, Any]) -> bool:
    """Whether ``forms`` (checked: ``checked_forms``) set nothing but what
    ``FORM_DEFAULTS`` gives: a call with lengths or nothing."""
    for name, value in forms.items():
        if value is not FORM_DEFAULTS[name]:
            return False
    return True


# Every field of a Mask that constrains attention. "Is anything set?" asks this
# list, so a new field can never read as "unmasked"; one that is neither an
# interval nor a bias/score_mod restricts visibility (the safe default).
FIELDS = ("lens", "causal", "window", "allowed", "bias", "mod", "score_mod", "segments")
INTERVAL_FIELDS = frozenset(("lens", "causal", "window"))
SCORE_FIELDS = frozenset(("bias", "score_mod"))  # change scores, not visibility


def compute_dtype(dtype: str) -> str:
    """The dtype scores are computed in: float32 for half precision."""
    return "float32" if dtype in HALF_DTYPES else dtype


# Filled at import: a dict that grows under torch.compile fails its guard on
# the next call (one recompile for nothing).
_FILL: dict[str, float] = {
    d: float(np.finfo(np.dtype(compute_dtype(d))).min)
    for d in ("float16", "bfloat16", "float32", "float64")
}


def fill_value(dtype: str) -> float:
    """What a masked score becomes: the lowest finite value of ``dtype``."""
    value = _FILL.get(dtype)
    if value is None:
        value = _FILL[dtype] = float(np.finfo(np.dtype(compute_dtype(dtype))).min)
    return value


_CONSTANTS: dict = {}  # (backend, what, device) -> array, made outside traces
_CONSTANTS_MAX = 64


def _constant(B: Backend, what: tuple[Any, ...], device: Any, make: Callable[[], Array]) -> Array:
    """``make()``, kept for the next call outside traces (small calls pay
    for every operator: constants are made once)."""
    if B.is_tracing():
        return make()
    cache_key = (B.name, what, device)
    value = _CONSTANTS.get(cache_key)
    if value is None:
        if len(_CONSTANTS) >= _CONSTANTS_MAX:
            _CONSTANTS.clear()
        value = _CONSTANTS[cache_key] = make()
    return value


def fill(B: Backend, dtype: str, device: Any) -> Array:
    """``fill_value`` as a 0-d array of the compute dtype (a Python float
    would promote float32 to float64 in NumPy 1.x)."""
    work = compute_dtype(dtype)
    return _constant(
        B,
        ("fill", work),
        device,
        lambda: B.asarray(np.asarray(fill_value(work), np.dtype(work)), device=device),
    )


def fill_against(B: Backend, dtype: str, device: Any) -> Array | float:
    """``fill_value`` to pass to ``where`` beside an array of the compute
    dtype: a Python float where the backend keeps that array's dtype
    (``Backend.weak_scalars``; torch's ``where`` is faster so), else ``fill``."""
    return fill_value(dtype) if B.weak_scalars else fill(B, dtype, device)


def _positions(B: Backend, num_keys: int, device: Any) -> Array:
    """int32 (1, 1, 1, K): the key positions 0..K-1."""
    return _constant(
        B,
        ("positions", num_keys),
        device,
        lambda: B.arange(num_keys, device).reshape((1, 1, 1, num_keys)),
    )


def lengths_visible(
    B: Backend, lens: Array, ndim: int, num_keys: int, device: Any
) -> tuple[Array, Array]:
    """The lengths form of the first rule without a ``Mask`` (the straight
    line of small calls): key ``j`` is visible to a query when ``j`` is below
    its length. ``lens`` (batch,) or (batch, Q), integer or float32/float64
    with whole values; ``ndim`` that of the inputs, 3 or 4. Returns
    ``(visible, used)``: bool (batch, [1,] Q|1, K), and bool (batch, [1,] K,
    1) where some query of the batch element sees the key."""
    dtype = B.dtype_name(lens)
    if dtype == "float32" and num_keys > 2**24:  # (positions past 2**24 are not exact there)
        lens, dtype = B.astype(lens, "int32"), "int32"
    j = _constant(
        B,
        ("positions", num_keys, dtype),
        device,
        lambda: (
            B.astype(B.arange(num_keys, device), dtype)
            if dtype != "int32"
            else B.arange(num_keys, device)
        ),
    )
    batch, lead = lens.shape[0], (1,) * (ndim - 3)
    if len(lens.shape) == 1:
        visible = j < lens.reshape((batch,) + lead + (1, 1))
        return visible, visible.reshape((batch,) + lead + (num_keys, 1))
    lens = lens.reshape((batch,) + lead + (lens.shape[1], 1))
    visible = j < lens
    return visible, j.reshape((num_keys, 1)) < B.max(lens, -2, keepdims=True)


class Mask:
    """Which keys each query may see, for (batch, heads, Q, K) attention.

    Fields (None: no constraint of that kind): ``lens`` int32 (batch, 1, Q|1,
    1) key lengths; ``offset`` int or 0-d int array (traced); ``causal``;
    ``window`` (left, right) or None; ``allowed`` bool and ``bias`` float,
    both 4-D and broadcastable to (batch, heads, Q, K). ``lens_known`` and
    ``offset_known`` are host copies, None while traced. ``host``: False
    while host NumPy code is itself traced (``Backend.host_code_traced``),
    when nothing is decided from the rows' intervals on the host.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        num_queries: int,
        num_keys: int,
        *,
        lens: Any = None,  # an array or None
        lens_known: Any = None,  # a NumPy array or None
        offset: Any = None,
        offset_known: Any = None,  # an int or None
        causal: bool = False,
        window: tuple[int | None, ...] | None = None,
        allowed: Array | None = None,
        bias: Array | None = None,
        host: bool = True,
        mod: Any = None,  # a mask_mod or None
        score_mod: Any = None,  # a score_mod or None
        segments: Any = None,  # (query ids, key ids) or None
        segments_known: Any = None,  # their NumPy copies or None
        bases: tuple[Any, Any, Any] = (0, 0, 0),
        blocks: blocks.BlockMask | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.batch, self.heads = batch, heads
        self.host = host
        self.num_queries, self.num_keys = num_queries, num_keys
        self.lens, self.lens_known = lens, lens_known
        if offset is None:
            offset = offset_known = num_keys - num_queries
        self.offset, self.offset_known = offset, offset_known
        self.causal, self.window = causal, window
        self.allowed, self.bias = allowed, bias
        self.mod, self.score_mod, self.blocks = mod, score_mod, blocks
        self.segments, self.segments_known = segments, segments_known
        self.b_base, self.q_base, self.k_base = bases
        self.backend = backend  # (evaluates mask_mod for block states)

    def set_fields(self) -> frozenset[str]:
        """The names in ``FIELDS`` that this mask sets."""
        return frozenset(
            f for f in FIELDS if getattr(self, f) is not None and getattr(self, f) is not False
        )

    @property
    def dense(self) -> bool:
        """Something beyond the row intervals is set (a block then needs the
        mask's value, not only its intervals)."""
        return bool(self.set_fields() - INTERVAL_FIELDS)

    @property
    def restricted(self) -> bool:
        """Something beyond the row intervals restricts which keys are seen."""
        return bool(self.set_fields() - INTERVAL_FIELDS - SCORE_FIELDS)

    # -- what kernels read ----------------------------------------------------------
    @property
    def intervals(self) -> bool:
        """True when lengths, causal or a window restrict the keys."""
        return self.lens is not None or self.causal or self.window is not None

    @property
    def unmasked(self) -> bool:
        """Every query may see every key, and there is no bias."""
        return not self.set_fields()

    @property
    def only_lens(self) -> bool:
        """Only ``valid_lens`` (1-D or 2-D) restrict the keys; no bias."""
        return self.set_fields() == {"lens"}

    @property
    def per_batch_lens(self) -> Array | None:
        """int32 (batch,) lengths when they are all there is (1-D valid_lens)."""
        if self.only_lens and self.lens.shape[2] == 1:
            return self.lens.reshape((self.batch,))
        return None

    @property
    def top_left_causal(self) -> bool:
        """Only causal, with query ``i`` seeing keys ``j <= i`` (offset 0),
        over as many keys as queries: what a kernel's ``is_causal`` means."""
        return (
            self.set_fields() == {"causal"}
            and self.num_queries == self.num_keys
            and self.offset_known == 0
        )

    def boolean(self, B: Backend, device: Any) -> Array | None:
        """bool (batch|1, heads|1, Q, K): True where a query may see a key;
        None when every query is known to see every key. Made once per Mask."""
        cached = self.__dict__.get("_visible")
        if cached is not None and cached[0] == device:
            return cached[1]
        visible = None
        if self.intervals and not self._sees_all():
            lo, hi = self.bounds(B, device)
            j = _positions(B, self.num_keys, device)
            visible = j < hi if lo is None else B.logical_and(j >= lo, j < hi)
        if self.allowed is not None:
            visible = self.allowed if visible is None else B.logical_and(visible, self.allowed)
        extra = mods.visible(B, self, device)
        if extra is not None:
            visible = extra if visible is None else B.logical_and(visible, extra)
        self.__dict__["_visible"] = (device, visible)
        return visible

    def boolean_one_head(self, B: Backend, device: Any) -> Array | None:
        """``boolean`` of a one-head mask without its heads axis: (batch|1, Q, K)."""
        visible = self.boolean(B, device)
        return (
            None
            if visible is None
            else visible.reshape((visible.shape[0],) + tuple(visible.shape[2:]))
        )

    def additive(self, B: Backend, dtype: str, device: Any) -> Array | None:
        """float: ``bias`` (or 0) where a query may see a key, ``fill_value``
        where it may not; None when nothing is masked and there is no bias."""
        visible = self.boolean(B, device)
        if visible is None:
            return self.bias
        return B.where(visible, 0.0 if self.bias is None else self.bias, fill(B, dtype, device))

    # -- the row intervals ----------------------------------------------------------
    def _fact(self, name: str, compute: Callable[[], Any]) -> Any:
        """A host decision about this Mask, computed once."""
        facts = self.__dict__.setdefault("_facts", {})
        if name not in facts:
            facts[name] = compute()
        return facts[name]

    def _sees_all(self) -> bool:
        """Known on the host: every row's interval is all the keys."""
        if not self.intervals:
            return True

        def compute() -> bool:
            if self._only_lengths():  # (one reduction, not the rows' intervals)
                return self.known_on_host() and self._least_length() >= self.num_keys
            known = self._bounds_known()
            return (
                known is not None
                and bool((known[0] <= 0).all())
                and bool((known[1] >= self.num_keys).all())
            )

        return self._fact("sees_all", compute)

    @property
    def every_row_sees_a_key(self) -> bool:
        """Known on the host: no query is left with no visible key."""
        if self.unmasked:
            return True
        return (
            self.only_lens
            and self.host
            and self.lens_known is not None
            and self._least_length() > 0
        )

    def _only_lengths(self) -> bool:
        """Only lengths make the intervals (no causal, no window)."""
        return self.lens is not None and not self.causal and self.window is None

    def _least_length(self) -> int:
        """The least known length (host)."""
        return self._fact(
            "least_length",
            lambda: int(self.lens_known.min()) if self.lens_known.size else self.num_keys,
        )

    def bounds(self, B: Backend, device: Any) -> tuple[Array | None, Array]:
        """``(lo or None, hi)`` int32 arrays broadcastable to (batch, 1, Q, 1)."""
        lo, hi = None, self.lens
        if self.causal or self.window is not None:
            p = (
                B.arange(self.num_queries, device).reshape((1, 1, self.num_queries, 1))
                + self.offset
            )
            ends = []
            if self.causal:
                ends.append(p + 1)
            if self.window is not None:
                left, right = self.window
                if left is not None:
                    lo = B.where(p > left, p - left, 0)
                if right is not None:
                    ends.append(p + (right + 1))
            for end in ends:
                hi = end if hi is None else B.minimum(hi, end)
        if hi is None:
            hi = B.zeros((1, 1, 1, 1), "int32", device) + self.num_keys
        return lo, hi

    def known_on_host(self) -> bool:
        """Whether the rows' intervals are known on the host (not traced)."""
        return self.host and not (
            (self.lens is not None and self.lens_known is None)
            or ((self.causal or self.window is not None) and self.offset_known is None)
            or (self.segments is not None and self.segments_known is None)
        )

    def _bounds_known(
        self, b0: int = 0, b1: int | None = None, q0: int = 0, q1: int | None = None
    ) -> Any:  # (lo, hi) or None
        """Host ``(lo, hi)`` int64, broadcastable to (batch block, Q block), of
        the rows' visible keys (before ``allowed`` and ``bias``); None while
        traced. Computed once per Mask, then sliced."""
        if not self.known_on_host():
            return None
        known = self.__dict__.get("_known")
        if known is None:
            lo, hi = np.zeros((1, 1), np.int64), np.full((1, 1), self.num_keys, np.int64)
            if self.lens is not None:
                hi = np.minimum(
                    hi, self.lens_known.reshape(self.lens_known.shape[0], self.lens_known.shape[2])
                )
            p = np.arange(self.num_queries)[None, :] + self.offset_known
            if self.causal:
                hi = np.minimum(hi, p + 1)
            if self.window is not None:
                left, right = self.window
                if left is not None:
                    lo = np.maximum(lo, p - left)
                if right is not None:
                    hi = np.minimum(hi, p + right + 1)
            known = self.__dict__["_known"] = (lo, hi)

        def block(x: np.ndarray) -> np.ndarray:
            return x[
                slice(b0, b1) if x.shape[0] > 1 else slice(None),
                slice(q0, q1) if x.shape[1] > 1 else slice(None),
            ]

        return block(known[0]), block(known[1])

    # -- blocks -----------------------------------------------------------------------
    def block_state(self, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> str:
        """``"none"`` when no query of the block may see a key of it, ``"all"``
        when each may see all (no mask needed), else ``"some"``; from what is
        known on the host (traced: ``"some"``)."""
        known = self._bounds_known(b0, b1, q0, q1)
        if known is None:
            return "some"
        lo, hi = known
        if (np.maximum(lo, k0) >= np.minimum(hi, k1)).all():
            return "none"
        whole = (lo <= k0).all() and (hi >= k1).all()
        if self.restricted:  # mask_mod, segment_ids (blocks.py); mask= is dense
            extra = blocks.extra_state(self, b0, b1, q0, q1, k0, k1)
            if extra == "none":
                return "none"
            whole = whole and extra == "all"
        # (the value forms blocks.py classifies drop from a whole block; others stay)
        rest = self.set_fields() - INTERVAL_FIELDS - blocks.BLOCK_FIELDS
        return "all" if whole and not rest else "some"

    def key_range(
        self, b0: int = 0, b1: int | None = None, q0: int = 0, q1: int | None = None
    ) -> tuple[int, int]:
        """Host ``(start, stop)``: the keys that any query of the block may see
        lie in ``[start, stop)``; all keys while traced."""
        known = self._bounds_known(b0, b1, q0, q1)
        if known is None:
            return 0, self.num_keys
        lo, hi = np.broadcast_arrays(*known)
        rows = hi > lo
        if not rows.any():
            return 0, 0
        return int(lo[rows].min()), int(hi[rows].max())

    def element_ranges(
        self, q0: int = 0, q1: int | None = None
    ) -> Any:  # (starts, stops, whole) or None
        """Host ``(start, stop, whole)`` int64/bool arrays (batch,): the keys
        that the rows ``[q0, q1)`` of each batch element may see lie in
        ``[start, stop)`` (``(0, 0)``: none), and ``whole`` tells whether
        every one of those rows sees all of them. None while traced."""
        known = self._bounds_known(0, None, q0, q1)
        if known is None:
            return None
        shape = (self.batch, (q1 or self.num_queries) - q0)
        lo, hi = (np.broadcast_to(x, shape) for x in known)
        rows = hi > lo
        start = np.where(rows, lo, self.num_keys).min(axis=1)
        stop = np.where(rows, hi, 0).max(axis=1)
        empty = stop <= start
        start[empty], stop[empty] = 0, 0
        whole = (lo <= start[:, None]).all(axis=1) & (hi >= stop[:, None]).all(axis=1)
        if self.segments_known is not None:  # narrowed to the rows' segments
            for b in range(self.batch):
                start[b], stop[b] = mods.segment_key_range(
                    self, b, q0, q1 or self.num_queries, start[b], stop[b]
                )
        return start, stop, whole & (not self.dense)

    def sub(
        self, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int, state: str | None = None
    ) -> Mask:
        """The Mask of a block: batch elements ``[b0, b1)``, queries ``[q0, q1)``
        and keys ``[k0, k1)``, with positions counted from the block's start.
        A block that every query sees whole gets a Mask without constraints."""
        if state is None:
            state = self.block_state(b0, b1, q0, q1, k0, k1)
        if state == "all":
            return Mask(b1 - b0, self.heads, q1 - q0, k1 - k0, host=self.host)

        def rows(x: Any, axis_q: int) -> Any:
            if x is None:
                return None
            index = [slice(None)] * 4
            if x.shape[0] > 1:
                index[0] = slice(b0, b1)
            if x.shape[2] > 1:
                index[2] = slice(q0, q1)
            if axis_q is False and x.shape[3] > 1:
                index[3] = slice(k0, k1)
            return x[tuple(index)]

        lens = rows(self.lens, True)
        known = None if self.lens_known is None else rows(self.lens_known, True) - k0
        return Mask(
            b1 - b0,
            self.heads,
            q1 - q0,
            k1 - k0,
            lens=None if lens is None else lens - k0,
            lens_known=known,
            offset=self.offset + (q0 - k0),
            offset_known=None if self.offset_known is None else self.offset_known + q0 - k0,
            causal=self.causal,
            window=self.window,
            allowed=rows(self.allowed, False),
            bias=rows(self.bias, False),
            host=self.host,
            **blocks.sub_fields(self, b0, b1, q0, q1, k0, k1),
        )

    def keys_from(self, k0: Any, size: int) -> Mask:
        """The Mask of the keys ``[k0, k0 + size)`` for every query, positions
        counted from ``k0``, which may be traced (ring attention under
        ``shard_map``); host copies are kept only when ``k0`` is an int.
        Only for interval masks (lengths, causal, window): ``allowed`` and
        ``bias`` are not sliced."""
        if self.dense:
            raise ValueError(
                "a block of keys at a traced position takes only valid_lens, "
                "causal and window, not mask=, bias=, mask_mod=, score_mod= or segment_ids="
            )
        host = isinstance(k0, int)
        lens_known = offset_known = None
        if host and self.lens_known is not None:
            lens_known = self.lens_known - k0
        if host and self.offset_known is not None:
            offset_known = self.offset_known - k0
        return Mask(
            self.batch,
            self.heads,
            self.num_queries,
            size,
            lens=None if self.lens is None else self.lens - k0,
            lens_known=lens_known,
            offset=self.offset - k0,
            offset_known=offset_known,
            causal=self.causal,
            window=self.window,
            host=self.host,
        )

    def frozen(self, B: Backend) -> Mask:
        """This Mask over copies of its arrays (``Backend.snapshot``), which
        the caller's later in-place writes do not reach."""
        copy = Mask.__new__(Mask)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.pop("_visible", None)  # (may be ``allowed`` itself)
        for name in ("lens", "allowed", "bias"):
            if getattr(self, name) is not None:
                setattr(copy, name, B.snapshot(getattr(self, name)))
        if self.segments is not None:
            copy.segments = tuple(B.snapshot(x) for x in self.segments)
        return copy

    # -- the rules every path applies ---------------------------------------------------
    def rows_with_keys(self, B: Backend, device: Any) -> Array | None:
        """bool (batch|1, heads|1, Q, 1): True where a query may see some key;
        None when every query is known to see one."""
        if not self.restricted:
            if not self.intervals:
                return None if self.num_keys else B.zeros((1, 1, 1, 1), "bool", device)
            if self._fact("rows_nonempty", self._rows_nonempty):
                return None
            lo, hi = self.bounds(B, device)
            return hi > (0 if lo is None else lo)
        return B.any(self.boolean(B, device), -1, keepdims=True)

    def _rows_nonempty(self) -> bool:
        if self._only_lengths() and self.known_on_host():
            return self.num_keys > 0 and self._least_length() > 0
        known = self._bounds_known()
        return known is not None and bool((known[1] > known[0]).all())

    def _keys_all_used(self) -> bool:
        """Known on the host: each batch element's rows together see every
        key (their intervals overlap or touch: the union is [least lo, last hi))."""
        if self._only_lengths() and self.lens.shape[2] == 1 and self.known_on_host():
            return self._least_length() >= self.num_keys
        known = self._bounds_known()
        if known is None:
            return False
        lo, hi = known
        rows = hi > lo
        return bool(
            rows.any(axis=1).all()
            and (np.where(rows, lo, 1).min(axis=1) == 0).all()
            and (np.where(rows, hi, 0).max(axis=1) >= self.num_keys).all()
        )

    def used_keys(self, B: Backend, device: Any) -> Array | None:
        """bool (batch|1, 1, K, 1): True where some query of that batch
        element may see the key; None when every key is known to be seen."""
        if not self.restricted and not self.intervals:
            return None
        one_row = (
            not self.causal
            and self.window is None
            and (self.lens is None or self.lens.shape[2] == 1)
            and (self.allowed is None or tuple(self.allowed.shape[1:3]) == (1, 1))
            and not (self.set_fields() - {"lens", "allowed", "bias", "score_mod"})
        )
        if not self.restricted and (
            self.window is None or self.lens is None or self.lens.shape[2] == 1
        ):
            if self._fact("keys_all_used", self._keys_all_used):
                return None
        if one_row:  # every query of an element sees the same keys: (batch|1, 1, 1, K)
            visible = self.boolean(B, device)
            return (
                None
                if visible is None
                else visible.reshape((visible.shape[0], 1, visible.shape[3], 1))
            )
        if not self.restricted and (
            self.window is None or self.lens is None or self.lens.shape[2] == 1
        ):
            lo, hi = self.bounds(B, device)
            nonempty = hi > (0 if lo is None else lo)
            last = B.max(B.where(nonempty, hi, 0), 2, keepdims=True)
            j = B.arange(self.num_keys, device).reshape((1, 1, self.num_keys, 1))
            if lo is None:
                return j < last
            first = -B.max(B.where(nonempty, -lo, -self.num_keys), 2, keepdims=True)
            return B.logical_and(j >= first, j < last)
        visible = self.boolean(B, device)  # (..., Q, K): any over heads and queries
        used = B.any(B.any(visible, 2, keepdims=True), 1, keepdims=True)
        # (b, 1, 1, K) -> (b, 1, K, 1): a reshape (MXNet cannot transpose booleans)
        return used.reshape((used.shape[0], 1, used.shape[3], 1))

    def guard_unused(
        self, B: Backend, keys: Array, values: Array, guard_keys: bool = True
    ) -> tuple[Array, Array]:
        """Zero key and value rows that no query may see (NaN there must not
        leak into the product); ``keys``/``values`` (batch, heads, K, d).
        ``guard_keys=False``: the values only (for a caller that masks the
        scores by ``where`` and computes no gradient through the keys)."""
        if (
            self.restricted
            and _size(keys) + _size(values) >= B.finite_check_min
            and all_finite(B, keys, values)
        ):  # (no dense mask to build)
            return keys, values
        used = self.used_keys(B, B.device_of(keys))
        if used is None or (
            _size(keys) + _size(values) >= B.finite_check_min and all_finite(B, keys, values)
        ):
            return keys, values
        return B.where(used, keys, 0.0) if guard_keys else keys, B.where(used, values, 0.0)

    @property
    def per_query(self) -> bool:
        """Some key is visible to some queries of a batch element and hidden
        from others (not: no mask, per-batch lengths)."""
        return not (self.unmasked or self.per_batch_lens is not None)

    def kernel_inputs(
        self,
        B: Backend,
        queries: Array,
        keys: Array,
        values: Array,
        queries_finite: bool = False,
        keys_finite: bool = False,
    ) -> tuple[Array, Array, Callable[[Array], Array]]:
        """``(keys, values, finish)`` for a framework's kernel: unused key and
        value rows zeroed (``guard_unused``); ``finish(out)`` zeroes empty rows.
        For a kernel without ``B.fused_keeps_nan`` the NaN rules are enforced
        around it, on the device (no host read): NaN in a query row comes back
        into that row (``sum(q * 0)`` is 0 or NaN), and under a per-query mask,
        which such a kernel adds to the scores (NaN + fill is NaN), NaN keys
        are zeroed before it and the rows that may see one are NaN after it.
        ``queries_finite``, ``keys_finite``: the caller checked that no query,
        or no key and value, is NaN or infinite (the tiled paths, once for
        all their tiles): the passes that guard against them are skipped."""
        if not keys_finite:
            keys, values = self.guard_unused(B, keys, values)
        if B.fused_keeps_nan:
            return keys, values, lambda out: self.zero_empty_rows(B, out)
        seen = None
        # (a kernel that skips the hidden half of top-left causal itself never reads it)
        if self.per_query and not keys_finite and not (self.top_left_causal and B.fused_causal):
            seen = self._sees_nan_keys(B, queries, keys)
            if seen is not None:
                keys = B.where(B.any(keys != keys, -1, keepdims=True), 0.0, keys)

        def finish(out: Array) -> Array:
            dtype = B.dtype_name(out)
            if not queries_finite:
                out = out + B.astype(B.sum(queries * 0.0, -1, keepdims=True), dtype)
            if seen is not None:
                nan = B.astype(B.asarray(np.float32(np.nan), device=B.device_of(out)), dtype)
                out = B.where(seen, nan, out)
            return self.zero_empty_rows(B, out)

        return keys, values, finish

    def _sees_nan_keys(self, B: Backend, queries: Array, keys: Array) -> Array | None:
        """bool (batch, heads, Q, 1): the query may see a key with a NaN;
        None when every query sees every key.
        One product of the visible keys (as 0/1, heads of a one-head mask in
        its columns, batch broadcast) with each key's NaN flag."""
        batch, heads, num_q = queries.shape[:3]
        work = compute_dtype(B.dtype_name(queries))
        bad = B.astype(B.any(keys != keys, -1, keepdims=True), work)  # (b, kv_heads, K, 1)
        if heads != bad.shape[1]:
            bad = B.repeat(bad, heads // bad.shape[1], 1)
        visible = self.boolean(B, B.device_of(keys))
        if visible is None:  # every query sees every key after all
            return None
        visible = B.astype(visible, work)
        columns = visible.shape[1] == 1
        if columns:  # (b, 1, Q, K) @ (b, 1, K, heads) -> (b, 1, Q, heads)
            bad = B.transpose(bad, (0, 3, 2, 1))
        else:
            visible = B.broadcast_to(visible, (visible.shape[0], heads, num_q, self.num_keys))
        if visible.shape[0] != batch:
            visible = B.broadcast_to(visible, (batch,) + tuple(visible.shape[1:]))
        count = B.matmul(visible, bad)
        if columns:
            count = B.transpose(count, (0, 3, 2, 1))
        return count > 0

    def zero_empty_rows(self, B: Backend, out: Array) -> Array:
        """Zero the output rows (batch, heads, Q, dv) of queries that see no key."""
        rows = self.rows_with_keys(B, B.device_of(out))
        return out if rows is None else B.where(rows, out, 0.0)


def _size(x: Array) -> int:
    return math.prod(x.shape)


def empty_rows(
    B: Backend, shape: tuple[int, ...], dtype: str, device: Any, *inputs: Array
) -> Array:
    """Zeros of ``shape`` for rows that see no key, computed by no kernel but
    kept in the autodiff graph of ``inputs``: their gradients are exact zeros
    (a select of one element of each, never taken, so NaN there stays out)."""
    out = B.zeros(shape, dtype, device)
    never = B.zeros((1,), "bool", device)
    for x in inputs:
        out = out + B.astype(B.sum(B.where(never, x.reshape((-1,))[:1], 0.0), 0), dtype)
    return out


def all_finite(B: Backend, *arrays: Array) -> bool:
    """Whether every entry of ``arrays`` is known to be finite: one sum each,
    read on the host (False while traced, or when a sum overflows). A pass
    over the keys and values to zero their unused rows then costs a read
    instead of a write (torch's ``where`` broadcast over the last axis is slow)."""
    if not all(B.is_concrete(x) for x in arrays):
        return False
    return all(np.isfinite(float(B.to_numpy(B.sum(x.reshape((-1,)), 0)))) for x in arrays)


def normalize(B: Backend, acc: Array, total: Array) -> Array:
    """``acc / total`` per row, 0 where the row saw no key. A row's softmax
    total is at least 1 when it saw a key (its largest term is exp(0)), and
    exactly 0 when it saw none; NaN is not 0, so NaN in what the row saw
    propagates (``total > 0`` would turn it into zeros)."""
    has_keys = total != 0
    return B.where(has_keys, acc / B.where(has_keys, total, 1.0), 0.0)


def masked_softmax(
    B: Backend,
    scores: Array,
    visible: Array | None,
    empty_rows: bool = True,
    hidden_finite: bool = False,
    before_product: bool = False,
    lens: Array | None = None,
    dtype: str | None = None,
    device: Any = None,
) -> Array:
    """Softmax over the last axis restricted to ``visible`` (None: all), in
    float32 for half precision; masked weights and empty rows are exactly 0.
    Returns the dtype of ``scores``.

    What the caller knows makes it cheaper, never different:
    ``empty_rows=False``, every row sees a key (masked weights are then 0
    without a second ``where``: exp of the fill against a visible score
    underflows to 0); ``hidden_finite``, no hidden score is NaN (the key rows
    nobody sees were zeroed), so where ``Backend.masks_by_adding`` a
    broadcast mask of 0 and the fill is added instead of a ``where`` over
    every score (fill + score rounds to the fill, or to -inf: weight 0).
    ``before_product``: the weights are multiplied by the values next and
    reach users only through ``Backend.nan_rows``
    (``Backend.softmax_before_product``). ``lens``: the lengths ``visible``
    was made from (``lengths_visible``), for ``Backend.below_lengths``;
    ``visible`` may then be a function that makes it (``small.py``).
    ``dtype`` and ``device``: those of ``scores``, where the caller has them."""
    if dtype is None:
        dtype = B.dtype_name(scores)
    work = compute_dtype(dtype)
    x = B.astype(scores, work) if work != dtype else scores
    softmax = B.softmax_before_product if before_product else B.softmax
    if visible is None:
        weights = softmax(x, -1)
    else:
        if device is None:
            device = B.device_of(x)
        by_lengths = lens is not None and B.masks_by_lengths
        if not by_lengths and callable(visible):
            visible = visible()
        if by_lengths:
            x = B.below_lengths(x, visible, lens, fill_value(work), -1)
        elif hidden_finite and B.masks_by_adding and _size(visible) * 8 <= _size(x):
            x = x + B.where(visible, _zero(B, work, device), fill(B, work, device))
        else:
            x = B.where(visible, x, fill_against(B, work, device))
        weights = softmax(x, -1)
        if empty_rows:
            weights = (
                B.below_lengths(weights, visible, lens, 0.0, -1)
                if by_lengths
                else B.where(visible, weights, 0.0)
            )
    return weights if work == dtype else B.astype(weights, dtype)


def _zero(B: Backend, dtype: str, device: Any) -> Array:
    """0 as a 0-d array of ``dtype``."""
    return _constant(
        B, ("zero", dtype), device, lambda: B.asarray(np.zeros((), np.dtype(dtype)), device=device)
    )


# -- from the caller's arguments to one Mask ---------------------------------------------

_SIDE_MAX = 2**30  # window sides while the offset is traced: far past any key, no int32 overflow


def _window_within(
    window: tuple[int | None, ...] | None,
    num_queries: int,
    num_keys: int,
    offset_known: int | None,
    offset: Any,
) -> tuple[int | None, ...] | None:
    """A window side that reaches past every key for every query means no
    limit (None): the arithmetic on positions then never meets a side near
    2**31 (which wraps in int32). While the offset is traced, sides are
    clamped to 2**30 instead."""
    if window is None or window == (None, None):
        return window
    if offset is None:
        offset_known = num_keys - num_queries
    if offset_known is None:
        return tuple(None if s is None else min(s, _SIDE_MAX) for s in window)
    left, right = window
    # query positions p run over [offset, offset + Q): p - left <= 0 and p + right >= K - 1
    if left is not None and left >= offset_known + num_queries - 1:
        left = None
    if right is not None and right >= num_keys - 1 - offset_known:
        right = None
    return None if left is None and right is None else (left, right)


def make_mask(
    B: Backend,
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    *,
    valid_lens: Any = None,
    mask: Any = None,
    bias: Any = None,
    causal: bool = False,
    window: Any = None,
    offset: Any = None,
    dtype: str | None = None,
    heads_axis: bool = True,
    device: Any = None,
    mask_mod: Callable[..., Array] | None = None,
    score_mod: Callable[..., Array] | None = None,
    segment_ids: Any = None,
) -> Mask:
    """Check what the caller gave and normalize it into one ``Mask``.

    ``valid_lens`` (batch,) or (batch, Q); ``mask`` bool and ``bias`` float,
    broadcastable to (batch, heads, Q, K) when ``heads_axis`` (4-D inputs),
    else to (batch, Q, K) (3-D inputs; a 4-D one is (batch, heads, Q, K), for
    multi-head attention); ``causal`` bool; ``window`` int or (left, right);
    ``offset`` the position of query 0 among the keys (default K - Q);
    ``dtype`` that of the queries (a bias is cast to its compute dtype);
    ``mask_mod``, ``score_mod``, ``segment_ids`` as in ``mods.py`` (query
    positions there count from ``offset`` when it is given, else from 0).
    Lists and NumPy arrays are placed on ``device``.
    """
    lens = lens_known = None
    if valid_lens is not None:
        lens, lens_known = valid_lens_checked(
            B, valid_lens, batch, num_queries, device=device, num_keys=num_keys
        )
        shape = (batch, 1, lens.shape[1] if len(lens.shape) == 2 else 1, 1)
        if lens_known is not None:
            lens_known = lens_known.reshape(shape)
        lens = lens.reshape(shape)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    window = check_window(window)
    shape = (batch, heads, num_queries, num_keys)
    allowed = None
    if mask is not None:
        allowed = check_mask_array(B, "mask", mask, shape, heads_axis, "bool", device)
    if bias is not None:
        bias = check_mask_array(B, "bias", bias, shape, heads_axis, "float", device)
        if dtype is not None and B.dtype_name(bias) != compute_dtype(dtype):
            bias = B.astype(bias, compute_dtype(dtype))
        finite = bias != float("-inf")  # -inf masks, as in additive masks
        allowed = finite if allowed is None else B.logical_and(allowed, finite)
    offset_known = None
    host = not B.host_code_traced()
    if offset is not None:
        if B.is_array(offset):
            offset_known = int(B.to_numpy(offset)) if B.is_concrete(offset) else None
        else:
            offset = offset_known = int(offset)
    window = _window_within(window, num_queries, num_keys, offset_known, offset)
    return Mask(
        batch,
        heads,
        num_queries,
        num_keys,
        lens=lens,
        lens_known=lens_known,
        offset=offset,
        offset_known=offset_known,
        causal=bool(causal),
        window=window,
        allowed=allowed,
        bias=bias,
        host=host,
        **mods.make_fields(
            B, batch, num_queries, num_keys, mask_mod, score_mod, segment_ids, offset, device
        ),
        **_block_mask_fields(mask_mod, batch, num_queries, num_keys),
    )


def _block_mask_fields(mask_mod: Any, batch: int, num_queries: int, num_keys: int) -> dict:
    """``{"blocks": mask_mod}`` when ``mask_mod`` is a prebuilt ``BlockMask``
    (checked against the call's shape), else nothing."""
    if not isinstance(mask_mod, blocks.BlockMask):
        return {}
    mask_mod.check(batch, num_queries, num_keys)
    return {"blocks": mask_mod}
