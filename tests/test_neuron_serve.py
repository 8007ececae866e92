"""`python -m g4ops serve --backend neuron --tp 2` on CPU: the OpenAI server over NeuronEngine with two gloo rank
processes (the tiny Gemma-4 built in code), answered through the official `openai` client on 127.0.0.1.

Oracles: stock transformers' greedy tokens (full forward, no cache) for temperature 0; for seeded sampling, the
same request through a TP=1 in-process NeuronEngine (a seeded request's noise depends on its seed, token index and
token id only, so TP=2 over the wire must give TP=1's tokens). The server runs as a subprocess, as a user starts it,
and stops on SIGTERM."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

from g4ops.engine.batch import SamplingParams  # noqa: E402
from g4ops.models import build_model, tiny_tokenizer  # noqa: E402
from g4ops.serve.cli import defaults_for  # noqa: E402
from g4ops.serve.params import sampling_params  # noqa: E402
from g4ops.serve.protocol import CompletionRequest  # noqa: E402
from neuron_backend.serve import engine_from_hf_model  # noqa: E402
from devices import one_intra_op_thread  # noqa: E402, F401 - autouse: this module runs on one thread

NAME = "tiny"
CONTEXT = 160
BUCKETS = (32, 128)
START_S = 240.0  # interpreter + two rank processes on a loaded 2-core machine
DEADLINE_S = 60.0
NO_EOS = {"ignore_eos": True}  # random weights may pick an eos id at any step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    cmd = [sys.executable, "-m", "g4ops", "serve", "--backend", "neuron", "--tp", "2", "--port", str(port),
           "--max-batch", "4", "--max-context", str(CONTEXT), "--neuron-buckets", *map(str, BUCKETS),
           "--served-model-name", NAME, "--log-level", "info"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    end = time.monotonic() + START_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if time.monotonic() > end:
                proc.kill()
                pytest.fail(f"the server did not start in {START_S:.0f} s:\n{proc.stdout.read()}")
            time.sleep(0.5)
    yield client, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-e4b")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@torch.no_grad()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "which rank holds token 300?"}]


def test_chat_greedy_is_stocks_argmax_and_streams_the_same(server, model, tokenizer):
    client, _ = server
    n = 10
    args = dict(model=NAME, messages=MESSAGES, max_tokens=n, temperature=0, extra_body=NO_EOS)
    reply = client.chat.completions.create(**args)
    expect = tokenizer.decode(_greedy(model, _chat_ids(tokenizer, MESSAGES), n), skip_special_tokens=True)
    assert reply.choices[0].message.content == expect
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == n
    text, finish = "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert (text, finish) == (expect, "length")
    assert client.models.list().data[0].id == NAME


def test_seeded_sampling_over_tp2_is_tp1s(server, model, tokenizer):
    """temperature / top_p / top_k / seed over the wire: TP=2 draws what TP=1 draws; a seed reproduces its text and
    another seed (almost surely) changes it."""
    client, _ = server
    prompt = "the shards gather only their candidates"
    body = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.95)
    extra = {**NO_EOS, "top_k": 40}
    texts = [client.completions.create(**body, seed=s, extra_body=extra).choices[0].text for s in (11, 11, 12)]
    assert texts[0] == texts[1] and texts[0] != texts[2]

    ids = tokenizer(prompt)["input_ids"]  # as the server tokenizes a completions prompt
    params = sampling_params(CompletionRequest(**body, seed=11, **extra), defaults_for(model), len(ids), CONTEXT)
    assert isinstance(params, SamplingParams) and params.temperature == 0.9 and params.top_k == 40
    tp1 = engine_from_hf_model(model, 1, max_batch=2, max_context=CONTEXT, buckets=BUCKETS)
    events = []
    tp1.submit(ids, params, events.append)
    while not (events and events[-1].finish_reason):
        tp1.step()
    tp1.shutdown()
    tokens = [e.token_id for e in events if e.token_id is not None]
    assert len(tokens) == 12
    assert texts[0] == tokenizer.decode(tokens, skip_special_tokens=True)


def test_concurrent_requests_share_the_batch_and_get_their_own_greedy_tokens(server, model, tokenizer):
    """Four chats at once over TP=2 (max batch 4, prompts of different lengths): each reply is stock's greedy
    continuation of its own prompt, whatever shares the batch (rows at different positions in one decode call are
    test_neuron_engine's)."""
    client, _ = server
    n = 8
    chats = [[{"role": "user", "content": "?" * i + f"request {i}"}] for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
        replies = list(pool.map(lambda m: client.chat.completions.create(
            model=NAME, messages=m, max_tokens=n, temperature=0, extra_body=NO_EOS), chats))  # fmt: skip
    for messages, reply in zip(chats, replies):
        expect = tokenizer.decode(_greedy(model, _chat_ids(tokenizer, messages), n), skip_special_tokens=True)
        assert reply.choices[0].message.content == expect


def test_bad_sampling_is_a_400_naming_the_field_and_sigterm_stops_everything(server):
    client, proc = server
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=1.0, extra_body={"top_k": 65})
    ranks = [pid for pid, name in _children(proc.pid) if name.startswith("python")]
    assert len(ranks) >= 2, _children(proc.pid)  # the two TP rank processes (spawn may add its resource tracker)
    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down, then re-raises the signal it caught: the exit status is SIGTERM's, as with --backend cuda
    assert proc.wait(DEADLINE_S) in (0, -signal.SIGTERM)
    log = proc.stdout.read()
    assert "Application shutdown complete" in log and "Traceback" not in log, log
    end = time.monotonic() + DEADLINE_S
    while any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in ranks):  # the ranks end too
        assert time.monotonic() < end, f"rank processes {ranks} outlived the server"
        time.sleep(0.2)


def _state(pid) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _children(ppid: int) -> list[tuple[int, str]]:
    """(pid, command name) of the processes whose parent is ppid (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        if int(rest.split()[1]) == ppid:
            out.append((int(entry), name))
    return out
