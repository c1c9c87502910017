"""``ServerAdmin``: the weight routes of one SGLang (or tinylm) server, for the weight syncer.

- ``load(model_path, version)`` posts SGLang's ``/update_weights_from_disk`` with
  ``{"model_path", "weight_version": str(version)}`` and returns once the server answered: the
  server waits for its in-flight requests before it swaps the weights (SGLang's
  ``model_update_lock``), so no request runs across the change. A reply with
  ``success: false`` (HTTP 400 on SGLang and tinylm) raises ``BackendHTTPError`` carrying the
  server's message; transport failures raise the other ``BackendError`` subclasses.
- ``weight_version()`` reads ``/get_model_info``'s ``weight_version`` (a string on SGLang).
- ``set_version(version)`` posts SGLang's ``/update_weight_version`` with ``{"new_version":
  str(version), "abort_all_requests": false}``: the label alone, weights untouched, nothing in
  flight aborted (``UpdateWeightVersionReqInput``, ``managers/io_struct.py``; SGLang answers
  ``{"success", "message", "new_version"}``, 400 with ``success: false`` on failure).

The admin key, when the server has one (``--admin-api-key``), goes as ``Authorization:
Bearer``; only the weight syncer holds it (docs/security.md), never the evaluator workers
(whose health tracker labels a server without a key, ``engine/backends/health.py``).
"""

from __future__ import annotations

from typing import Any

import httpx

from engine.backends._http import HTTPSettings, JSONClient, check_base_url
from engine.errors import BackendHTTPError, BackendProtocolError

__all__ = ["ServerAdmin"]


class ServerAdmin:
    """See the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        admin_key: str | None = None,
        http: HTTPSettings | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = check_base_url(url, what="model server")
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
        self._http = JSONClient(
            base_url=self.url,
            settings=http or HTTPSettings(connect_retries=2),
            transport=transport,
            headers=headers,
        )

    async def load(self, model_path: str, version: int) -> str:
        """Load the weights at ``model_path`` as ``version``; the server's message."""
        payload = {"model_path": model_path, "weight_version": str(version)}
        return await self._post("/update_weights_from_disk", payload)

    async def set_version(self, version: int) -> str:
        """Label the weights the server holds as ``version``; the server's message."""
        payload = {"new_version": str(version), "abort_all_requests": False}
        return await self._post("/update_weight_version", payload)

    async def _post(self, route: str, payload: dict[str, Any]) -> str:
        body = await self._http.post(route, payload)
        if not isinstance(body, dict) or body.get("success") is not True:
            message = body.get("message") if isinstance(body, dict) else body
            raise BackendHTTPError(self.url + route, 200, str(message))
        return str(body.get("message", ""))

    async def weight_version(self) -> str | None:
        """The version the server reports now (``None``: it reports none)."""
        body: Any = await self._http.get("/get_model_info")
        if not isinstance(body, dict):
            raise BackendProtocolError(
                f"{self.url}/get_model_info: expected a JSON object, got {type(body).__name__}"
            )
        version = body.get("weight_version")
        return None if version is None else str(version)

    async def aclose(self) -> None:
        await self._http.aclose()
