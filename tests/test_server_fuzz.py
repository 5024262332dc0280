"""schemathesis (4.x) over the committed schemas/openapi.json against a real uvicorn, writes enabled:
no input gives a server error, and every answer conforms to its schema and content type."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers.server_proc import ServerProc
from helpers.tools import tool
from server_fixtures import build_lineage_store

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fuzz-token-0123456789abcdef"



def test_fuzzing_the_openapi_finds_no_server_error_and_no_schema_mismatch(tmp_path: Path) -> None:
    store = build_lineage_store(tmp_path / "store")
    (tmp_path / "token").write_text(TOKEN)
    with ServerProc(store, token_file=tmp_path / "token") as srv:
        run = subprocess.run(
            [*tool("schemathesis", "dev"), "run", str(ROOT / "schemas" / "openapi.json"), "--url", srv.url,
             "-H", f"Authorization: Bearer {TOKEN}", "-n", "15", "--seed", "1", "--phases", "examples,fuzzing",
             "--checks", "not_a_server_error,response_schema_conformance,content_type_conformance",
             "--no-color"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
        alive = srv.proc is not None and srv.proc.poll() is None
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert " passed" in out and " failed" not in out, out[-4000:]
    assert alive  # the server survived every generated request
