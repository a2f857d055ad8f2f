"""Every ```python block in the README runs as written."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"]


def blocks():
    for doc in DOCS:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)):
            yield pytest.param(code, id=f"{doc.name}-{i}")


@pytest.mark.parametrize("code", blocks())
def test_python_block_runs(code, monkeypatch, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<readme>", "exec"), {"__name__": "__readme__"})
