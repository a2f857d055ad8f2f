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
import os
from collections import namedtuple

from .rules import TORCH_ONLY, translate

__all__ = ["Mapping", "match"]

Row = namedtuple("Row", "gluon gluon_shape torch torch_shape how")


class _Entry:
    """One Gluon parameter: its names and the leaf it goes to in a node."""

    def __init__(self, index, name, shape, exact):
        self.index, self.name, self.shape = index, name, shape
        self.translated, self.rule = (name, None) if exact else translate(name)
        self.how = []
        if self.rule is not None:
            cut = os.path.commonprefix([name, self.translated]).rfind(".") + 1
            self.how.append(f"{name[cut:]} -> {self.translated[cut:]}")

    def leaf_for(self, target_leaves):
        """The target leaf this entry asks for at its node."""
        original = self.name.rsplit(".", 1)[-1]
        if self.rule is not None and self.rule.keeps_original and original in target_leaves:
            return original
        return self.translated.rsplit(".", 1)[-1]


class _Node:
    def __init__(self):
        self.leaves, self.children = {}, {}   # leaf -> [items]; name -> _Node

    def add(self, parts, item):
        node = self
        for part in parts[:-1]:
            node = node.children.setdefault(part, _Node())
        node.leaves.setdefault(parts[-1], []).append(item)

    def items(self):
        out = [i for items in self.leaves.values() for i in items]
        for child in self.children.values():
            out += child.items()
        return out


def match(source, target, *, exact=False, source_label="the file", target_label="the module"):
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


def _join(path, name):
    return f"{path}.{name}" if path else name


def _walk(g, t, gpath, tpath, how, exact, m):
    # parameters at this node
    wanted = {}
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
        _walk(g.children[gn], t.children[tn], _join(gpath, gn), _join(tpath, tn),
              step, exact, m)
    for gn in g_rest:
        m.only_file += g.children[gn].items()
    for tn in t_rest:
        for item in t.children[tn].items():
            m._unmatched_target(item)


def _shape(shape):
    return str(tuple(shape))


def _listing(shapes):
    return ", ".join(f"{n} {_shape(s)}" for n, s in shapes.items()) or "nothing"


class Mapping:
    """How a Gluon file's parameters map onto a module's.

    ``rows``: the pairs (Gluon name, shape, PyTorch name, shape, how they
    paired); ``kept``: module entries with no Gluon counterpart by design
    (BatchNorm's ``num_batches_tracked``); ``problems``: what prevents
    loading (empty when it loads). ``str(mapping)`` is a table;
    ``check()`` raises ValueError listing every problem.
    """

    def __init__(self, source, target, source_label, target_label):
        self.source, self.target = dict(source), dict(target)
        self.source_label, self.target_label = source_label, target_label
        self.rows, self.kept, self.problems = [], [], []
        self.only_file, self.missing, self.ambiguous, self.unpaired = [], [], [], []
        self._mismatched = []

    def _pair(self, entry, target, how):
        _, name, shape = target
        how = how + entry.how
        if entry.shape != shape:
            self._mismatched.append((entry, name, shape))
            how = how + ["SHAPE MISMATCH"]
        self.rows.append((entry.index, Row(entry.name, entry.shape, name, shape,
                                           "; ".join(how))))

    def _unmatched_target(self, target):
        _, name, shape = target
        if name.rsplit(".", 1)[-1] in TORCH_ONLY:
            self.kept.append((name, shape))
        else:
            self.missing.append(target)

    def _finish(self):
        self.rows = [row for _, row in sorted(self.rows, key=lambda r: r[0])]
        self.kept.sort(key=lambda k: list(self.target).index(k[0]))
        what = self.target_label
        only = sorted(self.only_file, key=lambda e: e.index)
        missing = [name for _, name, _ in sorted(self.missing)]
        for (_, name, _), entries in self.ambiguous:
            self.problems.append(f"ambiguous: {name} could come from "
                                 f"{' or '.join(e.name for e in entries)}")
        for gpath, g_rest, tpath, t_rest in self.unpaired:
            where = gpath or "the top level"
            if tpath != gpath:
                where += f" ({what}: {tpath or 'the top level'})"
            self.problems.append(
                f"cannot pair by order under {where}: the file has "
                f"{len(g_rest)} ({', '.join(g_rest)}), {what} has {len(t_rest)} "
                f"({', '.join(t_rest)})")
        if only:
            self.problems.append(f"only in the file: {', '.join(e.name for e in only)}")
        if missing:
            self.problems.append(f"missing from the file: {', '.join(missing)}")
        for entry, name, shape in sorted(self._mismatched, key=lambda x: x[0].index):
            where = "" if name == entry.name else f"{name} "
            self.problems.append(f"{entry.name}: shape {_shape(entry.shape)} in the file, "
                                 f"{where}{_shape(shape)} in {what}")
        if only and all(e.name.endswith(".bias") for e in only) and not missing:
            self.problems.append("(the file has biases: build the module with bias=True)")
        elif missing and all(n.endswith(".bias") for n in missing) and not only:
            self.problems.append("(the file has no biases: build the module with bias=False)")

    @property
    def ok(self):
        return not self.problems

    def names(self):
        """``{module name: Gluon name}`` for every pair."""
        return {row.torch: row.gluon for row in self.rows}

    def error_message(self):
        lines = [f"{self.source_label} does not match {self.target_label}:"]
        lines += [f"  {p}" for p in self.problems]
        lines.append(f"the file holds: {_listing(self.source)}")
        lines.append(f"{self.target_label} expects: "
                     f"{_listing({n: s for n, s in self.target.items() if n not in dict(self.kept)})}")
        return "\n".join(lines)

    def check(self):
        """Raise ValueError (every problem, then both listings) unless it loads."""
        if self.problems:
            raise ValueError(self.error_message())
        return self

    def __str__(self):
        head = (f"Gluon ({self.source_label})", "shape", f"{self.target_label}", "shape", "how")
        body = [(r.gluon, _shape(r.gluon_shape), r.torch, _shape(r.torch_shape), r.how)
                for r in self.rows]
        body += [("-", "", name, _shape(shape), f"kept: {TORCH_ONLY[name.rsplit('.', 1)[-1]]}")
                 for name, shape in self.kept]
        widths = [max(len(row[i]) for row in [head] + body) for i in range(4)]
        lines = [f"{a:{widths[0]}}  {b:{widths[1]}} -> {c:{widths[2]}}  {d:{widths[3]}}  {e}".rstrip()
                 for a, b, c, d, e in [head] + body]
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)

    __repr__ = __str__
