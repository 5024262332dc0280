"""Communicators: the few collectives a distributed save needs, over one process, mpi4py or
torch.distributed, behind one small interface.

    comm = as_comm(MPI.COMM_WORLD)        # or a torch.distributed process group, or None
    comm.rank, comm.size, comm.node       # node: $DATASTATES_NODE, else the host name
    comm.allgather(obj) -> list           # every rank gets every rank's object, in rank order
    comm.bcast(obj, root=0) -> obj
    comm.barrier()

Objects are small Python values (plans, manifest ids, chunk locations): never tensors. The mpi4py
and torch backends work on a private duplicate of the caller's communicator or group, so the
store's collectives (which run on its pipeline thread) never interleave with the training loop's.
Creating one is collective: every rank must call `as_comm` in the same order.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Protocol

from ..errors import CommTimeoutError, InvalidArgumentError

DEFAULT_TIMEOUT = 1800.0
"""Seconds a collective waits for the other ranks before CommTimeoutError ($DATASTATES_COMM_TIMEOUT)."""


def comm_timeout() -> float:
    """The collective timeout: $DATASTATES_COMM_TIMEOUT seconds, else DEFAULT_TIMEOUT."""
    raw = os.environ.get("DATASTATES_COMM_TIMEOUT")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise InvalidArgumentError(f"DATASTATES_COMM_TIMEOUT={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise InvalidArgumentError(f"DATASTATES_COMM_TIMEOUT={raw!r} must be positive")
    return value


def _timed_out(what: str, timeout: float) -> CommTimeoutError:
    return CommTimeoutError(f"{what}: the other ranks did not arrive within {timeout:g} s (a rank hung or died); "
                            "nothing of this save is visible. End the job and restart it from the last version; "
                            "raise DATASTATES_COMM_TIMEOUT if saves are just slow")


def node_name() -> str:
    """This process's node: $DATASTATES_NODE when set (tests fake nodes with it), else the host name."""
    return os.environ.get("DATASTATES_NODE") or socket.gethostname()


class Comm(Protocol):
    """What datastates needs of a communicator."""

    rank: int
    size: int
    node: str

    def allgather(self, obj: Any) -> list[Any]: ...

    def bcast(self, obj: Any, root: int = 0) -> Any: ...

    def barrier(self) -> None: ...


class SingleComm:
    """One process: every collective is the identity."""

    def __init__(self) -> None:
        self.rank, self.size, self.node = 0, 1, node_name()

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None


class MpiComm:
    """An mpi4py communicator (duplicated: our messages never match the caller's).

    Before each collective the ranks meet in a non-blocking barrier polled against a deadline, so a
    rank that never arrives ends in CommTimeoutError instead of a hang; after that the communicator
    is broken (its barrier is still pending) and every later collective raises at once."""

    def __init__(self, comm: Any, timeout: float | None = None) -> None:
        self._comm = comm.Dup()
        self.rank, self.size, self.node = self._comm.Get_rank(), self._comm.Get_size(), node_name()
        self.timeout = comm_timeout() if timeout is None else timeout
        self._broken = False

    def _arrive(self, what: str) -> None:
        if self._broken:
            raise _timed_out(f"{what} after an earlier timeout", self.timeout)
        req = self._comm.Ibarrier()
        deadline = time.monotonic() + self.timeout
        pause = 1e-4
        while not req.Test():
            if time.monotonic() > deadline:
                self._broken = True
                raise _timed_out(what, self.timeout)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)  # quick when the ranks are close, cheap when one is late

    def allgather(self, obj: Any) -> list[Any]:
        self._arrive("allgather")
        return list(self._comm.allgather(obj))

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self._arrive("bcast")
        return self._comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self._arrive("barrier")


class TorchComm:
    """A torch.distributed process group; collectives go through a private gloo group (CPU objects,
    and safe beside NCCL collectives of the training loop on the default group)."""

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InvalidArgumentError("torch.distributed is not initialized; call "
                                       "torch.distributed.init_process_group first, or pass comm=None")
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._dist = dist
        self.timeout = comm_timeout() if timeout is None else timeout
        # gloo enforces the group's timeout itself: a collective a rank never joins raises.
        self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        self.rank = dist.get_rank(self._group)
        self.size = dist.get_world_size(self._group)
        self.node = node_name()

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise _timed_out(what, self.timeout) from exc
            raise

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._call("allgather", self._dist.all_gather_object, out, obj, group=self._group)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._call("bcast", self._dist.broadcast_object_list, box,
                   src=self._dist.get_global_rank(self._group, root), group=self._group)
        return box[0]

    def barrier(self) -> None:
        self._call("barrier", self._dist.barrier, group=self._group)


def as_comm(comm: Any) -> Comm:
    """A Comm for `comm`: None (one process), an mpi4py communicator, a torch.distributed process
    group, the string "torch" (the default group), or a Comm already. Collective for mpi4py and torch.
    Raises InvalidArgumentError for anything else."""
    if comm is None:
        return SingleComm()
    if isinstance(comm, (SingleComm, MpiComm, TorchComm)):
        return comm
    if comm == "torch":
        return TorchComm(None)
    if hasattr(comm, "Dup") and hasattr(comm, "Get_rank"):
        return MpiComm(comm)
    try:
        import torch.distributed as dist

        if isinstance(comm, dist.ProcessGroup):
            return TorchComm(comm)
    except ImportError:
        pass
    raise InvalidArgumentError(f"comm={comm!r} is not a communicator; pass an mpi4py communicator "
                               "(MPI.COMM_WORLD), a torch.distributed process group, \"torch\", or None")
