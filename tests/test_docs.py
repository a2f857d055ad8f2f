"""Every code block of README.md and of every page under docs/ (the
documentation site's guide and reference) runs, in order, as one script per
document.

``python`` blocks run as they are, ``sh`` blocks through the shell (``python``
is this interpreter); ``bash``, ``text`` and ``console`` blocks are shown, not
run. A block right after ``<!-- requires: mxnet -->`` runs only where mxnet
imports. The working directory is a temporary folder with ``tests`` linked to
the repository's, so the snippets' fixture paths resolve and the files they
write land there.

The reference pages are ``::: module`` directives that mkdocstrings fills in
(``make docs``); here every public module is checked to have one.
"""

import importlib
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from attention_multi.backends import available_backends

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PORTING = DOCS / "porting.md"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCK = re.compile(r"(<!-- requires: (\w+) -->\n)?```(python|sh)\n(.*?)```", re.S)
FENCE = re.compile(r"^```(\S*)", re.M)
SHOWN = {"bash", "text", "console"}  # fences that are shown, not run
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_doc(doc, tmp_path, select=None, prelude="", epilogue="", env_extra=()):
    """Run the document's blocks (those ``select(code)`` keeps) between ``prelude``
    and ``epilogue`` as one script in ``tmp_path``, with ``env_extra`` set; its stdout."""
    parts = [PROLOGUE, "import matplotlib\nmatplotlib.use('Agg')\n", prelude]
    for requirement, lang, code in blocks(doc):
        if not has(requirement) or (select is not None and not select(code)):
            continue
        if lang == "sh":
            code = f"import subprocess\nsubprocess.run({code!r}, shell=True, check=True)\n"
        parts.append(code)
    parts.append(epilogue)
    script = tmp_path / f"{doc.stem}_doc.py"
    script.write_text("\n".join(parts))
    (tmp_path / "tests").symlink_to(REPO / "tests", target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MASTER_PORT"] = str(free_port())  # the DDP recipes' default port may be taken
    env.update(env_extra)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.second_stack
def test_readme_snippets_run(tmp_path):
    out = run_doc(README, tmp_path)  # the tour: every framework, a mask function, a model
    assert out.count("[[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]]") >= 3
    assert "(1, 4, 64, 8)" in out and "attention.W_q.weight" in out


@pytest.mark.slow
def test_porting_doc_snippets_run(tmp_path):
    stdout = run_doc(PORTING, tmp_path)
    errors = [float(line) for line in stdout.splitlines() if re.fullmatch(r"[0-9.e+-]+", line)]
    assert len(errors) == 3 and max(errors) < 2e-5, stdout
    assert "mapped 64 arrays onto EncoderDecoder" in stdout
    # the user's test ran once per installed backend, through the pytest plugin
    assert re.search(rf"^{len(available_backends())} passed", stdout, re.M), stdout
    for name in ("transformer.pt", "mha.pt", "from_torch.params", "test_my_port.py"):
        assert (tmp_path / name).exists(), name
    if has("mxnet"):
        assert (tmp_path / "mha.params").exists()
        assert (tmp_path / "my_transformer.params").exists()


# The multi-device recipes (JAX NamedSharding and ring attention under shard_map)
# on 2 and 4 simulated host devices: every parameter must be on the mesh, and the
# sharded gradient equals the one-device one.
SCALING = DOCS / "guide" / "scaling.md"
ON_DEVICES = """
import numpy
weights = (jmha.W_q, jmha.W_k, jmha.W_v, jmha.W_o)
assert len(jax.devices()) == DEVICES, jax.devices()
assert all(len(w.weight.sharding.device_set) == DEVICES for w in weights)
first = jax.devices()[0]  # the same module and batch on one device
one = jax.grad(lambda m, x: apply(m, x, jnp.array([3, 5, 2, 4])).sum())(
    jax.device_put(jmha, first), jax.device_put(numpy.ones((4, 5, 8), "float32"), first))
pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(one))
pairs = [(numpy.asarray(a), numpy.asarray(b)) for a, b in pairs]
scale = max(float(abs(b).max()) for _, b in pairs)
err = max(float(abs(a - b).max()) for a, b in pairs) / scale
print("gradient error", err)
assert err < 1e-6, err  # relative to the largest gradient, float32
"""


def jax_only(code):
    return "jax" in code and "torch" not in code and "dist." not in code


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_jax_multi_device_recipes(devices, tmp_path):
    pytest.importorskip("jax")
    out = run_doc(
        SCALING,
        tmp_path,
        select=jax_only,
        prelude="import attention_multi as am\n",
        epilogue=ON_DEVICES.replace("DEVICES", str(devices)),
        env_extra={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
    )
    assert "False" not in out and out.count("True") == 2, out  # jax.export, ring
    assert "gradient error" in out


# ---- every page of the documentation site ----


def page_id(path):
    return str(path.relative_to(DOCS))


@pytest.mark.parametrize(
    "doc", [README] + PAGES, ids=lambda p: p.name if p == README else page_id(p)
)
def test_every_fence_is_run_or_shown(doc):
    """No block is silently left out: each fence is python/sh (found by the
    harness) or a shown-only language, and every opening fence is found."""
    text = doc.read_text()
    openings = FENCE.findall(text)[::2]  # fences alternate: opening, closing
    assert len(FENCE.findall(text)) % 2 == 0, f"{doc}: unbalanced fences"
    unknown = [lang for lang in openings if lang not in SHOWN | {"python", "sh"}]
    assert not unknown, (
        f"{doc}: fences of unknown language {unknown} (run: python, sh; shown: {sorted(SHOWN)})"
    )
    runnable = sum(1 for lang in openings if lang in ("python", "sh"))
    assert runnable == len(blocks(doc)), f"{doc}: a python/sh block is not found by BLOCK"
    for requirement, _, _ in blocks(doc):
        # (onnxscript: the onnx extra, required on the modern stack and tested
        # there by tests/test_export.py, which says why it skips elsewhere;
        # transformers and flax likewise, by tests/test_integrations_*.py;
        # tensorflow by tests/test_tensorflow.py)
        allowed = ("mxnet", "torch", "jax", "onnxscript", "transformers", "flax", "tensorflow")
        assert requirement in (None, *allowed), requirement


# porting.md and the README have their own tests, with their outputs checked.
RUNNABLE = [p for p in PAGES if p != PORTING and blocks(p)]


def _second_stack(doc):
    """A page with a block only the second stack runs (ONNX) runs there too (issue 63)."""
    if "<!-- requires: onnxscript -->" in doc.read_text():
        return pytest.param(doc, marks=pytest.mark.second_stack)
    return doc


@pytest.mark.slow
@pytest.mark.parametrize("doc", [_second_stack(d) for d in RUNNABLE], ids=page_id)
def test_docs_page_snippets_run(doc, tmp_path):
    run_doc(doc, tmp_path)


def test_guide_pages_have_examples():
    guide = {p.stem for p in RUNNABLE if p.parent.name == "guide"}
    assert {"quickstart", "backends", "masks", "performance", "errors"} <= guide, guide


def documented_modules():
    found = set()
    for page in (DOCS / "reference").glob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M))
    return found


def test_every_public_module_has_a_reference_page():
    """Every module and package of attention_multi (cli/: the tools, documented
    in the guide) and backends' package and protocol are rendered."""
    package = REPO / "attention_multi"
    public = {
        "attention_multi",
        "attention_multi.backends.protocol",
        "attention_multi.backends.types",
    }
    public |= {
        f"attention_multi.{p.stem}" for p in package.glob("*.py") if not p.name.startswith("_")
    }
    public |= {
        f"attention_multi.{p.name}"
        for p in package.iterdir()
        if (p / "__init__.py").exists() and p.name != "cli"
    }
    documented = documented_modules()
    assert public <= documented, f"no reference page for {sorted(public - documented)}"
    for name in documented:  # every directive names a real module, or an object in one
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("attention_multi"):
                # (a module of ours whose framework this stack lacks: it exists)
                assert importlib.util.find_spec(name) is not None, name
                continue
            parent, _, attr = name.rpartition(".")
            getattr(importlib.import_module(parent), attr)


def test_every_public_name_is_on_the_package_page():
    import attention_multi

    assert set(attention_multi.__all__) <= set(dir(attention_multi))
    page = (DOCS / "reference" / "attention_multi.md").read_text()
    assert re.search(r"^::: attention_multi\s*$", page, re.M)


def test_reference_lists_every_constructor_argument():
    """The modules page shows each module's constructor (mkdocstrings merges
    __init__ into the class, no private bases) and its table names every
    argument: the signature's, both d2l editions', and ModuleOptions'."""
    import inspect
    import typing

    import attention_multi.modules as modules
    from attention_multi.types import ModuleOptions

    options = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^\s+merge_init_into_class: true$", options, re.M)
    assert re.search(r"^\s+show_bases: false$", options, re.M)
    page = (DOCS / "reference" / "modules.md").read_text()
    assert re.search(r"^::: attention_multi\.modules\.attention\.bind_editions$", page, re.M)
    for key in typing.get_type_hints(ModuleOptions):
        assert f"`{key}=`" in page, key
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", page, re.M))
    for name in modules.__all__:
        cls = getattr(modules, name)
        if not inspect.isclass(cls) or cls is modules.Module:
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        names |= set(getattr(cls, "_SEEDS", ())) | set(getattr(cls, "_D2L10", ()))
        names.discard("self")
        assert name in rows, f"no row for {name}"
        missing = [n for n in names if not re.search(rf"`[^`]*\b{n}\b", rows[name])]
        assert not missing, f"{name}: {missing} not on the reference page"


def test_the_home_page_the_nav_and_the_readme_list_every_guide_page():
    nav = (REPO / "mkdocs.yml").read_text()
    index = (DOCS / "index.md").read_text()
    readme = README.read_text()
    for page in sorted((DOCS / "guide").glob("*.md")):
        assert f"guide/{page.name}" in nav, page.name
        assert f"(guide/{page.name}" in index, page.name
        assert f"(docs/guide/{page.name}" in readme, page.name


def test_the_readmes_links_resolve():
    """Every relative link of the README names a file, and a heading of it."""

    def slug(heading):
        return re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-")

    links = re.findall(r"\]\(((?!https?:)[^)#\s]+)(?:#([^)\s]+))?\)", README.read_text())
    assert len(links) >= 10, links
    for target, anchor in links:
        path = REPO / target
        assert path.exists(), target
        if anchor:
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in headings, (target, anchor, sorted(headings))
