"""Retention policies (public import path): which versions `Store.prune` keeps.

    from datastates.retention import Retention, KeepLatest, KeepBest
    store.prune(Retention(KeepLatest(5), KeepBest(3, "metrics.val_loss", "min")))

The implementation lives in `datastates.maintenance.retention`.
"""

from __future__ import annotations

from .maintenance.retention import *  # noqa: F403  (the public names, re-exported)
from .maintenance.retention import __all__  # noqa: F401
