"""From the caller's keywords to one ``Mask``: ``KEYWORDS`` lists each mask
keyword, the value that sets nothing and the family that builds its form;
``make_mask`` asks each family whose keywords are set, in the list's order.
A new form is its own file (a ``Form`` and a ``build(where, **keywords)``),
one entry here and its type in ``MaskForms``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypedDict

import numpy as np

from attention_multi.backends.capabilities import opt

from ..checks import check_mask_array, check_window, valid_lens_checked
from ..numerics import compute_dtype
from .arrays import arrays
from .blocks import BlockMask
from .captures import native_captures
from .functions import MaskMod, ScoreMod
from .intervals import Intervals, window_within
from .segments import make_segments
from .spec import Form, Mask, Where, is_int

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array, Window


class MaskForms(TypedDict, total=False):
    """The mask keywords besides ``valid_lens``, that ``dot_product_attention`` and
    the modules' ``forward`` take as ``**forms`` (meanings: in their docstrings)."""

    mask: Array | None
    bias: Array | None
    causal: bool
    window: Window
    mask_mod: Callable[..., Array] | None
    score_mod: Callable[..., Array] | None
    segment_ids: Any


def _intervals(
    where: Where, valid_lens: Any = None, causal: Any = False, window: Any = None
) -> Form | None:
    lens = known = None
    xp, batch, num_queries, num_keys = where.xp, where.batch, where.num_queries, where.num_keys
    if valid_lens is not None:
        lens, known = valid_lens_checked(
            xp, valid_lens, batch, num_queries, device=where.device, num_keys=num_keys
        )
        shape = (where.batch, 1, lens.shape[1] if len(lens.shape) == 2 else 1, 1)
        known = None if known is None else known.reshape(shape)
        lens = opt(xp).reshape(lens, (opt(xp).shape(lens)[0],) + shape[1:])
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    window = window_within(check_window(window), num_queries, num_keys, where.offset_known)
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


def _function(where: Where, name: str, fn: Any) -> tuple[Any, tuple[Any, Any, Any]]:
    """(``fn`` checked, its NumPy captures on the backend unless host code is traced, its
    bases: ``q_idx`` from ``query_base``)."""
    if not callable(fn):
        raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
    if not opt(where.xp).host_code_traced():
        fn = native_captures(where.xp, name, fn, where.device)
    return fn, (0, where.query_base, 0)


def _mask_mod(where: Where, mask_mod: Any = None) -> Form:
    fn, bases = _function(where, "mask_mod", mask_mod)
    if isinstance(fn, BlockMask):
        fn.check(where.batch, where.heads, where.num_queries, where.num_keys)
    return MaskMod(fn, bases, where.xp, where.device)


def _score_mod(where: Where, score_mod: Any = None) -> Form:
    return ScoreMod(*_function(where, "score_mod", score_mod))


def one_query_position(where: Where, keywords: Mapping[str, Any]) -> None:
    """One place for a query: a function's ``q_idx`` counts from ``query_base``, while
    ``causal``, ``window`` and one ``segment_ids`` array put query 0 at key ``offset``;
    where these differ, a call giving both is refused (never read one way or the other)."""
    base, offset = where.query_base, where.offset
    if base is offset or not is_int(base, offset) or base == offset:
        return
    functions = [n for n in ("mask_mod", "score_mod") if keywords.get(n) is not None]
    placed = [n for n in ("causal", "window") if keywords.get(n) not in (None, False)]
    ids = keywords.get("segment_ids")
    if ids is not None and not isinstance(ids, tuple):
        placed.append("segment_ids")
    if functions and placed:
        shift, aligned = offset - base, [n for n in placed if n != "segment_ids"]
        fix = f"write it in the function with q_idx + {shift}"
        if aligned:  # (a pair of ids would not move causal's or window's query)
            fix += (
                f", with {' and '.join(aligned)} in the function too (causal: kv_idx <= "
                f"q_idx + {shift}) instead of the keyword"
            )
        else:
            fix += ", or give segment_ids as a (query ids, key ids) pair"
        raise ValueError(
            f"{' and '.join(functions)} with {' and '.join(placed)} when Q={where.num_queries} "
            f"!= K={where.num_keys}: q_idx counts query 0 as {base} (flex's), while "
            f"{placed[0]} puts it at key position {offset} (bottom-right); {fix}"
        )


def _causal_block_mask(where: Where, keywords: dict[str, Any]) -> dict[str, Any]:
    """A ``BlockMask`` that is exactly causal, over a call where query ``i``
    is key ``i`` and no other lengths or window are given, as ``causal=True``
    (the framework's causal kernel); the keywords as they are otherwise."""
    bm = keywords.get("mask_mod")
    if not isinstance(bm, BlockMask) or not bm.causal:
        return keywords
    if any(keywords.get(n) is not None for n in ("valid_lens", "window")):
        return keywords
    if not (is_int(where.offset, where.query_base) and where.offset == where.query_base == 0):
        return keywords
    bm.check(where.batch, where.heads, where.num_queries, where.num_keys)
    if where.num_queries != bm.num_queries:
        return keywords
    return {**keywords, "mask_mod": None, "causal": True}


class Keyword(NamedTuple):
    default: Any  # the value that sets nothing (compared by identity)
    build: Callable[..., Form | None]  # the family: build(where, **its keywords that are set)


KEYWORDS: dict[str, Keyword] = {
    "valid_lens": Keyword(None, _intervals),
    "causal": Keyword(False, _intervals),
    "window": Keyword(None, _intervals),
    "mask": Keyword(None, _arrays),
    "bias": Keyword(None, _arrays),
    "mask_mod": Keyword(None, _mask_mod),
    "score_mod": Keyword(None, _score_mod),
    "segment_ids": Keyword(None, make_segments),
}
assert set(KEYWORDS) - {"valid_lens"} == set(MaskForms.__annotations__)


def checked_forms(function: str, forms: Mapping[str, Any], refused: tuple[str, ...] = ()) -> None:
    """Raise Python's TypeError for an unknown keyword (naming ``function`` and
    the mask keywords it takes, all but ``refused``) when a name of ``forms``
    is not a mask keyword."""
    for name in forms:
        if name not in KEYWORDS or name == "valid_lens":
            taken = ", ".join(k for k in KEYWORDS if k not in refused)
            raise TypeError(
                f"{function}() got an unexpected keyword argument {name!r} "
                f"(the mask keywords: {taken})"
            )


def no_forms(forms: Mapping[str, Any]) -> bool:
    """Whether ``forms`` (checked: ``checked_forms``) set nothing but the keywords' defaults."""
    return all(value is KEYWORDS[name].default for name, value in forms.items())


def _offset(xp: Backend, offset: Any, num_queries: int, num_keys: int) -> tuple[Any, Any, bool]:
    """``(offset, offset_known, offset_given)`` of the caller's ``offset`` (None: K - Q)."""
    if offset is None:
        return num_keys - num_queries, num_keys - num_queries, False
    if not xp.is_array(offset):
        return int(offset), int(offset), True
    return offset, int(xp.to_numpy(offset)) if opt(xp).is_concrete(offset) else None, True


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
    """Check what the caller gave and normalize it into one ``Mask``:
    ``valid_lens`` (batch,) or (batch, Q) and the ``MaskForms`` (``mask``,
    ``bias`` broadcast to (batch, heads, Q, K) when ``heads_axis``, else to
    (batch, Q, K) or a 4-D one); ``offset`` query 0's key position (default
    K - Q); ``query_base`` the index of query 0 that ``q_idx`` counts from
    (default: the given offset, the KV cache's length, else 0); ``dtype`` the
    queries' (a bias takes its compute dtype). Lists and NumPy arrays are
    placed on ``device``."""
    offset, known, given = _offset(xp, offset, num_queries, num_keys)
    base = (offset if given else 0) if query_base is None else query_base
    shape = (batch, heads, num_queries, num_keys)
    where = Where(xp, *shape, offset, known, dtype, heads_axis, device, base)
    keywords = _causal_block_mask(where, keywords)
    families: dict[Callable[..., Form | None], dict[str, Any]] = {}
    for name, value in keywords.items():
        spec = KEYWORDS.get(name)
        if spec is None:
            raise TypeError(f"make_mask() got an unexpected keyword argument {name!r}")
        if value is not spec.default:
            families.setdefault(spec.build, {})[name] = value
    one_query_position(where, keywords)
    order = dict.fromkeys(k.build for k in KEYWORDS.values())  # (the families, the list's order)
    forms = (build(where, **families[build]) for build in order if build in families)
    forms_set = tuple(f for f in forms if f is not None)
    return Mask(batch, heads, num_queries, num_keys, forms_set, not opt(xp).host_code_traced(), xp)
