"""The masking contract, written once: which keys a query may see, and what
every path must do about what it may not see.

Callers give any mix of d2l's ``valid_lens`` (1-D or 2-D), a boolean ``mask``
(True = may attend), a float ``bias``, ``causal``, ``window``, ``mask_mod``,
``score_mod`` and ``segment_ids``. ``make_mask`` (``build.py``) turns them
into one ``Mask`` (``spec.py``); every path reads it. The rules:

- **Visible keys**: every form combines by AND (``intervals.py``: lengths,
  causal, window, aligned at the bottom right; ``arrays.py``: ``mask``, and
  ``bias`` where it is ``-inf``; ``functions.py``: ``mask_mod``;
  ``segments.py``: ``segment_ids``).
- **Masked scores** are replaced by ``fill_value``, the lowest finite number
  of the compute dtype (never ``-inf``, so nothing becomes NaN), and masked
  weights are exactly 0; **half precision** is computed in float32
  (``numerics.py``).
- **Empty rows**: a query that may see no key gets zero weights and a zero
  output, with finite gradients (``rules.py``).
- **NaN**: NaN in the inputs propagates, except from key and value rows that
  no query of that batch element may see; those are zeroed before any kernel
  reads them (``rules.py``).

Paths ask a mask for one block (``Mask.region``), skip blocks no query may
see and drop the mask on blocks every query sees whole (``blocks.py``: one
encoding of block states).
"""

from .blocks import EMPTY, FULL, PARTIAL, BlockMask, computed_fraction, host_table
from .build import KEYWORDS, Keyword, MaskForms, Where, checked_forms, make_mask, no_forms
from .functions import block_mask
from .segments import segments_from_cu_seqlens, segments_from_lengths
from .spec import Form, Mask

__all__ = [
    "EMPTY",
    "FULL",
    "KEYWORDS",
    "Keyword",
    "PARTIAL",
    "BlockMask",
    "Form",
    "Mask",
    "MaskForms",
    "Where",
    "block_mask",
    "checked_forms",
    "computed_fraction",
    "host_table",
    "make_mask",
    "no_forms",
    "segments_from_cu_seqlens",
    "segments_from_lengths",
]
