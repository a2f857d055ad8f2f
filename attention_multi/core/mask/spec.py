"""``Mask``: which keys each query may see, as immutable data: a shape and the
forms set (only those). A ``Form``, one family of mask keywords, answers the
same few questions (``visible``, ``scores``, ``region_state``, ``states``,
``seen``, ``region``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple

import numpy as np

from attention_multi.backends.capabilities import opt

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Block states, the one encoding: no query of the block may see a key of it
(skipped), some may (computed with the mask), each sees all (no mask)."""


def state_of(empty: Any, full: Any) -> Any:
    """int8 states: EMPTY where ``empty``, else FULL where ``full``, else PARTIAL."""
    return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


def least_state(states: Any, axis: Any = None) -> Any:
    """Blocks together (over ``axis``, default all): EMPTY or FULL if all are, else PARTIAL."""
    return state_of((states == EMPTY).all(axis), (states == FULL).all(axis))


class Region(NamedTuple):
    """A block of a mask: batch elements ``[b0, b1)``, queries ``[q0, q1)``,
    keys ``[k0, k1)``. The starts of queries and keys may be traced (a
    scan's block, ``Mask.block_at``); ``sizes`` then gives (queries, keys)."""

    b0: int
    b1: int
    q0: Any
    q1: Any
    k0: Any
    k1: Any
    sizes: tuple[int, int] | None = None

    @property
    def on_host(self) -> bool:
        """Whether its starts are host ints (not traced)."""
        return is_int(self.q0) and is_int(self.k0)


class Where(NamedTuple):
    """What a family needs to build its form: ``offset`` the position of query 0 among
    the keys (int or traced), ``offset_known`` its host value (None: traced); ``dtype``
    the queries'; ``heads_axis``: 4-D inputs (else masks are (batch, Q, K));
    ``query_base``: the index of query 0 that ``q_idx`` counts from (int or traced)."""

    xp: Backend
    batch: int
    heads: int
    num_queries: int
    num_keys: int
    offset: Any
    offset_known: int | None
    dtype: str | None
    heads_axis: bool
    device: Any
    query_base: Any


def is_int(*xs: Any) -> bool:
    """Whether every one of ``xs`` is a host int (not traced)."""
    return all(isinstance(x, (int, np.integer)) for x in xs)


# (batch x Q x K) of a mask made on the host at most: larger, the framework's
# threads are faster (the least: ``Masking.host_mask_min_size``)
HOST_MASK_MAX = 1 << 22


class Form:
    """One family of mask keywords. Subclasses set ``kind`` and override what
    their family answers; the defaults tell nothing about a block on the host."""

    kind: ClassVar[str] = ""
    restricts: ClassVar[bool] = True  # hides keys (False: only changes scores, as score_mod)
    cuts_traced: ClassVar[bool] = False  # its region may start at a traced key position
    narrows: ClassVar[bool] = False  # its key_span narrows the keys of a row on the host
    gathers: ClassVar[bool] = False  # it takes batch elements in any order (``rows``)

    def known(self) -> bool:
        """Whether its host copies exist (values not traced)."""
        return True

    def visible(self, xp: Backend, mask: Mask, device: Any) -> Array | None:
        """bool broadcastable to (batch, heads, Q, K); None: every key."""
        return None

    def host_visible(self, mask: Mask) -> np.ndarray | bool | None:
        """``visible`` made with NumPy on the host (True: every key); None: it cannot be."""
        return None if self.restricts else True

    def scores(self, xp: Backend, mask: Mask, s: Array, work: str) -> Array:
        """The scaled scores ``s`` (batch, heads, Q, K) after this form."""
        return s

    def region_state(self, mask: Mask, r: Region) -> int:
        """The state of a region on the host (PARTIAL when it cannot tell)."""
        return PARTIAL

    def states(self, mask: Mask, block_q: int, block_k: int) -> np.ndarray | None:
        """int8 (batch|1, Q blocks, K blocks) states on the host; None: PARTIAL."""
        return None

    def seen(self, xp: Backend, mask: Mask, r: Region, device: Any) -> Array | None:
        """Device bool (0-d): some query of ``r`` may see a key of it (None: no answer)."""
        return None

    def key_span(
        self, mask: Mask, b: int, q0: int, q1: int, start: int, stop: int
    ) -> tuple[int, int]:
        """Host: the keys ``[start, stop)`` of element ``b``'s rows ``[q0, q1)``, narrowed."""
        return start, stop

    def region(self, mask: Mask, r: Region) -> Form:
        """This form over the region ``r``, positions counted from its start."""
        raise NotImplementedError

    def rows(self, xp: Backend, mask: Mask, rows: np.ndarray) -> Form:
        """This form over the batch elements ``rows`` (host ints), in that order."""
        raise NotImplementedError

    def snapshot(self, xp: Backend) -> Form:
        """This form over copies of its arrays (``Copies.snapshot``)."""
        return self


def _taken(xp: Backend, x: Any, rows: np.ndarray) -> Any:
    """``x`` (batch first, size 1 broadcast) at the batch elements ``rows``."""
    if x is None or x.shape[0] == 1:
        return x
    if isinstance(x, np.ndarray):
        return x[rows]
    return xp.take(x, xp.asarray(rows, "int32", xp.device_of(x)), 0)


def _cut(xp: Backend | None, x: Any, axis: int, start: Any, stop: Any, size: int | None) -> Any:
    """``x[start:stop]`` along ``axis``; a traced ``start``: ``size`` entries (``read_slice``)."""
    if is_int(start):
        index: list[Any] = [slice(None)] * len(x.shape)
        index[axis] = slice(start, stop)
        return x[tuple(index)]
    assert xp is not None and size is not None, "a traced start needs a backend and a size"
    return opt(xp).read_slice(x, start, size, axis)


def _sliced(x: Any, r: Region, keys: bool = True, xp: Backend | None = None) -> Any:
    """``x`` (4-D, size-1 axes broadcast) cut to ``r``, keys too if ``keys``; ``xp`` cuts traced."""
    if x is None:
        return None
    if not r.on_host:
        nq, nk = r.sizes or (None, None)
        x = x[r.b0 : r.b1] if x.shape[0] > 1 else x
        x = _cut(xp, x, 2, r.q0, r.q1, nq) if x.shape[2] > 1 else x
        return _cut(xp, x, 3, r.k0, r.k1, nk) if keys and x.shape[3] > 1 else x
    bounds = ((r.b0, r.b1), (None, None), (r.q0, r.q1), (r.k0, r.k1) if keys else (None, None))
    return x[tuple(slice(*b) if n > 1 else slice(None) for n, b in zip(x.shape, bounds))]


def _and(xp: Backend, parts: Iterable[Array | None]) -> Array | None:
    """The AND of the ``parts`` that are not None (None: every one is)."""
    out = None
    for part in parts:
        if part is not None:
            out = part if out is None else xp.logical_and(out, part)
    return out


class Mask:
    """Which keys each query may see, for (batch, heads, Q, K) attention:
    ``forms`` in the keyword list's order; ``host`` False while host code is
    traced (``Tracing.host_code_traced``: nothing decided on the host); ``xp``
    the backend. Nothing writes into a Mask: a block is a new one (``region``)."""

    __slots__ = (
        "batch",
        "heads",
        "num_queries",
        "num_keys",
        "forms",
        "host",
        "xp",
        "_kinds",
        "_cache",
    )

    def __init__(
        self,
        batch: int,
        heads: int,
        num_queries: int,
        num_keys: int,
        forms: tuple[Form, ...] = (),
        host: bool = True,
        xp: Backend | None = None,
    ) -> None:
        self.batch, self.heads = batch, heads
        self.num_queries, self.num_keys = num_queries, num_keys
        self.forms, self.host, self.xp = forms, host, xp
        self._kinds = {f.kind: f for f in forms}
        self._cache: dict[Any, Any] = {}

    def _once(self, name: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, kept for this Mask while host code runs eagerly
        (a traced host, ``torch.compile``, must see no mutation)."""
        if not self.host:
            return compute()
        if name not in self._cache:
            self._cache[name] = compute()
        return self._cache[name]

    def kept(self, name: Any) -> Any:
        """What ``_once`` kept under ``name``; None when nothing was."""
        return self._cache.get(name)

    def _with(self, forms: tuple[Form, ...], batch: int, num_queries: int, num_keys: int) -> Mask:
        return Mask(batch, self.heads, num_queries, num_keys, forms, self.host, self.xp)

    def __repr__(self) -> str:
        shape = (self.batch, self.heads, self.num_queries, self.num_keys)
        return f"Mask({shape}, {', '.join(self._kinds) or 'nothing'})"

    # -- the forms ---------------------------------------------------------------------
    def form(self, kind: str) -> Any:
        """The form ``kind`` (a ``Form.kind``) when it is set, else None."""
        return self._kinds.get(kind)

    @property
    def intervals(self) -> Any:
        """The lengths, causal and window form (``intervals.Intervals``) or None."""
        return self._kinds.get("intervals")

    @property
    def bias(self) -> Array | None:
        """The float bias added to the scaled scores (4-D) or None."""
        return getattr(self.form("arrays"), "bias", None)

    @property
    def score_mod(self) -> Callable[..., Array] | None:
        """The ``score_mod`` function or None."""
        return getattr(self.form("score_mod"), "score_mod", None)

    # -- predicates ------------------------------------------------------------------
    @property
    def unmasked(self) -> bool:
        """Every query may see every key, and there is no bias."""
        return len(self.forms) == 0  # (not `not self.forms`: torch.compile traces this)

    @property
    def dense(self) -> bool:
        """Something beyond the row intervals is set (a block needs its values)."""
        return any(f.kind != "intervals" for f in self.forms)

    @property
    def restricted(self) -> bool:
        """Something beyond the row intervals restricts which keys are seen."""
        return any(f.restricts and f.kind != "intervals" for f in self.forms)

    @property
    def only_lens(self) -> bool:
        """Only ``valid_lens`` (1-D or 2-D) restrict the keys; no bias."""
        return len(self.forms) == 1 and self.intervals is not None and self.intervals.only_lens

    @property
    def per_batch_lens(self) -> Array | None:
        """int32 (batch,) lengths when they are all there is (1-D valid_lens)."""
        if self.only_lens and self.intervals.valid_lens.shape[2] == 1:
            lens = self.intervals.valid_lens
            return opt(self.xp).reshape(lens, opt(self.xp).shape(lens)[:1])
        return None

    @property
    def per_query(self) -> bool:
        """Some key is visible to some queries of a batch element and hidden
        from others (not: no mask, per-batch lengths)."""
        return not (self.unmasked or self.per_batch_lens is not None)

    @property
    def top_left_causal(self) -> bool:
        """Only causal, with query ``i`` seeing keys ``j <= i`` (offset 0),
        over as many keys as queries: what a kernel's ``is_causal`` means."""
        form, square = self.intervals, self.num_queries == self.num_keys
        causal = form is not None and form.only_causal and form.offset_known == 0
        return len(self.forms) == 1 and causal and square

    def known_on_host(self) -> bool:
        """Whether every form is known on the host (not traced)."""
        return self.host and all(f.known() for f in self.forms)

    @property
    def every_row_sees_a_key(self) -> bool:
        """Known on the host: no query is left with no visible key."""
        known = self.only_lens and self.known_on_host()
        return self.unmasked or (known and self.intervals.least_length(self) > 0)

    # -- the dense rendering: the AND of the forms ------------------------------------
    def boolean(self, xp: Backend, device: Any) -> Array | None:
        """bool (batch|1, heads|1, Q, K): True where a query may see a key;
        None when every query is known to see every key. Made once per Mask."""

        def make() -> Array | None:
            made, visible = self._host_boolean(xp, device)
            if not made:
                visible = _and(xp, (form.visible(xp, self, device) for form in self.forms))
            if visible is not None and visible.shape[-1] != self.num_keys:  # (q_idx alone)
                visible = xp.broadcast_to(visible, tuple(visible.shape[:-1]) + (self.num_keys,))
            return visible

        return self._once(("boolean", device), make)

    def _host_boolean(self, xp: Backend, device: Any) -> tuple[bool, Array | None]:
        """``(made, boolean)``: the forms' AND made with NumPy and handed over
        once, where the backend takes host masks on this device (no framework
        call, so no parallel region) and every form renders on the host."""
        if not opt(xp).host_masks or not self.known_on_host() or opt(xp).is_tracing():
            return False, None
        size = self.batch * self.num_queries * self.num_keys
        if (
            opt(xp).on_accelerator(device)
            or not self.per_query
            or not opt(xp).host_mask_min_size <= size <= HOST_MASK_MAX
        ):
            return False, None
        parts = [form.host_visible(self) for form in self.forms]
        if any(p is None for p in parts):
            return False, None
        arrays = [p for p in parts if isinstance(p, np.ndarray)]  # (True: every key)
        if not arrays:
            return True, None
        visible = arrays[0]
        for part in arrays[1:]:
            visible = np.logical_and(visible, part)
        return True, xp.asarray(visible, "bool", device)

    def boolean_one_head(self, xp: Backend, device: Any) -> Array | None:
        """``boolean`` of a one-head mask without its heads axis: (batch|1, Q, K)."""
        visible = self.boolean(xp, device)
        if visible is None:
            return None
        shape = opt(xp).shape(visible)
        return opt(xp).reshape(visible, shape[:1] + shape[2:])

    def additive(self, xp: Backend, dtype: str, device: Any) -> Array | None:
        """float: ``bias`` (or 0) where a query may see a key, ``fill_value``
        where it may not; None when nothing is masked and there is no bias."""
        from ..numerics import fill

        visible = self.boolean(xp, device)
        if visible is None:
            return self.bias
        return xp.where(visible, 0.0 if self.bias is None else self.bias, fill(xp, dtype, device))

    def scores(self, xp: Backend, s: Array, work: str) -> Array:
        """The scaled scores ``s`` after every form (bias, then ``score_mod``), in ``work``."""
        for form in self.forms:
            s = form.scores(xp, self, s, work)
        return s

    # -- blocks -----------------------------------------------------------------------
    def whole(self) -> Region:
        """The region of every batch element, query and key."""
        return Region(0, self.batch, 0, self.num_queries, 0, self.num_keys)

    def block_state(self, r: Region) -> int:
        """The state of a region on the host, every form together (traced: PARTIAL)."""
        if not self.known_on_host():
            return PARTIAL
        state = FULL
        for form in self.forms:
            state = min(state, form.region_state(self, r))
            if state == EMPTY:
                break
        return state

    def region(self, r: Region, state: int | None = None) -> Mask:
        """The Mask of the block ``r``, positions counted from its start; a
        block every query sees whole gets a Mask without forms."""
        if state is None:
            state = self.block_state(r)
        forms = () if state == FULL else tuple(f.region(self, r) for f in self.forms)
        return self._with(forms, r.b1 - r.b0, r.q1 - r.q0, r.k1 - r.k0)

    def rows(self, rows: np.ndarray) -> Mask:
        """The Mask of the batch elements ``rows`` (host ints), in that order;
        every form must gather (``Form.gathers``)."""
        forms = tuple(f.rows(self.xp, self, rows) for f in self.forms)  # type: ignore[arg-type]
        return self._with(forms, len(rows), self.num_queries, self.num_keys)

    def block_at(self, q0: Any, k0: Any, num_queries: int, num_keys: int) -> Mask:
        """The Mask of the queries ``[q0, q0 + num_queries)`` and keys ``[k0, k0 +
        num_keys)``; ``q0``, ``k0`` ints or traced (a scan's block; clamped to the mask)."""
        r = Region(0, self.batch, q0, q0 + num_queries, k0, k0 + num_keys, (num_queries, num_keys))
        forms = tuple(f.region(self, r) for f in self.forms)
        return self._with(forms, self.batch, num_queries, num_keys)

    def keys_from(self, k0: Any, size: int) -> Mask:
        """The Mask of the keys ``[k0, k0 + size)``, ``k0`` an int or traced (ring
        attention, scans); only for forms that cut there (``Form.cuts_traced``)."""
        if not all(f.cuts_traced for f in self.forms):
            raise ValueError(
                "a block of keys at a traced position takes valid_lens, causal, window, "
                "mask_mod, score_mod and segment_ids, not mask= or bias="
            )
        r = Region(0, self.batch, 0, self.num_queries, k0, k0 + size)
        forms = tuple(f.region(self, r) for f in self.forms)
        return self._with(forms, self.batch, self.num_queries, size)

    def seen(self, xp: Backend, r: Region, device: Any) -> Array | None:
        """Device bool (0-d): whether some query of the region ``r`` may see
        some key of it, by every form that can tell (None: none can)."""
        return _and(xp, (form.seen(xp, self, r, device) for form in self.forms))

    def key_span(self, b: int, q0: int, q1: int, start: int, stop: int) -> tuple[int, int]:
        """Host: the keys ``[start, stop)`` of element ``b``'s rows ``[q0, q1)``, every form's."""
        for form in self.forms:
            if stop <= start:
                return 0, 0
            start, stop = form.key_span(self, b, q0, q1, start, stop)
        return start, stop

    def snapshot(self, xp: Backend) -> Mask:
        """This Mask over copies of its arrays, out of reach of the caller's in-place writes."""
        forms = tuple(f.snapshot(xp) for f in self.forms)
        return self._with(forms, self.batch, self.num_queries, self.num_keys)
