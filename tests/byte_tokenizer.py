"""A byte-level tokenizer built in the test (no hub download), for the tests that run a
trainer's own classes (tests/test_verl_real.py, tests/test_areal_real.py): every byte a
token plus the chat-template markers, so any text encodes and decodes exactly."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Every byte a token, plus the chat-template markers: encodes and decodes any text."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = CHAT_TEMPLATE
    return tok
