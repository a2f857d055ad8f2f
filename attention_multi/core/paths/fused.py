"""The fused path: the framework's own attention kernel
(``capabilities.Fused.fused_attention``), given the normalized mask, with the core's
rules around it (``mask.rules.kernel_inputs``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from attention_multi.backends.capabilities import Fused, opt, supports

from ...types import Path
from ..mask.rules import kernel_inputs, unguarded_holds, zero_empty_rows
from ..numerics import readable
from .call import Call, Plan, Result

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array
    from ..mask import Mask

NAME = Path.FUSED
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
    guarded: bool = True,
    rows_see_keys: bool = False,
) -> Array | None:
    """The backend's kernel (None when it declines) with the core's rules
    around it (``rules.kernel_inputs``: what the caller knows, finite inputs,
    rows that each see a key); not ``guarded``: empty rows zeroed only (the
    caller checks ``rules.unguarded_holds``)."""
    if not supports(xp, Fused) or mask.score_mod is not None:
        return None
    kernel = cast(Fused, xp)
    if not guarded:
        out = kernel.fused_attention(q, k, v, mask, scale, memory_budget, dropout)
        return None if out is None else zero_empty_rows(xp, mask, out)
    k, v, done = kernel_inputs(xp, mask, q, k, v, queries_finite, keys_finite, rows_see_keys)
    out = kernel.fused_attention(q, k, v, mask, scale, memory_budget, dropout)
    return None if out is None else done(out)


def trusting(xp: Backend, *arrays: Array) -> bool:
    """Whether to run kernels without the NaN guards first (then one host
    check of the output): the host reads the arrays (``readable``), and the
    kernel does not keep NaN by itself."""
    return not opt(xp).fused_keeps_nan and readable(xp, *arrays)


def takes(call: Call) -> bool:
    """Whether the backend's kernel takes this call's form and dropout."""
    xp = call.xp
    return (
        supports(xp, Fused)
        and call.mask.score_mod is None
        and (not call.dropout or opt(xp).fused_dropout)
    )


def plan(call: Call) -> Plan | None:
    """One kernel call over every score (half for top-left causal) when the
    backend's kernel can take the case (it may decline at run time); no lse."""
    xp, mask = call.xp, call.mask
    if call.lse or not (call.asks(NAME) and takes(call)):
        return None
    share = CAUSAL_SHARE if mask.top_left_causal and opt(xp).fused_causal else 1.0
    return Plan(share * call.scores + call.call_cost)


def run(call: Call, plan: Plan) -> Result | None:
    """The kernel, within the memory budget unless the caller asked for this path."""
    xp, q, k, v = call.xp, call.queries, call.keys, call.values
    budget = None if call.path == "fused" else call.budget
    args = (xp, q, k, v, call.mask, call.scale, budget, call.dropout)
    if trusting(xp, q, k, v):  # (one check of the output instead of the guards)
        out = kernel(*args, guarded=False)
        if out is None or unguarded_holds(xp, q, k, v, out):
            return None if out is None else Result(out)
    out = kernel(*args)
    return None if out is None else Result(out)
