"""What installing the library puts on a user's path: only ``attention_multi``.

The repository's ``backends/`` folder is the package ``attention_multi.backends``
(through the link ``attention_multi/backends``), so a project with its own
``backends`` package imports both, installed or from the repository."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORTS_TOP_LEVEL_BACKENDS = re.compile(r"^\s*(import|from)\s+backends\b", re.M)


def test_the_library_never_imports_the_top_level_backends():
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "attention_multi").rglob("*.py")
        if IMPORTS_TOP_LEVEL_BACKENDS.search(p.read_text())
    ]
    assert not offenders, f"import attention_multi.backends instead, in {offenders}"


def build_wheel(tmp_path):
    """The wheel of a copy of the sources (a build in the repository would race
    with the other stack's suite)."""
    source = tmp_path / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("attention_multi", "backends"):
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    result = subprocess.run(
        [*pip, "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel


def imports_beside_its_own_backends(project, path):
    """Run, in a project with its own ``backends`` package, an import of both."""
    (project / "backends").mkdir(parents=True)
    (project / "backends" / "__init__.py").write_text("OURS = 'the project'\n")
    code = (
        "import backends, attention_multi as am\n"
        "assert backends.OURS == 'the project', backends.__file__\n"
        "assert 'numpy' in am.available_backends()\n"
        "print(am.DotProductAttention(0.0).eval()(*[__import__('numpy').ones((1, 2, 4))] * 3)"
        ".shape)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        env={"PYTHONPATH": str(path), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_wheel_installs_only_attention_multi_and_works_beside_a_backends_package(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"attention_multi"}, top
    assert "attention_multi/backends/protocol.py" in names
    assert "attention_multi/backends/py.typed" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel: unpacking installs it
    result = imports_beside_its_own_backends(tmp_path / "project", site)
    assert result.returncode == 0 and "(1, 2, 4)" in result.stdout, result.stderr


def test_the_repository_works_beside_a_backends_package(tmp_path):
    result = imports_beside_its_own_backends(tmp_path / "project", REPO)
    assert result.returncode == 0 and "(1, 2, 4)" in result.stdout, result.stderr
