"""The load client the load and soak benchmarks share: the official ``openai`` client (asyncio)
against the real OpenAI server, a prefix-sharing prompt mix, and the per-response verdict
against a clean run (greedy, so the same prompt must give the same text).

Loopback only: every base URL is checked to be 127.0.0.1 or localhost. Every request loop
is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[1]
# The servers' shapes beyond tools.server.BASE_ARGS: room for 64 running requests.
SERVER_ARGS = ("--max-num-seqs", "64", "--max-num-batched-tokens", "2048")
GUARD_PREFIX = "KV-cache corruption"  # vllm_kvguard.errors.KVCacheCorruptionError.PREFIX
MAX_TOKENS = 24


def parser(doc: str) -> argparse.ArgumentParser:
    """The options the load and soak scripts share: --model, --dtype, --workdir, --json."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"), help="default: the tiny model")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="default float32")
    p.add_argument(
        "--workdir", default=None, help="keep reports and server logs here (default: a temp folder)"
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help=f"tokens per completion (default {MAX_TOKENS})"
    )
    return p


def prepare(p: argparse.ArgumentParser, args: argparse.Namespace, faults: str) -> tuple[str, tuple[str, ...]]:
    """Check the drill spec (one clear error), build the tiny model if it is the default path;
    (model path, server arguments)."""
    from vllm_kvguard.core.faults import parse_fault_spec
    from vllm_kvguard.errors import KVGuardConfigError
    from vllm_kvguard.tools.tinymodel import build_tiny_model

    global MAX_TOKENS
    if not 1 <= args.max_tokens <= 1024:
        p.error(f"--max-tokens {args.max_tokens}: expected 1..1024")
    MAX_TOKENS = args.max_tokens  # every completion this process sends (one() reads it)
    if faults:
        try:
            parse_fault_spec(faults, variable="--faults")
        except KVGuardConfigError as exc:
            p.error(str(exc))
    model = str(build_tiny_model(Path(args.model))) if args.model.endswith("tiny-model") else args.model
    return model, (*SERVER_ARGS, "--dtype", args.dtype)


def words(start: int, n: int, step: int = 7) -> str:
    """``n`` one-token words of the tiny model's tokenizer."""
    return " ".join(f"w{(start + i * step) % 400}" for i in range(n))


def prompt_mix(prefixes: int = 6, per_prefix: int = 8, seed: int = 0) -> list[str]:
    """Prompts over ``prefixes`` shared prefixes of 2, 3 or 4 full pages (block size 32), each
    with its own tail of 3 to 24 words, and a few with no shared prefix."""
    rng = random.Random(seed)
    out = []
    for p in range(prefixes):
        prefix = words(53 * p + 1, 32 * (2 + p % 3) - 1)
        for _ in range(per_prefix):
            out.append(prefix + " " + words(rng.randrange(400), rng.randint(3, 24), rng.choice((3, 11))))
    for _ in range(max(1, prefixes // 2)):
        out.append(words(rng.randrange(400), rng.randint(20, 90), 13))
    return out


@dataclass
class Response:
    prompt: int
    stream: bool
    ok: bool
    text: str = ""
    cause: str = ""  # why it errored: kv_corruption, http_<code>, timeout, connection, disconnected
    flagged: bool = False  # the guard's message in stop_reason (log mode: suspect)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0


def check_loopback(base: str) -> None:
    host = urllib.parse.urlparse(base).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"load client: {base} is not loopback (127.0.0.1 or localhost only)")


def _cause(exc: BaseException) -> str:
    if GUARD_PREFIX in str(exc):
        return "kv_corruption"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, openai.APITimeoutError | asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    return type(exc).__name__


async def one(
    client: openai.AsyncOpenAI,
    prompts: Sequence[str],
    index: int,
    stream: bool,
    *,
    disconnect_after: int | None = None,
) -> Response:
    """One completion. ``disconnect_after``: a streaming client that hangs up after that many
    chunks (the server must abort the request and forget it)."""
    out = Response(index, stream, ok=False)
    start = time.perf_counter()
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompts[index],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    try:
        if not stream:
            r = await client.completions.create(**kwargs)
            choice = r.choices[0]
            out.text = choice.text
            out.flagged = str(getattr(choice, "stop_reason", "")).startswith(GUARD_PREFIX)
        else:
            s = await client.completions.create(stream=True, **kwargs)
            last = start
            chunks = 0
            parts = []
            async for chunk in s:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.text:
                    now = time.perf_counter()
                    if out.ttft is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    parts.append(choice.text)
                    chunks += 1
                if str(getattr(choice, "stop_reason", "") or "").startswith(GUARD_PREFIX):
                    out.flagged = True
                if disconnect_after is not None and chunks >= disconnect_after:
                    await s.close()
                    out.cause = "disconnected"
                    out.latency = time.perf_counter() - start
                    return out
            out.text = "".join(parts)
        out.ok = True
    except Exception as exc:  # every failure is a counted cause, never lost
        out.cause = _cause(exc)
    out.latency = time.perf_counter() - start
    return out


async def drive(
    base: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    seconds: float,
    max_requests: int,
    seed: int = 0,
    disconnect_every: int = 0,
    order: Sequence[int] | None = None,
) -> list[Response]:
    """``concurrency`` clients sending requests until ``seconds`` pass or ``max_requests`` were
    sent (both bounds always apply). Prompts in ``order`` (cycled), else random; every other
    request streams; with ``disconnect_every`` N, every Nth streaming request hangs up after
    two chunks."""
    check_loopback(base)
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    deadline = time.monotonic() + seconds
    sent = 0
    out: list[Response] = []

    def take() -> tuple[int, bool, int | None] | None:
        nonlocal sent
        if sent >= max_requests or time.monotonic() >= deadline:
            return None
        n = sent
        sent += 1
        index = order[n % len(order)] if order is not None else rng.randrange(len(prompts))
        stream = n % 2 == 0
        hang_up = 2 if stream and disconnect_every and (n // 2) % disconnect_every == 1 else None
        return index, stream, hang_up

    async def worker() -> None:
        while (job := take()) is not None:
            index, stream, hang_up = job
            out.append(await one(client, prompts, index, stream, disconnect_after=hang_up))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return out


def run(base: str, prompts: Sequence[str], **kwargs: Any) -> list[Response]:
    return asyncio.run(drive(base, prompts, **kwargs))


def verdicts(responses: Sequence[Response], reference: dict[int, str]) -> dict[str, Any]:
    """Each response against the clean run: ``silent_wrong`` (differs, not errored, not flagged)
    is the count the contract says must be 0."""
    c: Counter[str] = Counter()
    causes: Counter[str] = Counter()
    wrong: list[dict[str, Any]] = []
    for r in responses:
        if r.cause == "disconnected":
            c["disconnected"] += 1
        elif not r.ok:
            c["errored"] += 1
            causes[r.cause] += 1
        elif r.text == reference[r.prompt]:
            c["flagged_same" if r.flagged else "same"] += 1
        elif r.flagged:
            c["flagged_different"] += 1
        else:
            c["silent_wrong"] += 1
            if len(wrong) < 10:
                wrong.append(
                    {"prompt": r.prompt, "stream": r.stream, "expected": reference[r.prompt], "got": r.text}
                )
    return {
        "requests": len(responses),
        **{k: c[k] for k in ("same", "flagged_same", "flagged_different", "errored", "disconnected")},
        "silent_wrong": c["silent_wrong"],
        "errors_by_cause": dict(causes),
        "silent_wrong_examples": wrong,
    }


def latency(responses: Sequence[Response]) -> dict[str, float | int | None]:
    """TTFT and inter-token latency (streaming responses), p50 and p99, in ms."""

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        values = sorted(values)
        return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 2)

    ttft = [r.ttft for r in responses if r.ok and r.ttft is not None]
    itl = [x for r in responses if r.ok for x in r.itl]
    return {
        "streams": len(ttft),
        "ttft_p50_ms": pct(ttft, 0.50),
        "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(itl, 0.50),
        "itl_p99_ms": pct(itl, 0.99),
        "latency_mean_ms": round(1000 * statistics.fmean(r.latency for r in responses), 2)
        if responses
        else None,
    }
