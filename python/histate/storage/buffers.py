"""Host buffers: block-aligned allocation and the adapters from caller objects to flat byte views.

The store moves bytes. Callers hand in numpy arrays, memoryviews/bytes, or CPU torch tensors (duck-typed:
torch is never imported here); each becomes a flat uint8 view plus a dtype name and shape for the header.
Aligned buffers matter because O_DIRECT needs block-aligned host addresses; anything else is bounced.
"""
from __future__ import annotations

import ctypes
import sys

import numpy as np

from histate.storage.format import ALIGN_BYTES


_UINT8 = np.dtype(np.uint8)


def aligned_empty(num_bytes: int, align_bytes: int = ALIGN_BYTES) -> np.ndarray:
    """Uninitialised uint8 array whose data pointer is a multiple of `align_bytes`."""
    raw = np.empty(num_bytes + align_bytes, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align_bytes
    return raw[offset: offset + num_bytes]


def address_of(view: np.ndarray) -> int:
    """Address of the first byte. `ctypes.c_char.from_buffer` costs ~0.5 us against ~2 us for
    `ndarray.ctypes.data`, which matters once per page of a batch; it needs a writable, non-empty
    buffer, so read-only and empty views take the slow path."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return int(view.ctypes.data)


def is_aligned(view: np.ndarray, align_bytes: int = ALIGN_BYTES) -> bool:
    return address_of(view) % align_bytes == 0


def _is_torch_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _torch_bytes(tensor, writable: bool) -> np.ndarray:
    torch = sys.modules["torch"]  # present: the caller already holds a tensor
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor on {tensor.device}: the store reads and writes host (CPU) memory only")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (call .contiguous() first)")
    flat = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    if writable and not flat.flags.writeable:
        raise ValueError("destination tensor is not writable")
    return flat


def source_view(obj) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """(flat uint8 view sharing memory, dtype name, shape) of a payload to write."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous and not obj.dtype.hasobject:  # the common case
        flat = obj if obj.dtype is _UINT8 and obj.ndim == 1 else obj.reshape(-1).view(np.uint8)
        return flat, obj.dtype.str, obj.shape
    if _is_torch_tensor(obj):
        return _torch_bytes(obj, writable=False), str(obj.dtype), tuple(int(d) for d in obj.shape)
    if isinstance(obj, np.generic):
        obj = np.asarray(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise ValueError(f"object arrays cannot be stored (dtype {obj.dtype})")
        if not obj.flags.c_contiguous:
            raise ValueError("array must be C-contiguous (use np.ascontiguousarray)")
        return obj.reshape(-1).view(np.uint8), obj.dtype.str, tuple(int(d) for d in obj.shape)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"cannot store {type(obj).__name__}: expected ndarray, tensor or buffer") from None
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    flat = np.frombuffer(mv.cast("B") if mv.ndim else mv, dtype=np.uint8)
    return flat, "|u1", (flat.size,)


def destination_bytes(obj) -> np.ndarray:
    """Flat writable uint8 view of a caller-supplied read destination (any size). Raises ValueError /
    TypeError for what can never be a destination (read-only, non-contiguous, not a buffer)."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous and obj.flags.writeable:  # the common case
        return obj if obj.dtype is _UINT8 and obj.ndim == 1 else obj.reshape(-1).view(np.uint8)
    if _is_torch_tensor(obj):
        return _torch_bytes(obj, writable=True)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous or not obj.flags.writeable:
            raise ValueError("destination array must be C-contiguous and writable")
        return obj.reshape(-1).view(np.uint8)
    mv = memoryview(obj)
    if mv.readonly or not mv.c_contiguous:
        raise ValueError("destination buffer must be writable and C-contiguous")
    return np.frombuffer(mv.cast("B") if mv.ndim else mv, dtype=np.uint8)


def typed_view(flat: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The payload as the numpy array it was written from; raw uint8 for non-numpy dtypes (bf16...)."""
    try:
        dtype = np.dtype(dtype_name.removeprefix("torch."))  # torch.float32 -> float32; bfloat16 fails
    except TypeError:
        return flat
    if dtype.itemsize == 0 or flat.size % dtype.itemsize:
        return flat
    return flat.view(dtype).reshape(shape)
