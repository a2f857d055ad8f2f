"""The attention core, written once against the backend protocol.

- ``mask/``: the masking contract: the keywords (``build.py``) normalized
  into one ``Mask`` (``spec.py``), one module per form family, block states,
  and the NaN and empty-row rules.
- ``numerics.py``: compute dtype, fill value, constants, empty rows.
- ``paths/``: the ways to compute attention, each a plan and a run.
- ``select.py``: the one chooser (``straight_line``, ``attend``).
- ``checks.py``: argument checks (errors name the argument and the shapes).
"""

from .checks import (
    check_bool,
    check_choice,
    check_divides,
    check_dropout,
    check_nonnegative_int,
    check_positive_int,
)
from .mask import Mask, MaskForms, checked_forms, make_mask, no_forms
from .mask.rules import masked_softmax
from .numerics import (
    DEFAULT_MEMORY_BUDGET,
    compute_dtype,
    default_scale,
    fill_value,
    zeros_for_empty,
)
from .paths import PATHS
from .select import SMALL_SCORES, attend, check_path_options, straight_line

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "PATHS",
    "SMALL_SCORES",
    "Mask",
    "MaskForms",
    "attend",
    "check_bool",
    "check_choice",
    "check_divides",
    "check_dropout",
    "check_nonnegative_int",
    "check_path_options",
    "check_positive_int",
    "checked_forms",
    "compute_dtype",
    "default_scale",
    "fill_value",
    "make_mask",
    "masked_softmax",
    "no_forms",
    "straight_line",
    "zeros_for_empty",
]
