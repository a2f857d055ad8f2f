"""NumPy backends with other frameworks' capability flags (issue 63).

The core branches on capability flags, never on a backend's name: masks by
adding (torch, MXNet), by lengths (MXNet's SequenceMask), index grids at full
shape and no mixed int32/int64 operations (MXNet), host masks (torch, JAX), a
fused kernel that masks by adding and loses NaN (torch's SDPA: the core
restores the contract around it) or one that masks by a select and keeps NaN
(JAX's), a fused kernel that skips the hidden half of top-left causal. Each
variant here is the NumPy backend with one such set flipped, so the grids
(``@pytest.mark.grid``) reach on NumPy, at NumPy's cost, every branch that the
other frameworks take; their own rows then need only the paths they really
take. conftest.py adds them to the ``backend`` parametrization of grid tests
(ids ``numpy-adding``, ``numpy-lengths``, ``numpy-select``).
"""

from __future__ import annotations

import numpy as np

import attention_multi as am

FLIPS = {
    # torch's flags: an additive float mask in its fused kernel (NaN lost)
    "numpy-adding": dict(
        masks_by_adding=True,
        host_masks=True,
        fused=True,
        fused_causal=True,
        fused_keeps_nan=False,
    ),
    # MXNet's flags: lengths by their own operator, dense index grids, no mixed ints
    "numpy-lengths": dict(
        masks_by_adding=True,
        masks_by_lengths=True,
        dense_index_grids=True,
        mixed_int_ops=False,
    ),
    # JAX's flags: a fused kernel that masks by a select and keeps NaN, host masks
    "numpy-select": dict(
        fused=True,
        fused_keeps_nan=True,
        host_masks=True,
        host_mask_min_size=1,
    ),
}
NAMES = tuple(FLIPS)
_MADE: dict = {}


def _softmax_rows(s):
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.max(s, -1, keepdims=True)
        e = np.exp(s - top)
        return e / np.sum(e, -1, keepdims=True)


class _Flipped:
    """What a flipped flag needs of NumPy: ``below_lengths`` that keeps x's
    dtype, and a NumPy ``fused_attention`` with the two masking habits of the
    frameworks' kernels: an additive mask (``fused_keeps_nan`` False: a NaN
    hidden score stays NaN, as in torch's SDPA) or a select (True: JAX's)."""

    def below_lengths(self, x, keep, lens, value, axis):
        """With ``masks_by_lengths``: x's dtype kept, as MXNet's SequenceMask
        keeps it (NumPy 1's ``where`` with a Python float would widen it)."""
        keep = keep() if callable(keep) else keep
        return np.where(keep, x, np.asarray(value, x.dtype))


class _FlippedFused(_Flipped):
    """A flipped backend with a fused kernel (``supports(xp, Fused)``: the
    capability is the method itself, so one without it has none)."""

    def fused_attention(self, queries, keys, values, mask, scale, memory_budget=None, dropout=0.0):
        if dropout or values.shape[-1] != queries.shape[-1]:
            return None
        dtype = queries.dtype
        q, k, v = (
            x.astype(np.float64) if dtype == np.float16 else x for x in (queries, keys, values)
        )
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
        with np.errstate(invalid="ignore", over="ignore"):
            s = np.matmul(q, k.swapaxes(-1, -2)) * scale
        if mask.top_left_causal:
            nq, nk = s.shape[-2:]
            s = np.where(np.tri(nq, nk, dtype=bool), s, -np.inf)
        elif not mask.unmasked:
            if self.fused_keeps_nan:
                if mask.bias is not None:
                    s = s + np.asarray(mask.bias, s.dtype)
                seen = mask.boolean(self, None)
                if seen is not None:
                    s = np.where(seen, s, -np.inf)
            else:
                s = s + mask.additive(self, self.dtype_name(queries), None)
        w = _softmax_rows(s)
        with np.errstate(invalid="ignore", over="ignore"):
            out = np.matmul(w, v)
        return out.astype(dtype, copy=False)


def make(name: str):
    """The variant ``name`` (one instance a process)."""
    if name not in _MADE:
        base = type(am.get_backend("numpy"))
        flags = {k: v for k, v in FLIPS[name].items() if k != "fused"}
        mixin = _FlippedFused if FLIPS[name].get("fused") else _Flipped
        cls = type(f"NumpyBackend_{name.split('-')[1]}", (mixin, base), flags)
        _MADE[name] = cls()
    return _MADE[name]
