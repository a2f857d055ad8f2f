"""Every code block of README.md and docs/porting.md runs, in order, as one
script per document.

``python`` blocks run as they are, ``sh`` blocks through the shell (``python``
is this interpreter). A block right after ``<!-- requires: mxnet -->`` runs
only where mxnet imports. The working directory is a temporary folder with
``tests`` linked to the repository's, so the snippets' fixture paths resolve
and the files they write land there.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from backends import available_backends

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PORTING = REPO / "docs" / "porting.md"
BLOCK = re.compile(r"(<!-- requires: (\w+) -->\n)?```(python|sh)\n(.*?)```", re.S)
PROLOGUE = """\
import warnings
import numpy
with warnings.catch_warnings():  # mxnet 1.9 needs numpy.bool, gone in numpy 1.24
    warnings.simplefilter("ignore")
    if not hasattr(numpy, "bool"):
        numpy.bool = bool
del warnings, numpy
"""


def blocks(doc):
    """(requirement or None, language, code) for each fenced block."""
    return [(m.group(2), m.group(3), m.group(4)) for m in BLOCK.finditer(doc.read_text())]


def has(requirement):
    return requirement is None or importlib.util.find_spec(requirement) is not None


def test_porting_doc_blocks_are_found():
    found = blocks(PORTING)
    assert sum(1 for req, lang, _ in found if req is None and lang == "python") >= 4
    assert any(lang == "sh" and "attention_multi port" in code for _, lang, code in found)
    assert {req for req, _, _ in found} == {None, "mxnet"}
    # every fence is one the harness knows (no block silently left out)
    assert PORTING.read_text().count("```") == 2 * len(found)


def run_doc(doc, tmp_path):
    """Run the document's blocks as one script in ``tmp_path``; its stdout."""
    parts = [PROLOGUE, "import matplotlib\nmatplotlib.use('Agg')\n"]
    for requirement, lang, code in blocks(doc):
        if not has(requirement):
            continue
        if lang == "sh":
            code = f"import subprocess\nsubprocess.run({code!r}, shell=True, check=True)\n"
        parts.append(code)
    script = tmp_path / "porting_doc.py"
    script.write_text("\n".join(parts))
    (tmp_path / "tests").symlink_to(REPO / "tests", target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_readme_snippets_run(tmp_path):
    out = run_doc(README, tmp_path)
    assert out.count("[[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]]") >= 3


def test_porting_doc_snippets_run(tmp_path):
    stdout = run_doc(PORTING, tmp_path)
    errors = [float(line) for line in stdout.splitlines()
              if re.fullmatch(r"[0-9.e+-]+", line)]
    assert len(errors) == 3 and max(errors) < 2e-5, stdout
    assert "mapped 64 arrays onto EncoderDecoder" in stdout
    # the user's test ran once per installed backend, through the pytest plugin
    assert re.search(rf"^{len(available_backends())} passed", stdout, re.M), stdout
    for name in ("transformer.pt", "mha.pt", "from_torch.params", "test_my_port.py"):
        assert (tmp_path / name).exists(), name
    if has("mxnet"):
        assert (tmp_path / "mha.params").exists()
        assert (tmp_path / "my_transformer.params").exists()
