"""schemas/: the committed generated files are current, and real records and answers validate."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from server_fixtures import build_lineage_store

import datastates as ds

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def load(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text())  # type: ignore[no-any-return]


def test_generated_schemas_and_openapi_are_current() -> None:
    from server.openapi import generated

    stale = [name for name, text in generated().items()
             if not (SCHEMAS / name).exists() or (SCHEMAS / name).read_text() != text]
    assert not stale, f"stale: {stale}; regenerate with `python -m server.openapi --write schemas`"


@pytest.mark.parametrize("name", sorted(p.name for p in SCHEMAS.glob("*.schema.json")))
def test_every_schema_is_a_valid_2020_12_schema(name: str) -> None:
    schema = load(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = ds.Store.open(build_lineage_store(tmp_path_factory.mktemp("schemas") / "store"), create=False)
    yield s
    s.close()


def test_every_record_the_store_wrote_validates(store: ds.Store) -> None:
    validator = Draft202012Validator(load("version-record.schema.json"))
    files = sorted((store.path / "versions").glob("*/*.json"))
    assert len(files) == store.find("", as_table=True).num_rows >= 10
    for f in files:
        rec = json.loads(f.read_bytes())
        errors = list(validator.iter_errors(rec))
        assert not errors, f"{f.name}: {errors[0].message}"
    # and the schema refuses what the format forbids
    bad = json.loads(files[0].read_bytes()) | {"parents": ["not-an-id"]}
    assert not validator.is_valid(bad)


def test_every_manifest_row_validates(store: ds.Store) -> None:
    validator = Draft202012Validator(load("manifest-row.schema.json"))
    kinds = set()
    for v in store.log("views") if "views" in store.branches() else store.log("main"):
        for row in store.manifest_of(v).rows:
            row = dict(row, chunks=[c.hex() for c in row["chunks"]])
            row = {k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in row.items()}
            kinds.add(row["kind"])
            errors = list(validator.iter_errors(row))
            assert not errors, f"{row['key']}: {errors[0].message}"
    assert "tensor" in kinds


def test_views_and_aliases_rows_validate(tmp_path: Path) -> None:
    validator = Draft202012Validator(load("manifest-row.schema.json"))
    with ds.Store.open(tmp_path / "s") as s:
        base = torch.arange(12.0)
        s.save({"a": base, "b": base})
        rows = s.manifest_of(s.version("main")).rows
        s.save({"a": base, "v": base[2:8].view(2, 3)})
        rows += s.manifest_of(s.version("main")).rows
    for row in rows:
        assert validator.is_valid(dict(row, chunks=[c.hex() for c in row["chunks"]])), row["key"]
    assert {r["kind"] for r in rows} >= {"alias", "view", "storage"}


def test_answers_validate_against_the_response_schemas(store: ds.Store) -> None:
    from fastapi.testclient import TestClient

    from server.app import create_app

    registry: Registry = Registry()
    for p in SCHEMAS.glob("*.schema.json"):
        registry = registry.with_resource(load(p.name)["$id"], Resource.from_contents(load(p.name)))
    with TestClient(create_app(store.path)) as c:
        cases = [("/api/v1/versions?limit=5", "versions-page"), ("/api/v1/versions/main", "version"),
                 ("/api/v1/versions/main/ancestors", "ids-page"), ("/api/v1/versions/main~1/tensors", "tensors-page"),
                 ("/api/v1/versions/main~4/diff/main", "diff-page"),
                 ("/api/v1/tensors/model.fc.weight/history", "history-page"), ("/api/v1/branches", "refs-page"),
                 ("/api/v1/tags/best", "ref"), ("/api/v1/versions/main/merge-base/lr%2Fhigh", "merge-base"),
                 ("/api/v1/populations/sweep/tree", "population-tree-page"), ("/api/v1/healthz", "health"),
                 ("/api/v1/versions/nope", "error"), ("/api/v1/versions?limit=0", "error")]
        for path, name in cases:
            r = c.get(path)
            schema = load(f"{name}.schema.json")
            errors = list(Draft202012Validator(schema, registry=registry).iter_errors(r.json()))
            assert not errors, f"{path}: {errors[0].message}"
