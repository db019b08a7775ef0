"""The ``kvguard`` command: ``drill``, ``bench``, ``doctor``, ``report``, ``config``, ``model``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from vllm_kvguard import __version__
from vllm_kvguard.config import Mode, load_config, variable_names
from vllm_kvguard.core.faults import parse_fault_spec
from vllm_kvguard.errors import KVGuardConfigError
from vllm_kvguard.tools.childrun import check_model


def _spec(text: str) -> str:
    try:
        parse_fault_spec(text, variable="--inject")
    except KVGuardConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _requests(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 4:
        raise argparse.ArgumentTypeError(f"--requests={text!r} is not valid: expected an integer >= 4")
    return value


def parser() -> argparse.ArgumentParser:
    from vllm_kvguard.tools.drill import DEFAULT_SPEC

    top = argparse.ArgumentParser(
        prog="kvguard", description="vllm-kvguard: KV-cache page checksums for vLLM"
    )
    top.add_argument("--version", action="version", version=f"kvguard (vllm-kvguard) {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    drill = sub.add_parser(
        "drill",
        help="inject KV-cache faults into a real vLLM engine and check the guard catches them",
        description="Runs a prefix-sharing workload through vLLM twice (plain, then guarded with injected "
        "faults) and prints what was injected, read, detected and healed. Exits 1 if a fault that was "
        "read escaped detection.",
    )
    drill.add_argument("--model", help="model directory (default: build a tiny random-weight model, offline)")
    drill.add_argument("--requests", type=_requests, default=16, help="requests in the workload (default 16)")
    drill.add_argument(
        "--inject", type=_spec, default=DEFAULT_SPEC, help=f"fault spec (default {DEFAULT_SPEC!r})"
    )
    drill.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.QUARANTINE, help="guard mode")
    drill.add_argument(
        "--workdir", type=Path, help="where to keep the model, engine logs and the guard's log"
    )
    drill.add_argument(
        "--keep", action="store_true", help="keep the temporary work folder (a failed run always keeps it)"
    )
    drill.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.add_parser(
        "config",
        help="print the effective configuration from the environment, validated",
        description="Reads every VLLM_KVGUARD* variable as the guard would at engine start, validates "
        "them, and prints the variable names and the effective settings as JSON. Exits 2 on a bad value, "
        "naming the variable and what it accepts.",
    )
    doctor = sub.add_parser(
        "doctor",
        help="check this machine and environment before enabling the guard (exit 1 on a blocker)",
        description="Checks the vLLM build against the supported versions, packages that break vLLM on "
        "CPU, that vLLM's plugin loader finds the guard, every VLLM_KVGUARD* variable, metrics, and with "
        "--model the engine configuration vLLM would build (block size and what it means for sealing).",
    )
    doctor.add_argument("--model", help="model directory: also build vLLM's engine configuration for it")
    doctor.add_argument(
        "--block-size", type=_positive("--block-size"), help="the --block-size you serve with"
    )
    doctor.add_argument("--json", action="store_true", help="print the rows as JSON")
    report = sub.add_parser(
        "report",
        help="summarise a guard log: corruptions by shape, rank, device, layer, hour, and a diagnosis",
        description="Reads the guard's lines from a log (VLLM_KVGUARD_LOG_FILE's JSON lines, or vLLM's own "
        "log, console or JSON) and says what the corruptions point at: failing memory, software, or a fire "
        "drill's injected faults, and the runbook section. Exits 1 if the file holds no guard line, or a "
        "guard line it cannot read; with --fail-on-corruption, exits 3 if it holds a finding.",
    )
    report.add_argument("logfile", type=Path, help="the log file")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.add_argument(
        "--fail-on-corruption",
        action="store_true",
        help="exit 3 if the log holds a bad page or another finding (identity mismatch, lost write, "
        "lifecycle violation), injected by a drill or not: a gate for scripts and CI",
    )
    model = sub.add_parser(
        "model",
        help="build the tiny random-weight model (offline) for trying the guard on a server",
        description="Writes a 2-layer random-weight Llama with a one-token-per-word tokenizer (w0 .. w479) "
        "to PATH: enough to start `vllm serve` with the guard and try it without a model hub.",
    )
    model.add_argument("path", type=Path, help="folder to write the model to (created)")
    bench = sub.add_parser(
        "bench",
        help="measure what the guard costs: plain vLLM vs guard (default, paranoid), interleaved",
        description="Runs the same prefix-sharing workload through vLLM with the guard off, default and "
        "paranoid, each run in its own engine process, interleaved; prints medians and ratios to off.",
    )
    bench.add_argument(
        "--model", help="model directory (default: build a 4-layer random-weight Llama, offline)"
    )
    bench.add_argument(
        "--repeats", type=_positive("--repeats"), default=3, help="interleaved repetitions (default 3)"
    )
    bench.add_argument(
        "--configs",
        type=_configs,
        default=["off", "default", "paranoid"],
        help="comma list of off, default, paranoid, reuse, rows-off, finish-off "
        "(default: off, default, paranoid)",
    )
    bench.add_argument(
        "--concurrency",
        type=_positive("--concurrency"),
        default=16,
        help="requests running at once (vLLM's max_num_seqs; twice as many are sent; default 16)",
    )
    bench.add_argument("--workdir", type=Path, help="where to keep the model, run logs and results")
    bench.add_argument(
        "--keep", action="store_true", help="keep the temporary work folder (a failed run always keeps it)"
    )
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    return top


def _positive(flag: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{flag}={text!r} is not valid: expected an integer >= 1")
        return int(text)

    return parse


def _configs(text: str) -> list[str]:
    from vllm_kvguard.tools.bench import CONFIGS

    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--configs={text!r} is not valid: expected a comma list of {', '.join(CONFIGS)}"
        )
    return names


# ``kvguard report --fail-on-corruption``: the log holds a finding (1 and 2 are taken by
# "nothing to read" and bad arguments).
FOUND_CORRUPTION = 3


def main(argv: list[str] | None = None) -> int:
    """The console script: :func:`run`, quiet when its reader goes away (``kvguard config | head``)."""
    try:
        code = run(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader closed the pipe: stop as coreutils do (killed by SIGPIPE: 128 + 13), and keep
        # Python from reporting the same error again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


def run(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "config":
        try:
            config = load_config()
        except KVGuardConfigError as exc:
            print(f"kvguard: {exc}", file=sys.stderr)
            return 2
        print(json.dumps({"variables": variable_names(), "effective": config.to_dict()}, indent=2))
        return 0
    if args.command == "model":
        from vllm_kvguard.tools.tinymodel import build_tiny_model

        if args.path.exists() and not args.path.is_dir():
            print(
                f"kvguard model: {args.path} is a file: expected a folder to write the model to",
                file=sys.stderr,
            )
            return 2
        path = build_tiny_model(args.path)
        print(f"tiny random-weight model written to {path}")
        print(
            "try it: VLLM_KVGUARD=1 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server "
            f"--model {path} --served-model-name tiny --max-model-len 512"
        )
        return 0
    if args.command == "report":
        from vllm_kvguard.tools import report as reporting

        if not args.logfile.is_file():
            print(
                f"kvguard report: {args.logfile} is not a file: expected a log with the guard's lines "
                "(VLLM_KVGUARD_LOG_FILE's JSON lines, or vLLM's own console or JSON log)",
                file=sys.stderr,
            )
            return 2
        found = reporting.read_lines(args.logfile)
        if not found.events:
            print(reporting.no_guard_lines(args.logfile, found), file=sys.stderr)
            return 1
        summary = reporting.summarize(found.events)
        print(json.dumps(summary, indent=2) if args.json else reporting.render(summary))
        if found.unreadable:
            print(
                f"kvguard report: {found.unreadable} line(s) of {args.logfile} named a guard event but could "
                "not be read: the counts above leave them out",
                file=sys.stderr,
            )
            return 1
        if args.fail_on_corruption and reporting.findings(summary):
            return FOUND_CORRUPTION
        return 0
    if args.command == "doctor":
        from vllm_kvguard.tools import doctor

        if args.model:
            try:
                check_model(args.model)
            except RuntimeError as exc:
                print(f"kvguard doctor: {exc}", file=sys.stderr)
                return 2
        rows = doctor.diagnose(model=args.model, block_size=args.block_size)
        print(json.dumps(doctor.to_json(rows), indent=2) if args.json else doctor.render(rows))
        return 1 if any(r.status == doctor.BLOCKER for r in rows) else 0
    if args.command == "bench":
        from vllm_kvguard.tools import bench

        try:
            result = bench.run_bench(
                model=args.model,
                repeats=args.repeats,
                configs=args.configs,
                workdir=args.workdir,
                keep=args.keep,
                concurrency=args.concurrency,
            )
        except RuntimeError as exc:
            print(f"kvguard bench: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(result, indent=2) if args.json else bench.render(result))
        return 0
    from vllm_kvguard.tools.drill import render, run_drill

    try:
        report = run_drill(
            model=args.model,
            requests=args.requests,
            spec=args.inject,
            mode=args.mode,
            workdir=args.workdir,
            keep=args.keep,
        )
    except RuntimeError as exc:
        print(f"kvguard drill: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
