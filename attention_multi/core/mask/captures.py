"""What a mask function captures, made the backend's: the NumPy arrays in
its closure, defaults and the globals it names (in the functions it captures
too, as ``and_masks`` makes them, and in a ``BlockMask``'s) become arrays of
the backend that evaluates it."""

from __future__ import annotations

import math
import types
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from attention_multi.backends.capabilities import opt

from ..numerics import readable
from .blocks import BlockMask

if TYPE_CHECKING:
    from attention_multi.backends import Backend


def captured(fn: Any) -> list[tuple[str, str, Any]]:
    """What a function captures, as ``(where, name, value)``: its bound closure
    cells (``"cell"``), defaults (``"default"``, keyword-only ones
    ``"kwdefault"``) and the globals its code names, nested code's too
    (``"global"``); nothing for other callables."""
    if not isinstance(fn, types.FunctionType):
        return []
    code, found = fn.__code__, []
    for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            found.append(("cell", var, cell.cell_contents))
        except ValueError:  # (an empty cell: a name bound later)
            continue
    names = code.co_varnames[code.co_argcount - len(fn.__defaults__ or ()) : code.co_argcount]
    found += [("default", n, d) for n, d in zip(names, fn.__defaults__ or ())]
    found += [("kwdefault", n, d) for n, d in (fn.__kwdefaults__ or {}).items()]
    space = fn.__globals__
    return found + [("global", n, space[n]) for n in sorted(_names(code)) if n in space]


def _names(code: types.CodeType) -> set[str]:
    """The names ``code`` reads (globals, attributes), nested code's too."""
    codes: list[types.CodeType] = [code]
    named: set[str] = set()  # (not set[str](): torch.compile traces this)
    while codes:
        c = codes.pop()
        named.update(c.co_names)
        codes += [x for x in c.co_consts if isinstance(x, types.CodeType)]
    return named


def native_captures(xp: Backend, name: str, fn: Any, device: Any) -> Any:
    """``fn`` with the NumPy arrays it captures (closure variables, default
    arguments, the globals it names; in the functions it captures too, as
    ``and_masks`` makes them, and in a ``BlockMask``'s) as arrays of ``xp``
    on ``device``; ``fn`` itself when it captures none, or when ``xp`` takes
    NumPy arrays."""
    if xp.is_array(np.zeros(0)):
        return fn

    def native(var: str, x: Any, depth: int) -> Any:
        if isinstance(x, np.ndarray):
            narrow = x.dtype == np.int64 and not opt(xp).mixed_int_ops and x.size
            if narrow and -(2**31) <= x.min() and x.max() < 2**31:  # (beside int32 indices)
                x = x.astype(np.int32)
            try:
                return xp.asarray(x, device=device)
            except Exception as exc:
                raise TypeError(
                    f"{name} captures the NumPy array {var!r} (dtype {x.dtype}, shape "
                    f"{x.shape}), which the {xp.name} backend cannot hold ({exc}); "
                    f"capture a {xp.name} array"
                ) from exc
        if isinstance(x, tuple) and depth < 4:
            parts = tuple(native(var, p, depth + 1) for p in x)
            return x if all(a is b for a, b in zip(parts, x)) else parts
        if isinstance(x, BlockMask) and depth < 4:
            inner = native(var, x.mask_mod, depth + 1)
            if inner is x.mask_mod:
                return x
            out = x.with_mask_mod(inner)
            out.memo = x.memo  # (the same function: its values, kept by what it was given)
            return out
        if isinstance(x, types.FunctionType) and depth < 4:
            return rebuilt(x, depth + 1)
        return x

    def rebuilt(f: types.FunctionType, depth: int) -> types.FunctionType:
        found, own, changed = captured(f), f.__module__, {}
        for where, var, x in found:
            user_global = isinstance(x, types.FunctionType) and x.__module__ == own
            if where != "global" or isinstance(x, np.ndarray) or user_global:
                y = native(var, x, depth)
                if y is not x:
                    changed[where, var] = y
        if not changed:
            return f
        code = f.__code__
        cells = tuple(
            types.CellType(changed[("cell", var)]) if ("cell", var) in changed else cell
            for var, cell in zip(code.co_freevars, f.__closure__ or ())
        )
        space = {**f.__globals__, **{v: x for (w, v), x in changed.items() if w == "global"}}
        defaults = tuple(changed.get((w, v), x) for w, v, x in found if w == "default")
        out = types.FunctionType(code, space, f.__name__, defaults or None, cells or None)
        kw = {v: changed.get((w, v), x) for w, v, x in found if w == "kwdefault"}
        out.__kwdefaults__ = kw or None
        return out

    return native(name, fn, 0)


_VALUES = (int, float, complex, bool, str, bytes, type(None))
MOST_COMPARED = 1 << 20  # elements of captured arrays compared on each call
MOST_KEPT = 1 << 26  # elements of a block mask's kept values
# (a function naming one of these draws random numbers: its values change every call)
_RANDOM = {"bernoulli", "dropout", "multinomial", "normal", "poisson", "uniform"}


class _Contents:
    """A captured array and a host view of what it holds (a copy once kept)."""

    def __init__(self, x: Any, host: np.ndarray) -> None:
        self.x, self.host = x, host


def fingerprint(xp: Backend, fn: Any) -> tuple[Any, ...] | None:
    """What ``fn`` computes from, for telling later that it is unchanged
    (``unchanged``): the functions it captures (as ``captured`` finds them,
    their attributes too), the numbers and strings, and the arrays with what
    they hold (at most ``MOST_COMPARED`` elements, read on the host). None
    when something could change unseen: a list, a class or any other object,
    a callable that is not a function, an array the host does not read, a
    function that draws random numbers."""
    found: list[Any] = []
    compared = [0]

    def array(x: Any) -> bool:
        if isinstance(x, np.ndarray):
            host = x
        elif xp.is_array(x) and readable(xp, x):
            host = xp.to_numpy(x)
        else:
            return False
        compared[0] += host.size
        found.append(_Contents(x, host))
        return compared[0] <= MOST_COMPARED

    def visit(x: Any, depth: int) -> bool:
        if depth > 6:
            return False
        if isinstance(x, _VALUES) or isinstance(x, types.ModuleType):
            found.append(x)
            return True
        if isinstance(x, types.BuiltinFunctionType):  # (a builtin, not a bound method)
            found.append(x)
            return isinstance(x.__self__, (types.ModuleType, type(None)))
        if isinstance(x, BlockMask):
            return visit(x.mask_mod, depth + 1)
        if isinstance(x, tuple):
            found.append(f"tuple of {len(x)}")
            return all(visit(p, depth + 1) for p in x)
        if isinstance(x, types.FunctionType):
            if any("rand" in n or n in _RANDOM for n in _names(x.__code__)):
                return False
            found.extend((x, x.__code__, f"{len(x.__dict__)} attributes"))
            parts = [y for _, _, y in captured(x)] + [y for _, y in sorted(x.__dict__.items())]
            return all(visit(y, depth + 1) for y in parts)
        return array(x)

    return tuple(found) if visit(fn, 0) else None


def unchanged(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> bool:
    """Whether two fingerprints are the same: the same objects, the same
    values (``-0.0`` is not ``0.0``), arrays holding the same."""
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, _Contents):
            same = isinstance(y, _Contents) and x.x is y.x
            if not same or x.host.shape != y.host.shape or not np.array_equal(x.host, y.host):
                return False
        elif x is not y:
            if type(x) is not type(y) or not isinstance(x, _VALUES) or repr(x) != repr(y):
                return False
    return True


def _kept(mark: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """``mark`` with the host views of its arrays copied (later writes change
    the arrays, not what was kept)."""
    if mark is None:
        return None
    return tuple(
        _Contents(x.x, np.array(x.host, copy=True)) if isinstance(x, _Contents) else x for x in mark
    )


def remembered(
    xp: Backend, memo: dict[str, Any], key: Any, mark: Any, make: Callable[[], Any]
) -> Any:
    """``make()``, a value of a function kept in ``memo`` (a ``BlockMask``'s)
    under ``key`` while the function's ``fingerprint``, ``mark``, is unchanged,
    up to ``MOST_KEPT`` elements: a call reusing the block mask evaluates nothing."""
    kept = memo.get("kept")  # (mark, values, [elements]): replaced whole, never cleared
    if kept is None or not unchanged(mark, kept[0]):
        kept = memo["kept"] = (_kept(mark), {}, [0])
    value = kept[1].get(key)
    if value is None:
        value = make()
        size = math.prod(value.shape)
        if mark is not None and kept[2][0] + size <= MOST_KEPT and opt(xp).can_keep(value):
            kept[1][key] = value
            kept[2][0] += size
    return value
