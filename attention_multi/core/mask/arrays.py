"""Boolean and bias arrays, 4-D, broadcastable to (batch, heads, Q, K):
``mask`` (True = may attend) and ``bias`` (added to the scaled scores;
``-inf`` masks the position). Their blocks are partial (not read on the host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from attention_multi.backends.capabilities import opt

from .spec import Form, Mask, Region, _sliced, _taken

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array


@dataclass(frozen=True, eq=False)
class Arrays(Form):
    """``mask`` bool and ``bias`` float (either may be None); ``allowed``,
    what they let a query see: ``mask`` AND ``bias != -inf`` (``arrays``)."""

    mask: Array | None
    bias: Array | None
    allowed: Array | None
    kind: ClassVar[str] = "arrays"
    gathers: ClassVar[bool] = True

    def visible(self, xp: Backend, mask: Mask, device: Any) -> Array | None:
        return self.allowed

    def scores(self, xp: Backend, mask: Mask, s: Array, work: str) -> Array:
        return s if self.bias is None else s + self.bias

    def region(self, mask: Mask, r: Region) -> Form:
        return Arrays(*(_sliced(x, r, True, mask.xp) for x in (self.mask, self.bias, self.allowed)))

    def rows(self, xp: Backend, mask: Mask, rows: np.ndarray) -> Form:
        return Arrays(*(_taken(xp, x, rows) for x in (self.mask, self.bias, self.allowed)))

    def snapshot(self, xp: Backend) -> Form:
        return Arrays(
            *(
                None if x is None else opt(xp).snapshot(x)
                for x in (self.mask, self.bias, self.allowed)
            )
        )


def arrays(xp: Backend, mask: Array | None, bias: Array | None) -> Arrays:
    """The form of a boolean ``mask`` and a float ``bias`` (either may be None)."""
    allowed = mask
    if bias is not None:
        finite = bias != float("-inf")
        allowed = finite if allowed is None else xp.logical_and(allowed, finite)
    return Arrays(mask, bias, allowed)
