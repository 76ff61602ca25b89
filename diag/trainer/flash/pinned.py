"""Pinned shared memory for the CUDA path: the slot mappings are registered with CUDA
(`cudaHostRegister`), so device-to-host copies into them run as asynchronous DMA at full PCIe/NVLink
bandwidth instead of being staged through a pageable bounce buffer."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class HostRegistry:
    def __init__(self) -> None:
        self._by_key: dict[int, tuple[int, int]] = {}  # slot index -> (pointer, size)
        self.failed = False

    def ensure(self, key: int, ptr: int, size: int) -> bool:
        """Registers [ptr, ptr+size) once; True when the range is pinned."""
        if self._by_key.get(key) == (ptr, size):
            return True
        self.release(key)
        if self.failed:
            return False
        import torch

        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            # Copies still work (pageable, synchronous); say so once.
            self.failed = True
            log.warning(
                "diag: cudaHostRegister of %d bytes failed (%s); copies unpinned", size, err
            )
            return False
        self._by_key[key] = (ptr, size)
        return True

    def release(self, key: int) -> None:
        entry = self._by_key.pop(key, None)
        if entry is None:
            return
        import torch

        err = torch.cuda.cudart().cudaHostUnregister(entry[0])
        if int(err) != 0:
            log.debug("diag: cudaHostUnregister failed: %s", err)

    def release_all(self) -> None:
        for key in list(self._by_key):
            self.release(key)
