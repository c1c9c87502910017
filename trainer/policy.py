"""The student being trained: a Hugging Face causal LM on CPU, its optimizer, and saving.

``Policy.log_probs(batch)`` runs the model on ``collate``'s ``tokens`` and returns the
``[B, T]`` logprob of each token (``engine.losses.token_log_probs``), the layout of
``loss_mask`` and ``rollout_log_probs``. ``step(loss)`` back-propagates, clips the gradient
norm and steps AdamW. ``save(dir)`` writes a whole model folder (weights, config, tokenizer),
which is what ``/update_weights_from_disk`` and ``from_pretrained`` read.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from engine.losses import token_log_probs

__all__ = ["FrozenModel", "Policy", "load_model", "tokenizer_vocab_size"]

_NOT_COPIED = frozenset({"model.safetensors", "config.json", "tinylm.json"})
"""Files of the source folder that ``save`` does not copy next to the new weights: the
weights and config it writes itself, and the build report of the original model."""


def tokenizer_vocab_size(model_dir: Path) -> int:
    """How many ids the folder's tokenizer has (special tokens included): the ids a model
    server samples from and normalizes over; the embedding may have spare rows above."""
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    ))


def load_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    hf_logging: Any = transformers_logging  # its toggles are unannotated
    hf_logging.disable_progress_bar()  # a bar per load and save of a tiny model is noise
    # fp32 whatever the transformers release's default dtype: the server computes in fp32
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    return model.float()


class Policy:
    """The trained model and its optimizer (see the module docstring)."""

    def __init__(
        self, model_dir: Path, *, lr: float, seed: int, max_grad_norm: float = 1.0
    ) -> None:
        torch.manual_seed(seed)
        self.source = Path(model_dir)
        self.model = load_model(self.source)
        self.model.train()
        self.vocab_size = min(tokenizer_vocab_size(self.source),
                              int(self.model.config.vocab_size))
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0
        )

    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"])
        return token_log_probs(out.logits, batch["tokens"], vocab_size=self.vocab_size)

    def step(self, loss: torch.Tensor) -> float:
        """One optimizer step on ``loss``; returns the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return float(norm)

    def save(self, directory: Path) -> Path:
        """Write the current weights as a complete model folder; returns it (absolute)."""
        directory = directory.resolve()
        staging = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(staging, safe_serialization=True)
        for src in self.source.iterdir():  # the tokenizer and chat template
            if src.is_file() and src.name not in _NOT_COPIED and not (staging / src.name).exists():
                shutil.copy2(src, staging / src.name)
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)  # a server never reads a half-written version
        return directory


class FrozenModel:
    """A model used only for logprobs (the initial policy, as GRPO's KL reference)."""

    def __init__(self, model_dir: Path) -> None:
        self.model = load_model(Path(model_dir))
        self.model.eval()
        self.vocab_size = min(tokenizer_vocab_size(Path(model_dir)),
                              int(self.model.config.vocab_size))

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"])
        return token_log_probs(out.logits, batch["tokens"], vocab_size=self.vocab_size)
