"""The DataStates REST server (FastAPI): routes that translate HTTP to `datastates` calls and back.

Start it with `datastates serve --store PATH` or build the app with
`server.app.create_app(store_path)`. See docs/server.md.
"""

from __future__ import annotations

API_PREFIX = "/api/v1"
