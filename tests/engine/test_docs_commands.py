"""The README's and docs/connectors.md's commands, run as written against real servers.

Each shell block the docs mark ``<!-- ci: NAME -->`` is run by bash from the checkout's root, as a
reader would paste it, with two changes only: its loopback ports (8000-8002) become free ones and
its ``/tmp/kvguard-*`` paths a test folder, so that parallel runs do not collide. Server blocks run
until the test stops them; client blocks run to the end, and what they print is compared with what
the docs say they print.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.engine.servers import free_port, get, wait

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONNECTORS = ROOT / "docs" / "connectors.md"
MARKED = re.compile(r"<!-- ci: (?P<name>[\w-]+) -->\n```bash\n(?P<body>.*?)\n```", re.S)
PORTS = ("8000", "8001", "8002")


def marked_blocks(path: Path) -> dict[str, str]:
    """The shell blocks ``path`` marks for CI, by name."""
    return {m["name"]: m["body"] for m in MARKED.finditer(path.read_text())}


def test_the_docs_mark_the_blocks_this_module_runs() -> None:
    """A renamed or dropped marker fails here rather than leaving a command untested."""
    assert set(marked_blocks(README)) == {"live-server", "live-client"}
    assert set(marked_blocks(CONNECTORS)) == {"beside-server", "beside-client", "pd-servers", "pd-client"}


class Rewrite:
    """The docs' loopback ports and /tmp paths, made this test's own."""

    def __init__(self, tmp: Path) -> None:
        self.ports = {p: str(free_port()) for p in PORTS}
        self.tmp = tmp

    def __call__(self, body: str) -> str:
        body = body.replace("/tmp/kvguard-", f"{self.tmp}/kvguard-")
        return re.sub(r"\b(800[0-2])\b", lambda m: self.ports[m.group(1)], body)

    def port(self, documented: str) -> str:
        return self.ports[documented]


@contextmanager
def running(script: str, log: Path, ports: list[str]) -> Iterator[None]:
    """A server block in its own process group, until every port answers /health; stopped
    (SIGTERM to the group, then SIGKILL) when the test is done."""
    out = log.open("w")
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )

    def up() -> bool:
        assert proc.poll() is None, f"the server block exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        try:
            return all(get(f"http://127.0.0.1:{p}/health") is not None for p in ports)
        except OSError:
            return False

    try:
        wait(up, 420, "the documented server(s) to answer /health")
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        out.close()


def run_client(script: str) -> list[str]:
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def _documented(path: Path, prefix: str) -> list[str]:
    """The lines the docs show as output that start with ``prefix``."""
    return [line for line in path.read_text().splitlines() if line.startswith(prefix)]


def test_readme_live_corruption_shows_a_503_then_the_recomputed_page(tmp_path: Path) -> None:
    blocks = marked_blocks(README)
    rewrite = Rewrite(tmp_path)
    with running(rewrite(blocks["live-server"]), tmp_path / "server.log", [rewrite.port("8000")]):
        lines = run_client(rewrite(blocks["live-client"]))
    statuses = [line for line in lines if line.startswith("w30")]
    # What the README says it prints, line for line.
    assert statuses == ["w301: HTTP 200", "w302: HTTP 503", "w303: HTTP 200", "w304: HTTP 200"]
    assert _documented(README, "w30") == statuses
    series = dict(line.rsplit(" ", 1) for line in lines if line.startswith("vllm:"))
    assert (
        series[
            'vllm:kvguard_corruptions_detected_total{engine="0",kind="checksum_mismatch",model_name="tiny"}'
        ]
        == "1.0"
    )
    assert (
        series['vllm:kvguard_requests_affected_total{engine="0",model_name="tiny",outcome="failed"}'] == "1.0"
    )
    log = (tmp_path / "server.log").read_text()
    assert "kv_block_corrupted" in log and "shape=single_bit" in log


def _answers_and_loads(lines: list[str]) -> tuple[list[str], list[str]]:
    loads = [line for line in lines if line.startswith("vllm:kvguard_pages_loaded_total")]
    return [line for line in lines if not line.startswith("vllm:")], loads


def test_connectors_doc_one_server_beside_example_connector(tmp_path: Path) -> None:
    blocks = marked_blocks(CONNECTORS)
    rewrite = Rewrite(tmp_path)
    with running(rewrite(blocks["beside-server"]), tmp_path / "server.log", [rewrite.port("8000")]):
        answers, loads = _answers_and_loads(run_client(rewrite(blocks["beside-client"])))
    assert len(answers) == 2 and answers[0].strip() and answers[0] == answers[1]
    # The second request's full page came from the connector and was checked (as documented).
    assert loads == _documented(CONNECTORS, "vllm:kvguard_pages_loaded_total")[:4]
    assert "External Cache Hit" in (tmp_path / "server.log").read_text()


def test_connectors_doc_producer_and_consumer(tmp_path: Path) -> None:
    blocks = marked_blocks(CONNECTORS)
    rewrite = Rewrite(tmp_path)
    ports = [rewrite.port("8001"), rewrite.port("8002")]
    with running(rewrite(blocks["pd-servers"]), tmp_path / "servers.log", ports):
        answers, loads = _answers_and_loads(run_client(rewrite(blocks["pd-client"])))
    assert len(answers) == 2 and answers[0].strip() and answers[0] == answers[1]
    # The consumer checked the page it loaded against the producer's published digest.
    assert loads == _documented(CONNECTORS, "vllm:kvguard_pages_loaded_total")[4:]
    assert list((tmp_path / "kvguard-digests").glob("*/*.bin"))
