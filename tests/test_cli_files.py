"""The commands never lose a file and never end in a traceback.

Every file that ``port``, ``report`` and ``bench --json`` write goes through
``attention_multi.files.atomic_write``. A command with a fault runs in a subprocess;
``tests/faults.py`` injects a full disk (ENOSPC) or a hang part-way through a
write, which the tests then kill (SIGKILL) or interrupt (SIGINT). The other
commands run in the test's process (tests/cli_runner.py): the same parser,
exit codes and messages, without a fresh interpreter's imports.
"""

import contextlib
import errno
import json
import os
import pickle
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attention_multi as am
from attention_multi.files import WriteError, atomic_write, check_writable, make_directory
from attention_multi.port import load_mxnet_params
from tests.cli_runner import run_in_process

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "mxnet"
FAULTS = REPO / "tests" / "faults.py"
OLD = b"the user's previous file\n"
TEMP = re.compile(r"\.(.+)\.[0-9a-f]{8}\.tmp")
FAST_BENCH = [
    "bench",
    "--backends",
    "numpy",
    "--shapes",
    "small",
    "--seconds",
    "0.05",
    "--long-length",
    "0",
]
FAST_REPORT = ["report", "--backends", "numpy", "--devices", "cpu"]


def environment():
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    for name in ("ATTENTION_MULTI_BACKEND", "ATTENTION_MULTI_DEVICE"):
        env.pop(name, None)
    return env


def run(*args, fault=None, cwd=REPO, process=False):
    """``attention-multi ARGS``: in this process (tests/cli_runner.py), or in a
    subprocess of its own with ``process=True`` or through tests/faults.py
    with ``fault=(kind, writer)``."""
    if fault is None and not process:
        return run_in_process(*args, cwd=cwd)
    prefix = [str(FAULTS), *fault] if fault else ["-m", "attention_multi"]
    return subprocess.run(
        [sys.executable, *prefix, *map(str, args)],
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=1200,
    )


def assert_one_line_error(result, command, code, message):
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("attention-multi")]
    assert lines == [f"attention-multi {command}: error: {message}"], result.stderr


def entries(directory):
    return sorted(p.name for p in Path(directory).iterdir())


def port_input(tmp_path, name="m.params"):
    path = tmp_path / name
    path.write_bytes((FIXTURES / "mha_bias.params").read_bytes())
    return path


def load_output(path, to):
    if to == "numpy":
        with np.load(path) as z:
            return dict(z)
    import torch

    return {k: v.numpy() for k, v in torch.load(path).items()}


# -- port: never over its input, never over an existing OUT without --force ---------


@pytest.mark.parametrize("to", ["numpy", "torch"])
@pytest.mark.parametrize(
    "how", ["same", "dot-slash", "symlink-out", "symlink-in", "default-out", "hard-link"]
)
def test_port_refuses_to_write_over_its_input(tmp_path, to, how):
    src = port_input(
        tmp_path,
        "m.pt"
        if how == "default-out" and to == "torch"
        else "m.npz"
        if how == "default-out"
        else "m.params",
    )
    original = src.read_bytes()
    args = {
        "same": (src.name, "--out", src.name),
        "dot-slash": (src.name, "--out", f"./{src.name}"),
        "symlink-out": (src.name, "--out", "link"),
        "symlink-in": ("link", "--out", src.name),
        "default-out": (src.name,),
        "hard-link": (src.name, "--out", "hard"),
    }[how]
    if how.startswith("symlink"):
        (tmp_path / "link").symlink_to(src.name)
    if how == "hard-link":
        os.link(src, tmp_path / "hard")
    before = entries(tmp_path)
    result = run("port", *args, "--to", to, "--force", cwd=tmp_path)
    named = f"--out {args[2]}" if len(args) == 3 else f"the default OUT {src.name}"
    assert_one_line_error(
        result,
        "port",
        1,
        f"{named} is the input file; choose another "
        "name with --out (--force does not override this)",
    )
    assert src.read_bytes() == original and entries(tmp_path) == before


@pytest.mark.parametrize("to,suffix", [("numpy", ".npz"), ("torch", ".pt")])
def test_port_replaces_an_existing_out_only_with_force(tmp_path, to, suffix):
    src = port_input(tmp_path)
    out = tmp_path / f"existing{suffix}"
    out.write_bytes(OLD)
    out.chmod(0o600)
    result = run("port", src, "--to", to, "--out", out)
    assert_one_line_error(
        result, "port", 1, f"{out} exists; add --force to replace it, or choose another --out"
    )
    assert out.read_bytes() == OLD

    result = run("port", src, "--to", to, "--out", out, "--force")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {out}: 8 arrays (float32)\n"
    want, got = load_mxnet_params(src), load_output(out, to)
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # the replaced file's mode
    assert entries(tmp_path) == ["existing" + suffix, "m.params"]


@pytest.mark.parametrize(
    "to,out,reason",
    [
        (
            "torch",
            "/nonexistent-attention-multi/dir/x.pt",
            "directory /nonexistent-attention-multi/dir does not exist",
        ),
        (
            "numpy",
            "/nonexistent-attention-multi/dir/x.npz",
            "directory /nonexistent-attention-multi/dir does not exist",
        ),
        ("numpy", "{tmp}/afile/x.npz", "{tmp}/afile is not a directory"),
        ("numpy", "/proc/attention-multi-x.npz", "No such file or directory"),
        ("numpy", "{tmp}/adir", "Is a directory"),
    ],
)
def test_port_unwritable_out_is_one_line_exit_1(tmp_path, to, out, reason):
    (tmp_path / "afile").write_bytes(OLD)
    (tmp_path / "adir").mkdir()
    out, reason = out.format(tmp=tmp_path), reason.format(tmp=tmp_path)
    result = run("port", FIXTURES / "mha_bias.params", "--to", to, "--out", out, "--force")
    assert_one_line_error(result, "port", 1, f"cannot write {out}: {reason}")
    assert entries(tmp_path) == ["adir", "afile"] and entries(tmp_path / "adir") == []


def test_port_permission_denied_is_one_line_exit_1():
    # sysfs refuses new files, to root too (a chmod'ed directory would not stop root)
    result = run(
        "port", FIXTURES / "mha_bias.params", "--to", "numpy", "--out", "/sys/attention-multi-x.npz"
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert re.fullmatch(
        r"attention-multi port: error: cannot write /sys/attention-multi-x"
        r"\.npz: (Permission denied|Operation not permitted|Read-only file "
        r"system)\n",
        result.stderr,
    ), result.stderr


def test_port_help_mentions_force():
    result = run("port", "--help", process=True)  # (the entry point itself)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--force replace OUT if it exists" in text
    assert "OUT exists and --force is not given" in text


# -- a full disk and an interrupted write leave the previous file ---------------------


@pytest.mark.parametrize("to,writer", [("numpy", "npz"), ("torch", "torch"), ("numpy", "fsync")])
def test_port_full_disk_keeps_the_previous_file(tmp_path, to, writer):
    src = port_input(tmp_path)
    out = tmp_path / "out.bin"
    out.write_bytes(OLD)
    result = run("port", src, "--to", to, "--out", out, "--force", fault=("enospc", writer))
    assert_one_line_error(result, "port", 1, f"cannot write {out}: No space left on device")
    assert out.read_bytes() == OLD
    assert entries(tmp_path) == ["m.params", "out.bin"]  # the temporary file is gone


def start_hanging(tmp_path, writer, *args):
    """A subprocess that hangs part-way through a write (tests/faults.py)."""
    proc = subprocess.Popen(
        [sys.executable, str(FAULTS), "hang", writer, *map(str, args)],
        cwd=tmp_path,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.strip() == "FAULT: writing":
            return proc
    proc.kill()
    raise AssertionError("never reached the write: " + proc.communicate()[1])


@pytest.mark.parametrize("to,writer", [("numpy", "npz"), ("torch", "torch"), ("torch", "fsync")])
def test_port_killed_mid_write_keeps_the_previous_file(tmp_path, to, writer):
    src = port_input(tmp_path)
    (tmp_path / "out.bin").write_bytes(OLD)
    proc = start_hanging(
        tmp_path, writer, "port", src.name, "--to", to, "--out", "out.bin", "--force"
    )
    proc.kill()  # SIGKILL: no clean-up runs
    proc.communicate(timeout=60)
    assert (tmp_path / "out.bin").read_bytes() == OLD
    # what SIGKILL leaves is hidden and named .out.bin.XXXXXXXX.tmp: never the output
    leftovers = [n for n in entries(tmp_path) if n not in ("m.params", "out.bin")]
    assert len(leftovers) == 1 and TEMP.fullmatch(leftovers[0]).group(1) == "out.bin"
    if writer != "npz":  # the other writers flush: the partial bytes are on disk
        assert (tmp_path / leftovers[0]).stat().st_size > 0


@pytest.mark.parametrize("to,writer", [("numpy", "npz"), ("torch", "torch")])
def test_port_interrupted_mid_write_cleans_up(tmp_path, to, writer):
    src = port_input(tmp_path)
    (tmp_path / "out.bin").write_bytes(OLD)
    proc = start_hanging(
        tmp_path, writer, "port", src.name, "--to", to, "--out", "out.bin", "--force"
    )
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr == "attention-multi port: interrupted; no partial file was left\n"
    assert (tmp_path / "out.bin").read_bytes() == OLD
    assert entries(tmp_path) == ["m.params", "out.bin"]


def test_port_interrupted_without_previous_file_leaves_none(tmp_path):
    port_input(tmp_path)
    proc = start_hanging(tmp_path, "torch", "port", "m.params", "--to", "torch")
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert entries(tmp_path) == ["m.params"]


# -- report ----------------------------------------------------------------------------


def test_report_creates_out_under_an_existing_parent(tmp_path):
    result = run(*FAST_REPORT, "--out", tmp_path / "new")
    assert result.returncode == 0, result.stderr
    assert entries(tmp_path / "new") == [
        "heatmap_additive.png",
        "heatmap_dot_product.png",
        "heatmap_mask_mod.png",
        "heatmap_multihead.png",
        "nadaraya_watson.png",
        "report.md",
    ]
    assert (tmp_path / "new" / "heatmap_additive.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Result" in (tmp_path / "new" / "report.md").read_text()


@pytest.mark.parametrize(
    "out,reason",
    [
        (
            "{tmp}/missing/new",
            "cannot create directory {tmp}/missing/new: directory {tmp}/missing does not exist",
        ),
        ("{tmp}/afile", "cannot create directory {tmp}/afile: it exists and is not a directory"),
        ("/proc/forbidden", "cannot create directory /proc/forbidden: No such file or directory"),
    ],
)
def test_report_unwritable_out_is_one_line_exit_3(tmp_path, out, reason):
    (tmp_path / "afile").write_bytes(OLD)
    out, reason = out.format(tmp=tmp_path), reason.format(tmp=tmp_path)
    result = run(*FAST_REPORT, "--out", out)
    assert_one_line_error(result, "report", 3, reason)
    assert result.stdout == ""  # checked before anything ran
    assert entries(tmp_path) == ["afile"] and (tmp_path / "afile").read_bytes() == OLD


def test_report_help_documents_exit_3():
    result = run("report", "--help", process=True)
    assert "3 --out cannot be created or written" in " ".join(result.stdout.split())


def previous_report(tmp_path):
    out = tmp_path / "rep"
    out.mkdir()
    for name in ("report.md", "heatmap_additive.png"):
        (out / name).write_bytes(OLD)
    return out


def test_report_full_disk_keeps_the_previous_files(tmp_path):
    out = previous_report(tmp_path)
    result = run(*FAST_REPORT, "--out", out, fault=("enospc", "png"))
    assert_one_line_error(
        result, "report", 3, f"cannot write {out}/heatmap_additive.png: No space left on device"
    )
    assert entries(out) == ["heatmap_additive.png", "report.md"]
    assert all((out / n).read_bytes() == OLD for n in entries(out))


def test_report_interrupted_mid_figure_keeps_the_previous_files(tmp_path):
    out = previous_report(tmp_path)
    proc = start_hanging(tmp_path, "png", *FAST_REPORT, "--out", out)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == (
        "attention-multi report: interrupted; no partial file was left"
    )
    assert entries(out) == ["heatmap_additive.png", "report.md"]
    assert all((out / n).read_bytes() == OLD for n in entries(out))


# -- bench --json ------------------------------------------------------------------------


def test_bench_json_unwritable_is_checked_first(tmp_path):
    out = tmp_path / "missing" / "b.json"
    result = run(*FAST_BENCH, "--json", out)
    assert_one_line_error(
        result, "bench", 1, f"cannot write {out}: directory {tmp_path}/missing does not exist"
    )
    assert result.stdout == ""  # before any timing


def test_bench_json_written_whole_or_not_at_all(tmp_path):
    out = tmp_path / "b.json"
    out.write_bytes(OLD)
    result = run(*FAST_BENCH, "--json", out, fault=("enospc", "json"))
    assert_one_line_error(result, "bench", 1, f"cannot write {out}: No space left on device")
    assert "| numpy DotProductAttention |" in result.stdout  # the table came first
    assert entries(tmp_path) == ["b.json"] and out.read_bytes() == OLD

    result = run(*FAST_BENCH, "--json", out)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["key"] for r in rows] == ["numpy-dot-sdpa"]
    assert entries(tmp_path) == ["b.json"]


# -- the library: atomic_write and save_mxnet_params ----------------------------------


def test_atomic_write_replaces_only_on_success(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(OLD)
    for error in (ValueError("bug"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with atomic_write(path) as f:
                f.write(b"new and partial")
                raise error
        assert path.read_bytes() == OLD and entries(tmp_path) == ["f.txt"]
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write("new\n")
    assert path.read_text() == "new\n" and entries(tmp_path) == ["f.txt"]


def test_atomic_write_follows_a_symlink_and_keeps_the_mode(tmp_path):
    target, link = tmp_path / "target", tmp_path / "link"
    target.write_bytes(OLD)
    target.chmod(0o640)
    link.symlink_to("target")
    with atomic_write(link) as f:
        f.write(b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_new_files_get_the_usual_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "new") as f:
            f.write(b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o644


def test_write_error_is_an_oserror_with_one_line(tmp_path):
    with pytest.raises(WriteError) as info:
        with atomic_write(tmp_path / "no" / "x.bin") as f:
            f.write(b"x")
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOENT
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
    assert str(info.value) == (
        f"cannot write {tmp_path}/no/x.bin: directory {tmp_path}/no does not exist"
    )
    with pytest.raises(ValueError, match="mode: expected 'wb' or 'w', got 'a'"):
        with atomic_write(tmp_path / "x", "a"):
            pass
    with pytest.raises(WriteError, match=r"cannot write .*/no/x: directory"):
        check_writable(tmp_path / "no" / "x")
    make_directory(tmp_path / "d")
    make_directory(tmp_path / "d")  # an existing directory is fine
    with pytest.raises(WriteError, match=r"cannot create directory .*/no/d: directory"):
        make_directory(tmp_path / "no" / "d")


def test_save_mxnet_params_full_disk_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "w.params"
    path.write_bytes(OLD)
    params = load_mxnet_params(FIXTURES / "mha_bias.params")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(WriteError, match=r"w\.params: No space left on device"):
            am.port.save_mxnet_params(params, path)
    assert path.read_bytes() == OLD and entries(tmp_path) == ["w.params"]
    am.port.save_mxnet_params(params, path)
    got = load_mxnet_params(path)
    assert all(np.array_equal(got[k], params[k]) for k in params)


# -- port: never a directory's name, never a FIFO or a device, never an endless input --


@pytest.mark.parametrize("force", [False, True])
def test_port_trailing_slash_never_overwrites_a_file(tmp_path, force):
    src = port_input(tmp_path)
    keep = tmp_path / "keep.npz"
    keep.write_bytes(OLD)
    out = f"{keep}/"
    result = run("port", src, "--to", "numpy", "--out", out, *["--force"] * force)
    assert_one_line_error(
        result, "port", 1, f"cannot write {out}: a trailing slash names a directory"
    )
    assert keep.read_bytes() == OLD and entries(tmp_path) == ["keep.npz", "m.params"]


def test_port_new_directory_name_is_never_written_as_a_file(tmp_path):
    src = port_input(tmp_path)
    out = f"{tmp_path}/newdir/"
    result = run("port", src, "--to", "numpy", "--out", out)
    assert_one_line_error(
        result, "port", 1, f"cannot write {out}: a trailing slash names a directory"
    )
    assert entries(tmp_path) == ["m.params"]


def special_files(tmp_path):
    """A FIFO and a character device (the same numbers as /dev/null) in tmp_path."""
    fifo, device = tmp_path / "fifo", tmp_path / "null"
    os.mkfifo(fifo)
    os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return {"fifo": (fifo, "a FIFO"), "device": (device, "a character device")}


@pytest.mark.parametrize("kind", ["fifo", "device", "link-to-fifo"])
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("to", ["numpy", "torch"])
def test_port_never_replaces_a_fifo_or_a_device(tmp_path, kind, force, to):
    src = port_input(tmp_path)
    special = special_files(tmp_path)
    path, what = special["fifo" if kind == "link-to-fifo" else kind]
    if kind == "link-to-fifo":
        (tmp_path / "link").symlink_to(path.name)
        path = tmp_path / "link"
    before = {p.name: p.lstat() for p in tmp_path.iterdir()}
    result = run("port", src, "--to", to, "--out", path, *["--force"] * force)
    assert_one_line_error(
        result, "port", 1, f"cannot write {path}: it is {what}, not a regular file"
    )
    after = {p.name: p.lstat() for p in tmp_path.iterdir()}
    assert sorted(after) == sorted(before)
    for name, st in before.items():  # same inode, same kind: nothing was replaced
        assert (after[name].st_ino, after[name].st_mode) == (st.st_ino, st.st_mode), name


def test_atomic_write_refuses_what_is_not_a_regular_file(tmp_path):
    for path, what in special_files(tmp_path).values():
        for call in (lambda p: atomic_write(p).__enter__(), check_writable):
            with pytest.raises(WriteError, match=f"it is {what}, not a regular file"):
                call(path)
        assert not stat.S_ISREG(path.stat().st_mode)
    (tmp_path / "file").write_bytes(OLD)
    with pytest.raises(WriteError, match="a trailing slash names a directory"):
        with atomic_write(f"{tmp_path}/file/") as f:
            f.write(b"new")
    assert (tmp_path / "file").read_bytes() == OLD
    assert entries(tmp_path) == ["fifo", "file", "null"]


def test_port_endless_input_is_refused_at_once(tmp_path):
    # a character device with /dev/zero's numbers, in tmp_path: endless zeros
    zero = tmp_path / "zero"
    os.mknod(zero, stat.S_IFCHR | 0o666, os.makedev(1, 5))
    result = run("port", zero, "--to", "numpy", "--out", tmp_path / "x.npz")
    assert_one_line_error(
        result,
        "port",
        2,
        f"{zero}: not an MXNet NDArray file: list magic is 0x0, expected 0x112 (at byte 0)",
    )
    assert entries(tmp_path) == ["zero"]


def test_port_reads_a_fifo_as_far_as_its_header_goes(tmp_path):
    """A FIFO is read as a stream: a good file converts; an endless one fed
    a valid header then zeros fails at the first bad field, read in bounded steps."""
    fifo = tmp_path / "in.params"
    os.mkfifo(fifo)
    good = (FIXTURES / "mha_bias.params").read_bytes()
    for payload, code in ((good, 0), (good[:24] + b"\0" * (1 << 20), 2)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "attention_multi", "port", str(fifo), "--to", "numpy"]
            + ["--out", str(tmp_path / "x.npz"), "--force"],
            cwd=REPO,
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with open(fifo, "wb") as f, contextlib.suppress(BrokenPipeError):
            f.write(payload)
        out, err = proc.communicate(timeout=1200)
        assert proc.returncode == code, err
        assert "Traceback" not in err
    assert "array 0 has unknown magic number 0x00000000 (at byte 24)" in err
    with np.load(tmp_path / "x.npz") as z:
        assert sorted(z.files) == sorted(load_mxnet_params(FIXTURES / "mha_bias.params"))
