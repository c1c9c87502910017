"""What a model-server supervisor reads from tinylm, as SGLang 0.5.23 serves it: aborts, health,
weight versions and the server's command line, from tinylm processes over real sockets.

Shapes, from SGLang 0.5.23's source (paths under ``python/sglang/srt/``):

- ``entrypoints/http_server.py``: ``abort_request`` answers an empty 200 whatever it reached;
  ``health_generate`` (both ``/health`` and ``/health_generate``) answers an empty 200 once the
  scheduler produced anything after the check began, an empty 503 after
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds without; ``/health`` is a plain 200 when
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false (``environ.py``); ``ready`` is 503
  while paused; ``update_weight_version`` answers ``{"success", "message", "new_version"}``.
- ``managers/tokenizer_manager.py``, ``abort_request``: with one tokenizer worker an rid that
  no request holds exactly is dropped; ``managers/scheduler.py``, ``abort_request``, then
  aborts every request whose rid starts with the one given. ``generate_request``: a request
  (the health check's too) waits while generation is paused.
- ``managers/schedule_batch.py``, ``FINISH_ABORT.to_json``: the finish reason of a running
  request so ended.
- ``arg_groups/fields/serving.py``: ``weight_version`` defaults to ``"default"``;
  ``model_info`` reports the version in effect, ``server_info`` the server's arguments.
- ``utils/weight_versions.py``, ``compute_weight_version_spans``: a request the version
  changed under reports one span per version.
- ``server_args.py``, ``prepare_server_args``: argparse refuses an unknown flag, naming it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.backends.test_tinylm_server import LONG, PROMPT, wait_until
from tests.backends.test_tinylm_stream import events
from tinylm.process import ServerProcess, spawn_server
from tinylm.replies import version_spans

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@pytest.fixture(scope="module")
def server(tinylm_dir: Path) -> Iterator[ServerProcess]:
    """Started without --weight-version; a failing health check gives up after 2 s."""
    with spawn_server(tinylm_dir, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def versioned(tinylm_dir: Path) -> Iterator[ServerProcess]:
    """Started as a supervisor starts SGLang: a version, and SGLang flags tinylm has no use for;
    several tokenizer workers; /health without the generation."""
    args = ["--weight-version", "7", "--tokenizer-worker-num", "2", "--tp-size", "1"]
    args += ["--mem-fraction-static", "0.5", "--enable-tf32-matmul"]
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": "2", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    with spawn_server(tinylm_dir, extra_args=args, env=env) as proc:
        yield proc


def post(proc: ServerProcess, route: str, body: Any = None) -> httpx.Response:
    return httpx.post(proc.url + route, json=body if body is not None else {}, timeout=60)


def get(proc: ServerProcess, route: str) -> httpx.Response:
    return httpx.get(proc.url + route, timeout=60)


def running(proc: ServerProcess) -> set[str]:
    return set(get(proc, "/get_server_info").json()["running_rids"])


def generate(proc: ServerProcess, **body: Any) -> Any:
    response = post(proc, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


# -- /abort_request ---------------------------------------------------------------------------


def test_an_abort_answers_an_empty_200_and_ends_the_request_it_names(
    server: ServerProcess,
) -> None:
    for body in ({"rid": "nobody-has-this"}, {}, {"rid": None}):
        answer = post(server, "/abort_request", body)
        assert (answer.status_code, answer.content) == (200, b""), body
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            generate, server, input_ids=PROMPT, rid="named", return_logprob=True,
            sampling_params=LONG,
        )  # fmt: skip
        wait_until(lambda: "named" in running(server), "the request to run")
        assert post(server, "/abort_request", {"rid": "named"}).status_code == 200
        out = job.result(60)
    meta = out["meta_info"]
    assert meta["finish_reason"] == ABORTED
    assert len(out["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"])
    assert meta["prompt_tokens"] == len(PROMPT)


def test_a_prefix_no_request_holds_is_dropped_with_one_tokenizer_worker(
    server: ServerProcess, versioned: ServerProcess
) -> None:
    for proc, forwarded in ((server, False), (versioned, True)):
        with ThreadPoolExecutor(1) as pool:
            batch = pool.submit(
                generate, proc, input_ids=[PROMPT, PROMPT], rid="pre", sampling_params=LONG
            )
            wait_until(lambda p=proc: {"pre_0", "pre_1"} <= running(p), "the batch to run")
            post(proc, "/abort_request", {"rid": "pre"})
            # Aborts reach the scheduler in order: once pre_0's own abort has ended it, an
            # abort of "pre" that had been forwarded would have ended pre_1 too.
            post(proc, "/abort_request", {"rid": "pre_0"})
            wait_until(lambda p=proc: "pre_0" not in running(p), "pre_0's abort")
            assert ("pre_1" not in running(proc)) is forwarded, proc.url
            post(proc, "/abort_request", {"rid": "pre_1"})
            replies = batch.result(60)
        assert [r["meta_info"]["finish_reason"] for r in replies] == [ABORTED, ABORTED]


def test_abort_all_ends_every_request(server: ServerProcess) -> None:
    with ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(generate, server, input_ids=PROMPT, rid=rid, sampling_params=LONG)
            for rid in ("all-a", "all-b")
        ]
        wait_until(lambda: {"all-a", "all-b"} <= running(server), "the requests to run")
        assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
        finishes = [job.result(60)["meta_info"]["finish_reason"] for job in jobs]
    assert finishes == [ABORTED, ABORTED]


# -- /health, /health_generate, /ready --------------------------------------------------------


def test_health_runs_a_generation_and_fails_while_the_scheduler_cannot_serve(
    server: ServerProcess,
) -> None:
    steps = get(server, "/get_server_info").json()["forward_steps"]
    for route in ("/health", "/health_generate"):
        answer = get(server, route)
        assert (answer.status_code, answer.content) == (200, b""), route
    assert get(server, "/get_server_info").json()["forward_steps"] > steps  # it really ran
    assert get(server, "/ready").status_code == 200
    assert post(server, "/pause_generation", {"mode": "abort"}).status_code == 200
    try:
        # Paused with nothing running: the check's request waits, nothing comes out.
        for route in ("/health_generate", "/health"):
            answer = get(server, route)
            assert (answer.status_code, answer.content) == (503, b""), route
        assert get(server, "/ready").status_code == 503
    finally:
        assert post(server, "/continue_generation").status_code == 200
    assert get(server, "/health").status_code == 200
    assert get(server, "/ready").status_code == 200


def test_a_server_paused_in_place_fails_its_health_check_though_busy(
    server: ServerProcess,
) -> None:
    # Paused in place, a running request keeps its slot and produces nothing: no news, 503.
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(generate, server, input_ids=PROMPT, rid="busy", sampling_params=LONG)
        wait_until(lambda: "busy" in running(server), "the request to run")
        assert get(server, "/health_generate").status_code == 200
        post(server, "/pause_generation", {"mode": "in_place"})
        try:
            assert get(server, "/health_generate").status_code == 503
        finally:
            post(server, "/continue_generation")
        post(server, "/abort_request", {"rid": "busy"})
        assert job.result(60)["meta_info"]["finish_reason"] == ABORTED


def test_health_without_generation_answers_at_once(versioned: ServerProcess) -> None:
    assert post(versioned, "/pause_generation", {"mode": "abort"}).status_code == 200
    try:
        assert get(versioned, "/health").status_code == 200  # no generation: a plain 200
        assert get(versioned, "/health_generate").status_code == 503
        assert get(versioned, "/ready").status_code == 503
    finally:
        post(versioned, "/continue_generation")
    assert get(versioned, "/health_generate").status_code == 200


# -- weight versions --------------------------------------------------------------------------


def test_a_server_started_without_a_version_reports_default(server: ServerProcess) -> None:
    assert get(server, "/get_model_info").json()["weight_version"] == "default"
    assert get(server, "/get_server_info").json()["weight_version"] == "default"
    assert get(server, "/get_weight_version").json() == {"weight_version": "default"}
    meta = generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})["meta_info"]
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": meta["completion_tokens"]}
    ]


def test_weight_version_at_start_and_from_update_weight_version(
    versioned: ServerProcess,
) -> None:
    assert get(versioned, "/get_model_info").json()["weight_version"] == "7"
    assert (
        generate(versioned, input_ids=PROMPT, sampling_params={"max_new_tokens": 1})["meta_info"][
            "weight_version"
        ]
        == "7"
    )
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            generate, versioned, input_ids=PROMPT, rid="old-version", sampling_params=LONG
        )
        wait_until(lambda: "old-version" in running(versioned), "the request to run")
        # abort_all_requests defaults to true (io_struct.py, UpdateWeightVersionReqInput)
        answer = post(versioned, "/update_weight_version", {"new_version": "8"})
        assert answer.status_code == 200
        assert answer.json() == {
            "success": True,
            "message": "Weight version updated to 8",
            "new_version": "8",
        }
        assert job.result(60)["meta_info"]["finish_reason"] == ABORTED
    assert get(versioned, "/get_model_info").json()["weight_version"] == "8"
    assert get(versioned, "/get_server_info").json()["weight_version"] == "7"  # as started
    assert (
        generate(versioned, input_ids=PROMPT, sampling_params={"max_new_tokens": 1})["meta_info"][
            "weight_version"
        ]
        == "8"
    )
    missing = post(versioned, "/update_weight_version", {"abort_all_requests": False})
    assert missing.status_code == 400 and "new_version" in missing.json()["message"]


def test_a_request_the_version_changed_under_reports_both(versioned: ServerProcess) -> None:
    before = get(versioned, "/get_model_info").json()["weight_version"]
    after = before + ".1"

    def steps() -> int:
        return int(get(versioned, "/get_server_info").json()["forward_steps"])

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(generate, versioned, input_ids=PROMPT, rid="spans", sampling_params=LONG)
        wait_until(lambda: "spans" in running(versioned), "the request to run")
        live_at = steps()
        wait_until(lambda: steps() > live_at, "a token on the old version")
        post(versioned, "/pause_generation", {"mode": "in_place"})
        answer = post(
            versioned,
            "/update_weight_version",
            {"new_version": after, "abort_all_requests": False},
        )
        assert answer.json()["success"] is True
        paused_at = steps()  # the version changed on the scheduler, after the pause
        post(versioned, "/continue_generation")
        wait_until(lambda: steps() > paused_at, "a token on the new version")
        post(versioned, "/abort_request", {"rid": "spans"})
        meta = job.result(60)["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [before, after]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == meta["completion_tokens"] > spans[1]["start"]
    assert meta["weight_version"] == after


@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 20)), max_size=5),
    st.sampled_from("abcd"),
    st.integers(0, 20),
)
def test_version_spans_cover_the_output_in_order(
    changes: list[tuple[str, int]], current: str, tokens: int
) -> None:
    # compute_weight_version_spans: changes come in time order, at growing token counts.
    changes = sorted(changes, key=lambda c: c[1])
    changes = [(v, min(n, tokens)) for v, n in changes]
    spans = version_spans(changes, current, tokens)
    assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == tokens
    if not changes or tokens > changes[-1][1]:  # tokens after the last change: current's
        assert spans[-1]["version"] == current
    for a, b in zip(spans, spans[1:], strict=False):
        assert a["end"] == b["start"] < b["end"] and a["version"] != b["version"]


# -- the command line -------------------------------------------------------------------------


def test_sglang_flags_tinylm_has_no_use_for_are_named_at_start(versioned: ServerProcess) -> None:
    assert (
        "SGLang flags with no effect on tinylm: --enable-tf32-matmul, --mem-fraction-static, "
        "--tp-size" in versioned.output_tail
    )


def test_serve_refuses_an_unknown_flag_naming_it(tinylm_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tinylm", "serve", "--model-path", str(tinylm_dir)]
        + ["--no-such-flag", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-flag 3" in done.stderr


def test_a_stream_reports_the_version_of_each_chunk(versioned: ServerProcess) -> None:
    version = get(versioned, "/get_model_info").json()["weight_version"]
    got = events(versioned.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    assert {c["meta_info"]["weight_version"] for c in got[:-1]} == {version}
