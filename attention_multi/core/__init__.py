"""The attention core: the masking contract (``masking.py``), the paths
(``paths.py``) and the one function that picks a path (``attend.py``), written
once against the backend protocol; ``small.py`` is the straight line of
small calls (lengths or nothing). Argument checks are in ``checks.py``
(constructor arguments: ``check_positive_int``, ``check_dropout``,
``check_bool``, ``check_choice``...)."""

from . import small
from .attend import DEFAULT_MEMORY_BUDGET, PATHS, attend, check_path_options, zeros_for_empty
from .checks import (
    check_bool,
    check_choice,
    check_divides,
    check_dropout,
    check_nonnegative_int,
    check_positive_int,
)
from .masking import Mask, compute_dtype, fill_value, make_mask, masked_softmax
from .paths import default_scale

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "PATHS",
    "Mask",
    "attend",
    "check_bool",
    "check_choice",
    "check_divides",
    "check_dropout",
    "check_nonnegative_int",
    "check_path_options",
    "check_positive_int",
    "compute_dtype",
    "default_scale",
    "fill_value",
    "make_mask",
    "masked_softmax",
    "small",
    "zeros_for_empty",
]
