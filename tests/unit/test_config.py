import pytest

from vllm_kvguard.config import HashAlgorithm, KVGuardConfig, LogFormat, Mode, load_config
from vllm_kvguard.errors import KVGuardConfigError


def test_defaults_are_off_and_quarantine() -> None:
    config = load_config({})
    assert config == KVGuardConfig()
    assert config.enabled is False
    assert config.mode is Mode.QUARANTINE
    assert config.hash is HashAlgorithm.XXH3_64


def test_all_variables_parse() -> None:
    config = load_config(
        {
            "VLLM_KVGUARD": "1",
            "VLLM_KVGUARD_MODE": "Raise",
            "VLLM_KVGUARD_HASH": "xxh64",
            "VLLM_KVGUARD_QUARANTINE_MAX_FRACTION": "0.5",
            "VLLM_KVGUARD_LOAD_DIGEST_SETS": " 2",
            "VLLM_KVGUARD_LOG_FORMAT": "console",
            "VLLM_KVGUARD_LOG_FILE": "/tmp/x.jsonl",
            "VLLM_KVGUARD_LOG_LEVEL": "warning",
            "VLLM_KVGUARD_INJECT": "bitflip:count=2",
            "PATH": "/bin",
        }
    )
    assert config.enabled and config.mode is Mode.RAISE and config.hash is HashAlgorithm.XXH64
    assert config.quarantine_max_fraction == 0.5 and config.load_digest_sets == 2
    assert config.log_format is LogFormat.CONSOLE and config.log_file == "/tmp/x.jsonl"
    assert config.log_level == "WARNING" and config.inject == "bitflip:count=2"


@pytest.mark.parametrize("value", ["0", "off", "false", ""])
def test_switch_off_values(value: str) -> None:
    assert load_config({"VLLM_KVGUARD": value}).enabled is False


@pytest.mark.parametrize(
    ("variable", "value", "accepted"),
    [
        ("VLLM_KVGUARD", "maybe", "1 or 0"),
        ("VLLM_KVGUARD_MODE", "panic", "quarantine | raise | log"),
        ("VLLM_KVGUARD_HASH", "md5", "xxh3_64 | xxh64"),
        ("VLLM_KVGUARD_QUARANTINE_MAX_FRACTION", "2", "between 0 and 1"),
        ("VLLM_KVGUARD_LOG_FORMAT", "xml", "json | console"),
        ("VLLM_KVGUARD_LOG_LEVEL", "loud", "DEBUG | INFO | WARNING | ERROR"),
        ("VLLM_KVGUARD_INJECT", "meteor:count=1", "bitflip | overwrite | zero | nan"),
        ("VLLM_KVGUARD_MDOE", "raise", "VLLM_KVGUARD_MODE"),
        ("VLLM_KVGUARD_SCRUB_INTERVAL", "soon", "a duration such as 300, 30s, 5m or 1h"),
        ("VLLM_KVGUARD_SCRUB_INTERVAL", "-5s", "0 or off: no scrubbing"),
        ("VLLM_KVGUARD_SCRUB_BUDGET", "0", "a positive size in bytes"),
        ("VLLM_KVGUARD_NONFINITE", "raise", "mode | log | off"),
        ("VLLM_KVGUARD_VERIFY_EVERY", "0", "a whole number of engine steps, 1 to 1000000"),
        ("VLLM_KVGUARD_VERIFY_EVERY", "2.5", "(1: every step)"),
        ("VLLM_KVGUARD_VERIFY_EVERY", "-1", "1 to 1000000"),
        ("VLLM_KVGUARD_LOAD_DIGEST_SETS", "0", "digest sets per page identity, 1 to 64"),
        ("VLLM_KVGUARD_LOAD_DIGEST_SETS", "many", "1 to 64"),
    ],
)
def test_bad_values_name_variable_value_and_accepted(variable: str, value: str, accepted: str) -> None:
    with pytest.raises(KVGuardConfigError) as info:
        load_config({"VLLM_KVGUARD": "1", variable: value})
    message = str(info.value)
    assert message.startswith(f"{variable}={value!r} is not valid: expected ")
    assert accepted in message


def test_injection_needs_the_guard_on() -> None:
    with pytest.raises(KVGuardConfigError, match=r"VLLM_KVGUARD_INJECT.*VLLM_KVGUARD=1"):
        load_config({"VLLM_KVGUARD_INJECT": "zero"})


def test_round_trip_through_connector_extra_config() -> None:
    config = load_config({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_MODE": "log"})
    assert KVGuardConfig.from_dict(config.to_dict()) == config


def test_metrics_port() -> None:
    assert load_config({"VLLM_KVGUARD_METRICS_PORT": "9400"}).metrics_port == 9400
    assert load_config({"VLLM_KVGUARD_METRICS_PORT": ""}).metrics_port is None
    with pytest.raises(KVGuardConfigError, match="a TCP port number 1-65535"):
        load_config({"VLLM_KVGUARD_METRICS_PORT": "99999"})


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("300", 300.0), ("30s", 30.0), ("0.5s", 0.5), ("5m", 300.0), ("1h", 3600.0), ("off", 0.0)],
)
def test_scrub_interval(value: str, seconds: float) -> None:
    assert load_config({"VLLM_KVGUARD_SCRUB_INTERVAL": value}).scrub_interval_s == seconds


@pytest.mark.parametrize(
    ("mode", "nonfinite", "effective"),
    [("raise", "mode", Mode.RAISE), ("quarantine", "log", Mode.LOG), ("quarantine", "off", None)],
)
def test_nonfinite_action_follows_the_mode_unless_told(
    mode: str, nonfinite: str, effective: Mode | None
) -> None:
    config = load_config({"VLLM_KVGUARD_MODE": mode, "VLLM_KVGUARD_NONFINITE": nonfinite})
    assert config.nonfinite_mode == effective
    assert KVGuardConfig.from_dict(config.to_dict()) == config


def test_log_file_is_checked_before_any_engine_starts(tmp_path) -> None:
    """A log file the guard could not open would kill the engine core late, after the model
    loaded; it is refused at configuration time with one line saying why."""
    good = tmp_path / "guard.jsonl"
    assert load_config({"VLLM_KVGUARD_LOG_FILE": str(good)}).log_file == str(good)
    cases = {
        str(tmp_path / "missing" / "x.jsonl"): f"the folder {tmp_path / 'missing'} does not exist",
        str(tmp_path): f"{tmp_path} is a folder",
    }
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    import os

    if os.geteuid() != 0:  # root may write anywhere: the permission case needs a normal user
        cases[str(locked / "x.jsonl")] = f"the folder {locked} is not writable"
    for value, why in cases.items():
        with pytest.raises(KVGuardConfigError) as info:
            load_config({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_LOG_FILE": value})
        assert str(info.value) == (
            f"VLLM_KVGUARD_LOG_FILE={value!r} is not valid: "
            f"expected a file path in an existing, writable folder ({why})"
        )


def test_verify_every() -> None:
    assert KVGuardConfig().verify_every == 4
    assert load_config({"VLLM_KVGUARD_VERIFY_EVERY": " 1 "}).verify_every == 1
    assert load_config({"VLLM_KVGUARD_VERIFY_EVERY": "16"}).verify_every == 16


def test_every_variable_has_a_row_in_the_configuration_reference() -> None:
    """docs/configuration.md is the reference: each variable the guard reads has its row there."""
    from pathlib import Path

    from vllm_kvguard.config import variable_names

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    rows = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `VLLM_KVGUARD")}
    assert rows == set(variable_names())
