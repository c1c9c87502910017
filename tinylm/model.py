"""``rollout tinylm init``: build, briefly train and save the tiny reference model.

``init_model(dir, seed=...)`` writes a Hugging Face model folder (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files with the chat template)
that ``AutoTokenizer`` / ``AutoModelForCausalLM`` load offline and the tinylm server serves.

Steps, all seeded and on CPU:

1. generate the synthetic tool-use dialogues of ``corpus.py``;
2. train the byte-level BPE tokenizer on their rendered text;
3. build a small Qwen2 (``Qwen2Config``/``Qwen2ForCausalLM``; sizes in ``ModelSize``) with
   seeded weights;
4. train it for ``train_steps`` AdamW steps on the chat-template rendering of the dialogues, the
   loss on assistant tokens only (what the policy emits, ``<|im_end|>`` included), so that it
   emits ``<tool_call>`` blocks and ``<answer>`` replies in the right places. ``train_steps=0``
   skips training (fast fixtures); the default keeps ``init`` at about a minute on 2 cores.

The model needn't be good, just speak the format: it exists so demos and tests exercise real
HTTP, real tokenizers and real logprobs without a GPU.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinylm.chat_template import render_chat
from tinylm.corpus import Dialogue, SystemPrompts, generate_dialogues
from tinylm.errors import ConfigError
from tinylm.tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer, save_tokenizer

__all__ = [
    "DEFAULT_TRAIN_STEPS",
    "InitReport",
    "ModelSize",
    "TrainSettings",
    "encode_dialogue",
    "init_model",
]

DEFAULT_TRAIN_STEPS = 450


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """Architecture of the tiny Qwen2. ``vocab_size`` is the tokenizer's BPE budget."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """The brief supervised run that teaches the format."""

    steps: int = DEFAULT_TRAIN_STEPS
    batch_size: int = 6
    learning_rate: float = 5e-3
    warmup_steps: int = 30
    num_dialogues: int = 1200


@dataclass(frozen=True)
class InitReport:
    """What ``init_model`` wrote and how training went."""

    model_dir: str
    seed: int
    vocab_size: int
    parameters: int
    train_steps: int
    first_loss: float | None
    final_loss: float | None
    seconds: float
    size: dict[str, Any] = field(default_factory=dict)


def encode_dialogue(tokenizer: Any, dialogue: Dialogue) -> tuple[list[int], list[int]]:
    """Token ids of the rendered dialogue and a 0/1 mask marking assistant-emitted tokens.

    An assistant turn spans from the end of the generation prompt (``<|im_start|>assistant\\n``)
    through its ``<|im_end|>``: exactly the tokens a policy samples for that turn.
    """

    def render(messages: Sequence[dict[str, Any]], prompt: bool) -> str:
        text = tokenizer.apply_chat_template(
            list(messages),
            tools=dialogue.tools or None,
            tokenize=False,
            add_generation_prompt=prompt,
        )
        assert isinstance(text, str)
        return text

    full = render(dialogue.messages, False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(dialogue.messages):
        if message["role"] != "assistant":
            continue
        start = len(render(dialogue.messages[:i], True))
        turn = render(dialogue.messages[: i + 1], False)
        end = turn.rindex(EOS_TOKEN) + len(EOS_TOKEN)
        if not full.startswith(turn):
            raise AssertionError("chat template is not prefix-stable; cannot mask assistant turns")
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    mask = [int(any(s <= a and b <= e for s, e in spans)) for a, b in enc["offset_mapping"]]
    return ids, mask


def _hf_config(size: ModelSize, vocab: int, eos_ids: list[int], pad_id: int) -> Any:
    from transformers import Qwen2Config

    # ``rope_theta`` is the transformers 4 spelling; 5 folds it into ``rope_parameters``.
    settings: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "rope_theta": size.rope_theta,
        "tie_word_embeddings": True,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "bos_token_id": None,
    }
    return Qwen2Config(**settings)


def _train(
    model: Any,
    examples: list[tuple[list[int], list[int]]],
    settings: TrainSettings,
    *,
    seed: int,
    pad_id: int,
    log: Callable[[str], None],
) -> tuple[float | None, float | None]:
    if settings.steps == 0:
        return None, None
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.98), weight_decay=0.0
    )

    def lr_at(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    began = time.perf_counter()
    model.train()
    first: float | None = None
    last: float | None = None
    for step in range(settings.steps):
        picks = torch.randint(len(examples), (settings.batch_size,), generator=gen).tolist()
        batch = [examples[i] for i in picks]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.where(
                torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), torch.tensor(-100)
            )
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last = float(loss.detach())
        if first is None:
            first = last
        if step % 50 == 0 or step == settings.steps - 1:
            log(
                f"tinylm init: step {step + 1}/{settings.steps} loss {last:.4f} "
                f"({time.perf_counter() - began:.1f}s)"
            )
    model.eval()
    return first, last


def init_model(
    model_dir: str | Path,
    *,
    system_prompts: SystemPrompts,
    seed: int = 0,
    train_steps: int | None = None,
    dialogues: Sequence[Dialogue] | None = None,
    size: ModelSize = ModelSize(),
    train: TrainSettings = TrainSettings(),
    log: Callable[[str], None] = lambda _msg: None,
) -> InitReport:
    """Create a trained tinylm in ``model_dir`` (created; must be empty if it exists).

    ``system_prompts`` are those of the agents the model will be served to (the corpus is
    rendered with them); ``train_steps`` overrides ``train.steps``; ``dialogues`` replaces the
    generated corpus (a test can overfit one dialogue to pin the model's output).
    """
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    from transformers.utils import logging as transformers_logging

    hf_logging: Any = transformers_logging  # its toggles are unannotated

    began = time.perf_counter()
    root = Path(model_dir)
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root}: refusing to initialise a model into a non-empty folder")
    if train_steps is not None:
        if train_steps < 0:
            raise ConfigError(f"train_steps must be >= 0, got {train_steps}")
        train = TrainSettings(**{**asdict(train), "steps": train_steps})
    corpus = (
        list(dialogues)
        if dialogues is not None
        else generate_dialogues(train.num_dialogues, seed=seed, prompts=system_prompts)
    )
    if not corpus:
        raise ConfigError("tinylm init needs at least one dialogue")
    texts = [render_chat(d.messages, tools=d.tools or None) for d in corpus]
    # The tokenizer sees the generated corpus even when a custom one is given, so the
    # vocabulary (and the template's wording) tokenizes compactly either way.
    if dialogues is not None:
        texts += [
            render_chat(d.messages, tools=d.tools)
            for d in generate_dialogues(500, seed=seed, prompts=system_prompts)
        ]
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for writing one small file is noise
    try:
        # Encode the training data with the tokenizer as it loads back from disk, so training
        # sees exactly the ids every server and backend will produce.
        save_tokenizer(build_tokenizer(texts, vocab_size=size.vocab_size), staging)
        tokenizer: Any = AutoTokenizer.from_pretrained(staging, local_files_only=True)
        vocab = math.ceil(len(tokenizer) / 64) * 64  # spare rows, as real checkpoints pad
        pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
        eos_ids = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), pad_id]

        torch.manual_seed(seed)
        model: Any = Qwen2ForCausalLM(_hf_config(size, vocab, eos_ids, pad_id))
        model.to(torch.float32)
        examples = [encode_dialogue(tokenizer, d) for d in corpus] if train.steps else []
        first, final = _train(model, examples, train, seed=seed, pad_id=pad_id, log=log)

        model.generation_config.eos_token_id = eos_ids
        model.generation_config.pad_token_id = pad_id
        model.generation_config.bos_token_id = None
        model.save_pretrained(staging)
        if root.exists():
            root.rmdir()
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    report = InitReport(
        model_dir=str(root),
        seed=seed,
        vocab_size=vocab,
        parameters=sum(p.numel() for p in model.parameters()),
        train_steps=train.steps,
        first_loss=first,
        final_loss=final,
        seconds=round(time.perf_counter() - began, 2),
        size=asdict(size),
    )
    (root / "tinylm.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
