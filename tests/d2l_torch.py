"""d2l's PyTorch models (one copy, shared with the bench's baselines): see
``attention_multi.cli.bench.d2l_torch``. ``attention-multi port --like
tests.d2l_torch:transformer()`` and the tests import them from here."""

from attention_multi.cli.bench.d2l_torch import *  # noqa: F403
from attention_multi.cli.bench.d2l_torch import FACTORIES  # noqa: F401
