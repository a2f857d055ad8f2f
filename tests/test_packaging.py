"""What installing the library puts on a user's path: only ``attention_multi``.

The backends are the subpackage ``attention_multi.backends`` (a folder of the
package, no link), which imports nothing of the rest of the library; a project
with its own ``backends`` package imports both, installed or from the repository."""

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


def test_backends_is_a_real_subpackage_that_imports_nothing_above_it():
    folder = REPO / "attention_multi" / "backends"
    assert folder.is_dir() and not folder.is_symlink()
    assert not (REPO / "backends").exists()
    above = re.compile(r"^\s*(from\s+(attention_multi\b|\.\.)|import\s+attention_multi\b)", re.M)
    offenders = [p.name for p in folder.rglob("*.py") if above.search(p.read_text())]
    assert not offenders, f"backends/ imports the rest of attention_multi in {offenders}"


def build_wheel(tmp_path):
    """The wheel of a copy of the sources (a build in the repository would race
    with the other stack's suite)."""
    source = tmp_path / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "attention_multi", source / "attention_multi", ignore=ignore)
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
    assert "attention_multi/py.typed" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel: unpacking installs it
    result = imports_beside_its_own_backends(tmp_path / "project", site)
    assert result.returncode == 0 and "(1, 2, 4)" in result.stdout, result.stderr


def test_the_repository_works_beside_a_backends_package(tmp_path):
    result = imports_beside_its_own_backends(tmp_path / "project", REPO)
    assert result.returncode == 0 and "(1, 2, 4)" in result.stdout, result.stderr
