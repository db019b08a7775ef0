"""A prefix-sharing workload: the traffic that makes vLLM reuse KV pages.

Used by the engine tests, ``kvguard drill`` and the benchmarks, so that all
three exercise the same path: several long shared prefixes, each reused by
many requests with short distinct suffixes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_kvguard.tools.tinymodel import WORDS


@dataclass(frozen=True)
class Workload:
    prefixes: int = 4
    per_prefix: int = 4
    prefix_words: int = 160
    suffix_words: int = 8
    max_tokens: int = 24
    seed: int = 0

    def waves(self) -> list[list[str]]:
        """Prompts in waves: each wave is one prefix's batch.

        Waves cycle over the prefixes, so pages of a prefix sit idle in the prefix
        cache between its waves and are then reused (and verified).
        """
        rng = random.Random(self.seed)
        prefixes = [
            " ".join(f"w{rng.randrange(WORDS)}" for _ in range(self.prefix_words))
            for _ in range(self.prefixes)
        ]
        out: list[list[str]] = []
        for _ in range(self.per_prefix // 2 + self.per_prefix % 2):
            for prefix in prefixes:
                batch = []
                for _ in range(min(2, self.per_prefix)):
                    suffix = " ".join(f"w{rng.randrange(WORDS)}" for _ in range(self.suffix_words))
                    batch.append(f"{prefix} {suffix}")
                out.append(batch)
        return out
