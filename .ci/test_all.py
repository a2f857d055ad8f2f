"""`make test`: the suite on the legacy and the modern stack and `make check`,
all three at once, each building its venv first if it is not built (2 cores:
each suite is mostly one busy process), each into .test-logs/NAME.log; a
progress line every 30 s; at the end pytest's own closing lines, the failures
in full, and a one-screen summary. Exit status 1 if any of the three failed.
Standard library only."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / ".test-logs"
JOBS = {"legacy": "test-legacy", "modern": "test-modern", "check": "check"}
EVERY = 30  # seconds between progress lines
COUNTS = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")


def progress(name, log):
    text = log.read_text(errors="replace") if log.exists() else ""
    if "[venv " in text and "] ready in " not in text:
        return "installing its venv"
    if name == "check":
        return f"{text.count('-- ')}/4 gates"
    found = re.findall(r"\[\s*(\d+)%\]", text)
    return f"{found[-1]}%" if found else "collecting"


def closing_line(text):
    """pytest's last line ('N passed, M skipped ... in 12.3s'), or ''."""
    lines = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|error|no tests)", ln)]
    return lines[-1].strip("= ") if lines else ""


def counts(line):
    found = dict.fromkeys(COUNTS, 0)
    for number, word in re.findall(r"(\d+) (\w+)", line):
        word = "errors" if word == "error" else word
        if word in found:
            found[word] = int(number)
    return found


def main():
    LOGS.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.time()
    procs, ended = {}, {}
    for name, target in JOBS.items():
        log = (LOGS / f"{name}.log").open("w")
        procs[name] = subprocess.Popen(
            ["make", "--no-print-directory", target],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    print(f"running {', '.join(JOBS)} at once; logs in {LOGS.relative_to(ROOT)}/", flush=True)
    last = time.time()
    while len(ended) < len(procs):
        time.sleep(1)
        for name, proc in procs.items():
            if name not in ended and proc.poll() is not None:
                ended[name] = (proc.returncode, time.time() - started)
                word = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                print(f"[{elapsed(started)}] {name} done: {word}", flush=True)
        if time.time() - last >= EVERY and len(ended) < len(procs):
            last = time.time()
            state = [f"{n} {progress(n, LOGS / f'{n}.log')}" for n in procs if n not in ended]
            print(f"[{elapsed(started)}] " + " · ".join(state), flush=True)

    rows, total = [], dict.fromkeys(COUNTS, 0)
    for name in JOBS:
        text = (LOGS / f"{name}.log").read_text(errors="replace")
        code, seconds = ended[name]
        if code != 0:  # the failures in full (pytest's own report), then the closing lines
            print(f"\n======== {name}: FAILED (exit {code}); its log ========")
            print(failures(text))
        if name == "check":
            gates = re.findall(r"^-- (.+): (ok|FAILED)$", text, re.M)
            rows.append((name, code, seconds, ", ".join(f"{g} {r}" for g, r in gates)))
            continue
        line = closing_line(text)
        print(f"\n{name} (pytest's closing line):")  # unprefixed, as pytest wrote it
        print(line or "no closing line from pytest (see its log)")
        found = counts(line)
        for key in COUNTS:
            total[key] += found[key]
        shown = ", ".join(f"{found[k]} {k}" for k in COUNTS if found[k] or k in COUNTS[:4])
        rows.append((name, code, seconds, shown))

    for name in JOBS:  # pytest's --durations table, the first lines of each
        if name != "check":
            print(f"\n{name}: slowest tests (pytest --durations)")
            print(slowest((LOGS / f"{name}.log").read_text(errors="replace")))

    matrix = os.environ.get("ATTENTION_MULTI_MATRIX", "fast")
    took = f"{elapsed(started)} for the suites and checks"
    print(f"\n==== make test summary, {matrix} matrix ({took}) ====")
    for name, code, seconds, shown in rows:
        word = "ok    " if code == 0 else "FAILED"
        print(f"{name:7s} {word} {fmt(seconds):>7s}  {shown}")
    failed = [name for name, code, _, _ in rows if code != 0]
    print(f"logs: {LOGS.relative_to(ROOT)}/{{{','.join(JOBS)}}}.log")
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if failed else 0


def slowest(text, limit=10):
    """The first ``limit`` rows of pytest's slowest-durations table, or a note."""
    lines = text.splitlines()
    start = next(
        (i for i, ln in enumerate(lines) if re.match(r"^=+ slowest .*durations", ln)), None
    )
    if start is None:
        return "  (no durations table in the log)"
    rows = [ln for ln in lines[start + 1 :] if re.match(r"^[\d.]+s ", ln)][:limit]
    return "\n".join(f"  {ln}" for ln in rows)


def failures(text, limit=600):
    """From pytest's FAILURES/ERRORS section on (or the log's end), at most ``limit`` lines."""
    lines = text.splitlines()
    start = next(
        (i for i, ln in enumerate(lines) if re.match(r"^=+ (FAILURES|ERRORS) =+$", ln)),
        max(0, len(lines) - 80),
    )
    shown = lines[start:]
    if len(shown) > limit:
        shown = shown[: limit // 2] + ["... (cut; the whole log is kept)"] + shown[-limit // 2 :]
    return "\n".join(shown)


def elapsed(started):
    return fmt(time.time() - started)


def fmt(seconds):
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


if __name__ == "__main__":
    sys.exit(main())
