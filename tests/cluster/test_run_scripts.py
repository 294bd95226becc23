"""``run --json`` on real nodes: the one document of a run that ended, with its schema,
after a preflight that ``--skip`` narrowed."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster

from torchherd.cli import main
from torchherd.console import make_console

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(180)
def test_run_json_after_a_skipping_preflight_is_one_document_with_the_schema(
        cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "proj"
    source.mkdir()
    (source / "train.py").write_text("import os\nprint('rank', os.environ['RANK'])\n")
    code = main(["-i", str(cluster.inventory), "run", "--json", "--skip", "gpu,clock", "--nproc-per-node", "1",
                 "--workdir", "/tmp/scripts-json", "--log-dir", str(tmp_path / "logs"), "--sync", str(source), "--",
                 "train.py"], console=make_console(StringIO()))
    document = json.loads(capsys.readouterr().out)
    assert code == 0, document
    assert (document["schema"], document["ok"], document["exit_code"]) == (1, True, 0)
    assert [(node["node"], node["state"], node["exit_code"]) for node in document["nodes"]] == [
        (name, "ok", 0) for name in cluster.names]
