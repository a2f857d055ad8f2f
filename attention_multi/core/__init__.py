"""The attention core, written once against the backend protocol.

- ``mask/``: the masking contract: the keywords (``build.py``) normalized
  into one ``Mask`` (``spec.py``), one module per form family, block states,
  and the NaN and empty-row rules.
- ``numerics.py``: compute dtype, fill value, constants, empty rows.
- ``paths/``: the ways to compute attention, each a plan and a run.
- ``select.py``: the one chooser (``straight_line``, ``attend``) and the one
  route of a call for the functions and the modules (``compute``: a ``Result``).
- ``checks.py``: argument checks (errors name the argument and the shapes).
"""

from .mask import Mask, MaskForms, checked_forms, make_mask, no_forms
from .mask.rules import masked_softmax
from .numerics import DEFAULT_MEMORY_BUDGET, default_scale, zeros_for_empty
from .paths.call import Options, Result
from .select import attend, check_path_options, compute, straight_line

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "Mask",
    "MaskForms",
    "Options",
    "Result",
    "attend",
    "check_path_options",
    "checked_forms",
    "compute",
    "default_scale",
    "make_mask",
    "masked_softmax",
    "no_forms",
    "straight_line",
    "zeros_for_empty",
]
