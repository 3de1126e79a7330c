"""Streaming safetensors I/O: a lazy checkpoint reader and a writer with fixed headers.

Reader: ``<stem>.safetensors`` or the shards named by
``<stem>.safetensors.index.json`` (never a glob), each opened once with
``safetensors.safe_open``, which checks the header and the file length (so a
truncated or corrupted file fails before anything is converted). Tensors are
then read one at a time, or one leading-axis slice at a time, with positioned
reads at the header's offsets into a fresh array: reading through safe_open's
memory map left every touched page of the file in the process's resident set
(peak RSS ~ the checkpoint size on a 2 GB benchmark), positioned reads keep it
at the tensors in flight.

Writer: the names, dtypes and shapes of every output tensor are known before
conversion starts, so each shard's header is written first and tensors (or
slices of stacked tensors) are written into their byte ranges as they are
produced. Peak memory is a few tensors, not the model.

Directories written whole or not at all: :mod:`posttrain.conversion.directories`.

Format: https://github.com/huggingface/safetensors (8-byte little-endian header
length, JSON header with ``dtype``, ``shape``, ``data_offsets``, then the data).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from posttrain.conversion.errors import ConversionError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
CODES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
DEFAULT_SHARD_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, read from a header."""

    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "F32"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def _open(path: pathlib.Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="numpy")
    except Exception as error:  # SafetensorError, OSError: one line naming the file
        raise ConversionError(
            f"{path}: not a readable safetensors file ({str(error).splitlines()[0]})"
        ) from None


Index = int | tuple[int, ...] | None
"""Leading-axis index of a slice: a scanned layer slot, an expert, or (slot, expert)."""


def _flat_index(shape: Sequence[int], index: Index) -> tuple[int, int]:
    """(number of leading axes indexed, row-major position among those slices)."""
    idx = () if index is None else (index if isinstance(index, tuple) else (index,))
    flat = 0
    for dim, i in zip(shape, idx, strict=False):
        if not 0 <= i < dim:
            raise IndexError(f"index {index} out of range for shape {list(shape)}")
        flat = flat * dim + i
    return len(idx), flat


def _data_offsets(path: pathlib.Path) -> dict[str, int]:
    """Absolute file offset of each tensor's data (after safe_open validated the file)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: 8 + size + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


class CheckpointReader:
    """The tensors of a safetensors checkpoint directory.

    Args:
      directory: holds ``<stem>.safetensors`` or ``<stem>.safetensors.index.json`` + shards.
      stem: ``model`` for HF checkpoints, ``params`` for native ones.

    Raises:
      ConversionError: no checkpoint file, an unreadable shard, or an index that
        disagrees with the shards (the message names the file and tensor).
    """

    def __init__(self, directory: str | os.PathLike, stem: str = "model"):
        self.directory = pathlib.Path(directory)
        index = self.directory / f"{stem}.safetensors.index.json"
        single = self.directory / f"{stem}.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise ConversionError(f"{index}: not a safetensors index ({error})") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            weight_map, files = None, [single.name]
        else:
            raise ConversionError(f"{self.directory}: no {single.name} or {index.name}")
        self._files = {}
        self._offsets: dict[str, int] = {}  # key -> absolute byte offset of its data
        self.tensors: dict[str, TensorInfo] = {}
        try:
            for name in files:
                path = self.directory / name
                if not path.is_file():
                    raise ConversionError(f"{index}: shard {name} does not exist")
                handle = _open(path)  # validates header and length
                offsets = _data_offsets(path)
                self._files[name] = open(path, "rb")  # noqa: SIM115 (closed in close())
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    if key in self.tensors:
                        raise ConversionError(
                            f"tensor {key} is in both {self.tensors[key].file} and {name}"
                        )
                    if weight_map is not None and weight_map.get(key) != name:
                        raise ConversionError(
                            f"tensor {key} is in {name} but the index maps it "
                            f"to {weight_map.get(key)}"
                        )
                    sl = handle.get_slice(key)
                    dtype = sl.get_dtype()
                    if dtype not in DTYPES:
                        raise ConversionError(f"tensor {key} in {name}: dtype {dtype} unsupported")
                    self.tensors[key] = TensorInfo(name, tuple(sl.get_shape()), dtype)
                    self._offsets[key] = offsets[key]
                del handle
            for key, name in (weight_map or {}).items():
                if key not in self.tensors:
                    raise ConversionError(f"{index}: tensor {key} is missing from shard {name}")
        except BaseException:
            self.close()  # a bad shard: close the ones already open
            raise

    def read(self, key: str, index: Index = None) -> np.ndarray:
        """Tensor ``key``, or its slice ``[index]`` on the leading axes (a new array)."""
        info = self.tensors[key]
        lead, flat = _flat_index(info.shape, index)
        out = np.empty(info.shape[lead:], DTYPES[info.dtype])
        offset = self._offsets[key] + flat * out.nbytes
        handle = self._files[info.file]
        handle.seek(offset)
        if handle.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:
            raise ConversionError(f"tensor {key} in {info.file}: file ends early")
        return out

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """One output tensor: name, safetensors dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


_CHUNK_BYTES = 16 << 20


def _write_bytes(handle, array: np.ndarray) -> None:
    handle.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


class CheckpointWriter:
    """Writes the tensors of ``specs`` into shards of at most ``max_shard_bytes`` (a larger
    tensor gets a shard of its own), in ``specs`` order.

    ``write(name, array)`` writes a whole tensor, ``write(name, array, index=k)``
    the k-th slice of its leading axis (``index=(k, j)``: slice j of slice k).
    ``finish()`` checks that every byte was written, ``fsync``s the shards (unless
    ``fsync=False``: then a crash right after the atomic rename may leave a renamed
    directory with unwritten pages), writes the index (several shards) and returns
    the file names.
    """

    def __init__(
        self,
        directory: pathlib.Path,
        stem: str,
        specs: Sequence[OutputSpec],
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        metadata: Mapping[str, str] | None = None,
        fsync: bool = True,
    ):
        self.directory, self.stem, self.fsync = pathlib.Path(directory), stem, fsync
        shards: list[list[OutputSpec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        n = len(shards)
        self.files = (
            [f"{stem}.safetensors"]
            if n == 1
            else [f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        )
        self._where: dict[str, tuple[int, int, OutputSpec]] = {}  # name -> (shard, start, spec)
        self._written: dict[str, int] = {}
        self._handles = []
        meta = {"format": "pt", **(metadata or {})}
        for k, shard in enumerate(shards):
            header: dict[str, object] = {"__metadata__": meta}
            offset = 0
            for spec in shard:
                header[spec.name] = {
                    "dtype": spec.dtype,
                    "shape": list(spec.shape),
                    "data_offsets": [offset, offset + spec.nbytes],
                }
                self._where[spec.name] = (k, offset, spec)
                offset += spec.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors does
            handle = open(self.directory / self.files[k], "wb")  # noqa: SIM115 (closed in finish)
            handle.write(len(raw).to_bytes(8, "little") + raw)
            handle.truncate(8 + len(raw) + offset)
            self._handles.append((handle, 8 + len(raw)))

    def write(self, name: str, array: np.ndarray, index: Index = None) -> None:
        shard, start, spec = self._where[name]
        lead, flat = _flat_index(spec.shape, index)
        want = spec.shape[lead:]
        if tuple(array.shape) != want or CODES.get(array.dtype) != spec.dtype:
            raise ConversionError(
                f"tensor {name}: produced {array.dtype}{list(array.shape)}, "
                f"expected {spec.dtype}{list(want)}"
            )
        handle, base = self._handles[shard]
        handle.seek(base + start + flat * array.nbytes)
        if array.flags.c_contiguous or array.ndim == 0 or array.size == 0:
            _write_bytes(handle, array)
        else:  # a transposed view: copy a few rows at a time, not the whole tensor
            row_bytes = max(array.nbytes // array.shape[0], 1)
            step = max(1, _CHUNK_BYTES // row_bytes)
            for i in range(0, array.shape[0], step):
                _write_bytes(handle, np.ascontiguousarray(array[i : i + step]))
        self._written[name] = self._written.get(name, 0) + array.nbytes

    def finish(self) -> list[str]:
        for name, (_, _, spec) in self._where.items():
            if self._written.get(name, 0) != spec.nbytes:
                raise ConversionError(
                    f"tensor {name}: wrote {self._written.get(name, 0)} of {spec.nbytes} bytes"
                )
        for handle, _ in self._handles:
            handle.flush()
            if self.fsync:
                os.fsync(handle.fileno())
            handle.close()
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": sum(s.nbytes for _, _, s in self._where.values())},
                "weight_map": {
                    name: self.files[k] for name, (k, _, _) in sorted(self._where.items())
                },
            }
            (self.directory / f"{self.stem}.safetensors.index.json").write_text(
                json.dumps(index, indent=2) + "\n"
            )
        return list(self.files)

    def abort(self) -> None:
        for handle, _ in self._handles:
            handle.close()
