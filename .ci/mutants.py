"""`make mutants`: the proof that the fast suite (`make test`) loses nothing (issue 63).

Each mutant is one planted bug, a text patch (``old`` -> ``new``, exactly once
in its file), applied to a temporary copy of the tree (tracked and untracked
files, no venvs); the legacy stack's venv runs the copy (PYTHONPATH first, so
the copy's package is imported, not the worktree's). For each mutant:

1. the fast suite (``--matrix=fast``, as `make test-legacy` runs it) with
   ``-x``: the first failing test is recorded and the run stops there; the
   mutant's ``hint`` files run first, so a caught mutant costs a minute;
2. only where the fast suite passes: the full matrix (``--matrix=full``) with
   ``-x``. A mutant the full matrix catches and the fast suite misses is a
   proof the tiers lost: the script exits 1.

A mutant whose ``old`` text is no longer in its file (the code moved) is
reported ``stale``, not run. Options: ``--only ID[,ID...]``, ``--list``,
``--full-too`` (run the full matrix on every mutant, for the table's second
column measured rather than implied: the full matrix holds every fast row),
``--quick`` (the hint files only, fast matrix: a first look in minutes; a
mutant they miss is shown ``?``), ``--markdown PATH`` (default
.test-logs/mutants.md). Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-legacy" / "bin" / "python"
REQUIRE = "numpy,torch,jax,mxnet"


class Mutant(NamedTuple):
    id: str
    area: str  # the masking contract, a path, a backend's translation, a module, the port...
    file: str
    old: str
    new: str
    what: str
    hint: tuple[str, ...] = ()  # test files likely to catch it: run first


M = Mutant
MUTANTS = [
    # -- the masking contract (core/mask, core/numerics)
    M(
        "fill-zero",
        "mask",
        "attention_multi/core/numerics.py",
        "    d: float(np.finfo(np.dtype(compute_dtype(d))).min)\n",
        "    d: 0.0\n",
        "a masked score becomes 0 instead of the lowest finite value",
        ("tests/test_parity.py",),
    ),
    M(
        "causal-offset",
        "mask",
        "attention_multi/core/mask/build.py",
        "        return num_keys - num_queries, num_keys - num_queries, False",
        "        return num_keys - num_queries + 1, num_keys - num_queries + 1, False",
        "bottom-right causal off by one (query i sees key i + K - Q + 1)",
        ("tests/test_forms.py",),
    ),
    M(
        "empty-rows-kept",
        "mask",
        "attention_multi/core/mask/rules.py",
        "    return out if rows is None else xp.where(rows, out, 0.0)",
        "    return out",
        "rows that see no key are not zeroed",
        ("tests/test_forms.py", "tests/test_numerics.py"),
    ),
    M(
        "nan-guard-dropped",
        "mask",
        "attention_multi/core/mask/rules.py",
        "            out = out + xp.astype(xp.sum(queries * 0.0, -1, keepdims=True), dtype)",
        "            pass",
        "a NaN query row no longer comes back after a fused kernel (the NaN guard dropped)",
        ("tests/test_nan.py",),
    ),
    M(
        "nan-keys-seen",
        "mask",
        "attention_multi/core/mask/rules.py",
        "    if mask.per_query and not keys_finite and not "
        "(mask.top_left_causal and opt(xp).fused_causal):",
        "    if False:",
        "rows that may see a NaN key are not made NaN around a fused kernel",
        ("tests/test_nan.py",),
    ),
    M(
        "lengths-fill-any",
        "mask",
        "attention_multi/core/mask/rules.py",
        "        by_lengths = lens is not None and opt(xp).masks_by_lengths",
        "        by_lengths = lens is not None",
        "every backend takes the lengths operator's branch (MXNet's only)",
        ("tests/test_parity.py", "tests/test_small_calls.py"),
    ),
    # -- the paths
    M(
        "scale-off",
        "paths",
        "attention_multi/core/numerics.py",
        "    return 1.0 / max(features, 1) ** 0.5",
        "    return 1.0 / max(features, 1)",
        "the default scale 1/d instead of 1/sqrt(d)",
        ("tests/test_parity.py",),
    ),
    M(
        "chunk-skip-last",
        "paths",
        "attention_multi/core/paths/chunked.py",
        "        for k0 in range(start, stop, block_k):\n            r = Region(",
        "        for k0 in range(start, stop - block_k, block_k):\n            r = Region(",
        "the chunked path skips the last block of keys",
        ("tests/test_paths.py",),
    ),
    M(
        "chunk-skip-seen",
        "paths",
        "attention_multi/core/paths/chunked.py",
        "            if seen != EMPTY:\n                blocks.append((r, seen))",
        "            if seen != EMPTY and k0 != start:\n                blocks.append((r, seen))",
        "the chunked path skips the first block of keys (a block it must compute)",
        ("tests/test_paths.py",),
    ),
    M(
        "tiled-blocks",
        "paths",
        "attention_multi/core/paths/tiled.py",
        "    blocks = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q, block_q)]",
        "    blocks = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q - 1, block_q)]",
        "the tiled path drops the last query (of a block of one)",
        ("tests/test_paths.py",),
    ),
    M(
        "mask-by-adding",
        "mask",
        "attention_multi/core/mask/rules.py",
        "        elif hidden_finite and opt(xp).masks_by_adding and",
        "        elif opt(xp).masks_by_adding and",
        "a backend that masks by adding does so where a hidden score may be NaN (NaN + fill "
        "is NaN)",
        ("tests/test_nan.py",),
    ),
    # -- the backends' translations
    M(
        "torch-fused-causal",
        "torch",
        "attention_multi/backends/torch.py",
        '            options["is_causal"] = True',
        '            options["is_causal"] = False',
        "torch's SDPA called without is_causal for top-left causal",
        ("tests/test_forms.py",),
    ),
    M(
        "torch-fused-gqa",
        "torch",
        "attention_multi/backends/torch.py",
        '        if queries.shape[1] != keys.shape[1]:\n            options["enable_gqa"] = True',
        "        if queries.shape[1] != keys.shape[1]:\n            return None",
        "torch's SDPA declines grouped-query heads (the fused path never runs for GQA)",
        ("tests/test_forms.py",),
    ),
    M(
        "jax-fused-lens",
        "jax",
        "attention_multi/backends/jax.py",
        "            lens = mask.per_batch_lens\n",
        "            lens = mask.per_batch_lens + 1\n",
        "JAX's fused kernel sees one key too many per batch element",
        ("tests/test_paths.py",),
    ),
    M(
        "jax-softmax-axis",
        "jax",
        "attention_multi/backends/jax.py",
        "        return jax.nn.softmax(x, axis=axis)",
        "        return jax.nn.softmax(x, axis=-1 if axis == -2 else axis)",
        "JAX's softmax ignores axis -2",
        ("tests/test_backends.py",),
    ),
    M(
        "mxnet-nan-rows",
        "mxnet",
        "attention_multi/backends/mxnet.py",
        "        return npx.softmax(x, axis=axis) + 0 * mnp.max(x, axis=axis, keepdims=True)",
        "        return npx.softmax(x, axis=axis)",
        "MXNet's softmax leaves a NaN row's other entries finite",
        ("tests/test_numerics.py", "tests/test_backends.py", "tests/test_nan.py"),
    ),
    M(
        "mxnet-lengths-rows",
        "mxnet",
        "attention_multi/backends/mxnet.py",
        "            lens = mnp.max(lens, axis=1) if lens.ndim == 2 else lens",
        "            lens = mnp.min(lens, axis=1) if lens.ndim == 2 else lens",
        "MXNet's SequenceMask keeps key rows below the shortest length, not the longest",
        ("tests/test_backends.py",),
    ),
    M(
        "numpy-matmul-transpose",
        "numpy",
        "attention_multi/backends/numpy.py",
        "        b = b.swapaxes(-1, -2) if transpose_b else b",
        "        b = b.swapaxes(-1, -2) if transpose_b and b.shape[-1] != b.shape[-2] else b",
        "NumPy's matmul forgets transpose_b for square operands",
        ("tests/test_backends.py",),
    ),
    # -- the modules and their checks
    M(
        "dropout-check",
        "modules",
        "attention_multi/core/checks.py",
        "    if not 0.0 <= rate <= 1.0:  # NaN fails both comparisons",
        "    if not 0.0 <= rate <= 1.5:  # NaN fails both comparisons",
        "a dropout of 1.5 is accepted",
        ("tests/test_constructors.py",),
    ),
    M(
        "edition-swapped",
        "modules",
        "attention_multi/modules/attention.py",
        "    if len(d2l10) < len(args) <= len(seeds):",
        "    if len(d2l10) <= len(args) <= len(seeds):",
        "d2l 1.0's full positional form is read as the seeds' form",
        ("tests/test_editions.py",),
    ),
    M(
        "positional-cos",
        "modules",
        "attention_multi/modules/encoding.py",
        "    P[0, :, 1::2] = np.cos(angles[:, : num_hiddens // 2])",
        "    P[0, :, 1::2] = np.sin(angles[:, : num_hiddens // 2])",
        "the positional encoding's odd features are sin, not cos",
        ("tests/test_parity.py",),
    ),
    M(
        "additive-tanh",
        "modules",
        "attention_multi/modules/attention.py",
        "            features = xp.tanh(rs(qb, (b, qb.shape[1], 1, h)) + k)",
        "            features = rs(qb, (b, qb.shape[1], 1, h)) + k",
        "additive attention without its tanh",
        ("tests/test_parity.py",),
    ),
    M(
        "transpose-output",
        "modules",
        "attention_multi/functional.py",
        "    X = xp.transpose(rs(X, (bh // num_heads, num_heads, n, size)), (0, 2, 1, 3))",
        "    X = xp.transpose(rs(X, (num_heads, bh // num_heads, n, size)), (1, 2, 0, 3))",
        "transpose_output splits the batch and heads axes the wrong way round",
        ("tests/test_parity.py",),
    ),
    # -- the port
    M(
        "port-rnn-gate",
        "port",
        "attention_multi/port/rules.py",
        '        kind = {"i2h": "ih", "h2h": "hh"}[m["gate"]]',
        '        kind = {"i2h": "hh", "h2h": "ih"}[m["gate"]]',
        "the port swaps an RNN's input and hidden weights",
        ("tests/test_port_models.py", "tests/test_port.py"),
    ),
]


def copy_tree(dest: Path) -> None:
    """The worktree's files (tracked and untracked, not ignored) into ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(tree: Path, m: Mutant) -> bool:
    path = tree / m.file
    text = path.read_text() if path.exists() else ""
    if text.count(m.old) != 1:
        return False
    path.write_text(text.replace(m.old, m.new))
    return True


def run_suite(
    tree: Path, matrix: str, hint: tuple[str, ...], quick: bool = False
) -> tuple[bool, str, float]:
    """(caught, the first failing test, seconds): the hint files first, then the suite."""
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        ATTENTION_MULTI_REQUIRE=REQUIRE,
        ATTENTION_MULTI_MATRIX=matrix,
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    started = time.time()
    base = [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rf"]
    base += ["-n", "auto", "--dist", "loadfile", f"--matrix={matrix}"]
    hints = [h for h in hint if (tree / h).exists()]
    rest = ["tests"] + [f"--deselect={h}" for h in hints] if hints else ["tests"]
    for args in ([*hints],) if quick else ([*hints], rest) if hints else (rest,):
        if not args:
            continue
        proc = subprocess.run(
            base + args, cwd=tree, env=env, capture_output=True, text=True, timeout=3600
        )
        if proc.returncode != 0:
            found = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
            name = found[0] if found else f"exit {proc.returncode}: " + proc.stdout[-300:]
            return True, name, time.time() - started
    return False, "", time.time() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--full-too", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--markdown", default=str(ROOT / ".test-logs" / "mutants.md"))
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.id:24s} {m.area:8s} {m.file}: {m.what}")
        return 0
    if not PYTHON.exists():
        sys.exit(f"{PYTHON} is missing: run `make venvs` first")
    rows, lost = [], []
    with tempfile.TemporaryDirectory(prefix="attention-multi-mutants-") as tmp:
        pristine = Path(tmp) / "pristine"
        copy_tree(pristine)
        for m in chosen:
            tree = Path(tmp) / m.id
            shutil.copytree(pristine, tree)
            if not apply(tree, m):
                rows.append((m, "stale", "stale", "the patch's text is not in the file once", 0.0))
                print(f"{m.id}: stale (its text moved)", flush=True)
                shutil.rmtree(tree)
                continue
            fast, test, seconds = run_suite(tree, "fast", m.hint, args.quick)
            full, full_test = fast, test  # (the full matrix holds every fast row)
            implied = True
            if args.quick and not fast:
                rows.append((m, "?", "?", "(not caught by its hint files)", seconds))
                print(f"{m.id}: not caught by its hint files ({seconds:.0f} s)", flush=True)
                shutil.rmtree(tree)
                continue
            if not fast or args.full_too:
                full, full_test, more = run_suite(tree, "full", m.hint)
                implied = False
                seconds += more
                test = test or full_test
            word = lambda b: "yes" if b else "no"  # noqa: E731
            if full and not fast:
                lost.append(m.id)
            shown = "yes (implied)" if implied and full else word(full)
            rows.append((m, word(fast), shown, test or "-", seconds))
            print(
                f"{m.id}: fast {word(fast)}, full {word(full)}, {test} ({seconds:.0f} s)",
                flush=True,
            )
            shutil.rmtree(tree)
    table = [
        "| mutant | area | the bug | fast suite caught? | full matrix caught? "
        "| first failing test |",
        "|---|---|---|---|---|---|",
    ]
    for m, fast, full, test, _ in rows:
        table.append(f"| `{m.id}` | {m.area} | {m.what} | {fast} | {full} | `{test}` |")
    text = "\n".join(table)
    Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
    Path(args.markdown).write_text(text + "\n")
    print("\n" + text)
    print(f"\n{len(rows)} mutants; lost by the fast suite: {', '.join(lost) or 'none'}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
