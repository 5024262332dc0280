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

import os
import socket
from typing import Any, Protocol

from ..errors import InvalidArgumentError


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
    """An mpi4py communicator (duplicated: our messages never match the caller's)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm.Dup()
        self.rank, self.size, self.node = self._comm.Get_rank(), self._comm.Get_size(), node_name()

    def allgather(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()


class TorchComm:
    """A torch.distributed process group; collectives go through a private gloo group (CPU objects,
    and safe beside NCCL collectives of the training loop on the default group)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InvalidArgumentError("torch.distributed is not initialized; call "
                                       "torch.distributed.init_process_group first, or pass comm=None")
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._dist = dist
        self._group = dist.new_group(ranks=ranks, backend="gloo")
        self.rank = dist.get_rank(self._group)
        self.size = dist.get_world_size(self._group)
        self.node = node_name()

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._dist.get_global_rank(self._group, root), group=self._group)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)


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
