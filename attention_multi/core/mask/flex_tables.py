"""FlexAttention's block tables, read as torch reads them: ``bound``, the one
rule by which tables bind a function's answers; ``host_tables``, that rule's
inputs on the host; ``tables_to_states``, the states a set of tables lists;
``noop_mask``, a table-made mask's default function."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from attention_multi.backends.capabilities import opt

from .spec import FULL, PARTIAL

if TYPE_CHECKING:
    from ...types import Array

__all__ = ["bound", "host_tables", "noop_mask", "sliced_mask_mod_error", "tables_to_states"]


def bound(
    xp: Any,
    tables: tuple[Array, Array, Array],
    layout: tuple[int, int, int, int],
    index: tuple[Array, Array, Array, Array],
    seen: Any,
) -> Array:
    """FlexAttention's rule for block tables: a key in a block the tables do
    not list is never seen, one in a FULL block always is (its function is not
    asked), one in a PARTIAL block as the function ``seen`` answers.
    ``tables``: the int32 states flattened, of ``layout`` (batch|1, heads|1,
    Q blocks, K blocks), and each query's and key's block (int32 arrays, one
    entry a position: no division, which MXNet's integers lack); ``index``:
    the (b, h, q_idx, kv_idx) arrays the function got."""
    states, q_block, k_block = tables
    nb, nh, nqb, nkb = layout
    b, h, q, kv = index

    def block_of(blocks: Array, x: Array) -> Array:
        return opt(xp).reshape(xp.take(blocks, opt(xp).reshape(x, (-1,)), 0), tuple(x.shape))

    row = block_of(q_block, q) * nkb + block_of(k_block, kv)
    if nh > 1:
        row = row + h * (nqb * nkb)
    if nb > 1:
        row = row + b * (nh * nqb * nkb)
    state = block_of(states, row)
    if not xp.is_array(seen):  # (a Python bool: noop_mask's kind)
        seen = xp.asarray(np.asarray(seen, bool), device=xp.device_of(state))
    return xp.where(state == PARTIAL, seen, state == FULL)


def host_tables(states: np.ndarray, shape: tuple[int, ...], block: tuple[int, int]) -> tuple:
    """``bound``'s tables on the host: the flat int32 states and each
    position's block, for ``shape`` (batch, heads, Q, K)."""
    q_block = (np.arange(shape[2]) // block[0]).astype(np.int32)
    k_block = (np.arange(shape[3]) // block[1]).astype(np.int32)
    return states.astype(np.int32).reshape(-1), q_block, k_block


def tables_to_states(
    listed: list[tuple[np.ndarray, np.ndarray, int]], lead: tuple[int, ...], nqb: int, nkb: int
) -> np.ndarray:
    """int8 (lead, Q blocks, K blocks) states of FlexAttention's tables:
    ``(counts (lead, rows), indices (lead, rows, n), state)`` each, the first
    ``count`` indices of a row listed in ``state`` (later tables win; an
    index out of range, or a row past the tables, lists nothing)."""
    states = np.zeros(lead + (nqb, nkb + 1), np.int8)
    for counts, indices, state in listed:
        counts = np.broadcast_to(counts, indices.shape[:-1])
        rows = min(nqb, indices.shape[-2])
        c, idx = counts[..., :rows], indices[..., :rows, :]
        width = np.arange(idx.shape[-1])
        kept = (width < c[..., None]) & (idx >= 0) & (idx < nkb)
        cols = np.where(kept, idx, nkb)
        view = states[..., :rows, :]
        np.put_along_axis(view, cols, np.int8(state), -1)
        states[..., :rows, :] = view
    return states[..., :nkb]


def noop_mask(batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
    """Every query sees every key (a table-made mask's default function)."""
    return token_kv == token_kv


def sliced_mask_mod_error(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """torch's ``mask_mod`` of a sliced block mask: set it again."""
    raise RuntimeError(
        "Cannot use mask_mod from a sliced BlockMask. When you slice a BlockMask using [], "
        "the mask_mod attribute is reset. You must set it from the original BlockMask's "
        "mask_mod."
    )
