"""Byte views of memory that other objects own (a tensor's storage), made from its address."""

from __future__ import annotations

import ctypes


def bytes_at(address: int, n: int) -> memoryview:
    """A writable, flat uint8 view of the `n` bytes at `address` (`n` > 0).

    Made without numpy: a numpy array of a tensor kept alive makes its storage unresizable (`resize_` raises),
    and `Tensor.numpy()` with the reshape and view a byte array needs costs ~3 us more per tensor (a load of
    8,000 small tensors makes 8,000). The view holds no reference to the memory's owner: it is valid only while
    the caller keeps the owner alive and does not resize it."""
    return memoryview((ctypes.c_char * n).from_address(address)).cast("B")
