"""Build a tiny random-weight Llama on local disk, so the guard can run offline.

There is no model hub in CI nor in a fire drill on an air-gapped box: the tests,
the demo and ``kvguard drill`` build this model themselves. Weights are drawn
with a wide init so that greedy outputs depend on the KV contents (the default
init gives near-uniform logits, which would hide a corrupted page).
"""

from __future__ import annotations

import json
from pathlib import Path

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
) -> Path:
    """Write a random-weight Llama and its tokenizer to ``path`` (idempotent)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    spec = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "seed": seed,
        "version": 1,
    }
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)

    vocab = {tok: i for i, tok in enumerate(_SPECIAL + vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.25,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out
