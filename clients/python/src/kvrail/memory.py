"""Memory the sidecar can map: shared-memory files for host KV caches, and CUDA
IPC handles of GPU tensors."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .errors import LayoutError
from .layout import KvLayout, Layout, PagedLayout, TensorView, paged_layout

# Address ranges of the shared-memory files this process mapped, so that a tensor
# handed over later (as vLLM hands its KV caches to a connector) can be traced
# back to the file the sidecar has to map.
# Entries are (end, path, inode); an entry whose range no longer maps that
# inode (the owner freed the memory, the address was reused) is stale.
_mapped: dict[int, tuple[int, Path, int]] = {}
_mapped_lock = threading.Lock()


def shm_dir() -> Path:
    """Where shared-memory files go: ``$KVRAIL_SHM_DIR`` or ``/dev/shm``."""
    return Path(os.environ.get("KVRAIL_SHM_DIR", "/dev/shm"))


#: Name prefix of the files :func:`adopt_host_memory` makes (then the pid).
ADOPTED_PREFIX = "kvrail-adopted-"


def _reserve(fd: int, nbytes: int, path: Path) -> None:
    """Allocates the file's blocks now: a filesystem short of space (docker's
    64 MiB /dev/shm) says so here instead of killing the process with SIGBUS
    at a later write. Filesystems without fallocate keep the sparse file."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise OSError(
            e.errno,
            f"cannot reserve {nbytes} bytes for {path}: {e.strerror} "
            f"(is the filesystem large enough? in docker, raise --shm-size)",
        ) from e


class SharedMemory:
    """A file on a tmpfs, sized and mapped shared; the sidecar maps the same file."""

    def __init__(self, path: str | os.PathLike[str], nbytes: int) -> None:
        if nbytes <= 0:
            raise LayoutError(f"shared memory of {nbytes} bytes")
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            _reserve(fd, nbytes, self.path)
            self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            fd = -1
            self.path.unlink(missing_ok=True)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        self.nbytes = nbytes
        #: The whole file as bytes.
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = int(self.array.__array_interface__["data"][0])
        with _mapped_lock:
            _mapped[self.address] = (self.address + nbytes, self.path, os.stat(self.path).st_ino)

    def unlink(self) -> None:
        """Removes the file (the mapping stays valid until the last view goes)."""
        with _mapped_lock:
            _mapped.pop(self.address, None)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.unlink()


@dataclass(frozen=True)
class _Mapping:
    """One line of ``/proc/self/maps``."""

    lo: int
    hi: int
    perms: str
    inode: int
    path: str


def _mappings() -> Iterator[_Mapping]:
    """This process's mappings, in address order."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5].strip() if len(fields) > 5 else ""
            yield _Mapping(lo, hi, fields[1], int(fields[4]), path)


def _kvrail_range(address: int) -> tuple[int, int, Path] | None:
    """(start, end, file) of the kvrail shared memory holding ``address``, if it
    is still mapped here. An entry whose range no longer maps its file (the
    owner freed the memory, the address now holds something else) is dropped."""
    with _mapped_lock:
        for start, (end, path, inode) in list(_mapped.items()):
            if start <= address < end:
                if next((m.inode for m in _mappings() if m.lo <= address < m.hi), None) != inode:
                    del _mapped[start]
                    continue
                return start, end, path
    return None


def find_shared_memory(address: int) -> tuple[Path, int]:
    """The file and the offset in it of an address inside a :class:`SharedMemory`
    (or memory adopted with :func:`adopt_host_memory`) that is still mapped."""
    found = _kvrail_range(address)
    if found is None:
        raise LayoutError(
            f"address {address:#x} is not in shared memory created by kvrail "
            "(allocate host KV caches with kvrail.HostKvCache or kvrail.SharedMemory)"
        )
    start, _, path = found
    return path, address - start


_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_SHARED, _MAP_FIXED = 0x01, 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value
#: Bytes copied and remapped at a time when adopting memory (page multiple).
_ADOPT_CHUNK = 64 << 20
#: glibc's largest mmap threshold on 64-bit: allocations at least this large
#: are always mmap'd on their own, never carved from a shared heap or arena.
MIN_ADOPTED_ALLOCATION = 32 << 20


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    return libc


def _private_anonymous(start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies wholly in private, anonymous, readable and
    writable mappings of this process other than the brk heap (large torch and
    numpy allocations are mmap'd on their own), from ``/proc/self/maps``."""
    covered = start
    for m in _mappings():
        if m.hi <= covered or m.lo > covered:
            continue
        if not m.perms.startswith("rw") or m.perms[3] != "p" or m.inode != 0:
            return False
        # Not the brk heap: its pages hold other allocations, which other
        # threads may write while the pages are copied and remapped.
        if m.path != "":
            return False
        covered = m.hi
        if covered >= end:
            return True
    return False


class AdoptedMemory:
    """Host memory this process allocated itself (a torch or numpy KV cache),
    moved under a shared-memory file without moving its address, so the sidecar
    can map the same pages. See :func:`adopt_host_memory`."""

    def __init__(
        self, path: Path, address: int, nbytes: int, owned: bool = True, lock_fd: int | None = None
    ) -> None:
        self.path = path
        self.address = address
        self.nbytes = nbytes
        #: False when the memory already was kvrail shared memory (a
        #: ``SharedMemory`` or ``HostKvCache`` keeps its own file).
        self.owned = owned
        # Held open with a shared lock while this process lives: a sweep
        # (sweep_adopted_files) never removes a file in use, whatever it
        # makes of the pid in its name (another pid namespace).
        self._lock_fd = lock_fd

    def unlink(self) -> None:
        """Removes the file (if adoption made it); the pages stay valid for
        every mapping of them (this process's and the sidecar's) until each is
        unmapped."""
        if not self.owned:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def adopt_host_memory(address: int, nbytes: int, min_allocation: int = 0) -> AdoptedMemory:
    """Puts the pages holding ``[address, address + nbytes)`` into a new file in
    :func:`shm_dir` and maps that file over them at the same address, contents
    kept: the allocation (e.g. vLLM's CPU KV cache, which the engine allocates
    with ``torch.zeros``) stays where it is for its owner, and the sidecar can
    map the file and read and write the same bytes with no copy per transfer.

    Call it before the memory is in use by other threads (e.g. from
    ``register_kv_caches``): bytes written to the pages during the call are lost.
    The whole pages are adopted, so they must belong to one private anonymous
    allocation mmap'd on its own (glibc does so for allocations above its mmap
    threshold, at most 32 MiB; a KV cache is far larger); anything else (the brk
    heap, file-backed, read-only or shared memory) is refused. When the owner frees the
    allocation, its munmap unmaps the file's pages as it would anonymous ones.
    Idempotent: memory already in kvrail shared memory is returned as it is;
    other memory under ``min_allocation`` bytes is refused.
    """
    if nbytes <= 0:
        raise LayoutError(f"cannot adopt {nbytes} bytes")
    found = _kvrail_range(address)
    if found is not None:
        start, end, path = found
        if address + nbytes <= end:
            return AdoptedMemory(path, start, end - start, owned=False)
        raise LayoutError(f"{address:#x}+{nbytes} runs past kvrail shared memory {path}")
    if nbytes < min_allocation:
        raise LayoutError(
            f"a {nbytes}-byte allocation at {address:#x} is not in kvrail shared memory and too "
            f"small to adopt (under {min_allocation} bytes it may share pages with other "
            "objects): allocate it with kvrail.HostKvCache or kvrail.SharedMemory"
        )
    page = mmap.PAGESIZE
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    length = end - start
    if not _private_anonymous(start, end):
        raise LayoutError(
            f"memory {address:#x}+{nbytes} is not wholly private anonymous read-write "
            "memory of this process: cannot adopt it into shared memory"
        )
    path = shm_dir() / f"{ADOPTED_PREFIX}{os.getpid()}-{start:x}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    libc = _libc()
    try:
        # Reserved up front: a full tmpfs is an error here, not a SIGBUS while
        # copying.
        os.posix_fallocate(fd, 0, length)
        # A chunk at a time, each replaced as soon as it is copied: the process
        # never holds much more than the allocation itself.
        for offset in range(0, length, _ADOPT_CHUNK):
            n = min(_ADOPT_CHUNK, length - offset)
            staging = libc.mmap(None, n, _PROT_READ | _PROT_WRITE, _MAP_SHARED, fd, offset)
            if staging in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap of the adopted file failed")
            try:
                ctypes.memmove(staging, start + offset, n)
                placed = libc.mmap(start + offset, n, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED, fd, offset)
                if placed != start + offset:
                    raise OSError(ctypes.get_errno(), "mapping the adopted file in place failed")
            finally:
                libc.munmap(staging, n)
    except BaseException:
        os.close(fd)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        raise
    inode = os.fstat(fd).st_ino
    # Kept open, share-locked, for as long as this process lives (see
    # AdoptedMemory): closed by unlink(), or by the process's end.
    fcntl.flock(fd, fcntl.LOCK_SH)
    with _mapped_lock:
        _mapped[start] = (end, path, inode)
    return AdoptedMemory(path, start, length, lock_fd=fd)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _in_use(path: Path) -> bool:
    """Whether a live process holds ``path``'s adoption lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def sweep_adopted_files(directory: Path | None = None) -> list[Path]:
    """Removes adopted-memory files that processes which no longer exist left
    behind (an engine killed with SIGKILL cannot remove its own, and its
    sidecar may have been down too), of this user only, in ``directory``
    (default :func:`shm_dir`). Returns what it removed. A file whose process
    is alive, or that a process holds locked (an engine in another pid
    namespace sharing the directory), and anything else, are left alone."""
    removed = []
    me = os.geteuid()
    for path in (directory or shm_dir()).glob(f"{ADOPTED_PREFIX}*-*"):
        pid_text = path.name[len(ADOPTED_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _process_alive(int(pid_text)):
            continue
        try:
            st = path.lstat()
            if st.st_uid != me or not path.is_file() or path.is_symlink() or _in_use(path):
                continue
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def adopt_tensor(t: Any) -> AdoptedMemory:
    """:func:`adopt_host_memory` for the whole allocation holding a torch CPU
    tensor (its untyped storage) or a numpy array (its base buffer). Memory
    already in kvrail shared memory is returned as it is; otherwise the
    allocation must be at least :data:`MIN_ADOPTED_ALLOCATION` bytes, so that
    glibc mmap'd it on its own (smaller ones may share pages with other
    objects, which other threads write)."""
    if hasattr(t, "untyped_storage"):
        storage = t.untyped_storage()
        address, nbytes = int(storage.data_ptr()), int(storage.nbytes())
    else:
        base = t
        while isinstance(getattr(base, "base", None), np.ndarray):
            base = base.base
        address, nbytes = TensorView.of(base).address, int(base.nbytes)
    return adopt_host_memory(address, nbytes, MIN_ADOPTED_ALLOCATION)


class HostKvCache:
    """A paged KV cache in host shared memory, as vLLM lays it out: one array per
    layer (``[2, num_blocks, *block_shape]`` for ``flash_attn``,
    ``[num_blocks, 2, *block_shape]`` for ``flash_infer``, ``[num_blocks,
    *block_shape]`` for ``mla``), layers back to back in one file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        num_layers: int,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: Any = np.float16,
        kv_layout: KvLayout = "flash_attn",
    ) -> None:
        dtype = np.dtype(dtype)
        if kv_layout == "flash_attn":
            shape = (2, num_blocks, *block_shape)
        elif kv_layout == "flash_infer":
            shape = (num_blocks, 2, *block_shape)
        elif kv_layout == "mla":
            shape = (num_blocks, *block_shape)
        else:
            raise LayoutError(f"unknown kv_layout {kv_layout!r}")
        layer_bytes = int(np.prod(shape)) * dtype.itemsize
        self.memory = SharedMemory(path, num_layers * layer_bytes)
        self.kv_layout: KvLayout = kv_layout
        #: One array per layer, views of the shared file.
        self.layers: list[np.ndarray] = [
            self.memory.array[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).reshape(shape)
            for i in range(num_layers)
        ]
        paged = paged_layout(self.layers, kv_layout)
        self.layout: Layout = paged.layout.shifted(paged.address - self.memory.address)

    @property
    def path(self) -> Path:
        return self.memory.path

    def block(self, layer: int, plane: int, block: int) -> np.ndarray:
        """One block's bytes (a writable view)."""
        off = self.layout.block_offset(layer, plane, block)
        return self.memory.array[off : off + self.layout.block_bytes]

    def unlink(self) -> None:
        self.memory.unlink()


@dataclass(frozen=True)
class CudaIpc:
    """GPU memory as the sidecar imports it: the allocation's IPC handle, its device,
    and where the layout starts inside the allocation."""

    handle: bytes
    device: int
    offset: int


def cuda_ipc_of_torch(tensor: Any) -> CudaIpc:
    """The CUDA IPC handle of the allocation holding a torch CUDA tensor.

    The memory must come from cudaMalloc (torch's default caching allocator), not
    from a stream-ordered pool (``expandable_segments`` or ``cudaMallocAsync``).
    """
    if getattr(getattr(tensor, "device", None), "type", None) != "cuda":
        raise LayoutError("not a CUDA tensor")
    storage = tensor.untyped_storage()
    # (device, handle, size, offset of the storage in the allocation, ...)
    shared = storage._share_cuda_()
    device, handle, offset = int(shared[0]), bytes(shared[1]), int(shared[3])
    if len(handle) == 66:
        # Newer torch prefixes the handle with a version byte (2) and its kind:
        # b"c" for cudaMalloc memory, b"e" for an expandable segment.
        version, kind = handle[0], handle[1:2]
        if version != 2 or kind != b"c":
            raise LayoutError(
                f"torch shares this tensor as {kind!r} (version {version}), not cudaMalloc "
                "memory: run without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            )
        handle = handle[2:]
    if len(handle) != 64:
        raise LayoutError(f"unexpected CUDA IPC handle of {len(handle)} bytes")
    return CudaIpc(handle, device, offset + (tensor.data_ptr() - storage.data_ptr()))


def describe(layers: Sequence[Any], kv_layout: KvLayout | None = None) -> tuple[PagedLayout, Path | CudaIpc]:
    """The layout of per-layer KV tensors and what the sidecar should map: the
    shared-memory file (host tensors) or the CUDA IPC allocation (GPU tensors).
    The returned layout's ``base_offset`` is the offset inside that memory."""
    paged = paged_layout(layers, kv_layout)
    if paged.device == "cpu":
        path, offset = find_shared_memory(paged.address)
        return PagedLayout(paged.layout.shifted(offset), paged.address, paged.device), path
    ipc = cuda_ipc_of_torch(layers[0])
    return PagedLayout(paged.layout.shifted(ipc.offset), paged.address, paged.device), ipc
