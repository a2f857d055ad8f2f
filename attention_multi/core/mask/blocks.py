"""Block states (``EMPTY``/``PARTIAL``/``FULL``, spec.py) as data: ``BlockMask``, a
``mask_mod`` and its states, built once by ``functions.block_mask`` and reused
across layers and steps; ``host_table``, the least of every form's states;
``bound``, the one rule by which block tables bind a function's answers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .spec import EMPTY, FULL, PARTIAL, Mask, least_state

if TYPE_CHECKING:
    from ...types import Array

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMask", "bound", "computed_fraction", "host_table", "host_tables"]


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
        return xp.take(blocks, x.reshape((-1,)), 0).reshape(tuple(x.shape))

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


def _field(state: int, by_keys: bool, which: int, doc: str) -> property:
    """A FlexAttention field: int32 host array of ``BlockMask._listed``."""
    return property(lambda self: self._listed(state, by_keys)[which], doc=f"int32 {doc}.")


class BlockMask:
    """A ``mask_mod`` and its block states (``states`` int8 (batch|1,
    heads|1, Q blocks, K blocks)) over (batch, heads, Q, K) with blocks of
    ``block_q`` x ``block_k``. Callable as the ``mask_mod`` itself: pass it as
    ``mask_mod=`` and the paths skip its empty blocks and drop the mask on its
    full ones. ``causal``: the function is exactly ``kv_idx <= q_idx`` over
    Q = K (a call may take the framework's causal kernel instead).
    ``binding``: the states are not the function's own but tables given
    with it (``from_kv_blocks``, torch's ``BlockMask``): called, the block
    mask answers by ``bound`` (FlexAttention's sense), on every path."""

    def __init__(
        self,
        mask_mod: Callable[..., Array],
        states: np.ndarray,
        shape: tuple[int, int, int, int],
        block_q: int,
        block_k: int,
        causal: bool = False,
        all_full: bool | None = None,
        binding: bool = False,
    ) -> None:
        self.mask_mod, self.states, self.causal = mask_mod, states, causal
        self.binding = binding
        self.batch, self.heads, self.num_queries, self.num_keys = shape
        self.block_q, self.block_k = block_q, block_k
        # (a host bool: read under traces too)
        self.all_full = bool((states == FULL).all()) if all_full is None else all_full
        # (its function's values, kept by captures.remembered)
        self.memo: dict[Any, Any] = {"fn": mask_mod}

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        seen = self.mask_mod(b, h, q_idx, kv_idx)
        if not self.binding:
            return seen
        from attention_multi.backends import backend_of_array

        xp = backend_of_array(kv_idx)
        index = (b, h, q_idx, kv_idx)
        return bound(xp, self._tables(xp, kv_idx), self.states.shape, index, seen)

    def _tables(self, xp: Any, like: Array) -> tuple[Array, Array, Array]:
        """``bound``'s tables as arrays of ``xp`` on ``like``'s device, made once."""
        device = xp.device_of(like)

        def make() -> tuple[Array, Array, Array]:
            found = host_tables(self.states, self.shape, self.BLOCK_SIZE)
            return tuple(xp.asarray(x, device=device) for x in found)  # type: ignore[return-value]

        if xp.is_tracing():  # (nothing kept: a trace's arrays end with it)
            return make()
        key = ("tables", xp.name, str(device))
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    # -- what FlexAttention's users read (host NumPy arrays) ---------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, Q, K) it was built for (1 where the function ignores the axis)."""
        return (self.batch, self.heads, self.num_queries, self.num_keys)

    @property
    def BLOCK_SIZE(self) -> tuple[int, int]:  # noqa: N802 (FlexAttention's name)
        """(queries, keys) per block."""
        return (self.block_q, self.block_k)

    @property
    def seq_lengths(self) -> tuple[int, int]:
        """(Q, K) it was built for."""
        return (self.num_queries, self.num_keys)

    def numel(self) -> int:
        """batch * heads * Q * K, as flex's."""
        return self.batch * self.heads * self.num_queries * self.num_keys

    def to(self, device: object) -> BlockMask:
        """Itself: its fields are host arrays, evaluated on each call's device."""
        return self

    def sparsity(self) -> float:
        """The percentage of the scores in blocks never computed, as flex's
        (each computed block counted whole)."""
        computed = int((self._flex_states() != EMPTY).sum()) * self.block_q * self.block_k
        return 100.0 * (1 - computed / self.numel())

    def to_dense(self) -> np.ndarray:
        """int32 (batch, heads, Q blocks, K blocks): 1 where a block is computed."""
        return (self._flex_states() != EMPTY).astype(np.int32)

    def _flex_states(self) -> np.ndarray:
        """The states as flex lists them, (batch, heads, Q blocks, K blocks): a
        block past the end of Q or K (padded there) is never full."""
        s = np.broadcast_to(self.states, (self.batch, self.heads) + self.states.shape[2:]).copy()
        if self.num_queries % self.block_q:
            s[:, :, -1] = np.minimum(s[:, :, -1], PARTIAL)
        if self.num_keys % self.block_k:
            s[..., -1] = np.minimum(s[..., -1], PARTIAL)
        return s

    def _listed(self, state: int, by_keys: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """FlexAttention's (num_blocks, indices) of the blocks in ``state``: per row of
        blocks (column: ``by_keys``), their count, and their indices first (ascending),
        then the others'."""
        hit = self._flex_states() == state
        hit = hit.swapaxes(-1, -2) if by_keys else hit
        order = np.argsort(~hit, axis=-1, kind="stable").astype(np.int32)
        return hit.sum(-1).astype(np.int32), order

    kv_num_blocks = _field(PARTIAL, False, 0, "(batch, heads, Q blocks): each row's partial blocks")
    kv_indices = _field(PARTIAL, False, 1, "(batch, heads, Q blocks, K blocks): partial ones first")
    full_kv_num_blocks = _field(FULL, False, 0, "(batch, heads, Q blocks): each row's full blocks")
    full_kv_indices = _field(FULL, False, 1, "(batch, heads, Q blocks, K blocks): full ones first")
    q_num_blocks = _field(PARTIAL, True, 0, "(batch, heads, K blocks): a column's partial blocks")
    q_indices = _field(PARTIAL, True, 1, "(batch, heads, K blocks, Q blocks): partial ones first")
    full_q_num_blocks = _field(FULL, True, 0, "(batch, heads, K blocks): each column's full blocks")
    full_q_indices = _field(FULL, True, 1, "(batch, heads, K blocks, Q blocks): full ones first")

    def with_mask_mod(self, mask_mod: Callable[..., Array]) -> BlockMask:
        """The same states of another function (``mask_mod`` with its captures converted)."""
        shape = (self.batch, self.heads, self.num_queries, self.num_keys)
        return BlockMask(
            mask_mod, self.states, shape, self.block_q, self.block_k, self.causal,
            binding=self.binding,
        )

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, block=({self.block_q}, {self.block_k}), "
            f"sparsity={self.sparsity():.2f}%)"
        )

    def check(self, batch: int, heads: int, num_queries: int, num_keys: int) -> None:
        """ValueError unless the block mask covers a call of this shape."""
        covered = self.batch in (1, batch) and self.heads in (1, heads)
        if self.num_keys != num_keys or not covered:
            raise ValueError(
                f"the BlockMask was built for batch {self.batch}, {self.heads} heads and "
                f"{self.num_keys} keys; this call has batch {batch}, {heads} query heads and "
                f"{num_keys} keys"
            )
        if num_queries > self.num_queries:
            raise ValueError(
                f"the BlockMask was built for {self.num_queries} queries; this call has "
                f"{num_queries}"
            )

    def lookup(self, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> int:
        """The state of the covering blocks of a region (global positions)."""
        s, bq, bk = self.states, self.block_q, self.block_k
        b = slice(b0, b1) if s.shape[0] > 1 else slice(None)
        return int(least_state(s[b, :, q0 // bq : -(-q1 // bq), k0 // bk : -(-k1 // bk)]))


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
