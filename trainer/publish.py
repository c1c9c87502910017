"""Publishing a new policy version: ``publish(version, weights_uri)``.

The loop saves each version as a model folder and calls ``Publisher.publish(version,
weights_uri)``. ``VersionPublisher`` is the engine's policy-version API: it appends
``PolicyVersionPublished`` (``RolloutClient.publish_version``) and waits for the weight
syncer's ``PolicyVersionActivated`` (``wait_version_active``): the syncer quiesces the
engine, loads the folder on every model server with the admin key, checks that each reports
the version, and resumes, so the next rollout samples the new weights; a failed sync
raises ``engine.errors.WeightSyncFailed`` with the servers' error.

``DiskPushPublisher`` is the direct form, with no syncer: it posts SGLang's
``/update_weights_from_disk`` (``model_path`` = the folder, ``weight_version`` = a label) to
every server with the admin key and returns once each answered ``success`` (the servers wait
for in-flight generations before swapping). The trainer uses it only for loads that are not
policy versions (the teacher's eval pass, ``trainer.cli``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import httpx

from engine.client import RolloutClient
from engine.errors import EngineError

__all__ = ["DiskPushPublisher", "PublishFailed", "Publisher", "VersionPublisher"]


class PublishFailed(EngineError):
    """A model server did not load a published version (the message names it and why)."""


class Publisher(Protocol):
    async def publish(self, version: int, weights_uri: str) -> None: ...


class VersionPublisher:
    """Publish through the policy-version API and wait until the version is active."""

    def __init__(self, client: RolloutClient, *, timeout_s: float | None = 300.0) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def publish(self, version: int, weights_uri: str) -> None:
        await self.client.publish_version(version, weights_uri)
        await self.client.wait_version_active(version, timeout=self.timeout_s)


class DiskPushPublisher:
    """Push a saved folder to each server's ``/update_weights_from_disk``."""

    def __init__(
        self, servers: Sequence[str], *, admin_key: str | None, timeout_s: float = 300.0
    ) -> None:
        if not servers:
            raise ValueError("DiskPushPublisher needs at least one model server URL")
        self.servers = [url.rstrip("/") for url in servers]
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.timeout_s = timeout_s

    async def publish(self, version: int, weights_uri: str) -> None:
        await self.load(weights_uri, label=str(version))

    async def load(self, weights_uri: str, *, label: str) -> None:
        """Load ``weights_uri`` on every server, reporting ``label`` as its weight version."""
        body = {"model_path": weights_uri, "weight_version": label}
        async with httpx.AsyncClient(headers=self._headers, timeout=self.timeout_s) as http:
            for url in self.servers:
                await self._post(http, url, weights_uri, body)

    @staticmethod
    async def _post(
        http: httpx.AsyncClient, url: str, weights_uri: str, body: dict[str, str]
    ) -> None:
        try:
            reply = await http.post(f"{url}/update_weights_from_disk", json=body)
        except httpx.HTTPError as exc:
            raise PublishFailed(
                f"{url}: /update_weights_from_disk of {weights_uri} failed: {exc}"
            ) from exc
        answer = reply.json() if reply.headers.get("content-type", "").startswith(
            "application/json"
        ) else {}
        if reply.status_code != 200 or not answer.get("success"):
            raise PublishFailed(
                f"{url}: /update_weights_from_disk of {weights_uri} answered "
                f"{reply.status_code}: {answer.get('message') or reply.text[:300]}"
            )
