"""GPU memory for workers without torch: a ``cuMemAlloc`` buffer exported by
CUDA IPC, through the driver library (libcuda) with ctypes. Torch users pass
their CUDA tensors to :func:`kvrail.describe` instead."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .errors import KvrailError
from .memory import CudaIpc


class CudaError(KvrailError):
    status = "CUDA"


_lib: Any = None


def _driver() -> Any:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"no CUDA driver (libcuda.so.1): {e}") from None
        _check(lib.cuInit(0), "cuInit")
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CudaError(f"{what} failed with CUresult {rc}")


def device_count() -> int:
    """GPUs the driver sees (0 without a driver)."""
    try:
        lib = _driver()
    except CudaError:
        return 0
    n = ctypes.c_int(0)
    _check(lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    return n.value


class CudaBuffer:
    """``nbytes`` of device memory on ``device`` (its primary context), with its
    IPC handle for :meth:`kvrail.Client.register_cuda`."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        lib = _driver()
        self.device = device
        dev = ctypes.c_int(0)
        _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self._ctx = ctypes.c_void_p()
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self.ptr = ctypes.c_uint64(0)
        _check(lib.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        self.nbytes = nbytes

    def ipc(self, offset: int = 0) -> CudaIpc:
        handle = (ctypes.c_char * 64)()
        _check(_driver().cuIpcGetMemHandle(handle, self.ptr), "cuIpcGetMemHandle")
        return CudaIpc(bytes(handle), self.device, offset)

    def upload(self, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data)
        if offset + data.nbytes > self.nbytes:
            raise CudaError(f"{data.nbytes} bytes at {offset} overflow {self.nbytes}")
        _check(
            _driver().cuMemcpyHtoD_v2(
                ctypes.c_uint64(self.ptr.value + offset), data.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(data.nbytes)
            ),
            "cuMemcpyHtoD",
        )

    def download(self, nbytes: int, offset: int = 0) -> np.ndarray:
        if offset + nbytes > self.nbytes:
            raise CudaError(f"{nbytes} bytes at {offset} overflow {self.nbytes}")
        out = np.empty(nbytes, dtype=np.uint8)
        _check(
            _driver().cuMemcpyDtoH_v2(
                out.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(self.ptr.value + offset), ctypes.c_size_t(nbytes)
            ),
            "cuMemcpyDtoH",
        )
        return out

    def free(self) -> None:
        if self.ptr.value:
            _check(_driver().cuMemFree_v2(self.ptr), "cuMemFree")
            self.ptr = ctypes.c_uint64(0)
