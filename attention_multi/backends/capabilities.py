"""Optional capabilities: each a small declared ``Protocol``, which a backend
has by defining its members; the core asks ``supports(backend, Fused)`` and
takes its generic path where the answer is no.

(This round moved the fused kernel and the distributed exchange here; the
other optional groups, each with its generic default, are still in
``protocol.Backend``: slices and scans, tracing hooks, autodiff, threads and
costs.)
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol, runtime_checkable

from .types import Array

__all__ = ["Distributed", "Fused", "supports"]


@runtime_checkable
class Fused(Protocol):
    """The framework's own attention kernel."""

    fused_dropout: bool  # whether it takes ``dropout`` (its own generator)
    fused_causal: bool  # whether it skips the masked half of top-left causal
    # whether it keeps NaN as the masking contract says: a NaN query row or
    # visible key gives NaN, a NaN score the mask hides does not (the mask is
    # a select, not an addition); if not, the core restores it
    fused_keeps_nan: bool

    def fused_attention(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        mask: Any,
        scale: float,
        memory_budget: int | None = None,
        dropout: float = 0.0,
    ) -> Array | None:
        """``dropout(softmax(scale Q K^T + bias, masked)) V`` (batch, heads, Q,
        dv), or None when the case (dtype, layout, mask form, dropout, or
        extra memory beyond ``memory_budget`` bytes) is not supported.

        ``queries`` (batch, heads, Q, d); ``keys`` and ``values`` (batch,
        kv_heads, K, d|dv), ``heads`` a multiple of ``kv_heads``. ``mask`` is
        the core's normalized mask, read through ``protocol.MaskView`` alone.
        The core has already zeroed key and value rows that no query may see,
        and zeroes rows with no visible key afterwards. Dropout at rate
        ``dropout`` with the framework's own generator; softmax accumulated
        in float32 for half precision."""
        ...


@runtime_checkable
class Distributed(Protocol):
    """An exchange between participants, for ring attention."""

    def ring_exchange(self, group: Any) -> tuple[Any, int, Callable[[Array], Array]]:
        """``(rank, size, shift)`` over ``group`` (the framework's process
        group or mesh axis): this participant's index (an int, or traced),
        how many there are, and ``shift(x)``, which sends ``x`` to participant
        ``rank + 1`` and returns the array that ``rank - 1`` sent,
        differentiably where the framework can."""
        ...


_SUPPORTS: dict[tuple[type, type], bool] = {}


def supports(backend: Any, capability: type) -> bool:
    """Whether ``backend`` has ``capability`` (one of this module's
    ``Protocol`` classes): ``isinstance``, answered once per backend class
    (a call then costs a dictionary lookup, not the protocol's check)."""
    key = (type(backend), capability)
    found = _SUPPORTS.get(key)
    if found is None:
        found = isinstance(backend, capability)
        if not _compiling():  # (a dict changed under torch.compile is a guard: a recompile)
            _SUPPORTS[key] = found
    return found


def _compiling() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.compiler.is_compiling())
