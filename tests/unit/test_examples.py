"""The shipped alert rules and dashboard: promtool's own tests, and series names."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_kvguard.metrics import SERIES, exported_names

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "examples" / "prometheus"


PROMTOOL_MISSING = "promtool is required (Debian package 'prometheus'; .ci/run installs it)"


def promtool(environ: dict[str, str] | None = None, which=shutil.which) -> str:
    """promtool's path. Without it a developer's run skips these tests with the reason; in CI
    (``CI`` set, as .ci/run's runner sets it) the test fails instead, so a missing install
    step cannot pass unseen."""
    path = which("promtool")
    if path:
        return path
    if (os.environ if environ is None else environ).get("CI"):
        pytest.fail(PROMTOOL_MISSING)
    pytest.skip(PROMTOOL_MISSING)


def test_alert_rules_pass_promtool_unit_tests() -> None:
    proc = subprocess.run(
        [promtool(), "test", "rules", "kvguard-alerts.test.yml"], cwd=PROM, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_alert_rules_and_config_are_valid() -> None:
    rules = subprocess.run(
        [promtool(), "check", "rules", "kvguard-alerts.yml"], cwd=PROM, capture_output=True, text=True
    )
    assert rules.returncode == 0 and "8 rules found" in rules.stdout, rules.stdout + rules.stderr
    config = subprocess.run(
        [promtool(), "check", "config", "prometheus.yml"], cwd=PROM, capture_output=True, text=True
    )
    assert config.returncode == 0, config.stdout + config.stderr


def _guard_names(text: str) -> set[str]:
    return set(re.findall(r"vllm:kvguard_[a-z_]+", text))


def test_rules_reference_only_exported_series() -> None:
    used = _guard_names((PROM / "kvguard-alerts.yml").read_text())
    assert used and used <= exported_names(), used - exported_names()


def test_dashboard_uses_only_exported_series_and_covers_them() -> None:
    dash = json.loads((ROOT / "examples" / "grafana" / "kvguard-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = _guard_names(" ".join(exprs))
    assert used <= exported_names(), used - exported_names()
    # Every series the guard exports has a panel.
    for series in SERIES:
        assert any(name.startswith(series.name) for name in used), series.name
    # vLLM's dashboard variables, and every query filtered by model.
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model_name"} <= names
    assert all('model_name="$model_name"' in e for e in exprs)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])


def test_promtool_missing_skips_for_a_developer_and_fails_in_ci() -> None:
    def none(_name: str) -> None:
        return None

    with pytest.raises(pytest.skip.Exception, match="promtool is required"):
        promtool({}, which=none)
    with pytest.raises(pytest.fail.Exception, match="promtool is required"):
        promtool({"CI": "true"}, which=none)
    assert promtool({}, which=lambda _name: "/usr/bin/promtool") == "/usr/bin/promtool"
