"""torch.distributed.checkpoint (DCP) storage over a datastates store.

    import torch.distributed.checkpoint as dcp
    dcp.save(state, storage_writer=ds.dcp.StoreWriter(store, branch="main", step=100))
    dcp.load(state, storage_reader=ds.dcp.StoreReader(store, "main"))

DCP's planner decides who writes what and reshards on load (FSDP, DTensor, any world size); the
store adds content addressing, dedup across versions, lineage and tiers. Each rank stages its items
as one manifest (`Store.stage`); the coordinator names every rank's manifest, plus one holding DCP's
metadata, in one version (`Store.commit_staged`). The metadata is kept as JSON: loading never
unpickles anything.
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

from .errors import IntegrityError, NotFoundError
from .save.tree import dtype_from_name, dtype_name
from .store import Store

METADATA_PART = "dcp"
"""The manifest key of a DCP version that holds DCP's metadata (the others are ranks)."""


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
        part = str(plan.storage_data)
        state: dict[str, torch.Tensor] = {}
        for pos, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                state[f"t{pos}"] = torch.frombuffer(bytearray(data.getvalue()) or bytearray(1), dtype=torch.uint8)[
                    :len(data.getvalue())]
            else:
                assert isinstance(data, torch.Tensor)
                state[f"t{pos}"] = data.detach().cpu()
        staged = self.store.stage(state)
        results = [WriteResult(index=item.index, size_in_bytes=state[f"t{pos}"].nbytes,
                               storage_data={"part": part, "pos": pos})
                   for pos, item in enumerate(plan.items)]
        if results:  # the coordinator learns this rank's part from its first result
            results[0].storage_data["staged"] = staged
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        parts = {}
        storage: dict[MetadataIndex, tuple[str, int]] = {}
        for rank_results in results:
            for r in rank_results:
                sd = r.storage_data
                if "staged" in sd:
                    parts[sd["part"]] = sd["staged"]
                storage[r.index] = (sd["part"], sd["pos"])
        metadata.storage_data = storage
        parts[METADATA_PART] = self.store.stage({"metadata": encode_metadata(metadata)})
        self.version = self.store.commit_staged(parts, world_size=len(results), branch=self.branch, step=self.step,
                                                hparams=self.hparams, metrics=self.metrics, message=self.message)


class StoreReader(StorageReader):
    """DCP `StorageReader` loading version `ref` of `store` at any world size (DCP reshards)."""

    def __init__(self, store: Store, ref: Any = "main") -> None:
        super().__init__()
        self.store = store
        self.ref = ref
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the version. Raises NotFoundError if it was not saved through DCP."""
        v = self.store.version(self.ref)
        if METADATA_PART not in v.manifests:
            raise NotFoundError(f"version {v.short} was not saved through torch.distributed.checkpoint; "
                                "load it with Store.load")
        self.vid = v.id
        return decode_metadata(self.store.load(v, rank=METADATA_PART)["metadata"])

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata
        self.vid = self.store.resolve(self.ref)

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
        for item in plan.items:
            part, pos = self.metadata.storage_data[item.storage_index]
            stored = loaded[part][f"t{pos}"]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(stored.numpy().tobytes()))
                continue
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


__all__ = ["METADATA_PART", "StoreReader", "StoreWriter", "decode_metadata", "encode_metadata"]
