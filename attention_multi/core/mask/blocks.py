"""Block states: for a block of queries x a block of keys, is it empty
(skipped), full (computed without a mask) or partial (computed with the
mask's value)? One encoding, ``EMPTY``/``PARTIAL``/``FULL`` (spec.py).

``BlockMask`` is plain data: a ``mask_mod`` and its states, built once by
``functions.block_mask`` and reused across layers and steps. ``host_table``
asks every form of a mask for its states and keeps the least.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from .spec import EMPTY, FULL, PARTIAL, Mask

if TYPE_CHECKING:
    from ...types import Array

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMask", "computed_fraction", "host_table"]


class BlockMask:
    """A ``mask_mod`` and its block states (``states`` int8 (batch|1,
    heads|1, Q blocks, K blocks)) over (batch, heads, Q, K) with blocks of
    ``block_q`` x ``block_k``. Callable as the ``mask_mod`` itself: pass it as
    ``mask_mod=`` and the paths skip its empty blocks and drop the mask on its
    full ones."""

    def __init__(
        self,
        mask_mod: Callable[..., Array],
        states: np.ndarray,
        shape: tuple[int, int, int, int],
        block_q: int,
        block_k: int,
    ) -> None:
        self.mask_mod, self.states = mask_mod, states
        self.batch, self.heads, self.num_queries, self.num_keys = shape
        self.block_q, self.block_k = block_q, block_k

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        return self.mask_mod(b, h, q_idx, kv_idx)

    @property
    def sparsity(self) -> float:
        """The share of blocks that are empty (as FlexAttention's ``BlockMask.sparsity``)."""
        return float((self.states == EMPTY).mean())

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={(self.batch, self.heads, self.num_queries, self.num_keys)}, "
            f"block=({self.block_q}, {self.block_k}), sparsity={self.sparsity:.3f})"
        )

    def check(self, batch: int, num_queries: int, num_keys: int) -> None:
        """ValueError unless the block mask covers a call of this shape."""
        if self.num_keys != num_keys or self.batch not in (1, batch):
            raise ValueError(
                f"the BlockMask was built for batch {self.batch} and {self.num_keys} keys; "
                f"this call has batch {batch} and {num_keys} keys"
            )
        if num_queries > self.num_queries:
            raise ValueError(
                f"the BlockMask was built for {self.num_queries} queries; this call has "
                f"{num_queries}"
            )

    def lookup(self, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> int:
        """The state of the covering blocks of a region (global positions)."""
        s = self.states
        b = slice(b0, b1) if s.shape[0] > 1 else slice(None)
        region = s[
            b,
            :,
            q0 // self.block_q : -(-q1 // self.block_q),
            k0 // self.block_k : -(-k1 // self.block_k),
        ]
        if (region == EMPTY).all():
            return EMPTY
        return FULL if (region == FULL).all() else PARTIAL


def host_table(mask: Mask, block_q: int, block_k: int) -> np.ndarray | None:
    """int8 (batch|1, Q blocks, K blocks) states of every block on the host,
    every form together (None while traced)."""
    if not mask.known_on_host():
        return None
    nqb, nkb = -(-mask.num_queries // block_q), -(-mask.num_keys // block_k)
    states: np.ndarray = np.full((1, nqb, nkb), FULL, np.int8)
    for form in mask.forms:
        part = form.states(mask, block_q, block_k)
        states = np.minimum(states, PARTIAL if part is None else part)
    return states.astype(np.int8)


def computed_fraction(mask: Mask, table: np.ndarray, block_q: int, block_k: int) -> float:
    """The share of the (batch, Q, K) scores in the blocks of ``table`` (by
    ``host_table``) that are not empty."""
    nq, nk = mask.num_queries, mask.num_keys
    qn = [min(block_q, nq - i) for i in range(0, nq, block_q)]
    kn = [min(block_k, nk - j) for j in range(0, nk, block_k)]
    size = np.outer(qn, kn)
    table = np.broadcast_to(table, (mask.batch,) + table.shape[1:])
    return float(((table != EMPTY) * size).sum() / (mask.batch * nq * nk))
