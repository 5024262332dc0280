"""The OpenAPI document and the JSON Schemas of the response bodies, generated from the app.

    python -m server.openapi --write schemas      # regenerate every generated file in schemas/
    python -m server.openapi > schemas/openapi.json

No store is opened. tests/test_server_schemas.py fails when a committed file is stale.
The on-disk record schemas (version-record, manifest-row) are written by hand, not here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA_ID = "https://datastates.dev/schemas/"


def document() -> dict[str, Any]:
    from .app import create_app

    return create_app("/nonexistent-store-for-openapi").openapi()


def response_schemas() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema (draft 2020-12) of each response body."""
    from . import models as m

    bodies: dict[str, Any] = {
        "version": m.VersionOut, "versions-page": m.Page[m.VersionOut], "ids-page": m.Page[str],
        "tensors-page": m.Page[m.TensorOut], "diff-page": m.Page[m.DiffRow], "history-page": m.Page[m.HistoryRow],
        "refs-page": m.Page[m.RefOut], "ref": m.RefOut, "merge-base": m.MergeBaseOut,
        "population-tree-page": m.Page[m.TreeEdge], "health": m.Health, "error": m.ErrorOut,
    }
    out = {}
    for name, model in bodies.items():
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                  "$id": f"{SCHEMA_ID}{name}.schema.json", **model.model_json_schema(mode="serialization")}
        out[f"{name}.schema.json"] = schema
    return out


def render(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def generated() -> dict[str, str]:
    """Every generated file of schemas/: name -> text."""
    files = {name: render(s) for name, s in response_schemas().items()}
    files["openapi.json"] = render(document())
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.openapi", description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="DIR", help="write openapi.json and the response schemas into DIR")
    args = p.parse_args(argv)
    if args.write:
        d = Path(args.write)
        d.mkdir(parents=True, exist_ok=True)
        for name, text in generated().items():
            (d / name).write_text(text)
        return 0
    sys.stdout.write(render(document()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
