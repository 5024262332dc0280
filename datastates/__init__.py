"""DataStates: a versioned model-state store for PyTorch.

    store = datastates.Store.open("runs/store")
    v = store.save({"model": model, "optim": opt}, branch="main", step=100)
    state = store.load("main~1")
"""

from __future__ import annotations

from .base.config import Flush
from .errors import (
    AmbiguousRefError,
    CommTimeoutError,
    ConflictError,
    DataStatesError,
    DeviceError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    NotFoundError,
    PrunedError,
    QueryError,
    ReadOnlyStoreError,
    SaveFailedError,
    ShapeMismatchError,
    StorageFullError,
    StoreClosedError,
    StoreFormatError,
    UnsupportedValueError,
)
from .meta.versions import Version
from .remote import RemoteStore
from .save.job import SaveHandle
from .save.manifest import TensorInfo
from .store import Store

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `ds.dcp` imports torch.distributed.checkpoint only when asked for; the ecosystem parts likewise.
    if name in ("import_checkpoints", "export"):
        from .ecosystem import transfer

        return getattr(transfer, name)
    if name == "CheckpointManager":
        from .ecosystem.manager import CheckpointManager

        return CheckpointManager
    if name == "dcp":
        import importlib

        return importlib.import_module("datastates.dcp")
    raise AttributeError(f"module 'datastates' has no attribute {name!r}")


__all__ = [
    "AmbiguousRefError", "CommTimeoutError", "ConflictError", "DataStatesError", "DeviceError", "Flush",
    "IntegrityError",
    "InvalidArgumentError", "InvalidNameError", "NotFoundError", "PrunedError", "QueryError", "ReadOnlyStoreError",
    "RemoteStore", "SaveFailedError",
    "SaveHandle", "ShapeMismatchError", "StorageFullError", "Store", "StoreClosedError", "StoreFormatError",
    "TensorInfo", "UnsupportedValueError", "Version", "__version__",
    "CheckpointManager", "import_checkpoints", "export",
]
