"""The cuda_ipc pool's memory: allocated once by the capture server, exported once, mapped once per reader.

Scope: one host. Two backends behind one interface:

- ``cuda``: one ``torch.empty(N, uint8)`` on the writer's GPU, exported with ``UntypedStorage._share_cuda_()``
  (a CUDA IPC handle of the allocation, plus torch's refcount file) and opened by a reader with
  ``UntypedStorage._new_shared_cuda`` on the reader's *own* device: CUDA maps the allocation into that
  device's address space and enables peer access to the writer's GPU (``cudaIpcMemLazyEnablePeerAccess``), so
  a trainer rank on another GPU of the node reads it over NVLink and no rank creates a context on the
  writer's GPU. The exporting process cannot open its own handle; readers are other processes.
- ``shm``: a file under ``/dev/shm`` mapped by both sides, for the CPU stand-in capture server
  (:mod:`specforge_kimi.servers.reference_server`), so everything but the CUDA handle runs on a CPU machine.

The pool file ``<dir>/<pool_id>.json`` names the memory, the slot table, the writer's pid (with its start time,
so a reused pid is not taken for the writer) and the lease; it is written once, atomically, before the server
answers its first request. A reader refuses a pool whose writer is gone: its features are lost with it.

The pool file carries the CUDA IPC handle, so another user must not read it: the pool directory is 0700, the
pool file, the slot table and the shared-memory file 0600, whatever the umask, and each is created without
following a link (one planted at the path is refused, not written through). Stale-pool cleanup works only in a
private directory of this user (a directory of another user, or one others may write to, is refused with a
warning) and removes only names of the form this module creates for a well-formed pool id, each a file of this
user, never a path a pool file names.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from specforge_kimi.procfs import stat_fields
from specforge_kimi.transport.slots import SlotTable, create_private_file, open_existing, shm_dir

#: the pool ids :class:`~specforge_kimi.transport.writer.IpcCaptureWriter` makes (``uuid4().hex[:16]``)
POOL_ID = re.compile(r"^[0-9a-f]{16}$")

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolInfo:
    """The content of a pool file."""

    pool_id: str
    backend: str  # cuda | shm
    nbytes: int
    slots_path: str
    pid: int
    pid_start: str | None
    lease_s: float
    created: float
    device: dict[str, Any]  # cuda: the writer's {"index", "uuid", "name"}; shm: {}
    handle: dict[str, Any]  # cuda: {"share": the _share_cuda_ tuple, bytes as base64}; shm: {"path"}
    alloc_conf: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PoolInfo:
        if not isinstance(raw, dict):
            raise ValueError(f"pool file is not an object: {type(raw).__name__}")
        if raw.get("version") != 1:
            raise ValueError(f"pool file version {raw.get('version')!r}, expected 1")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in fields})


def pool_file(directory: str | os.PathLike, pool_id: str) -> Path:
    return Path(directory) / f"{pool_id}.json"


def slots_path(pool_id: str) -> Path:
    return shm_dir() / f"sfk-ipc-{pool_id}.slots"


def shm_pool_path(pool_id: str) -> Path:
    return shm_dir() / f"sfk-ipc-{pool_id}.pool"


def _not_ours(st: os.stat_result, directory: Path) -> str | None:
    """Why ``directory`` (``st``: its ``lstat``) is not a plain directory of this user; None when it is."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"cuda_ipc pool directory {directory} is not a plain directory (a link?)"
    if st.st_uid != os.geteuid():
        return f"cuda_ipc pool directory {directory} belongs to uid {st.st_uid}, not us (uid {os.geteuid()})"
    return None


def private_dir(directory: str | os.PathLike) -> Path:
    """``directory`` as a directory of this user with mode 0700 (created so, or narrowed to it); a link there or
    a directory of another user is refused (``PermissionError``): the pool file in it carries the IPC handle."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    problem = _not_ours(st, directory)
    if problem:
        raise PermissionError(errno.EPERM, f"{problem}; refusing it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(directory, 0o700)
    return directory


def write_pool_file(directory: str | os.PathLike, info: PoolInfo) -> Path:
    """Atomically (write a 0600 file, then rename) so a reader never sees half a file, in a 0700 directory. The
    pool id is fresh, so anything at the pool file's path already (a link included) is refused."""
    directory = private_dir(directory)
    path = pool_file(directory, info.pool_id)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    if os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, f"cuda_ipc: {path} exists already; refusing to replace it")
    with create_private_file(tmp, 0) as f:
        f.write(json.dumps(info.to_json(), indent=2).encode())
    os.replace(tmp, path)
    return path


def read_pool_file(directory: str | os.PathLike, pool_id: str) -> PoolInfo:
    path = pool_file(directory, pool_id)
    if not path.is_file():
        raise FileNotFoundError(
            f"cuda_ipc pool {pool_id}: no pool file {path} (is {directory} the capture server's "
            "SGLANG_SPEC_CAPTURE_IPC_DIR, and is that server still running?)"
        )
    return PoolInfo.from_json(json.loads(path.read_text()))


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22), None where unavailable."""
    fields = stat_fields(pid)
    return fields[19] if len(fields) > 19 else None


def alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``start`` (when known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start is None or process_start(pid) in (None, start)


def _encode(value: Any) -> Any:
    return {"b64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _decode(value: Any) -> Any:
    return base64.b64decode(value["b64"]) if isinstance(value, dict) and "b64" in value else value


def create_memory(pool_id: str, nbytes: int, device) -> tuple[Any, str, dict, dict]:
    """The writer's pool: ``(uint8 tensor of nbytes, backend, handle, device info)``."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        memory = torch.empty(int(nbytes), dtype=torch.uint8, device=torch.device("cuda", index))
        share = memory.untyped_storage()._share_cuda_()
        props = torch.cuda.get_device_properties(index)
        info = {"index": index, "uuid": str(getattr(props, "uuid", "")), "name": props.name}
        return memory, "cuda", {"share": [_encode(x) for x in share]}, info
    if device.type != "cpu":
        raise ValueError(f"cuda_ipc pools live on a CUDA device (or the CPU stand-in), not {device}")
    import numpy as np

    path = shm_pool_path(pool_id)
    with create_private_file(path, int(nbytes)) as f:
        mm = np.memmap(f, dtype=np.uint8, mode="r+", shape=(int(nbytes),))
    return torch.from_numpy(mm), "shm", {"path": str(path)}, {}


def open_memory(info: PoolInfo, device):
    """A reader's mapping of ``info``'s pool as a uint8 tensor (on ``device`` for the CUDA backend)."""
    import torch

    if info.backend == "shm":
        import numpy as np

        with open_existing(info.handle["path"]) as f:
            mm = np.memmap(f, dtype=np.uint8, mode="r+", shape=(int(info.nbytes),))
        return torch.from_numpy(mm)
    if info.backend != "cuda":
        raise ValueError(f"cuda_ipc pool {info.pool_id}: unknown backend {info.backend!r}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cuda_ipc pool {info.pool_id} is GPU memory; map it on a CUDA device, not {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check_peer_access(info, index)
    share = [_decode(x) for x in info.handle["share"]]
    # (device, handle, size, offset, ref-counter handle, ref-counter offset, event handle, event sync): opened
    # on the reader's own device; no event to wait for (the slot table orders writer and reader)
    _dev, handle, size, offset, rc_handle, rc_offset, ev_handle, _ev_sync = share
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, handle, size, offset, rc_handle, rc_offset, ev_handle, False
        )
    except RuntimeError as exc:
        raise RuntimeError(
            f"cuda_ipc pool {info.pool_id}: cannot open the capture server's CUDA IPC handle on cuda:{index} "
            f"({exc}); the allocator config of the server was {info.alloc_conf!r} (expandable segments need "
            "CAP_SYS_PTRACE or the same user) -- use server.transport: mooncake where this cannot work"
        ) from exc
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)


def _check_peer_access(info: PoolInfo, index: int) -> None:
    """When the writer's GPU is visible here and is not ``index``, ``index`` must reach it by peer access."""
    import torch

    uuid = info.device.get("uuid")
    if not uuid:
        return
    for j in range(torch.cuda.device_count()):
        if str(getattr(torch.cuda.get_device_properties(j), "uuid", "")) == uuid:
            if j != index and not torch.cuda.can_device_access_peer(index, j):
                raise RuntimeError(
                    f"cuda_ipc pool {info.pool_id} lives on cuda:{j}, which cuda:{index} cannot reach by peer "
                    "access (no P2P between these GPUs): use server.transport: mooncake"
                )
            return


class PoolReader:
    """One process's mapping of one pool: the memory, the slot table, the writer's liveness."""

    ALIVE_CHECK_S = 1.0

    def __init__(self, info: PoolInfo, device) -> None:
        self.info = info
        self.memory = open_memory(info, device)
        self.table = SlotTable.attach(info.slots_path)
        self.is_cuda = info.backend == "cuda"
        self._checked = 0.0
        self._streams = threading.local()

    def check_alive(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.ALIVE_CHECK_S:
            return
        if not alive(self.info.pid, self.info.pid_start):
            raise RuntimeError(
                f"the capture server (pid {self.info.pid}) that owned cuda_ipc pool {self.info.pool_id} is gone; "
                "the features it held for unacknowledged samples went with it"
            )
        self._checked = now

    def _stream(self, device):
        import torch

        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(device=device)
        return stream

    def read(self, desc, specs: Mapping[str, tuple[tuple[int, ...], Any]], names: Iterable[str], device) -> dict:
        """Copy ``names`` of the sample ``desc`` places into fresh tensors on ``device``; ``specs`` gives each
        one's (shape, torch dtype). ``KeyError`` when the slot no longer holds the sample (before or after the
        copy: a slot reclaimed during the copy is refused, not half read)."""
        import contextlib

        import torch

        self.check_alive()
        if desc.pool_id != self.info.pool_id:
            raise ValueError(f"cuda_ipc descriptor names pool {desc.pool_id}, this reader maps {self.info.pool_id}")
        if not 1 <= desc.slot <= self.table.max_slots:
            raise ValueError(
                f"cuda_ipc descriptor slot {desc.slot} is outside pool {desc.pool_id}'s 1..{self.table.max_slots}"
            )
        if self.table.current(desc.slot) != desc.alloc_id:
            raise KeyError(f"cuda_ipc slot {desc.slot} of pool {desc.pool_id} no longer holds alloc {desc.alloc_id}")
        names = list(names)
        self._check_places(desc, specs, names)
        device = torch.device(device)
        on_gpu = device.type == "cuda"
        stream = self._stream(device) if on_gpu and self.is_cuda else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        out = {}
        with ctx:
            for name in names:
                offset, nbytes = desc.features[name]
                shape, dtype = specs[name]
                view = self.memory[offset : offset + nbytes].view(dtype)
                dst = torch.empty(tuple(shape), dtype=dtype, device=device)
                dst.copy_(view.view(tuple(shape)), non_blocking=stream is not None)
                out[name] = dst
        if stream is not None:
            stream.synchronize()
            consumer = torch.cuda.default_stream(device)
            for t in out.values():
                # allocated on our stream, used next on the default one (SpecForge's collate and step): the
                # allocator must not hand the block to our next read before that use is done
                t.record_stream(consumer)
        # without a stream every copy above touched the host, and those copies are synchronous
        if self.table.current(desc.slot) != desc.alloc_id:
            raise KeyError(f"cuda_ipc slot {desc.slot} of pool {desc.pool_id} was reclaimed during the read")
        return out

    def _check_places(self, desc, specs: Mapping[str, tuple[tuple[int, ...], Any]], names: list[str]) -> None:
        """Every feature read must lie inside the region the slot lent (the server wrote it into the slot table),
        start aligned as the writer places it and hold exactly its spec's bytes: a descriptor pointing elsewhere
        -- another sample's bytes, past the pool, mid-element -- is refused, not answered."""
        from specforge_kimi.transport import ALIGN

        lo, n = self.table.region(desc.slot)
        hi = min(lo + n, self.info.nbytes)
        for name in names:
            offset, nbytes = desc.features[name]
            shape, dtype = specs[name]
            if offset < lo or offset + nbytes > hi:
                raise ValueError(
                    f"cuda_ipc descriptor of pool {desc.pool_id} slot {desc.slot}: feature {name!r} at "
                    f"[{offset}, {offset + nbytes}) lies outside the region the slot lent, [{lo}, {hi}); refused"
                )
            if offset % ALIGN:
                raise ValueError(f"cuda_ipc feature {name!r}: offset {offset} is not {ALIGN}-byte aligned; refused")
            want = _numel(shape) * dtype.itemsize
            if nbytes != want:
                raise ValueError(
                    f"cuda_ipc feature {name!r}: {nbytes} bytes in the pool, spec {tuple(shape)} {dtype} needs {want}"
                )

    def release(self, desc) -> bool:
        return self.table.release(desc.slot, desc.alloc_id)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def remove_pool_files(info: PoolInfo, directory: str | os.PathLike | None = None) -> None:
    """The writer's own cleanup: remove the slot table, the shared-memory file (``shm``) and, with ``directory``,
    the pool file of the pool ``info`` describes (``info`` is the writer's, not read back from a file)."""
    paths = [Path(info.slots_path)]
    if info.backend == "shm":
        paths.append(Path(info.handle["path"]))
    if directory is not None:
        paths.append(pool_file(directory, info.pool_id))
    _unlink(paths)


def _unlink(paths: Iterable[Path]) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def remove_stale(directory: str | os.PathLike) -> list[str]:
    """Remove what pools of dead writers left under ``directory`` (and in ``/dev/shm``): a capture server
    killed without its cleanup leaves them. Returns the pool ids removed; live pools are kept.

    Only in a private directory of this user -- what :func:`private_dir` makes: ours, not a link, no group or
    other permission bits. Anything else (a directory of another user, one others may write to) is refused
    with a one-line warning and nothing is removed: a pool file there may be anyone's, naming anyone's pool.
    Only this module's own names go: ``<id>.json`` in ``directory`` and ``sfk-ipc-<id>.{slots,pool}`` in the
    shared-memory directory, for an ``<id>`` of the form writers make, each a regular file of this user; the
    paths a pool file names are never followed, so a pool file cannot point the cleanup at other files."""
    directory = Path(directory)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning(
            "cuda_ipc stale-pool cleanup: cannot open %s as a directory (%s); removing nothing", directory, exc.strerror
        )
        return []
    try:
        st = os.fstat(dir_fd)
        problem = _not_ours(st, directory) or (
            f"cuda_ipc pool directory {directory} is open to others (mode {stat.S_IMODE(st.st_mode):04o})"
            if stat.S_IMODE(st.st_mode) & 0o077
            else None
        )
        if problem:
            logger.warning("stale-pool cleanup refused: %s; removing nothing", problem)
            return []
        return [pool_id for pool_id in sorted(_pool_ids(dir_fd)) if _remove_if_dead(dir_fd, pool_id)]
    finally:
        os.close(dir_fd)


def _pool_ids(dir_fd: int) -> list[str]:
    names = (n[: -len(".json")] for n in os.listdir(dir_fd) if n.endswith(".json"))
    return [pool_id for pool_id in names if POOL_ID.fullmatch(pool_id)]


def _remove_if_dead(dir_fd: int, pool_id: str) -> bool:
    """Remove pool ``pool_id``'s files if its pool file (in the directory ``dir_fd``, a regular file of this user)
    names a writer that is gone; whether it did."""
    name = f"{pool_id}.json"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return False
            raw = json.loads(f.read(1 << 20))
        pid, start = raw["pid"], raw.get("pid_start")
        if raw.get("pool_id") != pool_id or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return False
        if alive(pid, start if isinstance(start, str) else None):
            return False
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError):
        return False
    for path in (slots_path(pool_id), shm_pool_path(pool_id)):
        _unlink_own(path)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    return True


def _unlink_own(path: Path) -> None:
    """Unlink ``path`` if it is a regular file of this user (``/dev/shm`` is shared: another user's file of the same
    name stays, even for root)."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    except FileNotFoundError:
        pass
