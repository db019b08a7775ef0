"""Build a tiny random-weight Llama on local disk, so the guard can run offline.

There is no model hub in CI nor in a fire drill on an air-gapped box: the tests,
the demo and ``kvguard drill`` build this model themselves. Weights are drawn
with a wide init so that greedy outputs depend on the KV contents (the default
init gives near-uniform logits, which would hide a corrupted page).
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any

WORDS = 480
_SPECIAL = ["<unk>", "<s>", "</s>"]
_MARKER = "kvguard-tiny-model.json"


def vocabulary() -> list[str]:
    """The tokenizer's words: ``w0`` .. ``w479``, one token each."""
    return [f"w{i}" for i in range(WORDS)]


def build_tiny_model(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    family: str = "llama",
    nan_word: int | None = None,
) -> Path:
    """Write a random-weight model and its tokenizer to ``path`` (idempotent).

    ``family="gemma2"`` builds a Gemma-2 with sliding-window and full-attention
    layers (two kinds of KV cache: a hybrid layout for vLLM's hybrid allocator);
    ``family="mistral"`` a Mistral whose every layer has a 64-token sliding window.
    ``nan_word``: the embedding of word ``w<nan_word>`` is NaN, a stand-in for a
    model that computes non-finite KV (every page written after it holds NaN).
    """
    out = Path(path)
    spec = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "seed": seed,
        "version": 1,
        **({"family": family} if family != "llama" else {}),
        **({"nan_word": nan_word} if nan_word is not None else {}),
    }
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (test workers in parallel, a drill beside them): the others wait,
    # then find it built.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == spec:
            return out
        _build(out, spec, layers, hidden, heads, kv_heads, seed, family, nan_word)
    return out


def _build(
    out: Path,
    spec: dict[str, Any],
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    seed: int,
    family: str,
    nan_word: int | None,
) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

    marker = out / _MARKER
    out.mkdir(parents=True, exist_ok=True)

    vocab = {tok: i for i, tok in enumerate(_SPECIAL + vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    common: dict[str, Any] = {
        "vocab_size": len(vocab),
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.25,
        "torch_dtype": "bfloat16",
    }
    torch.manual_seed(seed)
    model: PreTrainedModel
    if family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        kinds = ["sliding_attention", "full_attention"]
        layer_types = [kinds[i % 2] for i in range(layers)]
        model = Gemma2ForCausalLM(
            Gemma2Config(**common, pad_token_id=0, sliding_window=64, layer_types=layer_types)
        )
    elif family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        # Every layer attends to the last 64 tokens: vLLM frees the pages behind the window
        # while a request runs (one KV cache group, all sliding-window).
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=64, tie_word_embeddings=False))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        raise ValueError(f"family={family!r}: expected llama, mistral or gemma2")
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types .to() oddly
    if nan_word is not None:
        with torch.no_grad():
            embeddings: Any = model.get_input_embeddings()
            embeddings.weight[vocab[f"w{nan_word}"]] = float("nan")
    _save_quietly(model, out)
    marker.write_text(json.dumps(spec))


def _save_quietly(model: Any, out: Path) -> None:
    """``save_pretrained`` without transformers' "Writing model shards" progress bar (the
    drill's and the demo's terminal shows only their own progress); the setting is restored."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
