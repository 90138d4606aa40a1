"""The header of a GGUF file, read strictly and within bounds, over a memory map of the file.

A GGUF header is a list of typed metadata values and a list of tensor entries (name, shape, type,
data offset) that the rest of the file must honour. Everything it claims is checked as it is read,
so a malformed file is one CheckpointError of the form `<file>: <key or tensor>: <what is wrong>`,
never an IndexError from deep in a reader nor weights read from the wrong bytes: a count or a
length cannot exceed what the bytes left could hold, strings are UTF-8, keys and tensor names are
unique and not empty, a tensor's type is a GGML type, its rows split into whole blocks and its
data is aligned, inside the file, and no other tensor's.

Reading it is bounded in time and memory: more than MAX_TENSORS tensor entries (a 27B model has
under a thousand), more than MAX_STRINGS strings in all, or a string longer than
MAX_STRING_BYTES is refused before it is read, and a numeric array stays a view of the mapped
file. gguf's GGUFReader is not used for this reason: it builds numpy views for every part of
every entry (two for each string of a vocabulary), which for a quarter-million-token vocabulary
takes seconds and most of a gigabyte in each process that opens the file, and far more for a
header that lies about its counts. Torch-free (numpy).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 (32-bit counts) is not read, as gguf's own reader does not
MAX_TENSORS = 100_000
MAX_STRINGS = 8_000_000  # keys, string values, array items: a 262K vocabulary and its merges are 0.5M
MAX_STRING_BYTES = 16 << 20  # a chat template is tens of KB
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
UINT32, BOOL, STRING, ARRAY = 4, 7, 8, 9
# scalar value types: their struct codes (numpy reads the same codes) and names
SCALARS = {0: ("<B", "uint8"), 1: ("<b", "int8"), 2: ("<H", "uint16"), 3: ("<h", "int16"), 4: ("<I", "uint32"),
           5: ("<i", "int32"), 6: ("<f", "float32"), 7: ("<?", "bool"), 10: ("<Q", "uint64"), 11: ("<q", "int64"),
           12: ("<d", "float64")}
INTEGERS = (0, 1, 2, 3, 4, 5, 10, 11)
FLOATS = (6, 12)
# the fewest bytes an entry takes: a tensor (name length, a 1-byte name, dims count, one dim, type,
# offset); a metadata entry (key length, a 1-byte key, type, a 1-byte value)
MIN_TENSOR_ENTRY = 8 + 1 + 4 + 8 + 4 + 8
MIN_METADATA_ENTRY = 8 + 1 + 4 + 1


def gguf_error(path: Path, where: str, problem: str) -> CheckpointError:
    """The one form of every GGUF error: the file, the key or tensor, what is wrong."""
    return CheckpointError(f"{path}: {where}: {problem}")


@dataclass(frozen=True)
class Value:
    """A metadata value. `kind` is its GGUF value type, for an array the type of its items;
    `data` a Python scalar or str, or for an array a list of str or a numpy view of the file."""

    kind: int
    array: bool
    data: Any

    def describe(self) -> str:
        name = "string" if self.kind == STRING else SCALARS[self.kind][1]
        return f"an array of {name}" if self.array else f"a {name}"


@dataclass(frozen=True)
class TensorInfo:
    """A tensor entry: `shape` in GGUF order (the row length first), `start` and `nbytes` the
    span of its data in the file."""

    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Header:
    """A checked GGUF header; `buffer` maps the whole file (tensor data is read from it lazily)."""

    path: Path
    fields: dict[str, Value]
    tensors: dict[str, TensorInfo]
    buffer: mmap.mmap

    def data(self, t: TensorInfo) -> np.ndarray:
        """A view of the tensor's data as gguf's reader gives it (what gguf.quants.dequantize
        takes): F32 and F16 as floats shaped [..., rows, row length], every other type as bytes
        shaped [..., rows, bytes per row]."""
        dims = tuple(reversed(t.shape))
        if t.kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if t.kind == GGMLQuantizationType.F32 else np.float16
            return np.frombuffer(self.buffer, dtype, t.numel, t.start).reshape(dims)
        block, size = GGML_QUANT_SIZES[t.kind]
        return np.frombuffer(self.buffer, np.uint8, t.nbytes, t.start).reshape(*dims[:-1], dims[-1] // block * size)


class _Cursor:
    """Reads the header's items in order, each one checked against the bytes left."""

    def __init__(self, path: Path, buffer: mmap.mmap):
        self.path, self.buffer, self.pos, self.strings_left = path, buffer, 0, MAX_STRINGS

    def fail(self, where: str, problem: str) -> CheckpointError:
        return gguf_error(self.path, where, problem)

    def left(self) -> int:
        return len(self.buffer) - self.pos

    def take(self, code: str, where: str) -> Any:
        size = struct.calcsize(code)
        if size > self.left():
            raise self.fail(where, f"the file ends inside it (truncated at {len(self.buffer)} bytes)")
        value = struct.unpack_from(code, self.buffer, self.pos)[0]
        self.pos += size
        return value

    def string(self, where: str) -> str:
        length = self.take("<Q", where)
        if length > MAX_STRING_BYTES:
            raise self.fail(where, f"a string of {length} bytes; a header string has at most {MAX_STRING_BYTES}")
        if length > self.left():
            raise self.fail(where, f"the file ends inside it (truncated at {len(self.buffer)} bytes)")
        self.strings_left -= 1
        if self.strings_left < 0:
            raise self.fail(where, f"the header holds more than {MAX_STRINGS} strings")
        raw = self.buffer[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(where, f"not valid UTF-8 (byte {e.start} of {length})") from None

    def value(self, key: str) -> Value:
        kind = self.take("<I", key)
        if kind == ARRAY:
            return self.array(key)
        if kind == STRING:
            return Value(kind, False, self.string(key))
        if kind not in SCALARS:
            raise self.fail(key, f"unknown value type {kind}")
        return Value(kind, False, self.take(SCALARS[kind][0], key))

    def array(self, key: str) -> Value:
        kind, count = self.take("<I", key), self.take("<Q", key)
        if kind == ARRAY:
            raise self.fail(key, "an array of arrays (not supported)")
        if kind != STRING and kind not in SCALARS:
            raise self.fail(key, f"an array of unknown value type {kind}")
        least = 8 if kind == STRING else struct.calcsize(SCALARS[kind][0])  # a string: its length
        if count > self.left() // least:
            raise self.fail(key, f"an array of {count} items cannot fit in the {self.left()} bytes left")
        if kind == STRING:
            return Value(kind, True, [self.string(f"{key}[{i}]") for i in range(count)])
        items = np.frombuffer(self.buffer, SCALARS[kind][0], count, self.pos) if count else np.empty(0)
        self.pos += count * least
        return Value(kind, True, items)


def _alignment(c: _Cursor, fields: dict[str, Value]) -> int:
    value = fields.get("general.alignment")
    if value is None:
        return DEFAULT_ALIGNMENT
    if value.array or value.kind != UINT32 or value.data <= 0 or value.data & (value.data - 1):
        raise c.fail("general.alignment", f"must be a uint32 power of two, found {value.describe()} {value.data!r}")
    return value.data


def _tensor(c: _Cursor, entry: tuple[str, tuple[int, ...], int, int], data_start: int, alignment: int) -> TensorInfo:
    name, shape, kind_id, offset = entry
    try:
        kind = GGMLQuantizationType(kind_id)
        block, size = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise c.fail(name, f"unknown tensor type {kind_id}") from None
    if min(shape) < 1:
        raise c.fail(name, f"shape {list(shape)} has an empty dimension")
    if shape[0] % block:
        raise c.fail(name, f"rows of {shape[0]} values do not split into {kind.name} blocks of {block}")
    if offset % alignment:
        raise c.fail(name, f"data offset {offset} is not a multiple of the file's alignment {alignment}")
    nbytes = math.prod(shape) // block * size
    if data_start + offset + nbytes > len(c.buffer):
        raise c.fail(name, f"its {nbytes} bytes at data offset {offset} run past the end of the file "
                           f"({len(c.buffer)} bytes)")
    return TensorInfo(name, kind, shape, data_start + offset, nbytes)


def _entries(c: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, type, offset) of each tensor entry, names unique and not empty."""
    entries, names = [], set()
    for i in range(count):
        name = c.string(f"tensor entry {i}")
        if not name:
            raise c.fail(f"tensor entry {i}", "its name is empty")
        if name in names:
            raise c.fail(name, "two tensors have this name")
        names.add(name)
        dims = c.take("<I", name)
        if not 1 <= dims <= MAX_DIMS:
            raise c.fail(name, f"{dims} dimensions; a tensor has 1 to {MAX_DIMS}")
        shape = tuple(c.take("<Q", name) for _ in range(dims))
        entries.append((name, shape, c.take("<I", name), c.take("<Q", name)))
    return entries


def read_header(path: Path) -> Header:
    """The checked header of the GGUF file at `path` (see the module's docstring for the rules)."""
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from None
    c = _Cursor(path, buffer)
    if c.take("4s", "magic") != MAGIC:
        raise c.fail("magic", "not a GGUF file (it does not start with 'GGUF')")
    version = c.take("<I", "version")
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise c.fail("version", f"GGUF version {version}{endian} is not supported; supported: 2, 3")
    tensors, keys = c.take("<Q", "tensor count"), c.take("<Q", "metadata count")
    if tensors > MAX_TENSORS:
        raise c.fail("tensor count", f"{tensors} tensors; a model has at most {MAX_TENSORS}")
    if tensors * MIN_TENSOR_ENTRY + keys * MIN_METADATA_ENTRY > c.left():  # a count the file cannot hold
        raise c.fail("header", f"{tensors} tensor entries and {keys} metadata entries cannot fit in the "
                               f"{c.left()} bytes left in the file")
    fields: dict[str, Value] = {}
    for i in range(keys):
        key = c.string(f"metadata entry {i}")
        if not key:
            raise c.fail(f"metadata entry {i}", "its key is empty")
        if key in fields:
            raise c.fail(key, "this key appears twice")
        fields[key] = c.value(key)
    entries = _entries(c, tensors)
    alignment = _alignment(c, fields)
    data_start = -(-c.pos // alignment) * alignment
    tensors = {e[0]: _tensor(c, e, data_start, alignment) for e in entries}
    _no_overlap(c, tensors.values())
    return Header(path, fields, tensors, buffer)


def _no_overlap(c: _Cursor, tensors: Iterable[TensorInfo]) -> None:
    """Refuse two tensors whose bytes overlap: one of them (or both) reads another's data as its
    own, a header edited or written wrong, and the model answers garbage."""
    ordered = sorted(tensors, key=lambda t: t.start)
    for before, after in zip(ordered, ordered[1:]):
        if before.start + before.nbytes > after.start:
            raise c.fail(after.name, f"its data (at byte {after.start}) overlaps {before.name}'s "
                                     f"({before.nbytes} bytes at byte {before.start})")
