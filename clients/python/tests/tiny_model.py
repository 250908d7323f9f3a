"""A tiny random-weight Llama and a byte-level BPE tokenizer trained here, so
the vLLM tests need no download. Fixed seeds: the same files every time, and
greedy decoding over them is deterministic (outputs can be compared exactly)."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "kvrail moves the KV cache of a prompt from a prefill engine to a decode engine.",
    "The quick brown fox jumps over the lazy dog while the rails carry blocks.",
    "Disaggregated serving splits prefill and decode across nodes and GPUs.",
    "Every block of every layer crosses the network before the first token.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and words of many kinds make a small corpus.",
]


def build(directory: Path, vocab_size: int = 512) -> Path:
    """Writes the model to ``directory`` (once) and returns it."""
    marker = directory / "kvrail-tiny.json"
    if marker.exists():
        return directory
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        # No end of sequence: outputs run to max_tokens and compare in full.
        eos_token_id=None,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    marker.write_text(json.dumps({"layers": 2, "kv_heads": 2}))
    return directory


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1])))
