"""``TeacherBackend``: a frozen teacher model on its own SGLang server (inference-backend §3).

The teacher speaks its own chat template, so it loads its own tokenizer (CPU only, local files
only). It never acts in the environment. Two roles are foreseen:

- **Role B** (implemented): ``score_response`` force-decodes a kept student trajectory and
  returns, for every student-emitted token, the teacher's logprob and its top-K alternatives,
  the inputs of the K3 reverse-KL term. The payload is the seed's: ``prompt + response`` as
  ``input_ids``, one greedy step, ``logprob_start_len = len(prompt) - 1``,
  ``top_logprobs_num = K``. It assumes teacher and student share a vocabulary (same model
  family), as the seed does. A failure propagates (``BackendError``): a run must fail loudly
  rather than train on missing teacher logprobs.
- **Role A** (per-turn action labelling for DAgger rollin): only its low-level entry point,
  ``generate_from_tokens``, exists so far; the label parsing belongs with the DAgger agent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.backends._http import HTTPSettings
from engine.backends.base import GenerationResult
from engine.backends.sglang import ForceDecodeScore, SGLangBackend, SGLangConfig
from engine.errors import ConfigError

__all__ = ["DEFAULT_TOP_LOGPROBS", "TeacherBackend", "TeacherConfig"]

DEFAULT_TOP_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    """The teacher's server, tokenizer and the K of its top-K logprobs."""

    url: str
    tokenizer_path: str | Path | None = None
    top_logprobs_num: int = DEFAULT_TOP_LOGPROBS
    http: HTTPSettings = field(default_factory=HTTPSettings)

    def __post_init__(self) -> None:
        if self.top_logprobs_num < 0:
            raise ConfigError(
                f"TeacherConfig.top_logprobs_num must be >= 0, got {self.top_logprobs_num}"
            )


class TeacherBackend:
    """Force-decoding (and, later, labelling) on a frozen teacher (see the module docstring)."""

    def __init__(
        self,
        *,
        config: TeacherConfig,
        tokenizer: Any | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self._sglang = SGLangBackend(
            config=SGLangConfig(
                url=config.url, tokenizer_path=config.tokenizer_path, http=config.http
            ),
            tokenizer=tokenizer,
            transport=transport,
        )

    @property
    def tokenizer(self) -> Any | None:
        return self._sglang.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._sglang.tokenize(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._sglang.decode(token_ids)

    async def score_response(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        *,
        top_logprobs_num: int | None = None,
    ) -> ForceDecodeScore:
        """Teacher logprob and top-K of every response token (Role B)."""
        k = self.config.top_logprobs_num if top_logprobs_num is None else top_logprobs_num
        return await self._sglang.score(prompt_ids, response_ids, top_logprobs_num=k)

    async def generate_from_tokens(
        self, input_ids: Sequence[int], *, sampling_params: Mapping[str, Any]
    ) -> GenerationResult:
        """Continue a prompt already rendered in the teacher's own format (Role A, low level)."""
        return await self._sglang.generate(input_ids=input_ids, sampling_params=sampling_params)

    async def aclose(self) -> None:
        await self._sglang.aclose()
