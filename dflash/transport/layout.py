"""Slot layout: a set of named fixed-shape tensors packed into one flat byte buffer.

A slot is one ``[nbytes]`` uint8 buffer; every named tensor of the :data:`SlotSpec` is a view at
an offset aligned to :data:`ALIGN_BYTES`. Producer and consumer compute the same layout from the
same spec, so a whole slot moves with **one** copy (one ``cudaMemcpyAsync``, one ``memcpy``, one
zmq frame) and a ring of K slots is **one** allocation, exported once (one CUDA IPC handle, one
memfd).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["SlotSpec", "ALIGN_BYTES", "DTYPES", "FieldLayout", "SlotLayout", "dtype_name"]

#: ``{name: (shape, dtype)}``: the tensors of one slot, e.g.
#: ``{"features": ((R, S, L * D), torch.bfloat16), "input_ids": ((R, S), torch.int64)}``.
SlotSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

#: Alignment (bytes) of every tensor inside a slot and of the slot size: the CUDA allocation
#: granularity of small blocks, a multiple of every dtype size and of 128-bit vector loads.
ALIGN_BYTES = 256

#: dtypes a slot may hold, by wire name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a dtype (``torch.bfloat16`` → ``"bfloat16"``).

    Raises:
        ValueError: a dtype a slot cannot hold (complex, quantised, ...).
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel in a slot (supported: {sorted(DTYPES)})") from None


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class FieldLayout:
    """Where one named tensor lives inside a slot: ``offset`` and ``nbytes`` in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


class SlotLayout:
    """The packing of a :data:`SlotSpec` into one flat uint8 buffer.

    Fields keep the spec's order; each starts at a multiple of :data:`ALIGN_BYTES`;
    :attr:`nbytes` (the slot size) is rounded up to :data:`ALIGN_BYTES` too.

    Raises:
        ValueError: an empty spec, a bad name, a negative dimension or an unsupported dtype.
    """

    def __init__(self, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
        if not spec:
            raise ValueError("a slot spec needs at least one tensor")
        fields = []
        offset = 0
        for name, entry in spec.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"slot tensor names must be non-empty strings, got {name!r}")
            shape, dtype = entry
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise ValueError(f"slot tensor {name!r}: negative dimension in {shape}")
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            fields.append(FieldLayout(name, shape, dtype_name(dtype), offset, nbytes))
            offset = _round_up(offset + nbytes, ALIGN_BYTES)
        self.fields: tuple[FieldLayout, ...] = tuple(fields)
        self.nbytes: int = max(offset, ALIGN_BYTES)

    @property
    def spec(self) -> SlotSpec:
        """The spec back (``{name: (shape, dtype)}``)."""
        return {f.name: (f.shape, DTYPES[f.dtype]) for f in self.fields}

    def describe(self) -> list[list]:
        """Wire form: ``[[name, shape, dtype, offset, nbytes], ...]`` (msgpack-able)."""
        return [[f.name, list(f.shape), f.dtype, f.offset, f.nbytes] for f in self.fields]

    @property
    def digest(self) -> str:
        """A short hash of :meth:`describe`: equal digests mean byte-identical layouts."""
        text = repr(self.describe()).encode()
        return hashlib.sha256(text).hexdigest()[:16]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named tensor views into one slot.

        Args:
            flat: ``[nbytes]`` uint8, contiguous, on any device.
        Returns:
            ``{name: tensor of the spec's shape and dtype}``, all sharing ``flat``'s memory.
        Raises:
            ValueError: ``flat`` has the wrong size or dtype.
        """
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != self.nbytes:
            raise ValueError(f"slot buffer must be [{self.nbytes}] uint8, got {list(flat.shape)} {flat.dtype}")
        out = {}
        for f in self.fields:
            dtype = DTYPES[f.dtype]
            out[f.name] = flat[f.offset:f.offset + f.nbytes].view(dtype).view(f.shape)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotLayout) and self.fields == other.fields and self.nbytes == other.nbytes

    def __hash__(self) -> int:
        return hash((self.fields, self.nbytes))

    def __repr__(self) -> str:
        parts = ", ".join(f"{f.name}{list(f.shape)}:{f.dtype}" for f in self.fields)
        return f"SlotLayout({parts}; {self.nbytes} B)"
