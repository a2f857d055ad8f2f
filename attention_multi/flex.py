"""torch's FlexAttention API by name and signature, on every backend.

A FlexAttention script switches with one import::

    # from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    from attention_multi.flex import flex_attention, create_block_mask

``flex_attention`` takes (B, H, L, E) arrays of torch, JAX, MXNet or NumPy;
it runs eager (no compilation), under ``torch.compile(fullgraph=True)`` and
``jax.jit``, forward and backward on CPU. It is ``dot_product_attention``
with ``mask_mod`` (the block mask's function) and ``score_mod``; where it
differs from torch's:

- Index arguments are flex's: ``q_idx`` and ``kv_idx`` count from 0 and
  ``b``, ``h`` are the batch element and the query head. A function gets
  them as integer arrays that broadcast over (B, H, L, S), so it runs once
  per block row instead of once per score; a function that needs scalars
  (``torch.dot`` of two rows, ``interval[0]``) fails on the arrays and is
  then run per score with the framework's own ``vmap`` (eager and
  ``jax.jit``; under ``torch.compile`` it must take arrays).
- The block mask's fields are host NumPy arrays.
- ``sinks=`` (one logit per query head in every softmax denominator) is
  ours; gradients reach what a ``score_mod`` captures (a bias table, ALiBi
  slopes), on CPU too.
- ``return_aux=AuxRequest(lse=True, max_scores=True)`` (torch 2.13's form;
  ``return_lse``, deprecated there, still works and warns as torch does):
  ``lse`` the natural-log log-sum-exp (B, H, L) of the scaled scores after
  ``score_mod``, ``-inf`` for a query that sees no key (whose output is
  zeros, as flex's); ``max_scores`` each row's largest such score (``-inf``
  there), computed from the dense (B, H, L, S) scores.
- Keywords that only tune torch's GPU kernels (``kernel_options``,
  ``create_block_mask``'s ``compute_dq_write_order`` and ``dq_kv_order``,
  ``from_kv_blocks``' ``dq_*``) are accepted and have no effect here.
"""

from __future__ import annotations

import inspect
import sys
import types
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np

from attention_multi import backends
from attention_multi.backends.capabilities import opt

from .config import chosen_backend, get_backend, native_device
from .core.mask.blocks import BlockMask, bound, noop_mask
from .core.mask.captures import captured, native_captures
from .core.mask.functions import block_mask as _block_mask
from .core.mask.functions import checked_mask, checked_scores, index_grid, is_causal
from .core.mask.spec import FULL, PARTIAL
from .functional import attention
from .types import Array

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "FlexKernelOptions",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
]

FlexKernelOptions = dict
"""torch's ``kernel_options`` type (a dict of GPU kernel settings): accepted, no effect here."""


class AuxRequest(NamedTuple):
    """torch's ``AuxRequest``: which auxiliary outputs ``flex_attention`` returns
    (torch's own ``AuxRequest`` is accepted too)."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """torch's ``AuxOutput``: the auxiliary outputs asked for, None where not:
    ``lse`` and ``max_scores``, each (B, Hq, L)."""

    lse: Array | None = None
    max_scores: Array | None = None


_WARNED: set[str] = set()  # (torch warns once a process)

_CONVERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # torch BlockMask -> ours


def flex_attention(
    query: Array,
    key: Array,
    value: Array,
    score_mod: Callable[..., Array] | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: FlexKernelOptions | None = None,
    *,
    return_aux: AuxRequest | None = None,
    sinks: Array | None = None,
) -> Array | tuple[Array, Array] | tuple[Array, AuxOutput]:
    """torch's ``flex_attention``: ``query`` (B, Hq, L, E), ``key`` (B, Hkv,
    S, E), ``value`` (B, Hkv, S, Ev); ``Hq != Hkv`` needs ``enable_gqa``.
    ``block_mask``: a ``BlockMask`` of ``create_block_mask`` (ours or
    torch's). ``score_mod(score, b, h, q_idx, kv_idx)``; ``scale`` default
    ``1/sqrt(E)``. Returns the output (B, Hq, L, Ev); with ``return_aux``
    (an ``AuxRequest``, ours or torch's) ``(output, AuxOutput)``; with
    ``return_lse`` (deprecated in torch: a ``FutureWarning`` once, as
    torch's) ``(output, lse)``. ``kernel_options`` is accepted and has no
    effect (no kernel to tune); ``sinks`` (Hq,): attention sinks
    (``dot_product_attention``'s)."""
    if return_lse and return_aux is not None:
        raise ValueError(
            "Cannot specify both return_lse and return_aux. "
            "return_lse is deprecated, please use return_aux=AuxRequest(lse=True) instead."
        )
    if return_lse and "return_lse" not in _WARNED:
        _WARNED.add("return_lse")
        warnings.warn(
            "return_lse is deprecated and will be removed in v2.10. "
            "Please use return_aux=AuxRequest(lse=True) instead.",
            FutureWarning,
            stacklevel=2,
        )
    want_lse, want_max = bool(return_lse), False
    if return_aux is not None:
        if not all(hasattr(return_aux, f) for f in ("lse", "max_scores")):
            raise TypeError(
                f"return_aux must be an AuxRequest(lse=..., max_scores=...), "
                f"got {type(return_aux).__name__}"
            )
        want_lse, want_max = bool(return_aux.lse), bool(return_aux.max_scores)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, E), got shape {tuple(x.shape)}")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: "
            f"pass enable_gqa=True for grouped-query attention"
        )
    forms: dict[str, Any] = {}
    blocks = as_block_mask(block_mask)
    if blocks is not None and not getattr(blocks, "all_full", False):
        forms["mask_mod"] = blocks
    if score_mod is not None:
        forms["score_mod"] = score_mod
    done = attention(query, key, value, scale=scale, sinks=sinks, lse=want_lse, **forms)
    out, lse = done.output, done.lse
    if return_aux is None:
        return (out, lse) if want_lse else out
    top = _max_scores(query, key, scale, forms) if want_max else None
    return out, AuxOutput(lse=lse, max_scores=top)


def _max_scores(query: Array, key: Array, scale: float | None, forms: dict[str, Any]) -> Array:
    """(B, Hq, L): each row's largest scaled score after ``score_mod`` among
    the keys it sees (``-inf``: none), from the dense scores."""
    from .core.mask import make_mask
    from .core.numerics import compute_dtype, default_scale, scaled
    from .core.paths.call import expand_kv
    from .core.paths.online import minus_inf

    xp = backends.backend_of_array(query)
    batch, heads, num_q, width = query.shape
    device, dtype = xp.device_of(query), xp.dtype_name(query)
    work = compute_dtype(dtype)
    m = make_mask(xp, batch, heads, num_q, key.shape[2], dtype=dtype, device=device, **forms)
    k, _ = expand_kv(xp, key, key, heads)
    qs = scaled(xp, query, default_scale(width) if scale is None else scale, work)
    s = m.scores(xp, xp.matmul(qs, xp.astype(k, work), transpose_b=True), work)
    seen = m.boolean(xp, device)
    if seen is not None:
        s = xp.where(seen, s, minus_inf(xp, work, device))
    return xp.max(s, -1)


def as_block_mask(block_mask: Any) -> BlockMask | Callable[..., Array] | None:
    """Ours as it is; torch's as ours (its function bound by its block tables,
    FlexAttention's sense), made once; while torch traces, its function bound
    by its tables read on the device."""
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    if not _is_torch_block_mask(block_mask):
        raise TypeError(
            f"block_mask must be a BlockMask of create_block_mask (ours or torch's), "
            f"got {type(block_mask).__name__}"
        )
    if opt(backends.load("torch")).is_tracing():  # (its tables are not on the host now)
        return _traced_tables(block_mask)
    ours = _CONVERTED.get(block_mask)
    if ours is None:
        ours = _CONVERTED[block_mask] = _from_torch(block_mask)
    return ours


def _is_torch_block_mask(x: Any) -> bool:
    return type(x).__module__.startswith("torch.") and hasattr(x, "kv_indices")


def _torch_states(bm: Any) -> Any:
    """int8 torch (batch, heads, Q blocks, K blocks) states of torch's block
    tables, on their device, with torch operations only (so under a trace
    too): a listed block PARTIAL, one of the full tables FULL, others EMPTY."""
    import torch

    num_q, num_k = (int(n) for n in bm.seq_lengths)
    block_q, block_k = (int(n) for n in bm.BLOCK_SIZE)
    nqb, nkb = -(-num_q // block_q), -(-num_k // block_k)
    count = bm.kv_num_blocks[:, :, :nqb]
    states = torch.zeros(count.shape + (nkb + 1,), dtype=torch.int8, device=count.device)
    listed = [(bm.kv_num_blocks, bm.kv_indices, PARTIAL)]
    if bm.full_kv_num_blocks is not None:
        listed.append((bm.full_kv_num_blocks, bm.full_kv_indices, FULL))
    for counts, indices, state in listed:
        counts, indices = counts[:, :, :nqb], indices[:, :, :nqb].long()
        width = torch.arange(indices.shape[-1], device=indices.device)
        kept = (width < counts[..., None]) & (indices < nkb) & (indices >= 0)
        cols = torch.where(kept, indices, nkb)  # (unlisted: the spare column nkb)
        states = states.scatter(-1, cols, torch.full_like(cols, state, dtype=torch.int8))
    return states[..., :nkb]


def _traced_tables(bm: Any) -> Callable[..., Array]:
    """torch's BlockMask under a trace: its function bound by its tables."""
    import torch

    xp, states = backends.load("torch"), _torch_states(bm)
    (num_q, num_k), device = (int(n) for n in bm.seq_lengths), states.device
    tables = (
        states.to(torch.int32).reshape(-1),
        (torch.arange(num_q, device=device) // int(bm.BLOCK_SIZE[0])).to(torch.int32),
        (torch.arange(num_k, device=device) // int(bm.BLOCK_SIZE[1])).to(torch.int32),
    )
    layout = tuple(states.shape)

    def mask_mod(b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        seen = bm.mask_mod(b, h, q_idx, kv_idx)
        return bound(xp, tables, layout, (b, h, q_idx, kv_idx), seen)

    return mask_mod


def _from_torch(bm: Any) -> BlockMask:
    """torch's BlockMask as ours: its ``mask_mod``, shape and block states,
    binding (a block its tables do not list is not computed)."""
    num_q, num_k = (int(n) for n in bm.seq_lengths)
    block_q, block_k = (int(n) for n in bm.BLOCK_SIZE)
    states = _torch_states(bm).cpu().numpy()
    shape = (int(states.shape[0]), int(states.shape[1]), num_q, num_k)
    xp, device = backends.load("torch"), bm.kv_indices.device
    causal = is_causal(xp, bm.mask_mod, states, shape, block_q, block_k, device)
    return BlockMask(bm.mask_mod, states, shape, block_q, block_k, causal, binding=True)


def create_block_mask(
    mask_mod: Callable[..., Array],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
    *,
    backend: Any = None,
) -> BlockMask:
    """torch's ``create_block_mask``: the block states of ``mask_mod`` over
    (B, H, Q_LEN, KV_LEN), ``B`` or ``H`` None when the function ignores
    the axis, blocks of ``BLOCK_SIZE`` (an int or (queries, keys)).
    Evaluated one block row at a time on ``backend``: by default that of
    ``device`` or of the arrays or the framework the function names, else
    the chosen default, or torch where it is imported; ``device`` a device
    of it (default: the current device). ``separate_full_blocks=False``:
    every computed block is listed as partial (``full_kv_*`` None; the
    function is evaluated on all of them), as torch's. ``_compile``
    (deprecated in torch: a ``DeprecationWarning``, as torch's),
    ``compute_dq_write_order`` and ``dq_kv_order`` (torch's GPU backward
    order) have no effect here."""
    if _compile:
        warnings.warn(
            "_compile flag on create_block_mask was originally added to work around a "
            "torch.compile limitation. That limitation has since been addressed. So, to "
            "compile create_block_mask, we suggest doing torch.compile(create_block_mask). "
            "This still works for now, but will be removed in the future.",
            DeprecationWarning,
            stacklevel=2,
        )
    if not isinstance(dq_kv_order, bool):
        raise ValueError("dq_kv_order must be a bool when using create_block_mask")
    made = _create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, backend)
    return made if separate_full_blocks else made.without_full_blocks()


def _create_block_mask(
    mask_mod: Callable[..., Array],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any,
    BLOCK_SIZE: int | tuple[int, int],
    backend: Any,
) -> BlockMask:
    xp = _backend_for(mask_mod, backend, device)
    if opt(xp).host_code_traced():  # (torch.compile: no host states; every block is partial)
        shape = (1 if B is None else B, 1 if H is None else H, Q_LEN, KV_LEN)
        bq, bk = BLOCK_SIZE if isinstance(BLOCK_SIZE, (tuple, list)) else (BLOCK_SIZE,) * 2
        states = np.full(shape[:2] + (-(-Q_LEN // bq), -(-KV_LEN // bk)), PARTIAL, np.int8)
        return BlockMask(mask_mod, states, shape, bq, bk, all_full=False)
    return _block_mask(
        mask_mod,
        1 if B is None else B,
        1 if H is None else H,
        Q_LEN,
        KV_LEN,
        block=BLOCK_SIZE,
        backend=xp,
        device=native_device(xp, device),
    )


def create_mask(
    mod_fn: Callable[..., Array],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    *,
    backend: Any = None,
) -> Array:
    """torch's ``create_mask``: the dense (B, H, Q_LEN, KV_LEN) boolean mask
    of a ``mask_mod``, or the scores a ``score_mod`` makes of zeros, as an
    array of ``backend`` (as ``create_block_mask`` picks it)."""
    xp = _backend_for(mod_fn, backend, device)
    dev = native_device(xp, device)
    shape = (1 if B is None else B, 1 if H is None else H, Q_LEN, KV_LEN)
    grid = index_grid(xp, shape, (0, 0, 0), dev)
    if _is_score_mod(mod_fn):
        fn = native_captures(xp, "score_mod", mod_fn, dev)
        return checked_scores(xp, fn, xp.zeros(shape, "float32", dev), grid)
    fn = native_captures(xp, "mask_mod", mod_fn, dev)
    return xp.broadcast_to(checked_mask(xp, fn, grid, dev), shape)


def and_masks(*mask_mods: Callable[..., Array]) -> Callable[..., Array]:
    """A ``mask_mod`` True where all of ``mask_mods`` are (``noop_mask`` for none)."""
    return _combined(mask_mods, "and_masks", "logical_and")


def or_masks(*mask_mods: Callable[..., Array]) -> Callable[..., Array]:
    """A ``mask_mod`` True where any of ``mask_mods`` is (none: no key is seen)."""
    return _combined(mask_mods, "or_masks", "logical_or")


def _combined(mask_mods: tuple, name: str, how: str) -> Callable[..., Array]:
    for m in mask_mods:
        if not callable(m):
            raise TypeError(f"{name} takes mask_mod functions, got {type(m).__name__}")

    def combined(b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        if not mask_mods:
            seen = noop_mask(b, h, q_idx, kv_idx)
            return seen if how == "logical_and" else seen != seen
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            result = _logical(result, m(b, h, q_idx, kv_idx), how)
        return result

    combined.__name__ = name
    return combined


def _logical(a: Any, b: Any, how: str) -> Any:
    """``a`` AND/OR ``b`` of the backend of either (Python bools too)."""
    for x in (a, b):
        try:
            xp = backends.backend_of_array(x)
        except TypeError:
            continue
        a, b = _as_bool(xp, a, x), _as_bool(xp, b, x)
        if how == "logical_and":
            return xp.logical_and(a, b)
        return xp.astype(a, "int32") + xp.astype(b, "int32") > 0
    return (a and b) if how == "logical_and" else (a or b)


def _as_bool(xp: Any, v: Any, like: Array) -> Array:
    if not xp.is_array(v):
        return xp.asarray(np.asarray(v, bool), device=xp.device_of(like))
    return v if xp.dtype_name(v) == "bool" else xp.astype(v, "bool")


def _is_score_mod(fn: Callable[..., Any]) -> bool:
    """Five positional parameters (score, b, h, q_idx, kv_idx), as torch tells them apart."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return sum(p.default is inspect.Parameter.empty for p in params) == 5


_FRAMEWORKS = backends.ROOTS  # (top-level package -> backend: the one table's)


def _backend_for(fn: Callable[..., Any], backend: Any, device: Any = None) -> Any:
    """``backend``; else that of ``device`` (a framework's device object), of
    an array ``fn`` captures, or of the one framework it names (``torch.abs``,
    ``jnp.where``), in its closure and globals and in the functions it
    captures (as ``and_masks`` makes them); else the chosen default, or torch
    where it is imported (these are torch's functions)."""
    if backend is not None:
        return get_backend(backend)
    named = _framework(device) if device is not None and not isinstance(device, str) else None
    if named is not None:
        return backends.load(named)
    frameworks: set[str] = set()
    seen: set[int] = set()
    todo: list[Any] = [fn]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (tuple, list)):
            todo += x
        elif isinstance(x, BlockMask):
            todo.append(x.mask_mod)
        elif isinstance(x, types.FunctionType) and _framework(x) is None:
            for where, _, value in captured(x):  # (another package's functions: by name only)
                other = isinstance(value, types.FunctionType) and value.__module__ != x.__module__
                if not (where == "global" and other and _framework(value) is None):
                    todo.append(value)
        elif isinstance(x, types.ModuleType) or callable(x):
            name = _framework(x)
            frameworks |= set() if name is None else {name}
        elif not isinstance(x, (np.ndarray, np.generic, int, float, bool, str)):
            try:
                return backends.backend_of_array(x)
            except TypeError:
                pass
    if len(frameworks) == 1:
        return backends.load(frameworks.pop())
    chosen = chosen_backend()
    if chosen is not None:
        return chosen
    return backends.load("torch") if "torch" in sys.modules else get_backend()


def _framework(x: Any) -> str | None:
    """The backend named by the package ``x`` (a module, a function, a
    device) comes from, if a framework's."""
    module = x.__name__ if isinstance(x, types.ModuleType) else type(x).__module__
    if not isinstance(x, types.ModuleType) and callable(x):
        module = getattr(x, "__module__", None) or ""
    return backends.framework_of(str(module))
