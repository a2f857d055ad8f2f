"""Expected differences, as data: ``expected/<impl>.txt``, one per implementation
(the array-api-compat ``xfails`` pattern). One entry a line::

    lens-1d/empty-row/*                         # an empty row: the mean of the values
    window/(1,0)/*  when jax <= 0.6.2           # local_window_size alone is ignored

a case-id ``fnmatch`` pattern, optionally ``when`` and a condition on an
installed package's version, and the reason after ``#``. Lines with only a
comment are comments.

A listed case that differs counts as agreeing ("expected difference"); one
that agrees is reported as "unexpectedly agrees" (the bug is fixed: remove
the line), which fails the run like a new difference.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
from pathlib import Path

DIRECTORY = Path(__file__).parent / "expected"
_WHEN = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(<=|>=|==|!=|<|>)\s*([0-9][0-9.]*)\s*$")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def holds(when: str | None) -> bool:
    """Whether ``"package OP version"`` holds here (False when not installed)."""
    if not when:
        return True
    match = _WHEN.match(when)
    if match is None:
        raise ValueError(f"bad condition {when!r}: expected 'package OP version'")
    package, op, wanted = match.groups()
    try:
        have = _version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return False
    want = _version(wanted)
    return {
        "<": have < want,
        "<=": have <= want,
        ">": have > want,
        ">=": have >= want,
        "==": have == want,
        "!=": have != want,
    }[op]


def parse(text: str, where: str = "") -> list[tuple[str, str]]:
    """[(pattern, reason)] of the lines whose condition holds here."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        body, _, reason = line.partition("#")
        body = body.strip()
        if not body:
            continue
        body, sep, when = (x.strip() for x in body.partition(" when "))
        if not body or len(body.split()) != 1 or (sep and not when):
            raise ValueError(f"{where}:{number}: expected 'pattern [when condition]  # reason'")
        if not reason.strip():
            raise ValueError(f"{where}:{number}: {body}: no reason after '#'")
        try:
            if holds(when):
                entries.append((body, reason.strip()))
        except ValueError as exc:
            raise ValueError(f"{where}:{number}: {exc}") from None
    return entries


def load(name: str, path: Path | None = None) -> list[tuple[str, str]]:
    """[(pattern, reason)] of the entries for ``name`` that hold here."""
    path = DIRECTORY / f"{name}.txt" if path is None else path
    if not path.exists():
        return []
    return parse(path.read_text(encoding="utf-8"), str(path))


def reason_for(case_id: str, entries: list[tuple[str, str]]) -> str | None:
    """The reason a case is expected to differ, or None."""
    for pattern, reason in entries:
        if fnmatch.fnmatchcase(case_id, pattern):
            return reason
    return None
