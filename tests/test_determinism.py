"""The machine's load changes how fast a call runs, never its answer: the same
three calls (a block-table mask, padding by lengths, packed documents with
causal; path "auto") in 12 fresh processes give bit-identical outputs on
every CPU backend installed: 4 alone, and 8 run two at a time, each beside
the other (a CPU-bound process doing the same work, not a spinner). The
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
ROUNDS = (1, 2) * 4  # children at once: one alone, then two beside each other


def _required():
    return {
        n.strip() for n in os.environ.get("ATTENTION_MULTI_REQUIRE", "").split(",") if n.strip()
    }


def _children(count, names, env):
    """``count`` children at once: their JSON outputs (each beside the others)."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), *names],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        outputs.append(json.loads(out))
    return outputs


def test_the_same_call_gives_the_same_bits_in_every_process_idle_or_busy():
    names = [n for n in am.available_backends() if n in ("numpy", "torch", "jax", "mxnet")]
    assert _required() <= set(names) | {"transformers", "flax", "tensorflow"}, names
    env = {k: v for k, v in os.environ.items() if k != "ATTENTION_MULTI_CALL_COST"}
    env.pop("ATTENTION_MULTI_BACKEND", None)
    seen: dict[str, set[str]] = {}
    for count in ROUNDS:
        for output in _children(count, names, env):
            for case, digest in output.items():
                seen.setdefault(case, set()).add(digest)
    assert len(seen) == 3 * len(names), sorted(seen)
    differ = {case: len(d) for case, d in seen.items() if len(d) > 1}
    assert not differ, f"outputs that differ between processes: {differ}"
