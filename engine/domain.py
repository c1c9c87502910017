"""Domain records of the scheduler's data path: resources, generation limits, datasets, tasks.

- Every record is immutable pure data, validated once at construction: frozen pydantic models
  for what events carry, a frozen dataclass for ``EvaluatorProfile`` (errors name the
  evaluator id). No live objects: binding a profile to its agent is ``engine.agents.binding``.
- Integer and boolean fields are strict (a YAML ``"8"`` or ``true`` is refused, not coerced);
  float fields accept integers.
- ``StoppingCriteria`` and ``SamplingParams`` fields are optional, ``None`` meaning "not set at
  this level", so the cascade of ``engine.batching`` merges them field by field (``overlay``).
- ``max_new_tokens`` is a stopping criterion only: the agent derives each turn's budget from it
  and the remaining context.
- A dataset's ``task_type`` names the ``EvaluatorProfile.evaluator_id`` that runs its samples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    Strict,
    field_validator,
    model_validator,
)

from engine.errors import ConfigError
from engine.outcomes import SampleStatus, TerminationReason

__all__ = [
    "Batch",
    "ChatMessage",
    "DatasetConfig",
    "DatasetEntry",
    "EvalDatasetConfig",
    "EvaluatorProfile",
    "FrozenModel",
    "Identifier",
    "NonNegFloat",
    "NonNegInt",
    "PosFloat",
    "PosInt",
    "Prompt",
    "Resource",
    "SampleStatus",
    "SamplingParams",
    "StoppingCriteria",
    "Task",
    "TerminationReason",
    "batch_id_for",
    "check_identifier",
    "check_prompt",
    "overlay",
    "sample_id_for",
]


class FrozenModel(BaseModel):
    """Base of the engine's pure-data records: immutable, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


_IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def check_identifier(value: str) -> str:
    """Accept names safe inside stream keys and metric names (``rl:work:{id}``)."""
    if not _IDENTIFIER.fullmatch(value):
        raise ValueError(
            f"must be a name of letters, digits, '_', '.' or '-' (starting with a letter or "
            f"digit), got {value!r}"
        )
    return value


Identifier = Annotated[str, Strict(), AfterValidator(check_identifier)]
PosInt = Annotated[int, Strict(), Field(ge=1)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
NonNegFloat = Annotated[float, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0)]
StrictBool = Annotated[bool, Strict()]
StrictStr = Annotated[str, Strict()]

ChatMessage = dict[str, JsonValue]


def check_prompt(value: object) -> str | list[ChatMessage]:
    """``value`` if it is a string or a non-empty list of chat messages with a string ``role``;
    ``ValueError`` saying what is wrong otherwise."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"a prompt must be a string or a non-empty list of chat messages, "
            f"got {type(value).__name__}"
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"chat message {i} must be a mapping with a string 'role'")
    return value


Prompt = Annotated[str | list[ChatMessage], BeforeValidator(check_prompt)]


class Resource(FrozenModel):
    """Supply or demand of one placement token (per sample) or of an evaluator's budget.

    ``gpu`` is a fraction of one GPU (each GPU has capacity 1.0, so ``gpu=0.33`` packs three
    samples per GPU) or a whole number of GPUs; ``gpu=0`` gates on CPU and memory alone.
    ``concurrency`` is the evaluator's semaphore ceiling when the record is a budget.
    """

    gpu: NonNegFloat = 0.0
    cpu: NonNegFloat = 0.0
    memory_gb: NonNegFloat = 0.0
    concurrency: PosInt = 1

    @field_validator("gpu")
    @classmethod
    def _fraction_or_whole(cls, value: float) -> float:
        if value > 1 and not value.is_integer():
            raise ValueError(
                f"gpu must be a fraction of one GPU (0 to 1) or a whole number of GPUs, got {value}"
            )
        return value

    def peak(self, other: Resource) -> Resource:
        """Per-field maximum: what one holder of both (never at once) must reserve."""
        return Resource(
            gpu=max(self.gpu, other.gpu),
            cpu=max(self.cpu, other.cpu),
            memory_gb=max(self.memory_gb, other.memory_gb),
            concurrency=max(self.concurrency, other.concurrency),
        )


class StoppingCriteria(FrozenModel):
    """Limits of one episode; ``None`` leaves a limit to a coarser level (or unbounded)."""

    max_turns: PosInt | None = None
    max_context_len: PosInt | None = None
    max_new_tokens: PosInt | None = None  # per turn
    timeout_s: PosFloat | None = None  # whole-episode wall clock


class SamplingParams(FrozenModel):
    """SGLang sampling parameters (native ``/generate`` names); ``None`` means not set. Unknown
    names are refused: a typo must not silently sample with the server's default."""

    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Strict()] | None = None
    min_p: Annotated[float, Strict(), Field(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Strict(), Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Strict(), Field(ge=-2, le=2)] | None = None
    repetition_penalty: PosFloat | None = None
    min_new_tokens: NonNegInt | None = None
    stop: tuple[StrictStr, ...] | None = None
    stop_token_ids: tuple[NonNegInt, ...] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    sampling_seed: Annotated[int, Strict()] | None = None

    @model_validator(mode="before")
    @classmethod
    def _max_new_tokens_is_a_stopping_criterion(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_new_tokens" in data:
            raise ValueError(
                "max_new_tokens is a stopping criterion: set it as max_new_tokens on the "
                "dataset or in StoppingCriteria, not among sampling params"
            )
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _single_stop_string(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {value}")
        return value

    def as_request(self) -> dict[str, JsonValue]:
        """The fields that are set, as SGLang's ``sampling_params``."""
        out: dict[str, JsonValue] = {}
        for name, value in self:
            if value is None:
                continue
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


_Layer = TypeVar("_Layer", StoppingCriteria, SamplingParams)


def overlay(coarse: _Layer, fine: _Layer) -> _Layer:
    """``coarse`` with every field that ``fine`` sets (is not ``None``) taken from ``fine``."""
    updates = {name: value for name, value in fine if value is not None}
    return coarse.model_copy(update=updates) if updates else coarse


class _DatasetBase(FrozenModel):
    """Settings shared by training and eval datasets, with per-dataset generation overrides
    (the finest cascade level)."""

    name: Identifier
    path: Path
    task_type: Identifier
    input_key: StrictStr = "prompt"
    label_key: StrictStr | None = "label"
    metadata_keys: tuple[StrictStr, ...] = ()
    max_turns: PosInt | None = None
    max_context_len: PosInt | None = None
    max_new_tokens: PosInt | None = None
    timeout_s: PosFloat | None = None
    sampling_params: SamplingParams = SamplingParams()

    @property
    def stopping(self) -> StoppingCriteria:
        return StoppingCriteria(
            max_turns=self.max_turns,
            max_context_len=self.max_context_len,
            max_new_tokens=self.max_new_tokens,
            timeout_s=self.timeout_s,
        )


class DatasetEntry(_DatasetBase):
    """A training dataset: its prompts are served in epochs, each as a group of samples."""

    kind: Literal["train"] = "train"
    n_samples_per_prompt: PosInt = 1

    @property
    def copies_per_prompt(self) -> int:
        return self.n_samples_per_prompt


class EvalDatasetConfig(_DatasetBase):
    """An eval dataset: every prompt (or the first ``max_prompts``) once per eval, each as
    ``n_samples_per_eval_prompt`` copies (pass@k when more than one)."""

    kind: Literal["eval"] = "eval"
    n_samples_per_eval_prompt: PosInt = 1
    max_prompts: PosInt | None = None

    @property
    def copies_per_prompt(self) -> int:
        return self.n_samples_per_eval_prompt


DatasetConfig = Annotated[DatasetEntry | EvalDatasetConfig, Field(discriminator="kind")]


def sample_id_for(rollout_id: str, index: int) -> str:
    return f"{rollout_id}:s{index}"


def batch_id_for(rollout_id: str, sequence: int) -> str:
    return f"{rollout_id}:b{sequence}"


class Task(FrozenModel):
    """One sample to run: its own copy of a dataset prompt, with the dataset's name and task
    type and the prompt's 1-based line in the file. ``index`` numbers the samples of a rollout;
    samples of one prompt share ``group_index``. Dataset settings are resolved into the
    sample's ``TaskFetched``, not held here.
    """

    sample_id: StrictStr
    rollout_id: StrictStr
    index: NonNegInt
    group_index: NonNegInt
    prompt: Prompt
    label: JsonValue = None
    dataset_name: StrictStr
    task_type: StrictStr
    source_line: PosInt
    metadata: dict[str, JsonValue] = Field(default_factory=dict)


class Batch(FrozenModel):
    """Tasks of one task type and one rollout that are admitted and run together."""

    batch_id: StrictStr
    task_type: Identifier
    tasks: tuple[Task, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _uniform(self) -> Batch:
        rollouts = {task.rollout_id for task in self.tasks}
        if len(rollouts) != 1:
            raise ValueError(f"batch {self.batch_id} mixes rollouts {sorted(rollouts)}")
        for task in self.tasks:
            if task.task_type != self.task_type:
                raise ValueError(
                    f"batch {self.batch_id} of task type {self.task_type!r} holds task "
                    f"{task.sample_id} of task type {task.task_type!r}"
                )
        return self

    @property
    def rollout_id(self) -> str:
        return self.tasks[0].rollout_id


@dataclass(frozen=True, kw_only=True)
class EvaluatorProfile:
    """What the scheduler knows of an evaluator, selected by ``task_type``.

    ``resource`` is its whole budget (``concurrency``: its semaphore ceiling); ``run_resource`` /
    ``eval_resource`` are what one sample holds while its agent runs and while it is verified.
    ``batch_size=None`` keeps one open batch per type. ``default_stopping`` /
    ``default_sampling_params`` are the evaluator's level of the generation cascade.
    """

    evaluator_id: str
    resource: Resource = field(default_factory=Resource)
    run_resource: Resource = field(default_factory=Resource)
    eval_resource: Resource = field(default_factory=Resource)
    batch_size: int | None = None
    default_stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    default_sampling_params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        where = f"evaluator {self.evaluator_id!r}"
        if not isinstance(self.evaluator_id, str):
            raise ConfigError(f"evaluator_id must be a string, got {self.evaluator_id!r}")
        try:
            check_identifier(self.evaluator_id)
        except ValueError as exc:
            raise ConfigError(f"evaluator_id {exc}") from None
        for name in ("resource", "run_resource", "eval_resource"):
            value = getattr(self, name)
            if not isinstance(value, Resource):
                raise ConfigError(f"{where}: {name} must be a Resource, got {value!r}")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool)
            or not isinstance(self.batch_size, int)
            or self.batch_size < 1
        ):
            raise ConfigError(
                f"{where}: batch_size must be a positive integer or None, got {self.batch_size!r}"
            )
        if not isinstance(self.default_stopping, StoppingCriteria):
            raise ConfigError(f"{where}: default_stopping must be a StoppingCriteria")
        if not isinstance(self.default_sampling_params, SamplingParams):
            raise ConfigError(f"{where}: default_sampling_params must be a SamplingParams")

    @property
    def sample_resource(self) -> Resource:
        """Run and eval never overlap, so one sample holds the per-field max."""
        return self.run_resource.peak(self.eval_resource)
