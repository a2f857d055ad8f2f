"""Pair a Gluon file's names with a module's names: ``match(...)`` -> ``Mapping``.

Both sides become trees of dotted names (Gluon names after ``rules.translate``).
At each node, parameters pair by name; child containers pair by name, and
those left over pair in registration order when both sides have as many
(Gluon ``blks.0`` with PyTorch ``blks.block0``). Numeric names (Sequential
positions) always pair by order: parameterless layers (activations, pooling,
``nn.Flatten``) shift them differently in each framework. Every pair's leaf
name and shape is checked; whatever does not pair, or could pair two ways,
is a problem that ``Mapping.check`` raises.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from collections.abc import Mapping as MappingType
from typing import Any, NamedTuple

from .rules import TORCH_ONLY, Rule, translate

__all__ = ["Mapping", "match"]


class Row(NamedTuple):
    """One pair: a Gluon entry, the module entry it loads into, and how they paired."""

    gluon: str
    gluon_shape: tuple[int, ...]
    torch: str
    torch_shape: tuple[int, ...]
    how: str


_Target = tuple[int, str, tuple[int, ...]]  # (registration index, name, shape)


class _Entry:
    """One Gluon parameter: its names and the leaf it goes to in a node."""

    def __init__(self, index: int, name: str, shape: tuple[int, ...], exact: bool) -> None:
        self.index, self.name, self.shape = index, name, shape
        self.rule: Rule | None
        self.translated, self.rule = (name, None) if exact else translate(name)
        self.how: list[str] = []
        if self.rule is not None:
            cut = os.path.commonprefix([name, self.translated]).rfind(".") + 1
            self.how.append(f"{name[cut:]} -> {self.translated[cut:]}")

    def leaf_for(self, target_leaves: Iterable[str]) -> str:
        """The target leaf this entry asks for at its node."""
        original = self.name.rsplit(".", 1)[-1]
        if self.rule is not None and self.rule.keeps_original and original in target_leaves:
            return original
        return self.translated.rsplit(".", 1)[-1]


class _Node:
    def __init__(self) -> None:
        self.leaves: dict[str, list[Any]] = {}  # leaf -> [items]
        self.children: dict[str, _Node] = {}  # name -> _Node

    def add(self, parts: list[str], item: Any) -> None:
        node = self
        for part in parts[:-1]:
            node = node.children.setdefault(part, _Node())
        node.leaves.setdefault(parts[-1], []).append(item)

    def items(self) -> list[Any]:
        out = [i for items in self.leaves.values() for i in items]
        for child in self.children.values():
            out += child.items()
        return out


def match(
    source: MappingType[str, Any],
    target: MappingType[str, Any],
    *,
    exact: bool = False,
    source_label: str = "the file",
    target_label: str = "the module",
) -> Mapping:
    """Pair ``source`` ``{gluon name: shape}`` (file order) with ``target``
    ``{name: shape}`` (registration order). ``exact=True``: names pair only
    when equal (no rules, no order). Returns a ``Mapping``."""
    entries = [_Entry(i, n, tuple(s), exact) for i, (n, s) in enumerate(source.items())]
    gluon, module = _Node(), _Node()
    for e in entries:
        gluon.add(e.translated.split("."), e)
    for i, (name, shape) in enumerate(target.items()):
        module.add(name.split("."), (i, name, tuple(shape)))
    mapping = Mapping(source, target, source_label, target_label)
    _walk(gluon, module, "", "", [], exact, mapping)
    mapping._finish()
    return mapping


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _walk(
    g: _Node, t: _Node, gpath: str, tpath: str, how: list[str], exact: bool, m: Mapping
) -> None:
    # parameters at this node
    wanted: dict[str, list[_Entry]] = {}
    for items in g.leaves.values():
        for e in items:
            wanted.setdefault(e.leaf_for(t.leaves), []).append(e)
    for leaf, es in wanted.items():
        targets = t.leaves.get(leaf)
        if targets is None:
            m.only_file += es
        elif len(es) > 1:
            m.ambiguous.append((targets[0], es))
        else:
            m._pair(es[0], targets[0], how)
    for leaf, targets in t.leaves.items():
        if leaf not in wanted:
            m._unmatched_target(targets[0])
    # child containers
    by_name = [n for n in g.children if n in t.children and (exact or not n.isdigit())]
    pairs = [(n, n) for n in by_name]
    g_rest = [n for n in g.children if n not in by_name]
    t_rest = [n for n in t.children if n not in by_name]
    if g_rest and t_rest and not exact:
        if len(g_rest) == len(t_rest):
            pairs += list(zip(g_rest, t_rest))
            g_rest = t_rest = []
        else:
            m.unpaired.append((gpath, g_rest, tpath, t_rest))
    for gn, tn in pairs:
        step = how if gn == tn else how + [f"by order: {_join(gpath, gn)} -> {_join(tpath, tn)}"]
        _walk(g.children[gn], t.children[tn], _join(gpath, gn), _join(tpath, tn), step, exact, m)
    for gn in g_rest:
        m.only_file += g.children[gn].items()
    for tn in t_rest:
        for item in t.children[tn].items():
            m._unmatched_target(item)


def _shape(shape: Iterable[int]) -> str:
    return str(tuple(shape))


def _listing(shapes: MappingType[str, Any]) -> str:
    return ", ".join(f"{n} {_shape(s)}" for n, s in shapes.items()) or "nothing"


class Mapping:
    """How a Gluon file's parameters map onto a module's.

    ``rows``: the pairs (Gluon name, shape, PyTorch name, shape, how they
    paired); ``kept``: module entries with no Gluon counterpart by design
    (BatchNorm's ``num_batches_tracked``); ``problems``: what prevents
    loading (empty when it loads). ``str(mapping)`` is a table;
    ``check()`` raises ValueError listing every problem.
    """

    def __init__(
        self,
        source: MappingType[str, Any],
        target: MappingType[str, Any],
        source_label: str,
        target_label: str,
    ) -> None:
        self.source, self.target = dict(source), dict(target)
        self.source_label, self.target_label = source_label, target_label
        self.rows: list[Row] = []
        self._indexed_rows: list[tuple[int, Row]] = []
        self.kept: list[tuple[str, tuple[int, ...]]] = []
        self.problems: list[str] = []
        self.only_file: list[_Entry] = []
        self.missing: list[_Target] = []
        self.ambiguous: list[tuple[_Target, list[_Entry]]] = []
        self.unpaired: list[tuple[str, list[str], str, list[str]]] = []
        self._mismatched: list[tuple[_Entry, str, tuple[int, ...]]] = []

    def _pair(self, entry: _Entry, target: _Target, how: list[str]) -> None:
        _, name, shape = target
        how = how + entry.how
        if entry.shape != shape:
            self._mismatched.append((entry, name, shape))
            how = how + ["SHAPE MISMATCH"]
        self._indexed_rows.append(
            (entry.index, Row(entry.name, entry.shape, name, shape, "; ".join(how)))
        )

    def _unmatched_target(self, target: _Target) -> None:
        _, name, shape = target
        if name.rsplit(".", 1)[-1] in TORCH_ONLY:
            self.kept.append((name, shape))
        else:
            self.missing.append(target)

    def _finish(self) -> None:
        self.rows = [row for _, row in sorted(self._indexed_rows, key=lambda r: r[0])]
        self.kept.sort(key=lambda k: list(self.target).index(k[0]))
        what = self.target_label
        only = sorted(self.only_file, key=lambda e: e.index)
        missing = [name for _, name, _ in sorted(self.missing)]
        for (_, name, _), entries in self.ambiguous:
            self.problems.append(
                f"ambiguous: {name} could come from {' or '.join(e.name for e in entries)}"
            )
        for gpath, g_rest, tpath, t_rest in self.unpaired:
            where = gpath or "the top level"
            if tpath != gpath:
                where += f" ({what}: {tpath or 'the top level'})"
            self.problems.append(
                f"cannot pair by order under {where}: the file has "
                f"{len(g_rest)} ({', '.join(g_rest)}), {what} has {len(t_rest)} "
                f"({', '.join(t_rest)})"
            )
        if only:
            self.problems.append(f"only in the file: {', '.join(e.name for e in only)}")
        if missing:
            self.problems.append(f"missing from the file: {', '.join(missing)}")
        for entry, name, shape in sorted(self._mismatched, key=lambda x: x[0].index):
            where = "" if name == entry.name else f"{name} "
            self.problems.append(
                f"{entry.name}: shape {_shape(entry.shape)} in the file, "
                f"{where}{_shape(shape)} in {what}"
            )
        if only and all(e.name.endswith(".bias") for e in only) and not missing:
            self.problems.append("(the file has biases: build the module with bias=True)")
        elif missing and all(n.endswith(".bias") for n in missing) and not only:
            self.problems.append("(the file has no biases: build the module with bias=False)")

    @property
    def ok(self) -> bool:
        """True when it loads (no problems)."""
        return not self.problems

    def names(self) -> dict[str, str]:
        """``{module name: Gluon name}`` for every pair."""
        return {row.torch: row.gluon for row in self.rows}

    def error_message(self) -> str:
        """The problems, then what the file holds and what the module expects."""
        lines = [f"{self.source_label} does not match {self.target_label}:"]
        lines += [f"  {p}" for p in self.problems]
        lines.append(f"the file holds: {_listing(self.source)}")
        expected = {n: s for n, s in self.target.items() if n not in dict(self.kept)}
        lines.append(f"{self.target_label} expects: {_listing(expected)}")
        return "\n".join(lines)

    def check(self) -> Mapping:
        """Raise ValueError (every problem, then both listings) unless it loads."""
        if self.problems:
            raise ValueError(self.error_message())
        return self

    def __str__(self) -> str:
        head = (f"Gluon ({self.source_label})", "shape", f"{self.target_label}", "shape", "how")
        body = [
            (r.gluon, _shape(r.gluon_shape), r.torch, _shape(r.torch_shape), r.how)
            for r in self.rows
        ]
        body += [
            ("-", "", name, _shape(shape), f"kept: {TORCH_ONLY[name.rsplit('.', 1)[-1]]}")
            for name, shape in self.kept
        ]
        widths = [max(len(row[i]) for row in [head] + body) for i in range(4)]
        w0, w1, w2, w3 = widths
        lines = [
            f"{a:{w0}}  {b:{w1}} -> {c:{w2}}  {d:{w3}}  {e}".rstrip()
            for a, b, c, d, e in [head] + body
        ]
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)

    __repr__ = __str__
