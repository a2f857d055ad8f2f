"""Read and write MXNet Gluon ``.params`` files with NumPy only (no mxnet).

File layout (all integers little-endian), as written by MXNet 1.x
``NDArray::Save`` (``block.save_parameters``, ``mx.nd.save``, ``npx.save``)::

    uint64 0x112 (list magic), uint64 0 (reserved)
    uint64 n_arrays, then n_arrays records:
        uint32 magic     0xF993FACA (V3, np shape mode), 0xF993FAC9 (V2),
                         0xF993FAC8 (V1, no storage-type field)
        int32  stype     V2/V3 only; 0 = dense (others are sparse: rejected)
        int32  ndim, then ndim x int64 dims
        int32  dev_type, int32 dev_id   (context; ignored when reading)
        int32  dtype flag (see _DTYPES)
        raw C-order data, itemsize * prod(dims) bytes
    uint64 n_names (0 or n_arrays), then n_names x (uint64 length, utf-8 bytes)

An array with unknown shape (V3: ndim -1 or a dim -1; V1/V2: ndim 0) has no
context/dtype/data in the file; such uninitialised arrays are rejected.
Pre-V1 files (uint32 dims, no magic) are not supported.

Gluon's ``save_parameters`` writes structural names (``blks.0.attention.W_q.weight``);
``attention_multi.port`` maps them onto a module's names.
"""

from __future__ import annotations

import os
import stat
import struct
import sys
from collections.abc import Mapping
from typing import IO, Any, NoReturn, Union

import numpy as np

from ..files import atomic_write

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["load_mxnet_params", "save_mxnet_params"]

_LIST_MAGIC = 0x112
_V1, _V2, _V3 = 0xF993FAC8, 0xF993FAC9, 0xF993FACA
_CPU = 1  # mxnet Context::kCPU
_MAX_NDIM = 64  # NumPy 2's limit (NumPy 1 holds 32); MXNet's own is 32

# mshadow type flags (verified by saving each dtype with mxnet 1.9.1).
# 12 is bfloat16, which NumPy lacks, so it is rejected like any unknown flag.
_DTYPES = {
    0: "float32",
    1: "float64",
    2: "float16",
    3: "uint8",
    4: "int32",
    5: "int8",
    6: "int64",
    7: "bool",
}
_FLAGS = {np.dtype(name): flag for flag, name in _DTYPES.items()}


class _Reader:
    """Bounds-checked cursor over an open file; errors carry path and offset.

    ``size`` is the file's length when known (a regular file): counts and
    lengths are checked against it before anything is read. Otherwise (a FIFO,
    a device) bytes are read as the header announces them, in bounded chunks,
    so that memory grows only with what actually arrives.
    """

    _CHUNK = 1 << 24

    def __init__(self, path: PathLike, f: IO[bytes], size: int | None) -> None:
        self.path, self.f, self.size, self.pos = os.fspath(path), f, size, 0

    def fail(self, msg: str, at: int | None = None) -> NoReturn:
        at = self.pos if at is None else at
        raise ValueError(f"{self.path}: {msg} (at byte {at})")

    def left(self) -> int | None:
        return None if self.size is None else self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        left = self.left()
        if left is not None and n > left:
            self._truncated(n, left, what)
        parts, got = [], 0
        while got < n:
            part = self.f.read(min(n - got, self._CHUNK))
            if not part:
                self._truncated(n, got, what)
            parts.append(part)
            got += len(part)
        self.pos += n
        return b"".join(parts)

    def _truncated(self, n: int, left: int, what: str) -> NoReturn:
        raise ValueError(
            f"{self.path}: truncated at byte {self.pos} while reading "
            f"{what} (needed {n} bytes, {left} left)"
        )

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def count(self, what: str, min_item_size: int) -> int:
        """Read a uint64 count; refuse counts the remaining bytes cannot hold."""
        at = self.pos
        (n,) = self.unpack("<Q", what)
        left = self.left()
        if left is not None and n * min_item_size > left:
            self.fail(f"{what} is {n}, but only {left} bytes are left", at)
        return n

    def array(self, i: int) -> np.ndarray:
        at = self.pos
        (magic,) = self.unpack("<I", f"the magic number of array {i}")
        if magic not in (_V1, _V2, _V3):
            self.fail(f"array {i} has unknown magic number 0x{magic:08X}", at)
        if magic != _V1:
            at = self.pos
            (stype,) = self.unpack("<i", f"the storage type of array {i}")
            if stype != 0:
                self.fail(
                    f"array {i} has unsupported storage type {stype} (only 0 = dense is supported)",
                    at,
                )
        at = shape_at = self.pos
        (ndim,) = self.unpack("<i", f"the shape of array {i}")
        if ndim > _MAX_NDIM or (ndim < 0 and not (magic == _V3 and ndim == -1)):
            self.fail(f"array {i} has invalid ndim {ndim}", at)
        shape = self.unpack(f"<{max(ndim, 0)}q", f"the shape of array {i}")
        if (magic == _V3 and (ndim == -1 or -1 in shape)) or (magic != _V3 and ndim == 0):
            self.fail(f"array {i} has unknown shape (uninitialised array)", at)
        if any(d < 0 for d in shape):
            self.fail(f"array {i} has invalid shape {shape}", at)
        self.unpack("<ii", f"the context of array {i}")
        at = self.pos
        (flag,) = self.unpack("<i", f"the dtype flag of array {i}")
        if flag not in _DTYPES:
            self.fail(f"array {i} has unsupported dtype flag {flag}", at)
        dtype = np.dtype(_DTYPES[flag])
        size = int(np.prod(shape, dtype=object))  # exact Python int, no overflow
        if size * dtype.itemsize > sys.maxsize:
            self.fail(f"array {i} has shape {shape}, too large to hold", shape_at)
        raw = self.take(size * dtype.itemsize, f"the data of array {i}")
        try:
            return np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(shape)
        except ValueError as exc:  # more dims than this NumPy holds; a zero-size shape too big
            self.fail(f"array {i} has shape {shape}, which NumPy cannot hold: {exc}", shape_at)


def load_mxnet_params(path: PathLike) -> dict[str, np.ndarray]:
    """Read an MXNet ``.params`` file into ``{name: numpy.ndarray}``.

    A leading ``arg:`` or ``aux:`` prefix (written by ``mx.model.save_checkpoint``)
    is stripped from names, as Gluon's ``ParameterDict.load`` does. Files saved
    from a list (no names) get the keys ``"0"``, ``"1"``, ... Raises ValueError
    (naming the file and byte offset) for malformed or unsupported content,
    names with a NUL byte included. Only what the header announces is read:
    a FIFO or a device (``/dev/zero``) is refused as soon as its bytes stop
    making sense, never read whole.
    """
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        return _load(_Reader(path, f, info.st_size if stat.S_ISREG(info.st_mode) else None))


def _load(r: _Reader) -> dict[str, np.ndarray]:
    (magic, _reserved) = r.unpack("<QQ", "the file header")
    if magic != _LIST_MAGIC:
        r.fail(f"not an MXNet NDArray file: list magic is 0x{magic:X}, expected 0x112", 0)
    # No array record and no name is shorter than 8 bytes.
    arrays = [r.array(i) for i in range(r.count("the array count", 8))]
    at = r.pos
    n_names = r.count("the name count", 8)
    if n_names not in (0, len(arrays)):
        r.fail(f"{n_names} names for {len(arrays)} arrays", at)
    names: list[str] = []
    for i in range(n_names):
        (length,) = r.unpack("<Q", f"the length of name {i}")
        raw = r.take(length, f"name {i}")
        try:
            name = str(raw, "utf-8")
        except UnicodeDecodeError:
            r.fail(f"name {i} is not valid UTF-8", r.pos - length)
        if "\x00" in name:
            r.fail(f"name {i} ({name!r}) contains a NUL byte", r.pos - length)
        if name.startswith(("arg:", "aux:")):
            name = name[4:]
        if name in names:
            r.fail(f"duplicate name {name!r}", r.pos - length)
        names.append(name)
    left = r.left()
    if left or (left is None and r.f.read(1)):
        r.fail(f"{left or 'at least 1'} unexpected trailing bytes")
    return dict(zip(names or map(str, range(len(arrays))), arrays))


def save_mxnet_params(params: Mapping[str, Any], path: PathLike, *, np_mode: bool = True) -> None:
    """Write ``{name: array-like}`` as an MXNet ``.params`` file.

    ``np_mode=True`` writes V3 records (what ``npx.save`` / np-mode Gluon write,
    loadable by ``block.load_parameters`` under ``npx.set_np()``); ``np_mode=False``
    writes V2 records (legacy ``mx.nd.save``), which cannot hold 0-d arrays.
    Supported dtypes: float16/32/64, uint8, int8, int32, int64, bool.
    The file is written whole or not at all (``attention_multi.files.atomic_write``);
    failures raise ``attention_multi.files.WriteError``, an ``OSError``.
    """
    out = [struct.pack("<QQQ", _LIST_MAGIC, 0, len(params))]
    for name, value in params.items():
        a = np.asarray(value)
        flag = _FLAGS.get(a.dtype.newbyteorder("="))  # any byte order is fine
        if flag is None:
            raise ValueError(f"{name}: unsupported dtype {a.dtype} for an MXNet file")
        if not np_mode and a.ndim == 0:
            raise ValueError(f"{name}: 0-d arrays need np_mode=True (V2 reads ndim 0 as 'no data')")
        out.append(
            struct.pack(
                f"<Iii{a.ndim}qiii", _V3 if np_mode else _V2, 0, a.ndim, *a.shape, _CPU, 0, flag
            )
        )
        out.append(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes())
    out.append(struct.pack("<Q", len(params)))
    for name in params:
        if "\x00" in str(name):
            raise ValueError(f"{name!r}: a name with a NUL byte cannot be read back")
        raw = str(name).encode("utf-8")
        out += [struct.pack("<Q", len(raw)), raw]
    with atomic_write(path) as f:
        f.write(b"".join(out))
