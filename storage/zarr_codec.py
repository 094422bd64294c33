"""The outer-gradient codecs (dense and sparse) as a zarr v3 codec, so fragments
are ordinary zarr arrays.

``BlockQuantCodec`` wraps `storage.codecs.encode`/`decode` as the zarr v3
array-to-bytes codec ``diloco.blockquant`` (registered with zarr when this module
is imported); ``zarr_array_codecs`` adds a crc32c checksum to every chunk. A
flipped byte in a stored chunk makes zarr's ``Crc32cCodec`` raise a plain
``ValueError`` ("Stored and computed checksum do not match") on read.

So after ``import storage.zarr_codec`` a plain ``zarr.open_array`` on any array a
run stored (a store at its prefix: local directory, fsspec URL or mapper) returns
the values the project's readers return; the lossless arrays need nothing
registered. storage/arrays.py writes the chunks and decodes coded vectors without
zarr's pipeline, byte for byte what this codec writes and reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr.codecs
import zarr.registry
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import JSON, parse_named_configuration

from storage.codecs import CodecSpec, decode, encode, encoded_nbytes

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer

ZARR_CODEC_NAME = "diloco.blockquant"


@dataclass(frozen=True)
class BlockQuantCodec(ArrayBytesCodec):
    """zarr v3 array-to-bytes codec ``diloco.blockquant``: a float32 chunk,
    flattened in C order, stored as ``encode(chunk, spec)``.

    The array dtype stays float32 for every codec, so readers never care how a
    fragment travelled; the configuration in the array metadata (``CodecSpec.to_dict``:
    ``{"codec", "block_size"}`` dense, ``{"codec", "chunk", "k"}`` sparse) says how
    to decode it. A sparse zarr chunk decodes to zeros where nothing was kept.
    """

    is_fixed_size = True

    spec: CodecSpec

    def __init__(
        self, *, codec: str = "int8", block_size: int = 128, chunk: int = 4096, k: int = 64
    ) -> None:
        spec = CodecSpec(name=codec, block_size=block_size, chunk=chunk, k=k)
        object.__setattr__(self, "spec", spec)

    @classmethod
    def of(cls, spec: CodecSpec) -> BlockQuantCodec:
        """The codec that stores chunks as ``encode(chunk, spec)``."""
        return cls(codec=spec.name, block_size=spec.block_size, chunk=spec.chunk, k=spec.k)

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, config = parse_named_configuration(data, ZARR_CODEC_NAME, require_configuration=False)
        return cls.of(CodecSpec.from_dict(dict(config or {})))

    def to_dict(self) -> dict[str, JSON]:
        return {"name": ZARR_CODEC_NAME, "configuration": self.spec.to_dict()}

    def validate(self, *, shape: tuple[int, ...], dtype: Any, chunk_grid: Any) -> None:
        native = dtype.to_native_dtype()
        if native != np.dtype(np.float32):
            raise ValueError(f"{ZARR_CODEC_NAME}: array dtype must be float32, got {native}")

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        n = int(np.prod(chunk_spec.shape))
        values = decode(chunk_bytes.as_numpy_array(), n, self.spec).reshape(chunk_spec.shape)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(values)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        return self._decode_sync(chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        flat = np.ascontiguousarray(chunk_array.as_numpy_array(), dtype=np.float32).reshape(-1)
        return chunk_spec.prototype.buffer.from_bytes(encode(flat, self.spec))

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return self._encode_sync(chunk_array, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return encoded_nbytes(input_byte_length // 4, self.spec)


zarr.registry.register_codec(ZARR_CODEC_NAME, BlockQuantCodec)


def zarr_array_codecs(spec: CodecSpec) -> dict[str, Any]:
    """Keyword arguments for ``zarr.create_array``: our serializer plus crc32c.

    The checksum covers each stored chunk, so a flipped byte in object storage
    fails the read (zarr raises ValueError) instead of decoding to wrong numbers.
    """
    return {
        "serializer": BlockQuantCodec.of(spec),
        "compressors": [zarr.codecs.Crc32cCodec()],
    }
