"""``attention-multi conform``: the grid, each adapter on the quick grid, the
expected-differences data, the exit statuses and the argument errors."""

import collections
import dataclasses
import importlib.util
import json
import re

import numpy as np
import pytest

from attention_multi import reference as ref
from attention_multi.cli import main
from attention_multi.cli.conform import expected
from attention_multi.cli.conform.adapters import ADAPTERS, D2L
from attention_multi.cli.conform.run import exit_status, run_grid
from attention_multi.testing import conformance_cases, frameworks, run_case
from attention_multi.testing.conformance import DTYPES, REGRESSIONS, make_case, select
from attention_multi.testing.forms import materialized
from tests import d2l_torch

FAMILIES = {
    "plain",
    "lens-1d",
    "lens-2d",
    "mask",
    "bias",
    "causal-bottom-right",
    "causal-top-left",
    "window",
    "gqa",
    "poison",
    "decode",
    "empty-axis",
    "mask_mod",
    "score_mod",
    "segment_ids",
    "regression",
}
PROGRAMMABLE = ("mask_mod", "score_mod", "segment_ids")


@pytest.fixture(scope="module")
def grid():
    return conformance_cases()


@pytest.fixture(scope="module")
def quick():
    return conformance_cases(quick=True)


# ---- the grid ----


def test_grid_sizes_ids_and_coverage(grid, quick):
    assert len(grid) >= 500 and 60 <= len(quick) <= 80
    ids = [c.id for c in grid]
    assert len(set(ids)) == len(ids)
    assert {c.id for c in quick} <= set(ids)
    for cases in (grid, quick):
        assert {c.family for c in cases} == FAMILIES
        assert {c.dtype for c in cases} == set(DTYPES)
        assert any(c.grad for c in cases)
    assert collections.Counter(c.dtype for c in grid) == {d: len(grid) // 4 for d in DTYPES}
    # the forms themselves
    kinds = {(c.family, bool(c.grad)) for c in grid}
    assert ("decode", True) not in kinds  # decoding is forward only
    assert ("regression", True) not in kinds  # named cases: forward
    assert {c.causal for c in grid} == {None, "bottom-right", "top-left"}
    assert any(c.valid_lens is not None and c.valid_lens.ndim == 2 for c in grid)
    assert any(c.keys.shape[1] < c.queries.shape[1] for c in grid)  # grouped heads
    assert {c.decode for c in grid} == {None, "growing", "static"}
    assert {0} <= {s for c in grid if c.family == "empty-axis" for s in c.shape}
    for family in PROGRAMMABLE:  # each form with grouped heads, in every dtype, with gradients
        cases = [c for c in grid if c.family == family]
        assert {c.dtype for c in cases} == set(DTYPES) and any(c.grad for c in cases), family
        assert any(c.keys.shape[1] < c.queries.shape[1] for c in cases), family
        assert any(c.family == family for c in quick), family
    named = [c for c in grid if c.family == "regression"]
    assert {c.id.split("/")[1] for c in named} == set(REGRESSIONS)
    assert all(c.reports and c.reports[0].startswith("https://github.com/") for c in named)


def test_programmable_forms_and_their_oracle(grid):
    doc = next(c for c in grid if c.id == "mask_mod/document/q=k/float64")
    seg = next(c for c in grid if c.id == "segment_ids/padding/q=k/float64")
    # the document mask_mod and the segment ids mean one mask; row 0's last query is padding
    dense = materialized(doc.shape, mask_mod=doc.mask_mod)
    np.testing.assert_array_equal(dense, materialized(seg.shape, segment_ids=seg.segment_ids))
    assert not dense[0, :, 3].any() and not doc.expected[0, :, 3].any()
    out, _ = ref.attention(doc.queries, doc.keys, doc.values, mask=dense)
    np.testing.assert_array_equal(doc.expected, out)
    # the learnable table's gradient (the 4th) against central differences of the oracle
    case = next(c for c in grid if c.id == "score_mod/bias-table/q=k/float64/grad")
    mod = case.score_mod
    assert mod.learnable == ("table",) and len(case.expected_grads) == 4

    def loss(table):
        f = mod.make(frameworks.get("numpy"), table=table)
        out, _ = ref.attention(case.queries, case.keys, case.values, score_mod=f)
        return (out * case.grad_out).sum()

    table, numeric = mod.arrays["table"].copy(), np.zeros_like(mod.arrays["table"])
    for idx in np.ndindex(table.shape):
        saved = table[idx]
        table[idx] = saved + 1e-6
        up = loss(table)
        table[idx] = saved - 1e-6
        numeric[idx] = (up - loss(table)) / 2e-6
        table[idx] = saved
    np.testing.assert_allclose(case.expected_grads[3], numeric, rtol=1e-6, atol=1e-8)


def test_grid_expectations_are_the_oracles(grid):
    for case in grid:
        assert case.expected.shape == case.queries.shape[:3] + case.values.shape[3:]
        assert np.isfinite(case.expected).all(), case.id  # poison never reaches it
        if case.grad:
            assert all(np.isfinite(g).all() for g in case.expected_grads), case.id
    plain = next(c for c in grid if c.id == "plain/q<k/float64")
    scores = plain.queries @ plain.keys.swapaxes(-1, -2) / 2.0  # sqrt(d = 4)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ plain.values
    np.testing.assert_allclose(plain.expected, want, rtol=1e-12, atol=1e-12)
    # top-left causal: key j <= query i; an empty row (Q > K has none here) gives zeros
    tl = next(c for c in grid if c.id == "causal-top-left/q<k/float64")
    tril = np.arange(5)[None, :] <= np.arange(3)[:, None]
    out, _ = ref.attention(tl.queries, tl.keys, tl.values, mask=tril)
    np.testing.assert_array_equal(tl.expected, out)
    # empty rows: zeros
    empty = next(c for c in grid if c.id == "lens-1d/empty-row/q<k/float32")
    assert empty.valid_lens[-1] == 0 and not empty.expected[-1].any()
    assert not next(c for c in grid if c.id.startswith("empty-axis/K=0")).expected.any()


def test_grid_poisons_only_what_nobody_may_see(grid):
    for case in select(grid, ["poison/*/float32"]):
        hidden = ~np.isfinite(case.values).all(-1)  # (B, H_kv, K)
        assert hidden.any(), case.id
        if case.valid_lens is not None:
            lens = case.valid_lens
            assert (np.arange(case.keys.shape[2]) >= lens[:, None])[:, None].__ge__(hidden).all()
        elif case.segment_ids is not None:  # padding keys (negative ids) only
            assert ((case.segment_ids < 0)[:, None] >= hidden).all()
        else:
            assert not (case.mask.any(axis=(1, 2))[:, None] & hidden).any()
    assert np.isnan(next(c for c in grid if c.id.startswith("poison/nan+")).keys).any()


def test_low_precision_inputs_are_rounded_for_the_oracle(grid):
    case = next(c for c in grid if c.id == "plain/q<k/bfloat16")
    bits = case.queries.astype(np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any()  # exactly bfloat16 values
    half = next(c for c in grid if c.id == "plain/q<k/float16")
    np.testing.assert_array_equal(half.queries, half.queries.astype(np.float16))


# ---- a user's function (run_case and module:function) ----


def numpy_attention(q, k, v, *, valid_lens=None, mask=None, causal=None, window=None, scale=None):
    """A test function: correct on every case it supports, via the oracle's own formula
    in float32 (float64 for float64), written independently of reference.py."""
    work = np.float64 if q.dtype == np.float64 else np.float32
    q, k, v = (np.asarray(x, work) for x in (q, k, v))
    B, H, Q, d = q.shape
    K = k.shape[2]
    k, v = (np.repeat(x, H // x.shape[1], axis=1) for x in (k, v))
    ok = np.ones((B, H, Q, K), bool)
    j, p = np.arange(K), np.arange(Q)[:, None] + K - Q
    if valid_lens is not None:
        lens = valid_lens[:, None] if valid_lens.ndim == 1 else valid_lens
        ok &= (j < lens[:, :, None])[:, None]
    if mask is not None:
        ok &= mask
    if causal:
        ok &= j <= (p if causal == "bottom-right" else np.arange(Q)[:, None])
    if window is not None:
        left, right = (K if s is None else s for s in window)
        ok &= (j >= p - left) & (j <= p + right)
    s = np.where(ok, np.einsum("bhqd,bhkd->bhqk", q, k) * (scale or d**-0.5), -np.inf)
    top = np.where(ok.any(-1, keepdims=True), s.max(-1, keepdims=True, initial=-np.inf), 0)
    w = np.where(ok, np.exp(s - top), 0)
    w /= np.maximum(w.sum(-1, keepdims=True), 1e-30)
    return np.einsum("bhqk,bhkd->bhqd", w, np.where(ok.any(2)[..., None], v, 0))


def leaky_attention(q, k, v, valid_lens=None):
    """Uniform weights over masked rows, d2l-style: wrong on empty rows."""
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64))
    if valid_lens is not None:
        lens = valid_lens[:, None] if valid_lens.ndim == 1 else valid_lens
        s = np.where((np.arange(k.shape[2]) < lens[:, :, None])[:, None], s, -1e6)
    w = np.exp(s / np.sqrt(q.shape[-1]) - s.max(-1, keepdims=True) / np.sqrt(q.shape[-1]))
    with np.errstate(invalid="ignore"):  # NaN where nobody may look leaks: graded, not warned
        return (w / w.sum(-1, keepdims=True)) @ v.astype(np.float64)


def test_run_case_grades_a_users_function(quick):
    results = {c.id: run_case(c, numpy_attention) for c in quick}
    statuses = collections.Counter(r.status for r in results.values())
    assert statuses["agrees"] >= 25 and not statuses["differs"] and not statuses["error"], results
    assert results["bias/-inf/q<k/float32"].status == "not supported"  # takes no bias
    assert "bias" in results["bias/-inf/q<k/float32"].detail
    assert results["plain/q<k/float32/grad"].status == "not supported"
    leaky = {c.id: run_case(c, leaky_attention) for c in quick}
    assert leaky["plain/q<k/float32"].status == "agrees"
    bad = leaky["lens-1d/empty-row/q<k/float32"]
    assert bad.status == "differs" and bad.error > 0.1
    assert leaky["mask/empty-row/q<k/float32"].status == "not supported"


def torch_attention(
    q, k, v, *, valid_lens=None, mask=None, causal=None, scale=None, segment_ids=None
):
    """A user's torch function (the guide's): differentiable, zeros for empty rows."""
    import torch

    B, H, Q, d = q.shape
    K = k.shape[2]
    k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    j, i = torch.arange(K), torch.arange(Q)[:, None]
    allowed = torch.ones(B, H, Q, K, dtype=torch.bool)
    if valid_lens is not None:
        lens = valid_lens[:, None] if valid_lens.ndim == 1 else valid_lens
        allowed = allowed & (j < lens[:, :, None])[:, None]
    if mask is not None:
        allowed = allowed & mask
    if causal is not None:
        allowed = allowed & (j <= (i + K - Q if causal == "bottom-right" else i))
    if segment_ids is not None:
        q_ids, k_ids = (
            segment_ids
            if isinstance(segment_ids, tuple)
            else (segment_ids[:, K - Q :], segment_ids)
        )
        same = (q_ids[:, :, None] == k_ids[:, None]) & (q_ids[:, :, None] >= 0)
        allowed = allowed & same[:, None]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    seen = allowed.any(2)[..., None]
    k, v = (torch.where(seen, x, 0).to(work) for x in (k, v))
    scores = q.to(work) @ k.transpose(-1, -2) * (d**-0.5 if scale is None else scale)
    rows = allowed.any(-1, keepdim=True)
    scores = torch.where(rows, scores.masked_fill(~allowed, float("-inf")), 0)
    return (torch.softmax(scores, -1) * rows @ v).to(q.dtype)


def nan_torch_attention(q, k, v, *, valid_lens=None):
    """The classic: -inf fill, so an empty row's softmax (and its gradients) is NaN."""
    import torch

    K = k.shape[2]
    lens = valid_lens[:, None] if valid_lens is not None else torch.full(q.shape[:1] + (1,), K)
    allowed = (torch.arange(K) < lens[:, :, None])[:, None]
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


def jax_attention(q, k, v, *, valid_lens=None, causal=None, scale=None, score_mod=None):
    """A user's JAX function taking FlexAttention's score_mod (the guide's)."""
    import jax.numpy as jnp

    B, H, Q, d = q.shape
    K = k.shape[2]
    k, v = (jnp.repeat(x, H // x.shape[1], axis=1) for x in (k, v))
    j, i = jnp.arange(K), jnp.arange(Q)[:, None]
    allowed = jnp.ones((B, H, Q, K), bool)
    if valid_lens is not None:
        lens = valid_lens[:, None] if valid_lens.ndim == 1 else valid_lens
        allowed &= (j < lens[:, :, None])[:, None]
    if causal is not None:
        allowed &= j <= (i + K - Q if causal == "bottom-right" else i)
    work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    seen = allowed.any(2)[..., None]
    k, v = (jnp.where(seen, x, 0).astype(work) for x in (k, v))
    scores = q.astype(work) @ k.swapaxes(-1, -2) * (d**-0.5 if scale is None else scale)
    if score_mod is not None:
        scores = score_mod(scores, *jnp.ix_(*(jnp.arange(n) for n in (B, H, Q, K))))
    rows = allowed.any(-1, keepdims=True)
    scores = jnp.where(allowed, scores, -jnp.inf)
    e = jnp.exp(scores - jnp.where(rows, scores.max(-1, keepdims=True), 0))
    return (e / jnp.where(rows, e.sum(-1, keepdims=True), 1) @ v).astype(q.dtype)


GRADIENT_CASES = [
    "plain/q<k/float32/grad",
    "lens-1d/empty-row/q<k/float32/grad",
    "gqa/kv1/B2-H4-Hkv1-Q3-K5/float32/grad",
    "poison/nan+lens-1d/q<k/float32/grad",
    "segment_ids/padding/q=k/float32/grad",
    "score_mod/bias-table/q=k/float32/grad",
    "decode/static/B2-H2-Hkv2-Q5-K5/float32",
]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_run_case_grades_a_torch_function_with_gradients(quick):
    cases = select(quick, GRADIENT_CASES)
    assert len(cases) == len(GRADIENT_CASES)
    results = {c.id: run_case(c, torch_attention, "torch") for c in cases}
    status = {i: r.status for i, r in results.items()}
    assert status.pop("score_mod/bias-table/q=k/float32/grad") == "not supported"
    assert set(status.values()) == {"agrees"}, results
    assert results["segment_ids/padding/q=k/float32/grad"].error < 1e-4
    buggy = run_case(cases[1], nan_torch_attention, "torch")  # the empty row
    assert buggy.status == "differs" and buggy.detail.startswith("NaN in output")


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_run_case_grades_a_jax_function_and_its_score_mods_table(quick):
    """A learnable table the score_mod closes over: its gradient through the
    user's JAX function is graded (the 4th gradient)."""
    cases = select(quick, GRADIENT_CASES[1:2] + GRADIENT_CASES[3:6])  # (two shapes: compiles)
    results = {c.id: run_case(c, jax_attention, "jax") for c in cases}
    assert results.pop("segment_ids/padding/q=k/float32/grad").status == "not supported"
    assert {r.status for r in results.values()} == {"agrees"} and len(results) == 3, results
    table = next(c for c in cases if c.score_mod is not None)
    wrong = dataclasses.replace(
        table, expected_grads=(*table.expected_grads[:3], table.expected_grads[3] + 1e-2)
    )
    result = run_case(wrong, jax_attention, "jax")
    assert result.status == "differs" and result.detail == "largest error in d table"


def test_make_case_uses_the_oracle():
    rng = np.random.default_rng(3)
    q, (k, v) = rng.standard_normal((1, 1, 2, 4)), rng.standard_normal((2, 1, 1, 3, 4))
    case = make_case("mine", "mine", "float32", q, k, v, valid_lens=np.array([2]))
    out, _ = ref.attention(case.queries, case.keys, case.values, valid_lens=np.array([2]))
    np.testing.assert_array_equal(case.expected, out)
    assert run_case(case, numpy_attention).status == "agrees"


# ---- each adapter, on the quick grid ----


def available(name):
    why = ADAPTERS[name]().missing()
    return pytest.param(name, marks=pytest.mark.skipif(bool(why), reason=str(why)))


def run_adapter(adapter, cases):
    rows = run_grid(adapter, cases, expected.load(adapter.name), progress=False)
    return rows, {case.id: (result, status) for case, result, status, _ in rows}


ONNX = [n for n in ADAPTERS if n.startswith("onnx-")]
NOT_FLEX = [n for n in ADAPTERS if n not in ("flex", "d2l", "keras", "flax", *ONNX)]


@pytest.mark.slow
@pytest.mark.parametrize("name", [available(n) for n in NOT_FLEX])
def test_adapter_agrees_with_its_expected_differences(name, quick):
    adapter = ADAPTERS[name]()
    rows, by_id = run_adapter(adapter, quick)
    surprises = [
        (c.id, s, r.detail) for c, r, s, _ in rows if s in ("differs", "unexpectedly agrees")
    ]
    assert exit_status(rows) == 0 and not surprises, surprises
    assert by_id["plain/q<k/float32"][1] == "agrees"
    supported = [c for c, r, s, _ in rows if s != "not supported"]
    assert len(supported) >= 12, len(supported)
    if name.startswith("am-"):  # ours: no expected difference at all
        assert all(s in ("agrees", "not supported") for _, _, s, _ in rows)
        assert by_id["window/(1,0)/q=k/float32"][1] == "agrees"
        assert by_id["lens-1d/empty-row/q<k/float32"][1] == "agrees"
    if name == "torch-sdpa":
        assert by_id["window/(1,0)/q=k/float32"][1] == "not supported"
        assert by_id["lens-1d/empty-row/q<k/float32"][1] == "agrees"  # zeros, torch >= 2.5
        assert by_id["poison/nan+lens-1d/q<k/float32"][1] == "expected difference"


def test_jax_window_alone_is_graded_by_the_data():
    """jax 0.6.2 ignores local_window_size alone (the legacy stack); newer jax
    agrees. The expected-differences file says which, by the installed version."""
    if ADAPTERS["jax"]().missing():
        pytest.skip("jax is not installed")
    cases = select(conformance_cases(quick=True), ["window/(1,0)/q=k/float32"])
    rows, by_id = run_adapter(ADAPTERS["jax"](), cases)
    result, status = by_id["window/(1,0)/q=k/float32"]
    reason = expected.reason_for(cases[0].id, expected.load("jax"))
    if reason:  # the old jax: a real, large difference
        assert status == "expected difference" and "32300" in reason
        assert result.status == "differs" and result.error > 1.0
    else:
        assert status == "agrees" and result.error < 1e-5
    assert exit_status(rows) == 0


def test_d2l_adapter_on_d2ls_code(quick):
    """d2l's DotProductAttention (the copy in tests/d2l_torch.py): uniform weights
    on an empty row, where the oracle gives zeros."""
    pytest.importorskip("torch")
    rows, by_id = run_adapter(D2L(d2l_torch), quick)
    assert by_id["plain/q<k/float32"][1] == "agrees"
    assert by_id["lens-2d/empty-row/q<k/float32"][0].status == "differs"
    assert by_id["mask/empty-row/q<k/float32"][1] == "not supported"


@pytest.mark.parametrize("name", [available("keras"), available("flax")])
def test_optional_adapters(name, quick):
    rows, by_id = run_adapter(ADAPTERS[name](), select(quick, ["*/float32"]))
    assert exit_status(rows) == 0, [(c.id, s, r.detail) for c, r, s, _ in rows]


# ---- the expected-differences data ----


def test_expected_lines_conditions_and_errors(tmp_path):
    text = (
        "# a comment\n"
        "plain/*   # always\n"
        "mask/*  when numpy >= 1.0  # numpy is installed\n"
        "bias/*  when numpy < 1.0  # not this numpy\n"
        "gqa/*  when no-such-package >= 1  # not installed: never\n"
    )
    entries = expected.parse(text)
    assert [p for p, _ in entries] == ["plain/*", "mask/*"]
    assert expected.reason_for("plain/q<k/float32", entries) == "always"
    assert expected.reason_for("bias/-inf/q<k/float32", entries) is None
    for bad, words in (
        ("plain/*\n", "no reason"),
        ("plain/* extra  # why\n", "expected 'pattern"),
        ("plain/* when numpy  # why\n", "bad condition"),
    ):
        with pytest.raises(ValueError, match=words):
            expected.parse(bad, "x.txt")
    with pytest.raises(ValueError, match="x.txt:2"):
        expected.parse("# ok\nplain/*\n", "x.txt")


def test_shipped_expected_files_parse_and_match_cases(grid):
    ids = [c.id for c in grid]
    files = sorted(expected.DIRECTORY.glob("*.txt"))
    assert {f.stem for f in files} >= {"torch-sdpa", "torch-mha", "jax", "mxnet-softmax"}
    for path in files:
        assert path.stem in ADAPTERS, path
        lines = [ln for ln in path.read_text().splitlines() if ln.split("#")[0].strip()]
        for line in lines:  # every pattern names real cases (no typo hides a difference)
            pattern = line.split("#")[0].split(" when ")[0].strip()
            assert select(grid, [pattern]), (path.name, pattern)
        expected.load(path.stem)
    assert ids


def test_a_fixed_bug_shows_as_unexpectedly_agrees(quick, tmp_path):
    adapter = ADAPTERS["am-numpy"]()
    cases = select(quick, ["plain/q<k/float32", "lens-1d/empty-row/q<k/float32"])
    entries = expected.parse("lens-1d/empty-row/*  # pretend it differs\n")
    rows = run_grid(adapter, cases, entries, progress=False)
    assert [s for _, _, s, _ in rows] == ["agrees", "unexpectedly agrees"]
    assert exit_status(rows) == 1


# ---- the command: exit statuses, files, argument errors ----


def test_command_exit_0_json_and_markdown(tmp_path, capsys):
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    argv = ["conform", "--impl", "am-numpy", "--quick", "--cases", "lens-*"]
    assert main([*argv, "--json", str(out_json), "--markdown", str(out_md)]) == 0
    printed, err = capsys.readouterr()
    data = json.loads(out_json.read_text())
    assert data["impl"] == "am-numpy" and data["exit_status"] == 0
    assert {c["status"] for c in data["cases"]} <= {"agrees", "not supported"}
    assert all(c["id"].startswith("lens-") for c in data["cases"])
    assert data["counts"]["agrees"] == sum(c["status"] == "agrees" for c in data["cases"])
    assert out_md.read_text().strip() == printed.strip()
    assert "| lens-1d " in printed and "conform am-numpy:" in err
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically


def test_command_user_function_exit_0_and_1(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # module:function is found in the current directory
    (tmp_path / "conform_mine.py").write_text(
        "from tests.test_conform import leaky_attention, numpy_attention\n"
    )
    assert main(["conform", "--impl", "conform_mine:numpy_attention", "--quick"]) == 0
    assert main(["conform", "--impl", "conform_mine:leaky_attention", "--quick"]) == 1
    printed = capsys.readouterr().out
    assert re.search(r"\| lens-1d/empty-row/q<k/float32 +\| differs", printed)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_command_torch_function_detected_and_graded_with_gradients(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conform_torch.py").write_text(
        "import torch\n\nfrom tests.test_conform import torch_attention\n\n\n"
        "def attention(q, k, v, **forms):\n"
        "    assert isinstance(q, torch.Tensor)\n"
        "    return torch_attention(q, k, v, **forms)\n"
    )
    cases = ["--cases", "lens-1d/empty-row/q<k/float32*", "--cases", "segment_ids/pair/*float32*"]
    out_json = tmp_path / "t.json"
    argv = ["conform", "--impl", "conform_torch:attention", *cases, "--json", str(out_json)]
    assert main(argv) == 0
    data = json.loads(out_json.read_text())
    assert data["command"].endswith("--framework torch") and data["counts"]["agrees"] == 4
    assert {c["id"] for c in data["cases"] if c["grad"]} == {
        "lens-1d/empty-row/q<k/float32/grad",
        "segment_ids/pair/q<k/float32/grad",
    }
    assert data["families"] == {"lens-1d": 2, "segment_ids": 2}
    assert data["forms"] == {"valid_lens": 2, "segment_ids": 2}


def test_command_framework_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conform_two.py").write_text(
        "import json\nimport numpy\nimport torch\nimport jax\n\n"
        "def attention(q, k, v):\n    return q\n"
    )
    if importlib.util.find_spec("torch") and importlib.util.find_spec("jax"):
        assert main(["conform", "--impl", "conform_two:attention"]) == 2
        assert "imports jax and torch: say which framework" in capsys.readouterr().err
    assert main(["conform", "--impl", "am-numpy", "--framework", "torch"]) == 2
    assert "only with --impl module:function" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["conform", "--impl", "json:dumps", "--framework", "cntk"])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--impl", "nope"], "unknown; choose from torch-sdpa"),
        (["--impl", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
        (["--impl", "json:no_such_function"], "has no attribute 'no_such_function'"),
        (["--impl", "json:__doc__"], "is not callable"),
        (["--impl", "am-numpy", "--dtypes", "float8"], "--dtypes 'float8'"),
        (["--impl", "am-numpy", "--cases", "nothing/*"], "no case matches"),
    ],
)
def test_bad_arguments_exit_2(argv, words, capsys):
    assert main(["conform", *argv]) == 2
    assert words in capsys.readouterr().err


def test_missing_package_exits_2(capsys):
    missing = [n for n in ADAPTERS if ADAPTERS[n]().missing()]
    if not missing:
        pytest.skip("every adapter's package is installed")
    assert main(["conform", "--impl", missing[0]]) == 2
    assert "is not installed" in capsys.readouterr().err


def test_unwritable_json_exits_3_before_running(tmp_path, capsys):
    target = tmp_path / "no-such-dir" / "c.json"
    assert main(["conform", "--impl", "am-numpy", "--json", str(target)]) == 3
    assert "cannot write" in capsys.readouterr().err


def test_impl_required():
    with pytest.raises(SystemExit) as exc:
        main(["conform"])
    assert exc.value.code == 2


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_report_grades_the_frameworks_own_attention():
    from attention_multi.cli.report import frameworks
    from attention_multi.cli.report.cases import make_inputs, rounded
    from attention_multi.cli.report.render import table

    inputs = {"float32": rounded(make_inputs(), "float32")}
    labels, cells, ids, notes = frameworks.run(["torch"], inputs)
    assert labels[:2] == ["torch-sdpa", "torch-mha"]
    seed = "seed/DotProductAttention example (valid_lens [2, 6])"
    assert ids[0] == seed and cells["torch-sdpa"][seed].endswith(" ok")
    empty_row = "seed/valid_lens (B, Q), an empty row"
    assert cells["torch-sdpa"][empty_row].endswith(" ok")  # zeros since torch 2.5
    assert cells["torch-mha"][seed] == "n/s"  # values of another size than the keys
    assert cells["torch-mha"]["lens-1d/empty-row/q<k/float32"] == "NaN DIFFERS"
    lines = frameworks.markdown(labels, cells, ids, notes, table)
    assert lines[0] == "## The frameworks' own attention"
    assert any(line.startswith(f"| {seed}") for line in lines)
