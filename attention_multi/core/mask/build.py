"""From the caller's keywords to one ``Mask``.

``KEYWORDS`` is the keyword list: each mask keyword of the API, the value
that sets nothing, and the family that builds its form. ``make_mask`` checks
what the caller gave and asks each family whose keywords are set for its form,
in the list's order. A new form is its own file (a ``Form`` and a
``build(where, **keywords)``) and one entry here (and in ``MaskForms``, its
type for the API's signatures).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypedDict

import numpy as np

from ..checks import check_mask_array, check_window, valid_lens_checked
from ..numerics import compute_dtype
from .arrays import arrays
from .blocks import BlockMask
from .functions import MaskMod, ScoreMod, native_captures
from .intervals import Intervals, window_within
from .segments import make_segments
from .spec import Form, Mask

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array, Window


class MaskForms(TypedDict, total=False):
    """The mask keywords of the API, besides ``valid_lens``: what
    ``dot_product_attention`` and the modules' ``forward`` take as
    ``**forms`` and hand, as one dict, to ``make_mask`` (meanings in
    ``dot_product_attention``'s docstring)."""

    mask: Array | None
    bias: Array | None
    causal: bool
    window: Window
    mask_mod: Callable[..., Array] | None
    score_mod: Callable[..., Array] | None
    segment_ids: Any


class Where(NamedTuple):
    """What a family needs to build its form: the call's shape and context.
    ``offset``: the position of query 0 among the keys (an int, or traced),
    ``offset_known`` its host value (None while traced), ``offset_given``
    whether the caller set it (a KV cache); ``dtype`` that of the queries;
    ``heads_axis``: the inputs are 4-D (else masks are (batch, Q, K));
    ``query_base``: the index of query 0 that a function's ``q_idx`` counts
    from (an int, or traced)."""

    xp: Backend
    batch: int
    heads: int
    num_queries: int
    num_keys: int
    offset: Any
    offset_known: int | None
    offset_given: bool
    dtype: str | None
    heads_axis: bool
    device: Any
    query_base: Any


def _intervals(
    where: Where, valid_lens: Any = None, causal: Any = False, window: Any = None
) -> Form | None:
    lens = known = None
    if valid_lens is not None:
        lens, known = valid_lens_checked(
            where.xp,
            valid_lens,
            where.batch,
            where.num_queries,
            device=where.device,
            num_keys=where.num_keys,
        )
        shape = (where.batch, 1, lens.shape[1] if len(lens.shape) == 2 else 1, 1)
        known = None if known is None else known.reshape(shape)
        lens = lens.reshape(shape)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    window = window_within(
        check_window(window), where.num_queries, where.num_keys, where.offset_known
    )
    if lens is None and not causal and window is None:
        return None
    return Intervals(lens, known, where.offset, where.offset_known, bool(causal), window)


def _arrays(where: Where, mask: Any = None, bias: Any = None) -> Form | None:
    xp = where.xp
    shape = (where.batch, where.heads, where.num_queries, where.num_keys)
    if mask is not None:
        mask = check_mask_array(xp, "mask", mask, shape, where.heads_axis, "bool", where.device)
    if bias is not None:
        bias = check_mask_array(xp, "bias", bias, shape, where.heads_axis, "float", where.device)
        if where.dtype is not None and xp.dtype_name(bias) != compute_dtype(where.dtype):
            bias = xp.astype(bias, compute_dtype(where.dtype))
    if mask is None and bias is None:
        return None
    return arrays(xp, mask, bias)


def _function(name: str, fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a function, got {type(fn).__name__}")


def _bases(where: Where) -> tuple[Any, Any, Any]:
    """Where a function's indices start: ``q_idx`` at ``query_base``."""
    return (0, where.query_base, 0)


def _native(where: Where, name: str, fn: Any) -> Any:
    """``fn`` with the NumPy arrays it captures on the backend (not while
    host code is traced: the tracer reads NumPy there)."""
    if where.xp.host_code_traced():
        return fn
    return native_captures(where.xp, name, fn, where.device)


def _mask_mod(where: Where, mask_mod: Any = None) -> Form | None:
    _function("mask_mod", mask_mod)
    if mask_mod is None:
        return None
    if isinstance(mask_mod, BlockMask):
        mask_mod.check(where.batch, where.num_queries, where.num_keys)
    return MaskMod(_native(where, "mask_mod", mask_mod), _bases(where), where.xp)


def _score_mod(where: Where, score_mod: Any = None) -> Form | None:
    _function("score_mod", score_mod)
    if score_mod is None:
        return None
    return ScoreMod(_native(where, "score_mod", score_mod), _bases(where))


def _segments(where: Where, segment_ids: Any = None) -> Form | None:
    if segment_ids is None:
        return None
    return make_segments(
        where.xp,
        segment_ids,
        where.batch,
        where.num_queries,
        where.num_keys,
        where.offset,
        where.device,
    )


def one_query_position(where: Where, keywords: Mapping[str, Any]) -> None:
    """One place for a query in one call: a function's ``q_idx`` counts from
    ``query_base`` (0, flex's, unless decoding) where ``causal=``, ``window=``
    and one ``segment_ids`` array put query 0 at key position ``offset``
    (``K - Q``: bottom-right); when these differ a call giving both is
    refused, never read one way or the other."""
    base, offset = where.query_base, where.offset
    if base is offset or not (_known_int(base) and _known_int(offset)) or base == offset:
        return
    functions = [n for n in ("mask_mod", "score_mod") if keywords.get(n) is not None]
    placed = [n for n in ("causal", "window") if keywords.get(n) not in (None, False)]
    ids = keywords.get("segment_ids")
    if ids is not None and not isinstance(ids, tuple):
        placed.append("segment_ids")
    if functions and placed:
        raise ValueError(
            f"{' and '.join(functions)} with {' and '.join(placed)} when Q={where.num_queries} "
            f"!= K={where.num_keys}: q_idx counts query 0 as {base} (flex's), while "
            f"{placed[0]} puts it at key position {offset} (bottom-right); write it in the "
            f"function with q_idx + {offset - base}"
            + (", or give segment_ids as a (query ids, key ids) pair" if ids is not None else "")
        )


def _known_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer))


class Keyword(NamedTuple):
    default: Any  # the value that sets nothing (compared by identity)
    build: Callable[..., Form | None]  # the family: build(where, **its keywords)


KEYWORDS: dict[str, Keyword] = {
    "valid_lens": Keyword(None, _intervals),
    "causal": Keyword(False, _intervals),
    "window": Keyword(None, _intervals),
    "mask": Keyword(None, _arrays),
    "bias": Keyword(None, _arrays),
    "mask_mod": Keyword(None, _mask_mod),
    "score_mod": Keyword(None, _score_mod),
    "segment_ids": Keyword(None, _segments),
}
assert set(KEYWORDS) - {"valid_lens"} == set(MaskForms.__annotations__)


def checked_forms(function: str, forms: Mapping[str, Any]) -> None:
    """Raise the TypeError Python gives an unknown keyword, naming
    ``function`` and the mask keywords, when a name of ``forms`` is not one."""
    for name in forms:
        if name not in KEYWORDS or name == "valid_lens":
            raise TypeError(
                f"{function}() got an unexpected keyword argument {name!r} "
                f"(the mask keywords: {', '.join(KEYWORDS)})"
            )


def no_forms(forms: Mapping[str, Any]) -> bool:
    """Whether ``forms`` (checked: ``checked_forms``) set nothing but the
    keywords' defaults: a call with lengths or nothing."""
    for name, value in forms.items():
        if value is not KEYWORDS[name].default:
            return False
    return True


def make_mask(
    xp: Backend,
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    *,
    offset: Any = None,
    dtype: str | None = None,
    heads_axis: bool = True,
    device: Any = None,
    query_base: Any = None,
    **keywords: Any,
) -> Mask:
    """Check what the caller gave and normalize it into one ``Mask``.

    ``keywords``: ``valid_lens`` (batch,) or (batch, Q), and the mask
    keywords (``MaskForms``): ``mask`` bool and ``bias`` float, broadcastable
    to (batch, heads, Q, K) when ``heads_axis`` (4-D inputs), else to
    (batch, Q, K) (3-D inputs; a 4-D one is (batch, heads, Q, K), for
    multi-head attention); ``causal``; ``window`` int or (left, right);
    ``mask_mod``, ``score_mod``, ``segment_ids``. ``offset`` the position of
    query 0 among the keys (default K - Q); ``query_base`` the index of query
    0 that a function's ``q_idx`` counts from (default: the given offset, the
    KV cache's length, else 0); ``dtype`` that of the queries (a bias is cast
    to its compute dtype). Lists and NumPy arrays are placed on
    ``device``.
    """
    offset_known: int | None = None
    if offset is None:
        offset_given, offset = False, num_keys - num_queries
        offset_known = offset
    else:
        offset_given = True
        if xp.is_array(offset):
            offset_known = int(xp.to_numpy(offset)) if xp.is_concrete(offset) else None
        else:
            offset = offset_known = int(offset)
    where = Where(
        xp,
        batch,
        heads,
        num_queries,
        num_keys,
        offset,
        offset_known,
        offset_given,
        dtype,
        heads_axis,
        device,
        (offset if offset_given else 0) if query_base is None else query_base,
    )
    families: dict[Callable[..., Form | None], dict[str, Any]] = {}
    for name, value in keywords.items():
        spec = KEYWORDS.get(name)
        if spec is None:
            raise TypeError(f"make_mask() got an unexpected keyword argument {name!r}")
        if value is not spec.default:
            families.setdefault(spec.build, {})[name] = value
    one_query_position(where, keywords)
    forms = []
    for build in dict.fromkeys(k.build for k in KEYWORDS.values()):  # (the list's order)
        if build in families:
            form = build(where, **families[build])
            if form is not None:
                forms.append(form)
    return Mask(batch, heads, num_queries, num_keys, tuple(forms), not xp.host_code_traced(), xp)
