"""torch.distributed.checkpoint (DCP) storage over a datastates store.

    import torch.distributed.checkpoint as dcp
    dcp.save(state, storage_writer=ds.dcp.StoreWriter(store, branch="main", step=100))
    dcp.load(state, storage_reader=ds.dcp.StoreReader(store, "main"))

DCP's planner decides who writes what and reshards on load (FSDP, DTensor, any world size); the
store adds content addressing, dedup across versions, lineage and tiers. The metadata is kept as
JSON. DCP keeps each non-tensor value (`step`, an optimizer's hyperparameters) as a pickle, which its
planner loads with `torch.load(weights_only=False)`: `StoreReader` hands it only pickles that
`torch.load(weights_only=True)` accepts (plain containers, numbers, strings, tensors), unless it was made
with `allow_pickle=True`, so loading never runs arbitrary pickled code.

Two ways of committing, chosen by how the store was opened:

- A store opened by every rank of the job (`Store.open(path, comm=...)`, needed with node-local hot
  tiers): `write_data` is one collective `Store.save` of every rank's items (rank 0's carrying DCP's
  metadata under `DCP_KEY`). Everything a collective save does applies: two-phase commit, partner
  copies, every node's catalog learns the version, the parallel flush to cold; `writer.version` is set
  on every rank. DCP's planner must expose its global metadata as `planner.metadata` on the coordinator
  (the default planners do); otherwise the commit falls back to the second way, or, on node-local
  tiers, raises InvalidArgumentError on every rank before anything is written.
- A store each rank opened alone (a shared directory): each rank stages its items as one manifest
  (`Store.stage`); the coordinator names every rank's manifest, plus one holding DCP's metadata, in
  one version (`Store.commit_staged`). On node-local hot tiers this would commit on the coordinator's
  node only, which is why such stores take the first way.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .errors import DataStatesError, IntegrityError, InvalidArgumentError, NotFoundError, UnsupportedValueError
from .save.foreign import checkpoint_cause
from .save.tree import dtype_from_name, dtype_name
from .store import Store

METADATA_PART = "dcp"
"""The manifest key of a staged DCP version that holds DCP's metadata (the others are ranks)."""

DCP_KEY = "_dcp_metadata"
"""The key of rank 0's entries that holds DCP's metadata in a DCP version saved collectively."""


class StoreWriter(StorageWriter):
    """DCP `StorageWriter` saving one version into `store` (every rank opens the same store)."""

    def __init__(self, store: Store, *, branch: str | None = "main", step: int | None = None,
                 hparams: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                 message: str = "") -> None:
        super().__init__()
        self.store = store
        self.branch, self.step, self.hparams, self.metrics, self.message = branch, step, hparams, metrics, message
        self.version: Any = None
        """The committed Version, on the coordinator, after `dcp.save` returns."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.version = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by DCP from a path: pass the writer explicitly

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [replace(p, storage_data=str(rank)) for rank, p in enumerate(plans)]  # each rank's part name

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items (see the module docstring for the two ways). Collective when the
        store was opened with `comm=`: raises on every rank what a collective save raises."""
        state: dict[str, Any] = {}
        for pos, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                state[f"t{pos}"] = torch.frombuffer(bytearray(data.getvalue()) or bytearray(1), dtype=torch.uint8)[
                    :len(data.getvalue())]
            else:
                assert isinstance(data, torch.Tensor)
                state[f"t{pos}"] = data.detach().cpu()
        if self.store.comm.size > 1:
            part = self._save_collective(plan, planner, state)
            if part is not None:
                return _done([WriteResult(index=item.index, size_in_bytes=state[f"t{pos}"].nbytes,
                                          storage_data={"part": part, "pos": pos})
                              for pos, item in enumerate(plan.items)])
        part = str(plan.storage_data)
        staged = self.store.stage(state)
        results = [WriteResult(index=item.index, size_in_bytes=state[f"t{pos}"].nbytes,
                               storage_data={"part": part, "pos": pos})
                   for pos, item in enumerate(plan.items)]
        if results:  # the coordinator learns this rank's part from its first result
            results[0].storage_data["staged"] = staged
        return _done(results)

    def _save_collective(self, plan: SavePlan, planner: SavePlanner, state: dict[str, Any]) -> str | None:
        """One collective save of every rank's items, rank 0's with DCP's metadata (its storage data
        filled in from every rank's items). Returns this rank's part name, or None on every rank when
        the coordinator's planner does not expose its metadata (then the staged way is taken)."""
        comm = self.store.comm
        meta = getattr(planner, "metadata", None) if self.is_coordinator else None
        gathered = comm.allgather(([item.index for item in plan.items],
                                   meta if isinstance(meta, Metadata) else None))
        metas = [m for _, m in gathered if m is not None]
        if len(metas) != 1:
            placement = self.store.placement
            if placement is not None and placement.groups > 1:  # the staged way reaches one node only
                raise InvalidArgumentError(
                    f"DCP's planner ({type(planner).__name__}) exposes no global metadata on the coordinator "
                    "(planner.metadata), which a store with node-local hot tiers needs to commit on every node; "
                    "use DefaultSavePlanner (or a subclass), or save to a store without node-local tiers")
            return None
        metadata = metas[0]
        metadata.storage_data = {index: (str(r), pos) for r, (indexes, _) in enumerate(gathered)
                                 for pos, index in enumerate(indexes)}
        if comm.rank == 0:
            state[DCP_KEY] = encode_metadata(metadata)
        self.version = self.store.save(state, branch=self.branch, step=self.step, hparams=self.hparams,
                                       metrics=self.metrics, message=self.message)
        return str(comm.rank)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: name every rank's staged part in one version (the staged way); after a
        collective save, only fill in the metadata's storage data (the version is committed)."""
        parts = {}
        storage: dict[MetadataIndex, tuple[str, int]] = {}
        for rank_results in results:
            for r in rank_results:
                sd = r.storage_data
                if "staged" in sd:
                    parts[sd["part"]] = sd["staged"]
                storage[r.index] = (sd["part"], sd["pos"])
        metadata.storage_data = storage
        if self.version is not None:
            return
        parts[METADATA_PART] = self.store.stage({"metadata": encode_metadata(metadata)})
        self.version = self.store.commit_staged(parts, world_size=len(results), branch=self.branch, step=self.step,
                                                hparams=self.hparams, metrics=self.metrics, message=self.message)


def _check_plain_pickle(raw: bytes, fqn: str, vid: str) -> None:
    """UnsupportedValueError unless `torch.load(weights_only=True)` reads `raw`: DCP's planner then loads the
    same bytes in full, and a pickle weights_only accepts calls nothing outside torch's allowlist."""
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError... for what it refuses
        raise UnsupportedValueError(
            f"DCP value {fqn!r} of version {vid[:12]} is a pickle that torch.load(weights_only=True) refuses "
            f"({type(exc).__name__}); load it only if you trust the version: StoreReader(store, ref, "
            "allow_pickle=True)") from None


class StoreReader(StorageReader):
    """DCP `StorageReader` loading version `ref` of `store` at any world size (DCP reshards)."""

    def __init__(self, store: Store, ref: Any = "main", *, allow_pickle: bool = False) -> None:
        """`allow_pickle`: hand DCP's planner every stored non-tensor value, whatever its pickle holds
        (only for versions you trust: the planner unpickles them in full)."""
        super().__init__()
        self.store = store
        self.ref = ref
        self.allow_pickle = allow_pickle
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the version. Raises NotFoundError if it was not saved through DCP (or when
        DCP asks for a rank's own metadata: a version holds one for every rank)."""
        v = self.store.version(self.ref)
        not_dcp = NotFoundError(f"version {v.short} was not saved through torch.distributed.checkpoint; "
                                "load it with Store.load")
        if "rank" in kwargs:
            raise not_dcp
        self.vid = v.id
        if METADATA_PART in v.manifests:
            return decode_metadata(self.store.load(v, rank=METADATA_PART)["metadata"])
        try:
            text = self.store.load(v, rank=0, keys=[DCP_KEY])[DCP_KEY]
        except NotFoundError:
            raise not_dcp from None
        return decode_metadata(text)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Collective on a store with node-local tiers: every node first fetches, from the others, the
        packs of the version it lacks (DCP may reshard any rank's items onto any rank)."""
        self.metadata = metadata
        self.vid = self.store.resolve(self.ref)
        if self.store.placement is not None and self.store.placement.groups > 1:
            self.store.fetch_from_peers(self.vid, every_rank=True)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None
        wanted: dict[str, list[int]] = {}
        for item in plan.items:
            part, pos = self.metadata.storage_data[item.storage_index]
            wanted.setdefault(part, []).append(pos)
        loaded = {part: self.store.load(self.vid, rank=part, keys=[f"t{p}" for p in sorted(set(pos))])
                  for part, pos in wanted.items()}
        raws: dict[int, bytes] = {}
        for n, item in enumerate(plan.items):  # every value checked before the first is loaded into the state
            if item.type == LoadItemType.BYTE_IO:
                part, pos = self.metadata.storage_data[item.storage_index]
                raws[n] = loaded[part][f"t{pos}"].numpy().tobytes()
                if not self.allow_pickle:
                    _check_plain_pickle(raws[n], item.storage_index.fqn, self.vid)
        for n, item in enumerate(plan.items):
            if n in raws:
                planner.load_bytes(item, io.BytesIO(raws[n]))
                continue
            part, pos = self.metadata.storage_data[item.storage_index]
            stored = loaded[part][f"t{pos}"]
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                stored = stored.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            if target.shape != stored.shape:
                raise IntegrityError(f"DCP item {item.storage_index.fqn} has shape {tuple(stored.shape)} in version "
                                     f"{self.vid[:12]}, not {tuple(target.shape)}; run `datastates fsck`")
            target.copy_(stored)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def saved_state(store: Store, ref: Any, *, allow_pickle: bool = False) -> dict[str, Any] | None:
    """The state `dcp.save` saved as version `ref` (DCP's items put back together, at any world size), or None for a
    version not saved through DCP (whose `Store.load` is its state; a DCP version's gives DCP's items `t0`, `t1`...).
    Raises what `StoreReader` does (UnsupportedValueError for a pickle weights_only refuses, without
    `allow_pickle`), unwrapped from DCP's CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = StoreReader(store, ref, allow_pickle=allow_pickle)
    try:
        reader.read_metadata()
    except NotFoundError:
        return None
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as exc:  # a BaseException around our own error
        inner = checkpoint_cause(exc)
        if isinstance(inner, DataStatesError):
            raise inner from None
        raise
    return _optimizer_keys(state)


def _optimizer_keys(node: Any) -> Any:
    """`node` with every optimizer state_dict in it made whole again: DCP keeps str key paths only, so an
    optimizer's `state`, keyed by parameter index, came back keyed by '0', '1'... (`load_state_dict` then
    attached Adam's moments to no parameter, silently) or, empty, not at all (a review). A dict holding
    `param_groups` (a list of dicts whose `params` are ints) is one: its `state` keys that are those ints
    written as str become the ints, and a missing `state` is empty. Nothing else is touched."""
    if isinstance(node, list):
        return [_optimizer_keys(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _optimizer_keys(v) for k, v in node.items()}
    groups = out.get("param_groups")
    if isinstance(groups, list) and groups and all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in g["params"]) for g in groups):
        ids = {str(i): i for g in groups for i in g["params"]}
        state = out.setdefault("state", {})
        if isinstance(state, dict) and state and all(isinstance(k, str) and k in ids for k in state):
            out["state"] = {ids[k]: v for k, v in state.items()}
    return out


def _done(results: list[WriteResult]) -> Future[list[WriteResult]]:
    fut: Future[list[WriteResult]] = Future()
    fut.set_result(results)
    return fut


def encode_metadata(m: Metadata) -> str:
    """DCP metadata as JSON (no pickle)."""
    sdm: dict[str, Any] = {}
    for fqn, md in m.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            sdm[fqn] = {"t": "bytes"}
        else:
            sdm[fqn] = {"t": "tensor", "dtype": dtype_name(md.properties.dtype), "size": list(md.size),
                        "requires_grad": md.properties.requires_grad,
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
    storage = [[i.fqn, None if i.offset is None else list(i.offset), i.index, part, pos]
               for i, (part, pos) in (m.storage_data or {}).items()]
    planner = {k: list(v) for k, v in m.planner_data.items()} if isinstance(m.planner_data, dict) else None
    meta = m.storage_meta
    return json.dumps({"state_dict_metadata": sdm, "storage_data": storage, "planner_data": planner,
                       "version": m.version,
                       "storage_meta": None if meta is None else {
                           "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                           "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules)}})


def decode_metadata(text: str) -> Metadata:
    """The Metadata `encode_metadata` wrote."""
    d = json.loads(text)
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, md in d["state_dict_metadata"].items():
        if md["t"] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
        else:
            props = TensorProperties(dtype=dtype_from_name(md["dtype"]), requires_grad=md["requires_grad"])
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in md["chunks"]]
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(md["size"]), chunks)
    storage = {MetadataIndex(fqn, offset, index): (part, pos) for fqn, offset, index, part, pos in d["storage_data"]}
    planner = None if d["planner_data"] is None else {k: tuple(v) for k, v in d["planner_data"].items()}
    sm = d["storage_meta"]
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                    storage_meta=None if sm is None else StorageMeta(**sm), version=d["version"])


__all__ = ["DCP_KEY", "METADATA_PART", "StoreReader", "StoreWriter", "decode_metadata", "encode_metadata",
           "saved_state"]
