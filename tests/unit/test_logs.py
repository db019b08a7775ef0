import json
import logging
from pathlib import Path

import pytest

from vllm_kvguard.config import load_config
from vllm_kvguard.core.events import RequestAffected
from vllm_kvguard.logs import LOGGER_NAME, GuardLog, vllm_logs_json


def test_lines_go_through_vllms_logger_tree_and_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert LOGGER_NAME.startswith("vllm.")
    path = tmp_path / "g.jsonl"
    log = GuardLog(
        load_config({"VLLM_KVGUARD_LOG_FILE": str(path), "VLLM_KVGUARD_LOG_FORMAT": "console"}), rank=3
    )
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        log.event("kv_request_affected", RequestAffected("r-1", 7, (7,), "healed"), level="warning")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "kv_request_affected" in record.getMessage() and "block_id=7" in record.getMessage()
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["event"] == "kv_request_affected" and line["block_id"] == 7 and line["rank"] == 3
    assert line["level"] == "warning" and line["timestamp"].endswith("Z")


def test_json_format_renders_json(caplog: pytest.LogCaptureFixture) -> None:
    log = GuardLog(load_config({"VLLM_KVGUARD_LOG_FORMAT": "json"}))
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        log.line("kvguard_started", role="scheduler")
    assert json.loads(caplog.records[0].getMessage())["role"] == "scheduler"


def test_level_filter(caplog: pytest.LogCaptureFixture) -> None:
    log = GuardLog(load_config({"VLLM_KVGUARD_LOG_LEVEL": "error"}))
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        log.line("quiet", level="warning")
        log.line("loud", level="error")
    assert [r.getMessage().split()[0] for r in caplog.records] == ["loud"]


def test_auto_follows_vllms_logging_config(tmp_path: Path) -> None:
    cfg = tmp_path / "logging.json"
    cfg.write_text('{"formatters": {"json": {"class": "pythonjsonlogger.jsonlogger.JsonFormatter"}}}')
    assert vllm_logs_json(str(cfg)) is True
    assert vllm_logs_json(None) is False
    assert vllm_logs_json(str(tmp_path / "missing")) is False
