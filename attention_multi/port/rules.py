"""Gluon -> PyTorch naming rules: the one table ``attention_multi.port`` uses.

Gluon's ``save_parameters`` names parameters by structure
(``blks.0.addnorm1.ln.gamma``). Most layers d2l uses name and shape their
parameters as PyTorch does, so they need no rule:

- Dense / Linear: ``weight`` (out, in), ``bias`` (out,)
- Embedding: ``weight`` (vocab, dim)
- Conv1D/2D / Conv1d/2d: ``weight`` (out, in / groups, *kernel), ``bias``
- BatchNorm: ``running_mean``, ``running_var``
- this library's attention modules: ``W_q.weight``, ``W_k.weight``, ``w_v.weight``...

The rest is ``RULES``. Gluon and PyTorch order the gates the same way
(GRU: r, z, n; LSTM: i, f, g, o), so RNN weights are renamed, never reordered;
tests/test_port_models.py checks this against MXNet's own outputs.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

__all__ = ["RULES", "TORCH_ONLY", "Rule", "rules_table", "translate"]

# ``pattern`` matches the end of a dotted Gluon name; ``rename`` gives the
# PyTorch ending. A rule with ``keeps_original`` also lets the Gluon name match
# as it is (a PyTorch module may itself call a parameter ``gamma``).


class Rule(NamedTuple):
    """One renaming rule: a row of ``rules_table()``."""

    layer: str  # the layer it is for
    gluon: str  # the Gluon ending, as text
    torch: str  # the PyTorch ending, as text
    pattern: str  # regex matching the end of a Gluon name
    rename: Callable[[re.Match[str]], str]  # the PyTorch ending for a match
    keeps_original: bool  # the Gluon name may also match as it is


def _rnn(reverse: bool) -> Callable[[re.Match[str]], str]:
    def rename(m: re.Match[str]) -> str:
        kind = {"i2h": "ih", "h2h": "hh"}[m["gate"]]
        return f"{m['what']}_{kind}_l{m['layer']}" + ("_reverse" if reverse else "")

    return rename


_GATE = r"(?P<gate>i2h|h2h)_(?P<what>weight|bias)"

RULES = (
    Rule(
        "GRU/LSTM/RNN layer N (MXNet 1.9)",
        "_unfused.N.i2h_weight",
        "weight_ih_lN",
        rf"_unfused\.(?P<layer>\d+)\.(?:l_cell\.)?{_GATE}",
        _rnn(False),
        False,
    ),
    Rule(
        "GRU/LSTM/RNN layer N, backward direction (MXNet 1.9)",
        "_unfused.N.r_cell.h2h_bias",
        "bias_hh_lN_reverse",
        rf"_unfused\.(?P<layer>\d+)\.r_cell\.{_GATE}",
        _rnn(True),
        False,
    ),
    Rule(
        "GRU/LSTM/RNN layer N (older MXNet)",
        "lN_h2h_weight",
        "weight_hh_lN",
        rf"l(?P<layer>\d+)_{_GATE}",
        _rnn(False),
        False,
    ),
    Rule(
        "GRU/LSTM/RNN layer N, backward direction (older MXNet)",
        "rN_i2h_bias",
        "bias_ih_lN_reverse",
        rf"r(?P<layer>\d+)_{_GATE}",
        _rnn(True),
        False,
    ),
    Rule("LayerNorm, BatchNorm (any norm)", "gamma", "weight", "gamma", lambda m: "weight", True),
    Rule("LayerNorm, BatchNorm (any norm)", "beta", "bias", "beta", lambda m: "bias", True),
)
_COMPILED = [(rule, re.compile(rf"(?:^|(?<=\.)){rule.pattern}$")) for rule in RULES]

# PyTorch state_dict entries with no Gluon counterpart: kept as the module has them.
TORCH_ONLY = {"num_batches_tracked": "BatchNorm's batch counter (Gluon has none)"}


def translate(gluon_name: str) -> tuple[str, Rule | None]:
    """``(pytorch_name, rule)`` for a Gluon name; ``rule`` is None where the
    name stays as it is."""
    for rule, pattern in _COMPILED:
        m = pattern.search(gluon_name)
        if m:
            return gluon_name[: m.start()] + rule.rename(m), rule
    return gluon_name, None


def rules_table() -> str:
    """The rules as text: layer, Gluon ending -> PyTorch ending."""
    rows = [(r.layer, r.gluon, r.torch) for r in RULES]
    rows += [("BatchNorm", "(none)", f"{n}: kept") for n in TORCH_ONLY]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:{widths[0]}}  {b:{widths[1]}} -> {c}" for a, b, c in rows)
