"""What a new user meets first: the command's help and its absence, the errors
of a bad environment variable or a broken framework, the listed extras, the
report's figures, and a clean torch.export."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import tomllib

from attention_multi import backends

REPO = Path(__file__).resolve().parents[1]


def cli(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "attention_multi", *args],
        cwd=kwargs.pop("cwd", REPO),
        capture_output=True,
        text=True,
        timeout=1200,
        **kwargs,
    )


def test_no_command_prints_the_commands_and_exits_2():
    result = cli()
    assert result.returncode == 2 and result.stdout == ""
    for name in ("info", "report", "bench", "port"):
        assert re.search(rf"^\s+{name}\s+\w", result.stderr, re.M), result.stderr


def test_help_shows_plain_defaults_whole_words_and_a_description():
    report = cli("report", "--help").stdout
    every = ",".join(backends.BACKEND_NAMES)  # (argparse may wrap it: spaces made one)
    assert f"default: all ({every})" in " ".join(report.split()) and "['" not in report
    assert "Run every mechanism" in report  # a description line
    port = cli("port", "--help").stdout
    assert "num_hiddens=8,num_heads=2,bias=True" in port  # not broken across lines
    from attention_multi.cli import COMMANDS

    assert all(description for _, _, description, _ in list(COMMANDS.values())[1:])


def test_the_command_line_page_documents_every_command():
    from attention_multi.cli import COMMANDS

    page = (REPO / "docs" / "guide" / "quickstart.md").read_text()
    section = page.split("## The command line", 1)[1].split("\n## ", 1)[0]
    names = [name for name in COMMANDS if name]
    assert {"info", "report", "conform", "bench", "port"} <= set(names), names
    for name in names:
        assert f"`attention-multi {name}" in section, name
    assert "with no command" in section
    # and the README, the front door, names every command and links that page
    readme = (REPO / "README.md").read_text()
    assert all(name in readme for name in names) and "docs/guide/quickstart.md" in readme


def test_bad_device_variable_is_named(monkeypatch):
    import attention_multi as am

    monkeypatch.setenv("ATTENTION_MULTI_DEVICE", "gpu9x")
    with pytest.raises(ValueError, match=r"ATTENTION_MULTI_DEVICE='gpu9x': unknown device"):
        am.DotProductAttention(0.0)(*[np.ones((1, 2, 4), np.float32)] * 3)


@pytest.mark.parametrize(
    "framework, words",
    [
        ("numpy", ["which is installed but failed to import", "ModuleNotFoundError"]),
        (
            "no_such_framework_am",
            ["which is not installed", "pip install '.[x]' (in a checkout of attention-multi)"],
        ),
    ],
)
def test_import_failure_hint_tells_installed_from_missing(monkeypatch, framework, words):
    monkeypatch.setitem(backends._SPECS, "numpy", ("no_such_module_am", "X", framework, "x"))
    monkeypatch.delitem(backends._loaded, "numpy", raising=False)
    with pytest.raises(ImportError) as info:
        backends.load("numpy")
    for word in words:
        assert word in str(info.value), str(info.value)


def test_port_refuses_an_existing_out_before_any_work(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "out.pt"
    out.write_bytes(b"keep")
    src = REPO / "tests" / "fixtures" / "mxnet" / "transformer.params"
    like = "tests.d2l_torch:transformer()"
    result = cli("port", src, "--to", "torch", "--out", out, "--like", like)
    assert result.returncode == 1 and "exists; add --force" in result.stderr
    assert "mapped" not in result.stdout and out.read_bytes() == b"keep"


def test_the_install_section_lists_every_extra_and_the_floor_is_true():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    users = set(project["optional-dependencies"]) - {"test", "lint"}
    install = (REPO / "docs" / "guide" / "quickstart.md").read_text()
    install = install.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert all(f"'.[{name}]'" in install for name in users), users
    assert "download.pytorch.org/whl/cpu" in install  # torch's CPU build
    readme = (REPO / "README.md").read_text()
    assert "quickstart.md#install" in readme
    # the floor: what the legacy pins need, said alike in pyproject and the docs
    assert project["requires-python"] == ">=3.11"
    assert sys.version_info >= (3, 11)
    for text in (readme, install, (REPO / "docs" / "guide" / "quickstart.md").read_text()):
        assert not re.search(r"(?<![\d.])3\.(9|10)(?![\d])", text)  # no older floor
    assert "3.11 or newer" in readme


def test_extras_install_only_the_tested_versions():
    """Each framework extra has an upper bound (no untested major release), and
    'all' is the legacy stack's versions."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    legacy = dict(
        line.split("#")[0].strip().split("==")
        for line in (REPO / "requirements" / "legacy.txt").read_text().splitlines()
        if "==" in line.split("#")[0]
    )
    for name in ("torch", "jax", "mxnet", "plot", "onnx"):
        assert all("<" in req or "==" in req for req in extras[name] if req != "flatbuffers")
    pins = dict(r.split("==") for r in extras["all"] if "==" in r)
    for package in ("jax", "jaxlib", "mxnet"):
        assert pins[package] == legacy[package], package


def test_seed_heatmaps_are_titled_and_their_likeness_explained(tmp_path):
    pytest.importorskip("matplotlib").use("Agg")
    import matplotlib.pyplot as plt

    from attention_multi.cli.report import DTYPES, make_inputs, rounded
    from attention_multi.cli.report.render import figures

    made = []
    real = plt.Figure.savefig

    sizes, unlabelled = [], []

    def record(fig, *args, **kwargs):
        made.append(
            [t.get_text() for t in fig.texts]
            + [fig.get_supxlabel(), fig.get_suptitle()]
            + [ax.get_title() for ax in fig.axes]
        )
        sizes.append(fig.get_size_inches() * kwargs.get("dpi", fig.dpi))
        colorbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
        unlabelled.extend(ax for ax in colorbars if not ax.get_ylabel())
        assert fig.get_layout_engine() is not None  # nothing clipped or covered
        return real(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Figure, "savefig", record)
        inputs = {d: rounded(make_inputs(), d) for d in DTYPES}
        lines = figures(tmp_path, backends.load("numpy"), "cpu", inputs, None)
    assert len(made) == 5 and all(any(titles) for titles in made), made
    assert "Additive attention, valid_lens [2, 6]" in made[0]
    assert any("mask_mod: packed documents" in title for title in made[3])
    assert sum("as the seeds' keys are all equal" in line for line in lines) == 2
    # ... and the two alike figures say it themselves
    assert all(any("keys are all equal" in text for text in made[i]) for i in (0, 1)), made
    assert all(w >= 500 and h >= 250 for w, h in sizes), sizes
    assert not unlabelled, "a colorbar without a label"


def test_torch_export_does_not_warn_about_our_attributes():
    torch = pytest.importorskip("torch")
    import attention_multi as am

    model = am.NWKernelRegression(backend="torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.export.export(model, (torch.rand(5), torch.rand(5, 4), torch.rand(5, 4)))
    assert not [w for w in caught if "_attention" in str(w.message)], caught


# -- bench checks its arguments up front, with report's messages and exit status ----------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backends", "pytroch"], "argument --backends: unknown backend 'pytroch'; valid"),
        (["--shapes", "huge"], "argument --shapes: unknown shape 'huge'; valid choices: small"),
        (["--ring-processes", "two"], "argument --ring-processes: expected a positive integer"),
        (["--seconds", "-1"], "argument --seconds: expected a positive number of seconds"),
        (["--threads", "0"], "argument --threads: expected a positive integer, got '0'"),
        (["--long-length", "-5"], "argument --long-length: expected an integer >= 0"),
        (["--packed-batch", "-1"], "argument --packed-batch: expected an integer >= 0"),
        (
            ["--ring-length", "100", "--ring-processes", "1,3"],
            "--ring-length 100 is not a multiple of 16 times each of --ring-processes 1,3",
        ),
    ],
)
def test_bench_rejects_bad_arguments_before_any_work(capsys, args, message):
    from attention_multi.cli import main

    try:
        code = main(["bench", *args, "--json", "/nonexistent-dir/x.json"])
    except SystemExit as exc:  # argparse's own exit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"attention-multi bench: error: {message}" in err, err
    assert "Traceback" not in err and "long case" not in err


def test_bench_and_report_share_the_backend_check(capsys):
    import argparse

    from attention_multi.cli import bench, report

    for command in (bench, report):
        parser = argparse.ArgumentParser(prog=f"attention-multi {command.__name__}")
        command.add_arguments(parser)
        assert parser.parse_args(["--backends", "pytorch,numpy"]).backends == ["torch", "numpy"]
        with pytest.raises(SystemExit) as info:
            parser.parse_args(["--backends", "pytroch"])
        assert info.value.code == 2
    errors = capsys.readouterr().err.splitlines()
    messages = [line.split(": error: ", 1)[1] for line in errors if ": error: " in line]
    assert len(messages) == 2 and messages[0] == messages[1], errors


def test_the_small_calls_table_says_whether_each_target_is_met():
    from attention_multi.cli.bench.small import CASES, _row, small_table

    case = next(iter(CASES))
    missed = _row("numpy", case, "eval", (11.7e-6, 10e-6, 1.17, 100))  # a new user's NumPy
    met = _row("numpy", case, "eval", (10e-6, 10e-6, 1.0, 100))
    header, _, first, second = small_table([missed, met]).splitlines()
    assert header.endswith("| Target | Met |")
    assert first.endswith("| ≤ 1.10x | NO |") and second.endswith("| ≤ 1.10x | yes |")
    assert (missed["met"], met["met"]) == (False, True)  # in the JSON too


def test_mxnet_imported_before_attention_multi_works_in_the_venvs_make_builds(tmp_path):
    """MXNet 1.9.1 needs numpy.bool, gone in numpy 1.24-1.26: make installs a
    .pth hook into each venv with MXNet that restores it before mxnet loads."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("mxnet") is None:
        pytest.skip("MXNet is not installed in this stack")
    hook = REPO / "requirements" / "numpy_bool_for_mxnet.pth"
    makefile = (REPO / "Makefile").read_text()
    assert f"cp requirements/{hook.name}" in makefile and 'grep -q "^mxnet"' in makefile
    shutil.copy(hook, tmp_path)  # as make installs it: a .pth in a site directory
    code = (
        f"import site; site.addsitedir({str(tmp_path)!r})\n"
        "from mxnet import np\n"  # first, as a d2l notebook does
        "import attention_multi as am\n"
        "x = np.ones((1, 2, 4))\n"
        "print(am.DotProductAttention(0.0, backend='mxnet').eval()(x, x, x).shape)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's library
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "(1, 2, 4)" in result.stdout, result.stderr


def test_both_d2l_forms_are_typed_overloads_that_an_ide_shows():
    import inspect
    import typing

    import attention_multi as am

    for cls in (am.MultiHeadAttention, am.AdditiveAttention):
        forms = typing.get_overloads(cls.__init__)
        positional = [
            [
                p.name
                for p in inspect.signature(form).parameters.values()
                if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "self"
            ]
            for form in forms
        ]
        assert positional == [list(cls._SEEDS), list(cls._D2L10)], positional
        for form in forms:  # each names the keywords too, not *args/**kwargs alone
            keywords = inspect.signature(form).parameters
            assert "memory_budget" in keywords and "options" in keywords
