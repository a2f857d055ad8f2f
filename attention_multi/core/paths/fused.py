"""The fused path: the framework's own attention kernel
(``Backend.fused_attention``), given the normalized mask, with the core's
rules around it (``mask.rules.kernel_inputs``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..mask.rules import kernel_inputs
from .call import Call, Plan

if TYPE_CHECKING:
    from backends import Backend

    from ...types import Array
    from ..mask import Mask

NAME = "fused"
CAUSAL_SHARE = 0.5  # of the scores a kernel computes that skips top-left causal's upper half


def kernel(
    xp: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    memory_budget: int | None = None,
    dropout: float = 0.0,
    queries_finite: bool = False,
    keys_finite: bool = False,
) -> Array | None:
    """The backend's kernel (None when it declines), with the core's rules
    around it: unused key/value rows zeroed before, empty rows zeroed after,
    NaN kept where the kernel would not."""
    if not xp.has_fused_attention or mask.score_mod is not None:
        return None
    k, v, done = kernel_inputs(xp, mask, q, k, v, queries_finite, keys_finite)
    out = xp.fused_attention(q, k, v, mask, scale, memory_budget, dropout)
    return None if out is None else done(out)


def plan(call: Call) -> Plan | None:
    """One kernel call over every score (half of them for top-left causal,
    where the kernel skips the rest), when the backend has a kernel that can
    take the case; it may still decline at run time (memory, layout)."""
    xp, mask = call.xp, call.mask
    if not (call.asks("fused") and xp.has_fused_attention and mask.score_mod is None):
        return None
    if call.dropout and not xp.fused_dropout:
        return None
    share = CAUSAL_SHARE if mask.top_left_causal and xp.fused_causal else 1.0
    return Plan(share * call.scores + xp.kernel_call_cost)


def run(call: Call, plan: Plan) -> tuple[Array, None] | None:
    """The kernel, within the memory budget unless the caller asked for this path."""
    budget = None if call.path == "fused" else call.budget
    out = kernel(
        call.xp,
        call.queries,
        call.keys,
        call.values,
        call.mask,
        call.scale,
        budget,
        call.dropout,
    )
    return None if out is None else (out, None)
