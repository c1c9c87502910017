"""Who may call which route of the tiny model server: SGLang's API keys, same semantics.

SGLang 0.5.23 (``sglang/srt/utils/auth.py``, ``decide_request_auth``; the levels are attached
to the routes in ``sglang/srt/entrypoints/http_server.py``) has three levels:

* health, readiness and metrics routes (``/health*``, ``/ready*``, ``/metrics*``) are always
  open, so probes need no secret;
* *admin* routes (``ADMIN_OPTIONAL`` there: weight updates, ``/abort_request``,
  ``/pause_generation``, ``/continue_generation``, ``/flush_cache`` ...) need the admin key when
  one is set, else the API key when one is set, else nothing -- the API key does *not* open
  them once an admin key exists;
* every other route needs the API key when one is set (the admin key does not open them).

Keys travel as ``Authorization: Bearer <key>`` and are compared in constant time. A missing or
wrong key is 401. Hand the admin key only to what must change the server's state (the
engine's weight sync), never to the evaluator workers whose sandboxes run model-written code.
"""

from __future__ import annotations

import secrets

__all__ = ["ADMIN_ROUTES", "allowed", "is_admin_route"]

ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)
"""Routes that change the server's state; protected by the admin key (SGLang's
``ADMIN_OPTIONAL`` routes of the same names). Routes tinylm does not serve yet are listed so
that they are protected the day they are added."""

_OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def is_admin_route(path: str) -> bool:
    return path.split("?", 1)[0].rstrip("/") in ADMIN_ROUTES


def _bearer(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), key)


def allowed(
    method: str,
    path: str,
    authorization: str | None,
    *,
    api_key: str | None,
    admin_api_key: str | None,
) -> bool:
    """Whether a request may reach its route (see the module docstring)."""
    if method == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
        return True
    if is_admin_route(path):
        key = admin_api_key or api_key
        return key is None or _bearer(authorization, key)
    return api_key is None or _bearer(authorization, api_key)
