"""``attention-multi conform``'s compiled and exported adapters, apart from
tests/test_conform.py so that they run beside it: torch's flex_attention
(compiled: about 30 s for its first shape) and the attention exported to ONNX
and run in ONNX Runtime (an export per case)."""

import importlib.util

import numpy as np
import pytest

from attention_multi.cli.conform.adapters import ADAPTERS
from attention_multi.cli.conform.run import exit_status
from attention_multi.testing import conformance_cases
from attention_multi.testing.conformance import select
from tests.test_conform import ONNX, run_adapter


@pytest.fixture(scope="module")
def grid():
    return conformance_cases()


@pytest.mark.slow
def test_flex_adapter_one_compile(grid):
    """One compiled shape (q<k, float32): every form through one mask_mod
    (segment ids too); then a case's own mask_mod and score_mod, one more compile."""
    if ADAPTERS["flex"]().missing():
        pytest.skip("torch is not installed")
    adapter = ADAPTERS["flex"]()
    cases = select(conformance_cases(quick=True), ["*/q<k/float32"])
    cases += select(
        grid, ["segment_ids/pair/q<k/float32", "score_mod/bias-table+document/q=k/float32"]
    )
    rows, by_id = run_adapter(adapter, cases)
    assert exit_status(rows) == 0, [(c.id, s, r.detail) for c, r, s, _ in rows]
    assert len({shape for shape, _ in adapter.shapes}) == 2
    for family in (
        "plain",
        "lens-1d/empty-row",
        "lens-2d/empty-row",
        "mask/empty-row",
        "bias",
        "segment_ids/pair",
        "score_mod/bias-table+document",
    ):
        assert any(i.startswith(family) and st == "agrees" for i, (_, st) in by_id.items())


ONNX_CASES = [
    "plain/q<k/float32",
    "mask/empty-row/q<k/float16",
    "segment_ids/padding/q=k/float32",
    "regression/empty-row-nan/float32",
    "regression/gqa-kv-head-order/float32",
]


def _onnx_runtime_required():
    """The [onnx] extra is on the modern stack (requirements/modern.txt): there the
    ONNX Runtime adapters must run; the legacy stack does not have it."""
    missing = [m for m in ("onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing and np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        pytest.fail(f"the modern stack requires {missing} (requirements/modern.txt)")
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: the onnx extra is not on this stack")


@pytest.mark.second_stack
@pytest.mark.parametrize("name", ONNX)
def test_onnx_runtime_adapters(name, grid):
    """Exported to ONNX and run in ONNX Runtime: a few forward cases, one
    export each, graded with each adapter's expected differences."""
    _onnx_runtime_required()
    adapter = ADAPTERS[name]()
    cases = select(grid, ONNX_CASES + ["plain/q<k/float32/grad"])
    rows, by_id = run_adapter(adapter, cases)
    surprises = [
        (c.id, s, r.detail) for c, r, s, _ in rows if s in ("differs", "unexpectedly agrees")
    ]
    assert exit_status(rows) == 0 and not surprises, surprises
    assert by_id["plain/q<k/float32"][1] == "agrees"
    assert by_id["plain/q<k/float32/grad"][0].detail == "forward only (an exported graph)"
    assert 3 <= adapter.exports <= len(ONNX_CASES)  # one per shape and static argument
    empty_row = by_id["regression/empty-row-nan/float32"]
    if name in ("onnx-am", "onnx-torch-sdpa-opset23"):  # zeros for the row nobody may see
        assert empty_row[1] == "agrees" and by_id["segment_ids/padding/q=k/float32"][1] == "agrees"
    else:  # the default opset's SDPA: the mean of the values; the module: NaN
        assert empty_row[1] == "expected difference" and not empty_row[0].error < 0.5
    if name != "onnx-torch-mha":
        assert by_id["regression/gqa-kv-head-order/float32"][1] == "agrees"
