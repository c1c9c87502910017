"""Build the tinylm tokenizer: byte-level BPE trained locally, wrapped for transformers.

Layout of the vocabulary (stable for a given corpus and size):

- ids 0..2 are the special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
  (eos); they are skipped by ``decode(..., skip_special_tokens=True)``;
- then the 256 byte symbols and the learned merges, up to ``vocab_size`` entries;
- the last four ids are ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
  ``</tool_response>``: added tokens that always encode to one id but are *not* special, so
  they survive decoding (as in Qwen2.5), which is what lets a tool-call parser see them.

Normalisation and pre-tokenisation are Qwen2's (NFC, then its word/number/punctuation split,
which isolates single digits, then byte-level). That is not a matter of taste: transformers 5
loads any ``model_type: qwen2`` folder through ``Qwen2Tokenizer``, which rebuilds exactly that
pipeline around the saved vocabulary and merges, while transformers 4 reads ``tokenizer.json``
as written. Using the same pipeline makes both load paths tokenize identically.

The result is a ``PreTrainedTokenizerFast`` carrying the chat template of ``chat_template.py``;
``save_tokenizer`` writes it in Hugging Face format, loadable with
``AutoTokenizer.from_pretrained(dir, local_files_only=True)`` under transformers 4 and 5.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from tinylm.chat_template import CHAT_TEMPLATE

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "build_tokenizer",
    "save_tokenizer",
]

PAD_TOKEN = "<|endoftext|>"
BOS_OF_TURN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_OF_TURN, EOS_TOKEN)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2's pre-tokenisation rule (see the module docstring for why it must be this one).
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ALL_ADDED = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))


def _without_added_tokens(texts: Iterable[str]) -> Iterator[str]:
    """Training text with the added tokens cut out, so no merges are spent on their spelling."""
    for text in texts:
        for piece in _ALL_ADDED.split(text):
            if piece:
                yield piece


def build_tokenizer(texts: Iterable[str], *, vocab_size: int = 1024) -> Any:
    """Train byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    ``vocab_size`` counts the special tokens and merges but not the four tool tokens appended
    after them. Training is deterministic for a given text sequence.
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}"
        )
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_without_added_tokens(texts), trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    wrap: Callable[..., Any] = PreTrainedTokenizerFast  # its constructor is unannotated
    return wrap(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: Any, model_dir: str | Path) -> None:
    """Write ``tokenizer`` into ``model_dir`` so transformers 4 and 5 both load it.

    transformers 5 records its own class name (``TokenizersBackend``), which transformers 4
    does not know; ``Qwen2TokenizerFast`` is understood by both.
    """
    tokenizer.save_pretrained(model_dir)
    config_path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2TokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
