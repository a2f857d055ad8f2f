"""``attention-multi report`` end to end, and its reference against tests/oracle.py."""

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attention_multi as am
from attention_multi import backends
from attention_multi.cli.report import MECHANISMS

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = (
    "heatmap_additive.png",
    "heatmap_dot_product.png",
    "heatmap_multihead.png",
    "heatmap_mask_mod.png",
    "nadaraya_watson.png",
)


# -- the command, end to end ------------------------------------------------------


def run_report(*args, pythonpath=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, pythonpath), str(ROOT), env.get("PYTHONPATH", "")]
    )
    for name in ("ATTENTION_MULTI_BACKEND", "ATTENTION_MULTI_DEVICE"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "attention_multi", "report", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def importable(name):
    try:
        am.get_backend(name)
        return True
    except ImportError:
        return False


def installed_but_broken(name):
    return name in backends.available_backends() and not importable(name)


RUNNABLE = [n for n in backends.BACKEND_NAMES if importable(n)]


def table_cells(text, dtype):
    """{mechanism: {column: cell}} of the ``dtype`` table in the printed report."""
    block = text.split(f"### {dtype}\n", 1)[1].strip().split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()]
    header, body = rows[0], rows[2:]
    return {row[0]: dict(zip(header[1:], row[1:])) for row in body}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return run_report("--out", str(out)), out


@pytest.mark.slow
def test_report_passes_on_every_installed_backend(full_run):
    result, out = full_run
    assert result.returncode == 0, result.stdout + result.stderr
    for dtype in ("float32", "float64"):
        cells = table_cells(result.stdout, dtype)
        assert list(cells) == MECHANISMS
        for mech, row in cells.items():
            assert sorted(row) == sorted(f"{n}/cpu" for n in RUNNABLE)
            assert all(cell.endswith(" ok") for cell in row.values()), (mech, row)
    # it ends with the verdict: ours, then the frameworks' own (informative)
    ours, theirs = result.stdout.strip().splitlines()[-2:]
    assert re.fullmatch(r"Verdict, ours: All \d+ cells pass\.", ours), ours
    assert theirs.startswith("Verdict, the frameworks' own attention (informative"), theirs
    for name in RUNNABLE:  # progress on stderr, one line per backend/device
        assert f"report: running {name}/cpu" in result.stderr


def test_report_lists_every_backend_and_device(full_run):
    result, out = full_run
    md = (out / "report.md").read_text()
    for text in (result.stdout, md):
        for name in backends.BACKEND_NAMES:
            assert f"- {name}: " in text
            if name in RUNNABLE:
                assert f"{name}/cpu" in text
                if name != "numpy" and "cuda (" not in text:
                    assert "cuda not available" in text  # no GPU: listed, not failed
            elif installed_but_broken(name):
                assert f"- {name}: installed but fails to import" in text
            else:
                assert f"- {name}: not installed ({backends.install_hint(name)})" in text


def test_report_md_has_tables_and_versions(full_run):
    _, out = full_run
    md = (out / "report.md").read_text()
    assert f"Python {platform.python_version()}" in md
    for dist in ("numpy", "torch", "jax", "mxnet"):
        try:
            assert f"{dist} {importlib.metadata.version(dist)}" in md
        except importlib.metadata.PackageNotFoundError:
            assert f"{dist} not installed" in md
    for mech in MECHANISMS:
        assert md.count(f"| {mech} ") == 2  # float32 and float64 tables
    assert "## Forward time" in md
    for name in RUNNABLE:
        assert f"| {name}/cpu " in md.split("## Forward time")[1]


def test_report_figures_are_valid_pngs(full_run):
    result, out = full_run
    pytest.importorskip("matplotlib")
    import matplotlib.image

    md = (out / "report.md").read_text()
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and min(image.shape[:2]) > 50, (name, image.shape)
        assert f"]({name})" in md
    if any(n in RUNNABLE for n in ("torch", "jax", "mxnet")):
        assert "NWKernelRegression trained on" in md


def test_planted_disagreement_fails(tmp_path):
    planted = next((n for n in RUNNABLE if n != "numpy"), "numpy")
    names = ",".join(dict.fromkeys(["numpy", planted]))
    result = run_report(
        "--backends", names, "--devices", "cpu", "--plant", planted, "--out", str(tmp_path)
    )
    assert result.returncode == 1, result.stdout + result.stderr
    for dtype in ("float32", "float64"):
        cells = table_cells(result.stdout, dtype)
        for mech in MECHANISMS:
            assert cells[mech][f"{planted}/cpu"].endswith(" FAIL")
            if planted != "numpy":
                assert cells[mech]["numpy/cpu"].endswith(" ok")
    assert "FAILED:" in result.stdout
    md = (tmp_path / "report.md").read_text()
    assert "FAIL" in md and f"Planted disagreement (self-test): 0.01 added to every {planted}" in md


@pytest.mark.parametrize(
    "missing",
    [n for n in backends.BACKEND_NAMES if n not in backends.available_backends()]
    or [pytest.param("mxnet", marks=pytest.mark.skip(reason="every backend is installed here"))],
)
def test_uninstalled_backend_is_listed_with_its_extra(tmp_path, missing):
    result = run_report("--backends", f"numpy,{missing}", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    line = f"- {missing}: not installed ({backends.install_hint(missing)})"
    assert line in result.stdout
    assert line in (tmp_path / "report.md").read_text()
    alone = run_report("--backends", missing, "--out", str(tmp_path))
    assert alone.returncode == 2 and "No backend could run" in alone.stdout


def test_broken_backend_is_listed_with_the_reason(tmp_path):
    """A framework that is found but fails to import (as mxnet on numpy 2)."""
    shadow = tmp_path / "shadow"
    (shadow / "mxnet").mkdir(parents=True)
    (shadow / "mxnet" / "__init__.py").write_text("raise ImportError('simulated broken mxnet')\n")
    result = run_report(
        "--backends", "numpy,mxnet", "--out", str(tmp_path / "out"), pythonpath=[shadow]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "- mxnet: installed but fails to import (ImportError: simulated broken mxnet)"
    ) in result.stdout


def test_runs_without_matplotlib(tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "matplotlib").mkdir(parents=True)
    (shadow / "matplotlib" / "__init__.py").write_text(
        "raise ImportError('simulated: no matplotlib')\n"
    )
    out = tmp_path / "out"
    result = run_report("--backends", "numpy", "--out", str(out), pythonpath=[shadow])
    assert result.returncode == 0, result.stdout + result.stderr
    md = (out / "report.md").read_text()
    assert "Figures skipped" in md and "pip install '.[plot]'" in md
    assert "numpy/cpu" in md and not list(out.glob("*.png"))


@pytest.mark.parametrize(
    "args, words",
    [
        (["--backends", "numpy,cntk"], ["--backends", "'cntk'", "numpy, torch"]),
        (["--devices", "tpu"], ["--devices", "'tpu'", "cuda"]),
        (["--backends", "numpy", "--plant", "torch"], ["--plant torch", "--backends numpy"]),
    ],
)
def test_bad_arguments_are_named(tmp_path, args, words):
    result = run_report(*args, "--out", str(tmp_path))
    assert result.returncode == 2
    for word in words:
        assert word in result.stderr, result.stderr


def test_multi_head_heatmap_labels_each_row_with_its_batch_element():
    pytest.importorskip("matplotlib").use("Agg")
    import matplotlib.pyplot as plt

    from attention_multi.cli.report.render import multi_head_heatmaps

    weights = np.random.default_rng(0).random((3 * 2, 4, 5))  # batch 3, 2 heads
    fig = multi_head_heatmaps(weights, 2, [1, 5, 2])
    plt.close(fig)  # (its axes stay readable; later tests count the open figures)
    grid = [ax for ax in fig.axes if ax.get_images()]  # not the colorbar
    assert len(grid) == 6
    labels = [ax.get_ylabel() for ax in grid]
    assert labels[0::2] == [
        "batch 0 (valid_len 1)\nQueries",
        "batch 1 (valid_len 5)\nQueries",
        "batch 2 (valid_len 2)\nQueries",
    ]
    assert labels[1::2] == ["", "", ""]
    assert [ax.get_title() for ax in grid[:2]] == ["Head 1", "Head 2"]
