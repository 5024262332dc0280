"""Communicators: the few collectives a distributed save needs, over one process, mpi4py or
torch.distributed, behind one small interface.

    comm = as_comm(MPI.COMM_WORLD)        # or a torch.distributed process group, or None
    comm.rank, comm.size, comm.node       # node: $DATASTATES_NODE, else the host name
    comm.allgather(obj) -> list           # every rank gets every rank's object, in rank order
    comm.bcast(obj, root=0) -> obj
    comm.barrier()
    comm.sendrecv(obj, dest, source) -> obj   # pairwise; every rank calls it (dest/source may be None)
    exchange_files(comm, files, dest, source, place)   # whole files, in pieces, over sendrecv

Objects are Python values (plans, manifest ids, chunk locations, pieces of files): never tensors. The mpi4py
and torch backends work on a private duplicate of the caller's communicator or group, so the
store's collectives (which run on its pipeline thread) never interleave with the training loop's.
Creating one is collective: every rank must call `as_comm` in the same order.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..errors import CommTimeoutError, InvalidArgumentError, SaveFailedError
from .files import FileSink

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

    def dup(self) -> Comm:
        """A communicator of the same ranks whose messages never match this one's (collective): for collectives
        another thread runs at the same time, each thread then keeping its own order."""
        ...

    def sendrecv(self, obj: Any, dest: int | None, source: int | None) -> Any:
        """Send `obj` to `dest` and return what `source` sent this rank (None when `source` is None).
        Every rank calls it at the same time (it is a meeting point, so a rank that never comes ends in
        CommTimeoutError); the pairs must match: if r sends to d, d receives from r."""
        ...

    def sendrecv_into(self, out: memoryview | None, dest: int | None, into: memoryview | None,
                      source: int | None) -> None:
        """As `sendrecv` for raw bytes, without pickling: send `out` to `dest` while filling `into`
        (whose length the two ranks agreed on before) from `source`."""
        ...


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

    def dup(self) -> SingleComm:
        return self

    def sendrecv(self, obj: Any, dest: int | None, source: int | None) -> Any:
        return obj if source == 0 and dest == 0 else None

    def sendrecv_into(self, out: memoryview | None, dest: int | None, into: memoryview | None,
                      source: int | None) -> None:
        if out is not None and into is not None and dest == 0 and source == 0:
            into[:] = out


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

    def dup(self) -> MpiComm:
        return MpiComm(self._comm, self.timeout)  # MpiComm duplicates what it is given

    def sendrecv(self, obj: Any, dest: int | None, source: int | None) -> Any:
        self._arrive("sendrecv")
        if dest is not None and source is not None:
            return self._comm.sendrecv(obj, dest=dest, source=source)
        if dest is not None:
            self._comm.send(obj, dest=dest)
            return None
        return self._comm.recv(source=source) if source is not None else None

    def sendrecv_into(self, out: memoryview | None, dest: int | None, into: memoryview | None,
                      source: int | None) -> None:
        from mpi4py import MPI

        self._arrive("sendrecv")
        send = None if out is None or dest is None else [out, MPI.BYTE]
        recv = None if into is None or source is None else [into, MPI.BYTE]
        if send is not None and recv is not None:
            self._comm.Sendrecv(send, dest=dest, recvbuf=recv, source=source)
        elif send is not None:
            self._comm.Send(send, dest=dest)
        elif recv is not None:
            self._comm.Recv(recv, source=source)


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
            # gloo's own failure (a peer's connection closed: that rank exited or crashed), raised as torch's
            # RuntimeError: what every store call raises instead, and what to do.
            raise SaveFailedError(f"the job's {what} failed ({exc}): a rank of the job left it (exited or crashed); "
                                  "nothing of this save is visible and the communicator is unusable: end the job and "
                                  "restart it") from exc

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

    def dup(self) -> TorchComm:
        return TorchComm(self._group, self.timeout)  # a new private gloo group of the same ranks

    def sendrecv(self, obj: Any, dest: int | None, source: int | None) -> Any:
        # Objects go as pickled byte tensors: first their lengths, then the bytes, each as a non-blocking
        # send and receive pair so that a ring of ranks sending to each other cannot deadlock. The
        # pickles come from our own ranks (the peers of this job), never from storage.
        import torch

        self.barrier()  # the meeting point: a rank that never comes ends in the group's timeout
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if dest is not None else None
        size_out = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        self._pairwise(size_out if dest is not None else None, dest, size_in if source is not None else None, source)
        buf = torch.empty(int(size_in.item()), dtype=torch.uint8) if source is not None else None
        self._pairwise(data, dest, buf, source)
        return None if buf is None else pickle.loads(buf.numpy().tobytes())

    def sendrecv_into(self, out: memoryview | None, dest: int | None, into: memoryview | None,
                      source: int | None) -> None:
        import torch

        self.barrier()
        t_out = torch.frombuffer(out, dtype=torch.uint8) if out is not None and len(out) else None
        t_in = torch.frombuffer(into, dtype=torch.uint8) if into is not None and len(into) else None
        self._pairwise(t_out, dest, t_in, source)  # straight from and into the caller's buffers

    def _pairwise(self, out: Any, dest: int | None, into: Any, source: int | None) -> None:
        glob = self._dist.get_global_rank
        works: list[Any] = []
        if into is not None and source is not None:
            works.append(self._dist.irecv(into, src=glob(self._group, source), group=self._group))
        if out is not None and dest is not None:
            works.append(self._dist.isend(out, dst=glob(self._group, dest), group=self._group))
        for w in works:
            self._call("sendrecv", w.wait)


PIECE_BYTES = 16 << 20
"""Files move between ranks in pieces of this size: bounded messages, bounded memory."""

_buffers: weakref.WeakKeyDictionary[Any, tuple[bytearray, bytearray]] = weakref.WeakKeyDictionary()
"""Per communicator, the two piece buffers (out, in), kept for the next exchange: this VM (and many
others) touches new pages far slower than it copies into resident ones."""


def _piece_buffers(comm: Comm, size: int) -> tuple[bytearray, bytearray]:
    bufs = _buffers.get(comm)
    if bufs is None or len(bufs[0]) < size:
        bufs = (bytearray(size), bytearray(size))
        _buffers[comm] = bufs
    return bufs


def exchange_files(comm: Comm, files: list[tuple[str, Path]], dest: int | None, source: int | None,
                   place: Callable[[str], Path], piece_bytes: int = PIECE_BYTES) -> list[str]:
    """Send `files` (name, path) to rank `dest` while receiving `source`'s files, each written durably
    (temp, fsync, link, directory fsync) at `place(name)`; a file already there is kept. Collective:
    every rank of `comm` calls it, with None for no peer and [] for nothing to send (the ranks first
    agree on the listing and so on the number of rounds, and each round is one meeting of all). The
    bytes travel raw, piece by piece, from and into two reused buffers. Returns the names received.

    A rank whose reading fails still sends its pieces (their bytes then mean nothing) and tells its peer
    at the end, which then keeps none of them; the error is raised after the exchange. Raises OSError
    (this rank's files, or its peer's failure), and CommTimeoutError as the collectives do."""
    sizes: list[tuple[str, int]] = []
    failure: OSError | None = None
    for name, path in files:
        try:
            sizes.append((name, path.stat().st_size))
        except OSError as exc:
            failure = failure or exc
    mine = [] if failure is not None or dest is None else sizes
    everyone: list[list[tuple[str, int]]] = comm.allgather(mine)
    theirs = everyone[source] if source is not None else []

    def pieces(listing: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
        return [(name, off, min(piece_bytes, size - off)) for name, size in listing
                for off in range(0, size, piece_bytes)]

    out_pieces, in_pieces = pieces(mine), pieces(theirs)
    rounds = max(len(pieces(listing)) for listing in everyone)
    out_buf, in_buf = _piece_buffers(comm, piece_bytes) if rounds else (bytearray(), bytearray())
    paths = dict(files)
    sinks = {name: FileSink(place(name)) for name, _ in theirs}
    got: list[str] = []
    reader: Any = None
    try:
        for i in range(rounds):
            out = into = None
            if i < len(out_pieces):
                name, off, n = out_pieces[i]
                out = memoryview(out_buf)[:n]
                try:
                    if off == 0:
                        if reader is not None:
                            reader.close()
                        reader = open(paths[name], "rb")  # noqa: SIM115 - closed at the next file or below
                    if reader.readinto(out) != n:
                        raise OSError(f"{paths[name]} shrank while it was being sent")
                except OSError as exc:
                    failure = failure or exc
            if i < len(in_pieces):
                into = memoryview(in_buf)[:in_pieces[i][2]]
            comm.sendrecv_into(out, dest if out is not None else None, into, source if into is not None else None)
            if into is not None:
                sinks[in_pieces[i][0]].write(into)
        peer_ok = comm.sendrecv(failure is None, dest, source)  # the peer's pieces meant something
        if source is not None and peer_ok:
            for name, size in theirs:
                if sinks.pop(name).done(size):
                    got.append(name)
        elif source is not None:
            failure = failure or OSError(f"rank {source} could not send its files (its error is raised there)")
    finally:
        if reader is not None:
            reader.close()
        for sink in sinks.values():
            sink.abort()
    if failure is not None:
        raise failure
    return got


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
