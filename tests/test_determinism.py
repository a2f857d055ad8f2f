"""The machine's load changes how fast a call runs, never its answer: the same
three calls (a block-table mask, padding by lengths, packed documents with
causal; path "auto") in 20 fresh processes, half of them beside a CPU-bound
process, give bit-identical outputs on every CPU backend installed. The
processes get the user's environment: no ``ATTENTION_MULTI_CALL_COST`` (the
suite's conftest sets it; a user's shell does not). The first stack only:
the choices it proves load-free are the core's, the same code on both."""

import json
import os
import subprocess
import sys
from pathlib import Path

import attention_multi as am

CHILD = Path(__file__).with_name("determinism_child.py")
RUNS = 20


def _required():
    return {
        n.strip() for n in os.environ.get("ATTENTION_MULTI_REQUIRE", "").split(",") if n.strip()
    }


def _spin():
    """A CPU-bound process (ended by the caller)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_the_same_call_gives_the_same_bits_in_every_process_idle_or_busy():
    names = [n for n in am.available_backends() if n in ("numpy", "torch", "jax", "mxnet")]
    assert _required() <= set(names) | {"transformers", "flax", "tensorflow"}, names
    env = {k: v for k, v in os.environ.items() if k != "ATTENTION_MULTI_CALL_COST"}
    env.pop("ATTENTION_MULTI_BACKEND", None)
    seen: dict[str, set[str]] = {}
    for run in range(RUNS):
        spinner = _spin() if run % 2 else None  # (half of them beside a busy process)
        try:
            done = subprocess.run(
                [sys.executable, str(CHILD), *names],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        assert done.returncode == 0, done.stderr[-3000:]
        for case, digest in json.loads(done.stdout).items():
            seen.setdefault(case, set()).add(digest)
    assert len(seen) == 3 * len(names), sorted(seen)
    differ = {case: len(d) for case, d in seen.items() if len(d) > 1}
    assert not differ, f"outputs that differ between processes: {differ}"
