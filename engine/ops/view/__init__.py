"""``rollout view``: the rollouts, their timelines and their samples in the browser, read-only,
from a live log or an archive (:mod:`engine.ops.view.app` lists the pages)."""

from engine.ops.view.app import create_app, serve
from engine.ops.view.data import ViewData, archive_log

__all__ = ["ViewData", "archive_log", "create_app", "serve"]
