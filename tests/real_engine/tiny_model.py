"""Builds the tiny model the real-engine tests serve: no hub download, same bytes every time.

Run with the engine environment's interpreter (it has torch, transformers and tokenizers)::

    .venv-engine/bin/python tests/real_engine/tiny_model.py .cache/real-engine/tiny-llama

A ``LlamaForCausalLM`` (hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, vocabulary
512) with weights drawn from a fixed seed, and a byte-level BPE tokenizer trained on a fixed
text with ``tokenizers``, wrapped in ``PreTrainedTokenizerFast`` with bos/eos/pad tokens and
a chat template. float32 weights: greedy decoding on a random model has near ties, and the
tests compare SGLang's output with a plain forward pass of this model (``--reference``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 512
SEED = 20261203
SPECIAL = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Write one sentence about the sea. The sea is wide and deep and blue.",
    "Agentic reinforcement learning runs many rollouts with tools and long contexts.",
    "Prefill computes the prompt; decode produces one token after another.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "user: solve 12 * 7. assistant: 12 * 7 = 84.",
    "A switch flips an engine between the prefill and the decode role in place.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # @ & % $",
]
STAMP = "prorsa-tiny-model.json"


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / STAMP).write_text(json.dumps({"seed": SEED, "vocab": VOCAB}))


def reference(model_dir: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by a plain forward pass (no KV cache, no SGLang)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids) :]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--reference",
        metavar="JSON",
        help='{"input_ids": [...], "max_new_tokens": N}: print the greedy output ids',
    )
    args = parser.parse_args()
    if args.reference:
        query = json.loads(args.reference)
        ids = reference(args.out, query["input_ids"], query["max_new_tokens"])
        print(json.dumps(ids))
        return 0
    if (args.out / STAMP).exists():
        print(f"{args.out}: already built", file=sys.stderr)
        return 0
    build(args.out)
    print(f"{args.out}: built", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
