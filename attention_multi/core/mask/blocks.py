"""Block states (``EMPTY``/``PARTIAL``/``FULL``, spec.py) as data: ``BlockMask``, a
``mask_mod`` and its states, built once by ``functions.block_mask`` and reused
across layers and steps; ``host_table``, the least of every form's states;
FlexAttention's tables and the rule that binds them are in ``flex_tables.py``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from attention_multi.backends.capabilities import opt

from .flex_tables import (
    bound,
    host_tables,
    noop_mask,
    sliced_mask_mod_error,
    tables_to_states,
)
from .spec import EMPTY, FULL, PARTIAL, Mask, least_state

if TYPE_CHECKING:
    from ...types import Array

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMask",
    "bound",
    "computed_fraction",
    "host_table",
    "host_tables",
]


def _field(state: int, by_keys: bool, which: int, doc: str) -> property:
    """A FlexAttention field: int32 host array of ``BlockMask._listed`` (None
    where torch's is: full ones not listed apart, q_* not computed)."""

    def read(self: BlockMask) -> np.ndarray | None:
        if (state == FULL and not self.separate_full) or (by_keys and not self.q_blocks):
            return None
        given = self.given.get((state, which)) if not by_keys else None
        return given if given is not None else self._listed(state, by_keys)[which]

    return property(read, doc=f"int32 {doc}.")


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
        self.states, self.causal = states, causal
        self.binding = binding
        self.batch, self.heads, self.num_queries, self.num_keys = shape
        self.block_q, self.block_k = block_q, block_k
        # (a host bool: read under traces too)
        self.all_full = bool((states == FULL).all()) if all_full is None else all_full
        self._mask_mod = mask_mod
        # (its function's values, kept by captures.remembered)
        self.memo: dict[Any, Any] = {"fn": mask_mod}
        # FlexAttention's fields that no kernel reads here: torch's GPU backward order
        self.dq_write_order: Any = None
        self.dq_write_order_full: Any = None
        self.dq_kv_order: Any = None
        self.dq_kv_order_spt: bool | None = None
        self.lead: tuple[int, ...] = (self.batch, self.heads)  # (the tables' leading axes)
        self.separate_full = True  # (False: full blocks listed as partial, full_* None)
        self.q_blocks = True  # (False: q_* None, from_kv_blocks(compute_q_blocks=False))
        self.given: dict[tuple[int, int], np.ndarray] = {}  # (from_kv_blocks' kv tables)

    @property
    def mask_mod(self) -> Callable[..., Array]:
        """The function (torch's attribute: assigning one keeps the block
        states and forgets what was kept of the old function)."""
        return self._mask_mod

    @mask_mod.setter
    def mask_mod(self, fn: Callable[..., Array]) -> None:
        if fn is not getattr(self, "_mask_mod", None):
            self._mask_mod, self.causal = fn, False
            self.memo = {"fn": fn}

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
            return tuple(xp.asarray(x, device=device) for x in found)

        if opt(xp).is_tracing():  # (nothing kept: a trace's arrays end with it)
            return make()
        key = ("tables", xp.name, str(device))
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    # -- what FlexAttention's users read (host NumPy arrays) ---------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """(batch, heads, Q, K) it was built for (1 where the function ignores the
        axis); torch's: the tables' leading axes and ``seq_lengths``."""
        return self.lead + (self.num_queries, self.num_keys)

    @property
    def BLOCK_SIZE(self) -> tuple[int, int]:  # noqa: N802 (FlexAttention's name)
        """(queries, keys) per block."""
        return (self.block_q, self.block_k)

    @property
    def seq_lengths(self) -> tuple[int, int]:
        """(Q, K) it was built for (assignable, as torch's: a sliced mask's)."""
        return (self.num_queries, self.num_keys)

    @seq_lengths.setter
    def seq_lengths(self, lengths: tuple[int, int]) -> None:
        self.num_queries, self.num_keys = (int(n) for n in lengths)
        self.memo = {"fn": self._mask_mod}

    def numel(self) -> int:
        """batch * heads * Q * K, as flex's (the product of ``shape``)."""
        return math.prod(self.shape)

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
        """The states as flex lists them, (leading axes, Q blocks, K blocks): a
        block past the end of Q or K (padded there) is never full, unless its
        tables were given (``binding``: as they are); without full blocks
        listed apart, every computed block partial."""
        s = np.broadcast_to(self.states, (self.batch, self.heads) + self.states.shape[2:]).copy()
        if not self.binding and self.num_queries % self.block_q:
            s[:, :, -1] = np.minimum(s[:, :, -1], PARTIAL)
        if not self.binding and self.num_keys % self.block_k:
            s[..., -1] = np.minimum(s[..., -1], PARTIAL)
        if not self.separate_full:
            s = np.minimum(s, PARTIAL)
        return s.reshape(self.lead + s.shape[2:])

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
        out = BlockMask(
            mask_mod,
            self.states,
            shape,
            self.block_q,
            self.block_k,
            self.causal,
            all_full=self.all_full,
            binding=self.binding,
        )
        out.lead, out.separate_full, out.q_blocks = self.lead, self.separate_full, self.q_blocks
        out.given = self.given
        return out

    def without_full_blocks(self) -> BlockMask:
        """The same mask with every computed block partial (torch's
        ``separate_full_blocks=False``): its function evaluated on each."""
        shape = (self.batch, self.heads, self.num_queries, self.num_keys)
        states = np.minimum(self.states, PARTIAL).astype(np.int8)
        out = BlockMask(
            self.mask_mod,
            states,
            shape,
            self.block_q,
            self.block_k,
            self.causal,
            all_full=False,
            binding=self.binding,
        )
        out.lead, out.separate_full, out.q_blocks = self.lead, False, self.q_blocks
        return out

    # -- torch's BlockMask methods -------------------------------------------------------
    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: Any,
        kv_indices: Any,
        full_kv_num_blocks: Any = None,
        full_kv_indices: Any = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,  # noqa: N803 (FlexAttention's name)
        mask_mod: Callable[..., Array] | None = None,
        seq_lengths: tuple[int, int] | None = None,
        compute_q_blocks: bool = True,
        *,
        dq_write_order: Any = None,
        dq_write_order_full: Any = None,
        dq_kv_order: Any = None,
    ) -> BlockMask:
        """torch's ``BlockMask.from_kv_blocks``: a block mask of given tables
        (arrays of any backend, or NumPy): per row of query blocks, the count
        and the indices (first ones) of its partial key blocks (``kv_*``) and
        of its full ones (``full_kv_*``). The tables bind (FlexAttention's
        sense, ``binding``): an unlisted block is never computed, a full one
        always is, a partial one as ``mask_mod`` (default: every key) says.
        ``seq_lengths`` default: the tables' blocks times ``BLOCK_SIZE``. The
        ``dq_*`` orders (torch's GPU backward) are kept and have no effect."""
        if len(getattr(kv_indices, "shape", ())) < 2:
            raise RuntimeError("BlockMask must have at least 2 dimensions")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise AssertionError(
                "full_kv_num_blocks and full_kv_indices must be both provided or omitted"
            )
        if dq_kv_order is not None and not isinstance(dq_kv_order, bool):
            if not hasattr(dq_kv_order, "shape"):
                raise ValueError("dq_kv_order must be a bool, Tensor, or None")
        bq, bk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
        bq, bk = int(bq), int(bk)
        counts, indices = _host(kv_num_blocks), _host(kv_indices)
        lead = tuple(int(n) for n in indices.shape[:-2])
        if len(lead) > 2:
            raise ValueError(f"kv_indices must have 2 to 4 axes, got shape {indices.shape}")
        if seq_lengths is None:
            seq_lengths = (indices.shape[-2] * bq, indices.shape[-1] * bk)
        num_q, num_k = (int(n) for n in seq_lengths)
        nqb, nkb = -(-num_q // bq), -(-num_k // bk)
        listed = [(counts, indices, PARTIAL)]
        if full_kv_num_blocks is not None:
            listed.append((_host(full_kv_num_blocks), _host(full_kv_indices), FULL))
        states = tables_to_states(listed, lead, nqb, nkb)
        four = (1,) * (2 - len(lead)) + lead
        states = states.reshape(four + states.shape[-2:])
        fn = noop_mask if mask_mod is None else mask_mod
        out = cls(fn, states, (four[0], four[1], num_q, num_k), bq, bk, binding=True)
        out.lead, out.q_blocks = lead, bool(compute_q_blocks)
        out.separate_full = full_kv_num_blocks is not None
        for c, idx, state in listed:  # (as given: past each count, what the caller put)
            out.given[state, 0], out.given[state, 1] = c.astype(np.int32), idx.astype(np.int32)
        out.dq_write_order, out.dq_write_order_full = dq_write_order, dq_write_order_full
        out.dq_kv_order = None if isinstance(dq_kv_order, bool) else dq_kv_order
        out.dq_kv_order_spt = dq_kv_order if isinstance(dq_kv_order, bool) else None
        return out

    def as_tuple(self, flatten: bool = True) -> tuple[Any, ...]:
        """torch's ``as_tuple``: (Q, K | (Q, K)), the eight tables, the four
        ``dq_*`` fields, (block_q, block_k | (block_q, block_k)), ``mask_mod``."""
        sizes = (self.BLOCK_SIZE,) if not flatten else self.BLOCK_SIZE
        lengths = (self.seq_lengths,) if not flatten else self.seq_lengths
        return (
            *lengths,
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
            self.q_num_blocks,
            self.q_indices,
            self.full_q_num_blocks,
            self.full_q_indices,
            self.dq_write_order,
            self.dq_write_order_full,
            self.dq_kv_order,
            self.dq_kv_order_spt,
            *sizes,
            self.mask_mod,
        )

    def __getitem__(self, index: Any) -> BlockMask:
        """torch's indexing of the batch, heads and query-block axes (an int
        keeps its axis, as torch's): a block mask of the selected tables,
        binding, whose ``mask_mod`` must be set again (torch's rule: the
        sliced one raises)."""
        if len(self.lead) != 2:
            raise IndexError("only a block mask with (batch, heads) axes can be indexed")
        index = index if isinstance(index, tuple) else (index,)
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        s = self._flex_states()
        sizes = s.shape[:3]
        axes = tuple(
            (slice(i + n, i + n + 1) if -n <= i < 0 else slice(i, i + 1))
            if isinstance(i, int)
            else (_host(i) if hasattr(i, "shape") else i)
            for i, n in zip(padded, sizes)
        )
        picked = s
        for axis, i in enumerate(axes):  # (one axis at a time: arrays index as torch's do)
            where: list[Any] = [slice(None)] * 4
            where[axis] = i
            picked = picked[tuple(where)]
        shape = (picked.shape[0], picked.shape[1], self.num_queries, self.num_keys)
        out = BlockMask(
            sliced_mask_mod_error,
            np.ascontiguousarray(picked, np.int8),
            shape,
            self.block_q,
            self.block_k,
            binding=True,
        )
        out.separate_full, out.q_blocks = self.separate_full, self.q_blocks
        out.dq_kv_order_spt = self.dq_kv_order_spt
        return out

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """torch's picture of the computed blocks, one per (batch, head) up to
        ``limit``: a full cell of blocks ``█``, none `` ``, some ``░``;
        ``grid_size`` cells at most (-1: one a block)."""
        dense = self.to_dense()
        *lead, rows, cols = dense.shape
        if isinstance(grid_size, int):
            most = (rows, cols) if grid_size == -1 else (grid_size, grid_size)
        else:
            most = (int(grid_size[0]), int(grid_size[1]))
        step_r, step_c = max(1, -(-rows // most[0])), max(1, -(-cols // most[1]))

        def picture(at: tuple[int, ...]) -> str:
            lines = [f"{at}"]
            for r in range(0, rows, step_r):
                line = ""
                for c in range(0, cols, step_c):
                    share = dense[at][r : r + step_r, c : c + step_c].mean()
                    line += ("█" if share == 1 else " " if share == 0 else "░") * 2
                lines.append(line)
            return "\n".join(lines) + "\n"

        shown = []
        for n, at in enumerate(np.ndindex(*lead)):
            if n == limit:
                shown += [
                    "...",
                    "To print out more, set BlockMask.to_string(limit=N)",
                    "You can also index (BlockMask[batch, head]) to choose a specific batch "
                    "or head",
                ]
                break
            shown.append(picture(at))
        return "\n".join(shown)

    def __str__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
            f"{self.to_string().strip()}\n)"
        )

    def __repr__(self) -> str:
        def shape(x: Any) -> Any:
            return None if x is None else tuple(x.shape)

        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        fields = [
            f"{q}{kind}"
            for q in ("kv_", "full_kv_", "q_", "full_q_")
            for kind in ("num_blocks", "indices")
        ]
        lines = [f"    {f}={shape(getattr(self, f))}," for f in fields]
        lines += [f"    BLOCK_SIZE={self.BLOCK_SIZE},", f"    shape={self.shape},"]
        lines += [f"    sparsity={self.sparsity():.2f}%,", f"    mask_mod={name}"]
        return "BlockMask(\n" + "\n".join(lines) + "\n)"

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
        rows, cols = -(-num_queries // self.block_q), -(-num_keys // self.block_k)
        if self.states.shape[2] < rows or self.states.shape[3] < cols:
            raise ValueError(
                f"the BlockMask has {self.states.shape[2]} x {self.states.shape[3]} blocks; "
                f"this call of {num_queries} queries and {num_keys} keys needs {rows} x {cols} "
                f"(a sliced mask needs seq_lengths set, as torch's)"
            )

    def lookup(self, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> int:
        """The state of the covering blocks of a region (global positions)."""
        s, bq, bk = self.states, self.block_q, self.block_k
        b = slice(b0, b1) if s.shape[0] > 1 else slice(None)
        return int(least_state(s[b, :, q0 // bq : -(-q1 // bq), k0 // bk : -(-k1 // bk)]))


def _host(x: Any) -> np.ndarray:
    """An array of any backend (or NumPy, or a list) as a host int64 NumPy array."""
    if isinstance(x, np.ndarray):
        return x.astype(np.int64)
    if hasattr(x, "shape") and not isinstance(x, np.generic):
        from attention_multi.backends import backend_of_array

        try:
            return np.asarray(backend_of_array(x).to_numpy(x)).astype(np.int64)
        except TypeError:
            pass
    return np.asarray(x).astype(np.int64)


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
