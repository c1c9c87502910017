"""The tinylm model folder, runtime and SGLang-compatible server, over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.ops.tinylm import SYSTEM_PROMPTS
from engine.ops.tinylm import main as tinylm_main
from tests.backends.conftest import MATH_DIALOGUE
from tinylm.chat_template import render_chat
from tinylm.cli import main as tinylm_own_main
from tinylm.corpus import PYTHON_TOOL, generate_dialogues
from tinylm.process import spawn_server
from tinylm.runtime import Chunk, TinyLMRuntime
from tinylm.sampling import LogprobMode, SamplingParams, next_token
from tinylm.server import TinyLMServer, start_server

# -- the model folder -------------------------------------------------------------------------


def test_model_folder_loads_offline_with_transformers(tinylm_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tinylm_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tinylm_dir, local_files_only=True)
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert model.config.vocab_size >= len(tok)
    for token in (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ):
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, f"{token} should be one token, got {ids}"
    assert tok.eos_token == "<|im_end|>"
    # Tool-call markers are added tokens but not special: they survive skip_special_tokens.
    ids = tok("<|im_start|>x<tool_call>y</tool_call><|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>y</tool_call>"


def test_chat_template_renders_the_documented_tool_dialogue(tinylm_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(tinylm_dir, local_files_only=True)
    text = tok.apply_chat_template(
        MATH_DIALOGUE.messages, tools=MATH_DIALOGUE.tools, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(PYTHON_TOOL) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "python", "arguments": {"code": "print(17 + 25)"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is <answer>42</answer><|im_end|>\n"
    )
    # OpenAI-style string arguments render the same; so does the tokenizer-free renderer.
    wire = [dict(m) for m in MATH_DIALOGUE.messages]
    wire[1] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "python", "arguments": '{"code": "print(17 + 25)"}'},
            }
        ],
    }
    assert tok.apply_chat_template(wire, tools=MATH_DIALOGUE.tools, tokenize=False) == text
    for d in generate_dialogues(20, seed=3, prompts=SYSTEM_PROMPTS):
        assert render_chat(d.messages, tools=d.tools) == tok.apply_chat_template(
            d.messages, tools=d.tools, tokenize=False
        )
    prompt = tok.apply_chat_template(
        MATH_DIALOGUE.messages[:1],
        tools=MATH_DIALOGUE.tools,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")


def test_runtime_matches_transformers_qwen2(tinylm_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tinylm_dir, local_files_only=True)
    a = [5, 17, 300, 42, 8, 99, 120, 3, 64, 7]
    b = [11, 250, 31, 4]
    with torch.no_grad():
        ref_a = model(torch.tensor([a])).logits[0]
        ref_b = model(torch.tensor([b])).logits[0]
    rt = TinyLMRuntime.load(tinylm_dir, max_slots=3)
    # a: prefill 6 then decode one by one; b: prefilled whole in the same forward as a's first.
    first = rt.forward([Chunk(2, 0, a[:6], logits_from=0), Chunk(0, 0, b, logits_from=0)])
    rows = [first[0]]
    for i in range(6, len(a)):
        rows.append(rt.forward([Chunk(2, i, a[i : i + 1])])[0])
    assert torch.allclose(torch.cat(rows), ref_a, atol=1e-4, rtol=0)
    assert torch.allclose(first[1], ref_b, atol=1e-4, rtol=0)
    tail = rt.forward([Chunk(1, 0, b, logits_from=2)])[0]
    assert tail.shape == (2, ref_b.shape[1]) and torch.allclose(tail, ref_b[2:], atol=1e-4, rtol=0)


# -- /generate over HTTP ----------------------------------------------------------------------


def generate(server: TinyLMServer, **body: Any) -> Any:
    response = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]


def test_generate_reply_has_sglang_shape(tinylm_server: TinyLMServer) -> None:
    reply = generate(
        tinylm_server,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        sampling_params={"max_new_tokens": 5, "temperature": 0},
    )
    meta = reply["meta_info"]
    assert set(reply) == {"text", "output_ids", "meta_info"}
    assert meta["prompt_tokens"] == len(PROMPT) == 0 + len(meta["input_token_logprobs"])
    assert meta["input_token_logprobs"][0] == [None, PROMPT[0], None]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT
    assert all(e[0] <= 0 for e in meta["input_token_logprobs"][1:])
    out = meta["output_token_logprobs"]
    assert [e[1] for e in out] == reply["output_ids"] and len(out) == meta["completion_tokens"]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(PROMPT)
    for pos, top in enumerate(meta["output_top_logprobs"]):
        values = [e[0] for e in top]
        assert len(top) == 3 and values == sorted(values, reverse=True)
        assert top[0][1] == out[pos][1] and top[0][0] == pytest.approx(out[pos][0])  # greedy
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"] == {"type": "length", "length": 5}


def test_logprob_start_len_and_its_default(tinylm_server: TinyLMServer) -> None:
    reply = generate(
        tinylm_server,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=4,
        sampling_params={"max_new_tokens": 2},
    )
    meta = reply["meta_info"]
    assert meta["prompt_tokens"] == 4 + len(meta["input_token_logprobs"])
    default = generate(
        tinylm_server, input_ids=PROMPT, return_logprob=True, sampling_params={"max_new_tokens": 2}
    )
    # SGLang's default start is len(prompt) - 1: only the last prompt token.
    assert [e[1] for e in default["meta_info"]["input_token_logprobs"]] == PROMPT[-1:]


def test_text_input_and_batches(tinylm_server: TinyLMServer, tinylm_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tinylm_dir, local_files_only=True)
    greedy = {"max_new_tokens": 6, "temperature": 0}
    by_text = generate(tinylm_server, text="What is 3 + 4?", sampling_params=greedy)
    by_ids = generate(
        tinylm_server,
        input_ids=tok("What is 3 + 4?", add_special_tokens=False)["input_ids"],
        sampling_params=greedy,
    )
    assert by_text["output_ids"] == by_ids["output_ids"]
    prompts = [PROMPT, PROMPT[:5], [7, 8, 9]]
    steps_before = tinylm_server.scheduler.steps
    batch = generate(tinylm_server, input_ids=prompts, sampling_params=greedy, rid="b")
    # The batch's requests were queued together and shared forwards (3 x 6 alone).
    assert tinylm_server.scheduler.steps - steps_before < 3 * 6
    assert isinstance(batch, list) and [r["meta_info"]["id"] for r in batch] == [
        "b_0",
        "b_1",
        "b_2",
    ]
    singles = [
        generate(tinylm_server, input_ids=p, sampling_params=greedy)["output_ids"] for p in prompts
    ]
    assert [r["output_ids"] for r in batch] == singles


def test_concurrent_requests_batch_without_changing_results(tinylm_server: TinyLMServer) -> None:
    prompts = [[3 + i, 40 + i, 100 + 7 * i, 9] * (1 + i % 3) for i in range(8)]

    def body(i: int) -> dict[str, Any]:
        params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
        return {"input_ids": prompts[i], "sampling_params": params, "return_logprob": True}

    sequential = [generate(tinylm_server, **body(i)) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda i: generate(tinylm_server, **body(i)), range(8)))
    for seq, con in zip(sequential, concurrent, strict=True):
        assert con["output_ids"] == seq["output_ids"]
        lp_seq = [e[0] for e in seq["meta_info"]["output_token_logprobs"]]
        lp_con = [e[0] for e in con["meta_info"]["output_token_logprobs"]]
        assert lp_con == pytest.approx(lp_seq, abs=1e-5)


def test_sampling_seed_makes_sampling_deterministic(tinylm_server: TinyLMServer) -> None:
    def sample(seed: int, **extra: Any) -> list[int]:
        params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": seed, **extra}
        return list(generate(tinylm_server, input_ids=PROMPT, sampling_params=params)["output_ids"])

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert (
        sample(7, top_k=1)
        == generate(
            tinylm_server,
            input_ids=PROMPT,
            sampling_params={"max_new_tokens": 16, "temperature": 0},
        )["output_ids"]
    )


def test_max_new_tokens_zero_only_scores_the_prompt(tinylm_server: TinyLMServer) -> None:
    reply = generate(
        tinylm_server,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": 0},
    )
    meta = reply["meta_info"]
    assert reply["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert len(meta["input_token_logprobs"]) == len(PROMPT)


def test_stop_strings_and_stop_tokens(tinylm_server: TinyLMServer) -> None:
    # Seeded sampling gives varied text; the stop runs draw the same tokens until they stop.
    params = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    full = generate(tinylm_server, input_ids=PROMPT, sampling_params=params)
    ids, text = full["output_ids"], full["text"]
    # An ASCII stop string (a partial UTF-8 byte token cannot straddle it), not at the start.
    at = next(
        (
            j
            for j in range(4, len(text) - 1)
            if text[j : j + 2].isascii() and text[j : j + 2].isalnum()
        ),
        None,
    )
    assert at is not None, f"need two ASCII letters or digits to stop on, got {text!r}"
    stop = text[at : at + 2]
    cut = generate(tinylm_server, input_ids=PROMPT, sampling_params={**params, "stop": [stop]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.find(stop)]
    assert cut["output_ids"] == ids[: len(cut["output_ids"])] and len(cut["output_ids"]) < len(ids)
    kept = generate(
        tinylm_server,
        input_ids=PROMPT,
        sampling_params={**params, "stop": stop, "no_stop_trim": True},
    )
    # Untrimmed: everything the generated tokens decode to, through the one completing the stop.
    assert kept["text"].startswith(text[: text.find(stop) + len(stop)])
    assert text.startswith(kept["text"]) and kept["output_ids"] == cut["output_ids"]
    target = ids[len(ids) // 2]
    by_token = generate(
        tinylm_server, input_ids=PROMPT, sampling_params={**params, "stop_token_ids": [target]}
    )
    assert by_token["output_ids"] == ids[: ids.index(target) + 1]
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"sampling_params": {}}, "exactly one of 'input_ids' and 'text'"),
        ({"input_ids": [1], "text": "x"}, "exactly one of 'input_ids' and 'text'"),
        ({"input_ids": [1, "2"]}, "input_ids must be a list of ints"),
        ({"input_ids": [1, 10**9]}, "outside the vocabulary"),
        ({"input_ids": []}, "input_ids is empty"),
        (
            {"input_ids": [1], "sampling_params": {"top_q": 1}},
            "unknown sampling parameter 'sampling_params.top_q'",
        ),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n must be an integer"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
            "logprob_start_len (2)",
        ),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid has 1 entries for a batch of 2"),
        ({"input_ids": [1], "stream": "yes"}, "stream must be a boolean"),
    ],
)
def test_bad_requests_get_400_naming_the_problem(
    tinylm_server: TinyLMServer, body: dict[str, Any], message: str
) -> None:
    response = httpx.post(tinylm_server.url + "/generate", json=body)
    assert response.status_code == 400
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400 and message in error["message"]


def test_non_json_and_unknown_routes(tinylm_server: TinyLMServer) -> None:
    bad = httpx.post(
        tinylm_server.url + "/generate",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["message"]
    assert httpx.post(tinylm_server.url + "/generate", json=[1, 2]).status_code == 400
    assert httpx.get(tinylm_server.url + "/nope").status_code == 404
    # AbortReq's fields are typed (io_struct.py): a rid that is no string is refused.
    assert httpx.post(tinylm_server.url + "/abort_request", json={"rid": 7}).status_code == 400


def test_info_routes(tinylm_server: TinyLMServer, tinylm_dir: Path) -> None:
    assert httpx.get(tinylm_server.url + "/health").status_code == 200
    info = httpx.get(tinylm_server.url + "/get_model_info").json()
    assert info["model_path"] == str(tinylm_dir) and info["is_generation"] is True
    assert info["logprob_mode"] == "original"
    models = httpx.get(tinylm_server.url + "/v1/models").json()
    assert models["data"][0]["id"] == tinylm_dir.name


def test_keep_alive_reuses_one_connection(tinylm_server: TinyLMServer) -> None:
    with httpx.Client(base_url=tinylm_server.url) as client:
        for _ in range(3):
            assert (
                client.post(
                    "/generate",
                    json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                ).status_code
                == 200
            )
        ports = {
            client.get("/health").extensions["network_stream"].get_extra_info("client_addr")[1]
            for _ in range(2)
        }
    assert len(ports) == 1


def test_a_burst_of_new_connections_is_served_not_reset(tinylm_server: TinyLMServer) -> None:
    # Agents open a connection per episode, so a rollout starts dozens at once; with
    # socketserver's backlog of 5 the kernel reset some of them (ReadError on the client).
    async def one() -> int:
        async with httpx.AsyncClient(base_url=tinylm_server.url, timeout=60) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
            reply = await client.post("/generate", json=body)
            return reply.status_code

    async def burst() -> list[int]:
        return await asyncio.gather(*(one() for _ in range(64)))

    for _ in range(2):
        assert asyncio.run(burst()) == [200] * 64


# -- aborts ---------------------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Poll ``condition`` (not a timing assertion: the limit only turns a hang into a failure)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


LONG = {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 1.0}


def test_abort_request_ends_a_running_generation(tinylm_server: TinyLMServer) -> None:
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            generate, tinylm_server, input_ids=PROMPT, rid="to-abort", sampling_params=LONG
        )
        wait_until(
            lambda: "to-abort" in tinylm_server.scheduler.running_rids(), "the request to run"
        )
        assert (
            httpx.post(tinylm_server.url + "/abort_request", json={"rid": "to-abort"}).status_code
            == 200
        )
        reply = future.result(timeout=60)
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert reply["meta_info"]["id"] == "to-abort"


def test_disconnected_client_aborts_its_request(tinylm_server: TinyLMServer) -> None:
    body = json.dumps({"input_ids": PROMPT, "rid": "gone", "sampling_params": LONG}).encode()
    with socket.create_connection(("127.0.0.1", tinylm_server.port)) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        wait_until(lambda: "gone" in tinylm_server.scheduler.running_rids(), "the request to run")
    wait_until(lambda: "gone" not in tinylm_server.scheduler.running_rids(), "the abort")


def test_shutdown_aborts_in_flight_requests_and_answers_them(tinylm_dir: Path) -> None:
    server = start_server(tinylm_dir, max_running_requests=2)
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(generate, server, input_ids=PROMPT, rid=f"s{i}", sampling_params=LONG)
            for i in range(2)
        ]
        wait_until(lambda: len(server.scheduler.running_rids()) == 2, "both requests to run")
        server.close()
        replies = [f.result(timeout=60) for f in futures]
    for reply in replies:
        assert reply["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "server is shutting down",
        }
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


# -- sampling -------------------------------------------------------------------------------


def test_top_k_top_p_restrict_the_support_and_processed_logprobs_are_temperature_scaled() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    seen_k = {next_token(logits, SamplingParams(top_k=2), gen)[0] for _ in range(200)}
    assert seen_k == {0, 1}
    probs = torch.softmax(logits, -1)
    # Keep tokens whose preceding mass is <= top_p: with top_p just above p0 + p1, tokens 0-2.
    top_p = float(probs[0] + probs[1]) + 1e-4
    seen_p = {next_token(logits, SamplingParams(top_p=top_p), gen)[0] for _ in range(300)}
    assert seen_p == {0, 1, 2}
    _, raw = next_token(logits, SamplingParams(top_p=top_p), gen)
    assert torch.allclose(raw, torch.log_softmax(logits, -1))  # original mode: raw logprobs
    _, processed = next_token(
        logits, SamplingParams(temperature=0.5, top_p=top_p), gen, mode=LogprobMode.PROCESSED
    )
    # SGLang 0.5.23 (srt/layers/sampler.py, Sampler.forward): without
    # SGLANG_RETURN_ORIGINAL_LOGPROB the logprobs are log(softmax(logits / T)), taken before
    # the top-k / top-p filters (which renormalise a copy): not renormalised over the nucleus.
    assert torch.allclose(processed, torch.log_softmax(logits / 0.5, -1), atol=1e-6)
    assert not torch.allclose(processed, raw, atol=1e-3)
    token, greedy_row = next_token(
        torch.tensor([1.0, 3.0, 3.0]), SamplingParams(temperature=0), gen
    )
    assert token == 1 and torch.allclose(
        greedy_row, torch.log_softmax(torch.tensor([1.0, 3.0, 3.0]), -1)
    )


# -- process and CLI ------------------------------------------------------------------------


def test_spawned_server_reports_its_port_and_stops_cleanly(tinylm_dir: Path) -> None:
    with spawn_server(tinylm_dir, port=0) as proc:
        assert proc.url.startswith("http://127.0.0.1:")
        assert httpx.get(proc.url + "/health", timeout=30).status_code == 200
        reply = httpx.post(
            proc.url + "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        )
        assert reply.status_code == 200
    assert proc.process.returncode == 0, proc.output_tail


def test_cli_init_writes_a_model_and_refuses_a_non_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "m"
    assert tinylm_main(["init", str(target), "--steps", "0", "--seed", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["train_steps"] == 0 and (target / "model.safetensors").is_file()
    assert tinylm_main(["init", str(target), "--steps", "0"]) == 2
    assert "non-empty folder" in capsys.readouterr().err
    assert tinylm_main(["serve", "--model", str(tmp_path / "missing"), "--port", "0"]) == 2


def test_tinylm_init_without_the_engine_needs_the_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # tinylm knows no agent: its own command refuses to guess the system prompts.
    assert tinylm_own_main(["init", str(tmp_path / "m"), "--steps", "0"]) == 2
    assert "--math-system-prompt" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_the_corpus_is_rendered_with_the_bundled_agents_prompts() -> None:
    from engine.tasks.prompts import MATH_SYSTEM_PROMPT, SHELL_SYSTEM_PROMPT

    systems = [
        d.messages[0]["content"]
        for d in generate_dialogues(200, seed=0, prompts=SYSTEM_PROMPTS)
        if d.messages[0]["role"] == "system"
    ]
    assert systems.count(MATH_SYSTEM_PROMPT) > 60 and systems.count(SHELL_SYSTEM_PROMPT) > 60


@pytest.mark.parametrize(
    "text",
    [
        "plain prose",
        'lead <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
        '<tool_call>{"name": "shell", "arguments": "{\\"cmd\\": \\"ls\\"}"}</tool_call> tail',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>',
        "<tool_call>not json</tool_call> kept",
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>',
        '<tool_call>[1, 2]</tool_call> and <tool_call>{"name": "ok"}</tool_call>',
        'unterminated <tool_call>{"name": "python", "arguments": {}}',
        'x <tool_call>{"name": "é", "arguments": {"s": "ü"}}</tool_call>',
    ],
)
def test_the_servers_tool_call_parser_agrees_with_the_engines(text: str) -> None:
    # tinylm parses on the server side, as SGLang does with its own parser; an agent reading
    # the text with the engine's parser must see the same calls and prose.
    from engine.backends.toolcalls import parse_tool_calls
    from tinylm.toolcalls import split_tool_calls

    engine_side = parse_tool_calls(text, id_prefix="call_7_")
    content, calls = split_tool_calls(text, id_prefix="call_7_")
    assert content == engine_side.content
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        (c.id, c.name, c.arguments) for c in engine_side.tool_calls
    ]


def test_the_template_renders_a_call_as_the_engine_writes_it() -> None:
    from engine.backends.toolcalls import render_tool_call

    call = {"name": "python", "arguments": {"code": "print(17 + 25)"}}
    text = render_chat([{"role": "assistant", "content": "", "tool_calls": [{"function": call}]}])
    assert render_tool_call(call["name"], call["arguments"]) in text
