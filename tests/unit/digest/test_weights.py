"""The weights' identity (digest/weights.py) and the fingerprint root it keys (digest/identity.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from vllm_kvguard.digest import weights
from vllm_kvguard.digest.identity import ROOT, PageIdentity, RequestInputs, root_for


def _model(folder: Path, seed: int, size: int = 300_000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (folder / "model.safetensors").write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    (folder / "config.json").write_text("{}")
    return folder


def test_the_same_weights_anywhere_are_the_same_identity(tmp_path: Path) -> None:
    a = _model(tmp_path / "a", seed=0)
    b = tmp_path / "elsewhere"
    shutil.copytree(a, b)
    assert weights.weight_files(a) == [a / "model.safetensors"]  # weights files only
    assert weights.fingerprint(weights.weight_files(a), "bf16") == weights.fingerprint(
        weights.weight_files(b), "bf16"
    )


def test_other_weights_dtype_or_size_are_another_identity(tmp_path: Path) -> None:
    base = weights.fingerprint(weights.weight_files(_model(tmp_path / "a", seed=0)), "bf16")
    assert weights.fingerprint(weights.weight_files(_model(tmp_path / "b", seed=1)), "bf16") != base
    assert weights.fingerprint(weights.weight_files(tmp_path / "a"), "fp16") != base
    # A change in the middle of the file only (a sampled place), and the size alone.
    data = bytearray((tmp_path / "a" / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1
    (_model(tmp_path / "c", seed=0) / "model.safetensors").write_bytes(bytes(data))
    assert weights.fingerprint(weights.weight_files(tmp_path / "c"), "bf16") != base
    (tmp_path / "c" / "model.safetensors").write_bytes(bytes(data) + b"\0")
    assert weights.fingerprint(weights.weight_files(tmp_path / "c"), "bf16") != base


def test_no_weights_file_found_the_name_stands_in(tmp_path: Path) -> None:
    assert weights.weight_files(tmp_path / "missing") == [] and weights.weight_files("org/model") == []
    assert weights.of_name("org/model@main", "bf16") != weights.of_name("org/model@v2", "bf16")


def test_other_weights_give_every_page_another_fingerprint() -> None:
    assert root_for(0) == ROOT and root_for(5) != ROOT and root_for(5) != root_for(6)
    fps = []
    for root in (ROOT, root_for(5)):
        identity = PageIdentity(4, root)
        identity.add("r", RequestInputs(tokens=list(range(12))))
        fps.append(identity.fingerprints("r", np.arange(3)))
    assert not set(fps[0].tolist()) & set(fps[1].tolist())
