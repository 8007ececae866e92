"""The OpenAI-compatible server (g4ops/serve/) over the real BatchEngine and the tiny Gemma-4 on CPU, driven by the
official `openai` client over loopback: outputs against greedy decoding computed here, streaming against
non-streaming, seeds, concurrency, stop strings, every kind of bad input, overload, disconnects, metrics, shutdown.

Servers run in a background thread (uvicorn.Server on a socket bound to a free port on 127.0.0.1) and are stopped
at the end of each test or of the module; every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import argparse
import time

import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from g4ops.engine.batch import BatchEngine
from g4ops.models import build_model, tiny_tokenizer
from g4ops.serve import GenerationDefaults, create_app
from g4ops.serve.cli import defaults_for
from g4ops.serve.params import sampling_params
from g4ops.serve.protocol import ChatCompletionRequest
from g4ops.serve.text import Detokenizer, StopMatcher, fast_decode

try:  # the HTTP client the installed openai uses (httpx2 since openai 3)
    import httpx2 as httpx
except ImportError:
    import httpx

NAME = "tiny"
CONTEXT = 192
DEADLINE_S = 30.0  # no single wait in this file may take longer
NO_EOS = {"ignore_eos": True}  # random weights may pick an eos id at any step; most tests want exact lengths


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-e4b")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@contextlib.contextmanager
def serving(engine, tokenizer, model, *, graceful_s: float | None = None, start: bool = True, defaults=None):
    """(base_url, uvicorn server, app) for `engine` on a free loopback port (generation defaults: the model's); stops
    the server on exit."""
    if start:
        engine.start()
    app = create_app(engine, tokenizer, NAME, defaults or defaults_for(model), shutdown_timeout=DEADLINE_S)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started, "the server to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, app
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def _wait(condition, what: str, timeout: float = DEADLINE_S):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = BatchEngine(model, max_batch=16, max_context=CONTEXT)
    with serving(engine, tokenizer, model) as (base, _, app):
        yield base, engine, app


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    """The oracle: argmax of a full forward over everything so far, n times (no cache, no engine)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def _messages(i: int = 0) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question number {i}" + "?" * i}]


def _stream_text(stream) -> tuple[str, str | None, object]:
    """(text, finish_reason, usage) of a chat or completions stream."""
    text, finish, usage = "", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += piece or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def _metrics(base: str) -> dict[tuple[str, tuple], float]:
    body = httpx.get(f"{base}/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


# -- what is generated ---------------------------------------------------------------------------------------------
def test_chat_greedy_text_is_the_models_argmax(server, model, tokenizer):
    base, *_ = server
    n = 12
    reply = _client(base).chat.completions.create(model=NAME, messages=_messages(), max_tokens=n, temperature=0,
                                                  extra_body=NO_EOS)
    prompt = _chat_ids(tokenizer, _messages())
    assert reply.choices[0].message.content == tokenizer.decode(_greedy(model, prompt, n), skip_special_tokens=True)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.role == "assistant"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(prompt), n, len(prompt) + n)
    assert reply.model == NAME and reply.object == "chat.completion"


def test_completions_text_and_token_prompts(server, model, tokenizer):
    base, *_ = server
    client, n, prompt = _client(base), 10, "The capital of France is"
    ids = tokenizer(prompt)["input_ids"]
    expected = tokenizer.decode(_greedy(model, ids, n), skip_special_tokens=True)
    by_text = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, extra_body=NO_EOS)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=n, temperature=0, extra_body=NO_EOS)
    for reply in (by_text, by_ids):
        assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == n


def test_streaming_equals_non_streaming(server):
    base, *_ = server
    client, n = _client(base), 20
    chat = dict(model=NAME, messages=_messages(3), max_tokens=n, temperature=0, extra_body=NO_EOS)
    whole = client.chat.completions.create(**chat)
    text, finish, usage = _stream_text(client.chat.completions.create(
        **chat, stream=True, stream_options={"include_usage": True}))
    assert (text, finish) == (whole.choices[0].message.content, "length")
    assert usage.completion_tokens == n and usage.prompt_tokens == whole.usage.prompt_tokens
    completion = dict(model=NAME, prompt="once upon a time", max_tokens=n, temperature=0, extra_body=NO_EOS)
    whole = client.completions.create(**completion)
    text, finish, usage = _stream_text(client.completions.create(**completion, stream=True))
    assert (text, finish, usage) == (whole.choices[0].text, "length", None)  # no usage unless asked for


def test_stop_token_ends_generation_and_is_not_text(model, tokenizer):
    """Generation stops at a stop id of the generation defaults (the checkpoint's eos ids), counted as a completion
    token but not part of the text. The stop id is one the greedy path reaches, found by the oracle."""
    ids = tokenizer("stop here")["input_ids"]
    tokens = _greedy(model, ids, 8)
    hit = max(k for k, t in enumerate(tokens) if t not in tokens[:k])  # the last first occurrence
    engine = BatchEngine(model, max_batch=2, max_context=CONTEXT)
    defaults = GenerationDefaults.from_generation_config(None, stop_token_ids=(tokens[hit],))
    with serving(engine, tokenizer, model, defaults=defaults) as (base, *_):
        client = _client(base)
        reply = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == hit + 1
        assert reply.choices[0].text == tokenizer.decode(tokens[:hit], skip_special_tokens=True)
        reply = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0, extra_body=NO_EOS)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8


def test_stop_strings_trim_the_text(server):
    base, *_ = server
    client = _client(base)
    args = dict(model=NAME, prompt="stop strings", max_tokens=24, temperature=0, extra_body=NO_EOS)
    full = client.completions.create(**args).choices[0].text
    stop = full[9:11]
    cut = full.find(stop)
    for stream in (False, True):
        reply = client.completions.create(**args, stop=["never appears \x00", stop], stream=stream)
        text, finish, _ = _stream_text(reply) if stream else (reply.choices[0].text, reply.choices[0].finish_reason,
                                                              None)
        assert (text, finish) == (full[:cut], "stop"), stream


def test_seed_reproduces_a_sampled_text(server):
    base, *_ = server
    client = _client(base)
    args = dict(model=NAME, messages=_messages(1), max_tokens=10, temperature=1.0, extra_body=NO_EOS)
    first, again, other = (client.chat.completions.create(**args, seed=seed).choices[0].message.content
                           for seed in (7, 7, 8))
    greedy = client.chat.completions.create(**{**args, "temperature": 0}).choices[0].message.content
    assert first == again
    assert other != first and greedy != first  # 10 draws from 512 ids: equal only by a bug


def test_concurrent_requests_each_equal_their_solo_greedy_text(server):
    base, engine, _ = server
    client = _client(base)
    prompts = [_messages(i) for i in range(16)]
    lengths = [4 + i % 5 for i in range(16)]  # rows leave the batch at different steps
    solo = [client.chat.completions.create(model=NAME, messages=m, max_tokens=n, temperature=0, extra_body=NO_EOS)
            .choices[0].message.content for m, n in zip(prompts, lengths)]  # fmt: skip

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                      timeout=DEADLINE_S) as aclient:  # fmt: skip
            replies = await asyncio.gather(*[aclient.chat.completions.create(
                model=NAME, messages=m, max_tokens=n, temperature=0, extra_body=NO_EOS)
                for m, n in zip(prompts, lengths)])
        return [r.choices[0].message.content for r in replies]

    steps = engine.stats().decode_steps
    assert asyncio.run(asyncio.wait_for(together(), DEADLINE_S)) == solo
    assert engine.stats().decode_steps - steps < sum(lengths)  # they did share steps


# -- bad input and overload ----------------------------------------------------------------------------------------
BAD_CHAT = [  # (body change, field the error must name)
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),  # wrong type, not coerced
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"logprobs": True}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": CONTEXT}, "max_tokens"),  # prompt + completion past the context
    ({"messages": [{"role": "user", "content": "x" * CONTEXT}]}, "messages"),  # the prompt alone is too long
    ({"model": "gpt-4"}, "model"),
]


def test_bad_input_gets_400_naming_the_field_and_the_server_carries_on(server):
    base, engine, _ = server
    good = {"model": NAME, "messages": _messages(), "max_tokens": 2}
    for change, field in BAD_CHAT:
        reply = httpx.post(f"{base}/v1/chat/completions", json={**good, **change})
        expected = 404 if field == "model" else 400
        assert reply.status_code == expected, (change, reply.status_code, reply.text)
        error = reply.json()["error"]
        assert error["param"] == field and error["message"] and error["type"], (change, error)
    for body in (b"{not json", b'["a list"]', b""):
        reply = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error", body
    for change, field in [({"prompt": [1, 10**6]}, "prompt"), ({"prompt": []}, "prompt"), ({"echo": True}, "echo"),
                          ({"prompt": ["a", "b"]}, "prompt")]:  # fmt: skip
        reply = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "hi", **change})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (change, reply.text)
    with pytest.raises(openai.BadRequestError) as info:  # what the official client makes of it
        _client(base).chat.completions.create(model=NAME, messages=_messages(), n=3)
    assert info.value.status_code == 400 and info.value.param == "n"
    assert engine.stats().running == 0 and engine.stats().waiting == 0
    assert _client(base).chat.completions.create(**good).choices[0].finish_reason in ("stop", "length")


def test_full_queue_answers_429(model, tokenizer):
    """An engine that is not started yet holds what it admits: one request waits, the next finds the queue full."""
    engine = BatchEngine(model, max_batch=1, max_context=64, max_waiting=1)
    with serving(engine, tokenizer, model, start=False) as (base, *_):
        client = _client(base)
        done = {}
        first = threading.Thread(target=lambda: done.setdefault("reply", client.completions.create(
            model=NAME, prompt="first", max_tokens=3, temperature=0)))
        first.start()
        _wait(lambda: engine.stats().waiting == 1, "the first request to be queued")
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=NAME, prompt="second", max_tokens=3)
        assert info.value.status_code == 429 and info.value.body["type"] == "rate_limit_error"
        engine.start()
        first.join(DEADLINE_S)
        assert done["reply"].usage.completion_tokens >= 1


# -- disconnects, metrics, shutdown --------------------------------------------------------------------------------
def test_client_disconnect_frees_the_slot(server):
    base, engine, _ = server
    aborted = _metrics(base).get(("g4ops:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"model": NAME, "prompt": "a long one", "max_tokens": CONTEXT - 16, "temperature": 0, **NO_EOS}
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
        assert engine.stats().running == 1
    _wait(lambda: engine.stats().running == 0, "the streamed request to leave the engine")
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up
        httpx.post(f"{base}/v1/completions", json=body, timeout=0.3)
    _wait(lambda: engine.stats().running == 0, "the non-streamed request to leave the engine")
    assert _metrics(base)[("g4ops:request_success_total", (("finished_reason", "abort"),))] == aborted + 2


def test_client_disconnect_while_queued_cancels_the_request(model, tokenizer):
    """A streaming client that leaves before its request got a KV slot: the request is cancelled, never run."""
    engine = BatchEngine(model, max_batch=1, max_context=64)
    with serving(engine, tokenizer, model, start=False) as (base, *_):
        body = {"model": NAME, "prompt": "queued", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            _wait(lambda: engine.stats().waiting == 1, "the request to be queued")
        _wait(lambda: _metrics(base)[("g4ops:request_success_total", (("finished_reason", "abort"),))] == 1,
              "the server to see the disconnect")
        engine.start()
        _wait(lambda: engine.stats().waiting == 0, "the engine to drop the cancelled request")
        assert engine.stats().generated_tokens == 0


def test_metrics_count_what_was_served(model, tokenizer):
    engine = BatchEngine(model, max_batch=4, max_context=CONTEXT)
    with serving(engine, tokenizer, model) as (base, *_):
        client = _client(base)
        replies = [client.completions.create(model=NAME, prompt=f"count {i}", max_tokens=4 + i, temperature=0,
                                             extra_body=NO_EOS) for i in range(3)]  # fmt: skip
        text, _, usage = _stream_text(client.chat.completions.create(
            model=NAME, messages=_messages(), max_tokens=5, stream=True, stream_options={"include_usage": True},
            extra_body=NO_EOS))
        usages = [r.usage for r in replies] + [usage]
        m = _metrics(base)
        generated = sum(u.completion_tokens for u in usages)
        assert m[("g4ops:prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usages)
        assert m[("g4ops:generation_tokens_total", ())] == generated
        assert m[("g4ops:request_success_total", (("finished_reason", "length"),))] == len(usages)
        assert m[("g4ops:time_to_first_token_seconds_count", ())] == len(usages)
        assert m[("g4ops:inter_token_latency_seconds_count", ())] == generated - len(usages)
        assert m[("g4ops:e2e_request_latency_seconds_count", ())] == len(usages)
        assert m[("g4ops:e2e_request_latency_seconds_sum", ())] >= m[("g4ops:time_to_first_token_seconds_sum", ())]
        assert m[("g4ops:num_requests_running", ())] == 0 and m[("g4ops:num_requests_waiting", ())] == 0
        assert m[("g4ops:kv_slots_in_use", ())] == 0 and m[("g4ops:kv_slots_total", ())] == 4


def test_health_and_models(server):
    base, *_ = server
    assert httpx.get(f"{base}/health").status_code == 200
    models = _client(base).models.list().data
    assert [(m.id, m.object, m.max_model_len) for m in models] == [(NAME, "model", CONTEXT)]


def test_shutdown_cancels_requests_in_flight(model, tokenizer):
    """uvicorn's shutdown (what SIGTERM starts) waits the graceful timeout, cancels what still streams, and the
    lifespan's exit shuts the engine down: its thread ends and it accepts nothing more."""
    engine = BatchEngine(model, max_batch=2, max_context=CONTEXT)
    with serving(engine, tokenizer, model, graceful_s=0.2) as (base, server, _):
        with httpx.stream("POST", f"{base}/v1/completions", json={
                "model": NAME, "prompt": "long", "max_tokens": CONTEXT - 16, "stream": True, **NO_EOS}) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.should_exit = True
            _wait(lambda: engine.stats().running == 0, "shutdown to cancel the request")
            with contextlib.suppress(httpx.HTTPError):
                list(lines)  # the stream ends (cut or closed), it does not hang
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="shutdown"):
        engine.submit([2, 3], sampling_params(ChatCompletionRequest(model=NAME, messages=_messages(), max_tokens=1),
                                              GenerationDefaults(), 2, CONTEXT), lambda event: None)  # fmt: skip


def test_engine_ending_a_stream_sends_an_error_event(model, tokenizer):
    """When the engine ends a request itself (its shutdown), the stream closes with an OpenAI error event and
    [DONE], which the official client raises; later requests get 503, and so does /health."""
    engine = BatchEngine(model, max_batch=2, max_context=CONTEXT)
    with serving(engine, tokenizer, model) as (base, *_):
        client = _client(base)
        stream = client.completions.create(model=NAME, prompt="x", max_tokens=CONTEXT - 16, stream=True,
                                           extra_body=NO_EOS)
        chunks = iter(stream)
        next(chunks)
        engine.shutdown()
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=NAME, prompt="x", max_tokens=2)
        assert info.value.status_code == 503
        assert httpx.get(f"{base}/health").status_code == 503
        m = _metrics(base)
        assert m[("g4ops:request_success_total", (("finished_reason", "error"),))] == 1


# -- pieces ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [True, False], ids=["rust-decode", "transformers-decode"])
def test_detokenizer_pieces_join_to_the_whole_decode(tokenizer, backend, monkeypatch):
    """Random ids (bytes that are not valid UTF-8, control and special tokens included) come out piece by piece as
    the one-shot decode of the whole sequence, on the Rust backend's decode and on transformers' own."""
    if not backend:
        monkeypatch.setattr(type(tokenizer), "backend_tokenizer", None, raising=False)
    assert (fast_decode(tokenizer) != tokenizer.decode) == backend
    rng = torch.Generator().manual_seed(0)
    for trial in range(200):
        ids = torch.randint(0, len(tokenizer), (int(torch.randint(1, 40, (1,), generator=rng)),), generator=rng)
        if trial % 2:  # mostly high bytes: multi-byte characters split across tokens
            ids = torch.where(ids % 3 > 0, 256 + 128 + ids % 128, ids)
        detok = Detokenizer(tokenizer)
        text = "".join(detok.add(int(i)) for i in ids) + detok.flush()
        assert text == tokenizer.decode(ids.tolist(), skip_special_tokens=True), ids.tolist()


def test_stop_matcher_finds_stops_split_across_deltas():
    text, stops = "the cat sat on the mat; the end", ("sat on", "mat;")
    for cuts in ([], [1, 5, 9], list(range(1, len(text))), [12, 13, 20]):
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        matcher = StopMatcher(stops)
        out = "".join(matcher.feed(piece) for piece in pieces) + matcher.finish()
        assert (out, matcher.stopped) == ("the cat ", True), cuts
    matcher = StopMatcher(("zz",))
    assert "".join(matcher.feed(c) for c in "abz") + matcher.finish() == "abz" and not matcher.stopped


def test_generation_defaults_follow_transformers():
    from transformers import GenerationConfig

    sampled = GenerationDefaults.from_generation_config(GenerationConfig(
        do_sample=True, temperature=1.0, top_k=64, top_p=0.95, eos_token_id=[1, 106, 50]))  # E4B-it's
    assert sampled == GenerationDefaults(greedy=False, temperature=1.0, top_k=64, top_p=0.95,
                                         stop_token_ids=(1, 106, 50))
    greedy = GenerationDefaults.from_generation_config(GenerationConfig(eos_token_id=1), stop_token_ids=(1, 7))
    assert greedy.greedy and greedy.stop_token_ids == (1, 7)

    def params(defaults, **fields):
        req = ChatCompletionRequest(model=NAME, messages=_messages(), **fields)
        return sampling_params(req, defaults, prompt_len=10, max_context=CONTEXT)

    assert params(sampled).temperature == 1.0 and params(sampled).top_k == 64 and params(sampled).top_p == 0.95
    assert params(sampled, temperature=0.5, top_k=-1).top_k == 0  # what a request sets wins
    assert params(greedy).temperature == 0 and params(greedy, temperature=0.7).temperature == 0.7
    assert params(greedy).max_new_tokens == CONTEXT - 10  # unset: to the end of the context
    assert params(greedy, max_tokens=5, max_completion_tokens=7).max_new_tokens == 7
    assert params(greedy, ignore_eos=True).stop_token_ids == () and params(greedy).stop_token_ids == (1, 7)
    assert json.loads(ChatCompletionRequest(model=NAME, messages=_messages()).model_dump_json())["n"] == 1


def test_cli_loads_a_local_checkpoint(tmp_path, tokenizer):
    """--model DIR: weights, tokenizer and generation_config.json from the directory (never downloading); the
    generation config becomes the request defaults."""
    from transformers import GenerationConfig

    from g4ops.serve import cli

    saved = build_model("tiny-e4b", num_layers=3)
    saved.generation_config = GenerationConfig(do_sample=True, temperature=0.8, top_k=5, top_p=0.9,
                                               eos_token_id=[1, 106])
    saved.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    args = argparse.ArgumentParser()
    cli.add_arguments(args)
    model, loaded, name = cli.load(args.parse_args(["--model", str(tmp_path / "ckpt"), "--device", "cpu"]))
    assert name == "ckpt" and next(model.parameters()).dtype == torch.float32  # fp32 on CPU
    assert loaded.apply_chat_template(_messages(), add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(_messages(), add_generation_prompt=True, tokenize=False)
    assert defaults_for(model) == GenerationDefaults(greedy=False, temperature=0.8, top_k=5, top_p=0.9,
                                                     stop_token_ids=(1, 106))
    ids = torch.tensor([[2, 300, 301, 302]])
    torch.testing.assert_close(model(ids).logits, saved(ids).logits, rtol=0, atol=0)
