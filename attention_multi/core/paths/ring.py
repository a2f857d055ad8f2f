"""Ring (sequence-parallel) attention, written once against the protocol.

The sequence is split over ``size`` participants in a **layout**:
``contiguous`` (participant ``r`` holds chunk ``r`` of ``size``) or ``zigzag``
(chunks ``r`` and ``2 size - 1 - r`` of ``2 size``: under a causal mask each
then sees as many keys). In ``size`` steps each participant merges its queries
over the block of keys it holds into its online-softmax state and passes the
block on (``Distributed.ring_exchange``); empty chunks cost no kernel call (while
the rank is traced, ``Blocks.cond`` skips them). Every exchange happens on
every participant, and the last block stays in the output's graph so the
backward exchanges pair up. Messages travel in the compute dtype. Memory:
O(T/P d).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..mask.rules import guard_unused
from ..mask.spec import EMPTY, FULL, PARTIAL, Mask, Region
from ..numerics import compute_dtype, empty_rows, in_dtype, kept, scaled
from . import online
from .call import expand_kv
from .chunked import queries_per_block

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array

LAYOUTS = ("contiguous", "zigzag")


def chunks_per_participant(layout: str) -> int:
    """How many chunks of the sequence a participant holds in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return 1 if layout == "contiguous" else 2


def held_chunks(layout: str, rank: Any, size: int) -> list[Any]:
    """The chunks (of ``chunks_per_participant(layout) * size``) that
    participant ``rank`` (an int, or traced) holds, in its order."""
    if chunks_per_participant(layout) == 1:
        return [rank]
    return [rank, 2 * size - 1 - rank]


def ring(
    xp: Backend,
    q: Array,
    k: Array,
    v: Array,
    masks: list[Mask],
    scale: float,
    rank: int | Array,
    size: int,
    shift: Callable[[Array], Array],
    memory_budget: int,
    layout: str = "contiguous",
    log: list[dict[str, Any]] | None = None,
) -> Array:
    """Attention of the local queries ``q`` (batch, heads, Q, d) over every
    participant's keys; ``k``, ``v`` the local parts in ``layout``; ``masks``:
    per chunk of local queries, its ``Mask`` over all ``size * K`` keys. Blocks
    of queries fit ``memory_budget`` as on the chunked path. ``log`` gets per
    step the scores, kernel calls and seconds of compute and exchange (rank
    on the host). Returns (batch, heads, Q, dv) in the dtype of ``q``."""
    dtype = xp.dtype_name(q)
    work = compute_dtype(dtype)
    device = xp.device_of(q)
    batch, heads, num_q = q.shape[:3]
    num_k, d, dv = k.shape[2], k.shape[-1], v.shape[-1]
    parts = len(masks)
    chunk_q, chunk_k = num_q // parts, num_k // parts
    block_q = queries_per_block(xp, q, num_k, memory_budget)
    rows = []  # (first, last local query, the rows' Mask)
    for c, m in enumerate(masks):
        for r0 in range(0, chunk_q, block_q):
            r1 = min(chunk_q, r0 + block_q)
            sub = m if r1 - r0 == chunk_q else m.region(Region(0, batch, r0, r1, 0, m.num_keys))
            rows.append((c * chunk_q + r0, c * chunk_q + r1, sub))
    qs = [scaled(xp, q[:, :, a:b], scale, work) for a, b, _ in rows]
    host = isinstance(rank, (int, np.integer))
    kv = in_dtype(xp, xp.concatenate([k, v], -1), work)  # one message per step
    if host:
        states: list[Any] = [None] * len(rows)
    else:
        # (kept in the graph of the local queries: under shard_map the state
        # then varies over the mesh axis, as the steps' states do)
        states = [
            tuple(
                kept(xp, x, qs_i) for x in online.start(xp, (batch, heads, b - a), dv, work, device)
            )
            for (a, b, _), qs_i in zip(rows, qs)
        ]
    for step in range(size):
        began = time.perf_counter()
        owner = (rank - step) % size  # whose block this participant holds now
        starts = [i * chunk_k for i in held_chunks(layout, owner, size)]
        kb, vb = expand_kv(xp, kv[..., :d], kv[..., d:], heads)
        scores = calls = 0
        for i, (a, b, sub) in enumerate(rows):
            if host:
                blocks = _blocks(sub, starts, chunk_k)
            else:  # (every chunk, skipped at run time)
                cuts = [slice(j * chunk_k, (j + 1) * chunk_k) for j in range(len(starts))]
                blocks = [(cut, sub.keys_from(g, chunk_k)) for cut, g in zip(cuts, starts)]
            for cut, block in blocks:
                kc, vc = guard_unused(xp, block, kb[:, :, cut], vb[:, :, cut])
                seen = None if host else block.seen(xp, block.whole(), device)
                states[i] = online.step(xp, states[i], qs[i], kc, vc, block, work, seen=seen)
                scores += batch * heads * (b - a) * block.num_keys
                calls += 1
        computed = time.perf_counter()
        if step + 1 < size:
            kv = shift(kv)
        if log is not None and host:
            exchange = time.perf_counter() - computed
            entry = dict(step=step, scores=scores, calls=calls, compute_s=computed - began)
            log.append({**entry, "exchange_s": exchange})
    outs = []
    for (a, b, _), qs_i, state in zip(rows, qs, states):
        if state is None:  # no query of these rows may see any key
            outs.append(empty_rows(xp, (batch, heads, b - a, dv), work, device, qs_i, k, v))
        else:
            outs.append(online.finish(xp, state))
    out = online.joined(xp, outs)
    # (the last block received stays in the graph: its exchange's backward
    # runs on every participant, even where every step was skipped)
    return in_dtype(xp, kept(xp, out, kv), dtype)


def _blocks(sub: Mask, starts: list[int], chunk_k: int) -> list[tuple[slice, Mask]]:
    """``(cut of the local keys, Mask)`` per kernel call of rows whose Mask is
    ``sub`` over the chunks at ``starts`` (host positions): a partial chunk is
    classified again in pieces as long as the rows are many; empty ones are
    skipped, neighbours in one state are one call (full ones without a mask)."""
    piece = sub.num_queries
    spans: list[list[int]] = []  # [first, last local key, first global key, state]
    for j, g in enumerate(starts):
        state = sub.block_state(Region(0, sub.batch, 0, sub.num_queries, g, g + chunk_k))
        step = piece if state == PARTIAL and piece < chunk_k else chunk_k
        for p0 in range(0, chunk_k, step):
            p1 = min(chunk_k, p0 + step)
            if step < chunk_k:
                state = sub.block_state(Region(0, sub.batch, 0, sub.num_queries, g + p0, g + p1))
            if state == EMPTY:
                continue
            last = spans[-1] if spans else None
            if (
                last is not None
                and last[1] == j * chunk_k + p0
                and last[3] == state
                and (state == FULL or last[2] + last[1] - last[0] == g + p0)
            ):
                last[1] = j * chunk_k + p1
            else:
                spans.append([j * chunk_k + p0, j * chunk_k + p1, g + p0, state])
    blocks = []
    for k0, k1, g, state in spans:
        if state == FULL:
            mask = Mask(sub.batch, sub.heads, sub.num_queries, k1 - k0, (), sub.host, sub.xp)
        else:
            mask = sub.region(Region(0, sub.batch, 0, sub.num_queries, g, g + k1 - k0), state)
        blocks.append((slice(k0, k1), mask))
    return blocks
