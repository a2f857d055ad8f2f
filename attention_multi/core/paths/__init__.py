"""The ways to compute scaled dot-product attention, all reading one ``Mask``.

Every path is a module with ``NAME`` (its ``Path``: what ``last_path``
reports, each path its own), ``plan(call)`` (a ``Plan`` with its cost, or
None when it cannot take the call) and ``run(call, plan)`` (a ``Result``:
output, weights or None, log-sum-exp or None; or None when a kernel declines
at run time). ``REGISTRY`` lists them; ``select.attend`` asks each
for its plan and runs the cheapest. A new path is its own module and one
entry here. The straight line of small calls (``small.py``) and ring
attention (``ring.py``) are called by name.
"""

from typing import get_args

from ...types import AttentionPath, Path, TakenPath
from . import blocked, chunked, full, fused, tiled, traced

REGISTRY = (blocked, tiled, traced, fused, chunked, full)
"""The planned paths; of two plans that cost the same, the earlier runs."""

PATHS: tuple[str, ...] = get_args(AttentionPath)
"""The names of ``path=``: ``"auto"`` and each path's ``NAME``."""
assert set(PATHS) == {"auto"} | {p.NAME for p in REGISTRY}
assert set(get_args(TakenPath)) == set(Path) and len({p.NAME for p in REGISTRY}) == len(REGISTRY)
