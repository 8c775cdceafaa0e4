"""`polystrata serve` (polystrata/server.py) through the official `openai` client, as a real client uses it: chat
and text completions, whole and streamed, stop strings, seeds, usage, errors, the API key, concurrent requests.

The server runs in this process on the reference target (no kernels to compile) with a tiny synthetic model whose
text is gibberish but deterministic; the batched decoding under it is checked against single runs in test_batch."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import polystrata.engine as engine_module
from polystrata.chat import encode_chat
from polystrata.cli import main
from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.runtimes import memory
from polystrata.sampling import Sampler, SamplerConfig
from polystrata.server import MAX_BODY, Scheduler, Server, listen
from polystrata.synth import synth_model

KEY = "test-key"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, engine, scheduler) of a server with 2 parallel slots of 128 tokens, its scheduler in a thread."""
    path = synth_model("llama", tmp_path_factory.mktemp("serve") / "llama.gguf", preset="tiny", qtype="Q8_0", seed=7)
    eng = Engine(path, target="reference", n_ctx=256, logit_rows=2)  # as `serve -np 2` makes it
    sched = Scheduler(eng, 2)
    server = Server(sched, "tiny", api_key=KEY)
    url = server.start(listen("127.0.0.1", 0))
    worker = threading.Thread(target=sched.run, daemon=True)
    worker.start()
    yield url, eng, sched
    sched.stop()
    server.close()
    worker.join(10)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _alone(eng: Engine, ids: list[int], n: int, seed: int | None = None, temp: float = 0.0,
           ignore_eos: bool = False) -> str:
    """What the engine generates on its own: the text a server's answer must equal."""
    sampler = Sampler(SamplerConfig(temperature=temp, seed=seed))
    stop = (lambda _tok: False) if ignore_eos else None
    return eng.tokenizer.decode(list(eng.generate(ids, n, sampler, stop=stop)))


LONG = " ".join(f"word{i} and" for i in range(25))  # a prompt of many steps of 8 tokens (91)


def test_chat_whole_and_streamed(client, served):
    """A chat completion equals the engine's own greedy generation after the chat template; streamed, its deltas
    add up to the same text, the first carrying the role, the last the finish reason, then the usage."""
    _, eng, _ = served
    ids = encode_chat(eng.tokenizer, eng.metadata["tokenizer.chat_template"], MESSAGES)
    want = _alone(eng, ids, 12)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_text_completion_stop_strings(client, served):
    """A stop string ends the text before it (never sent, streamed or not) with finish_reason "stop"; one that
    never appears changes nothing."""
    _, eng, _ = served
    want = _alone(eng, eng.tokenizer.encode("Once upon a time"), 24)
    stop = want[9:12]
    cut = want[: want.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                      stop=[stop, "never-in-gibberish"], stream=stream)
        if stream:
            chunks = list(r)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")


def test_seeded_sampling_and_parallel_requests(client, served, monkeypatch):
    """Five requests at once on two slots (three wait and join as others leave): each answer is what its prompt and
    seed give alone, sampled at temperature 1. The scheduler's lines on going idle count them all."""
    _, eng, sched = served
    deadline = time.monotonic() + 10
    while sched.busy and time.monotonic() < deadline:  # the earlier tests' requests go into a line of their own
        time.sleep(0.01)
    lines: list[str] = []
    monkeypatch.setattr(sched, "log", lines.append)
    prompts = [f"Tell me about the number {i}" for i in range(5)]
    want = [_alone(eng, eng.tokenizer.encode(p), 10 + i, seed=100 + i, temp=1.0) for i, p in enumerate(prompts)]

    def ask(i: int) -> str:
        r = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=10 + i, temperature=1.0,
                                      seed=100 + i)
        return r.choices[0].text

    with ThreadPoolExecutor(5) as pool:
        assert list(pool.map(ask, range(5))) == want
    deadline = time.monotonic() + 10
    while (sched.busy or not lines) and time.monotonic() < deadline:  # the last line follows the last answer
        time.sleep(0.01)
    counts = [re.match(r"served (\d+) requests: (\d+) tokens in [\d.]+ s \([\d.]+ tok/s\), (\d+) steps of "
                       r"([\d.]+) rows; a step [\d.]+ ms in the model, [\d.]+ ms sampling and sending, [\d.]+ ms "
                       r"between steps; the longest step [\d.]+ ms$", line).groups() for line in lines]
    assert sum(int(c[0]) for c in counts) == 5 and sum(int(c[1]) for c in counts) == sum(10 + i for i in range(5))
    # Every generated token but each request's last came back as a decode row of a later step.
    assert sum(round(int(c[2]) * float(c[3])) for c in counts) >= sum(9 + i for i in range(5))


def test_long_and_short_prompts_at_once_in_shared_steps(client, served, monkeypatch):
    """Steps of 8 rows here: four requests at once on two slots, long prompts and short ones; the long prompts go
    in chunks over several steps, beside the other request's decode rows or the end of another prompt. Each answer
    is what its prompt gives alone."""
    _, eng, sched = served
    monkeypatch.setattr(eng, "n_ubatch", 8)
    prompts = [LONG, "Hi", " ".join(f"and word{i}" for i in range(25)), "Tell me more"]
    assert min(len(eng.tokenizer.encode(p)) for p in prompts[::2]) > 40
    want = [_alone(eng, eng.tokenizer.encode(p), 12 + i, ignore_eos=True) for i, p in enumerate(prompts)]
    sizes: list[list[int]] = []
    step = sched.batch.step
    monkeypatch.setattr(sched.batch, "step", lambda runs, need=None, launched=None: (
        sizes.append([len(t) for _, t in runs]), step(runs, need, launched))[1])

    def ask(i: int) -> str:
        r = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12 + i, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12 + i
        return r.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == want
    assert max(map(sum, sizes)) == 8  # steps filled to the step size
    assert any(len(s) > 1 and max(s) > 1 for s in sizes)  # a prompt's chunk shared a step with another request


def test_a_stream_goes_on_while_a_long_prompt_joins(client, served, monkeypatch):
    """While a long prompt is fed (steps of 8 rows, each slowed by 5 ms here), a running stream keeps receiving
    tokens: its decode row is in every step. (Were the prompt prefilled alone, the stream would wait for all of
    it: at most the token of the step under way between the long job's submission to the scheduler and its first
    token.) Both texts are what they give alone."""
    _, eng, sched = served
    monkeypatch.setattr(eng, "n_ubatch", 8)
    ids = eng.tokenizer.encode(LONG)
    want_long, want_short = _alone(eng, ids, 4, ignore_eos=True), _alone(eng, eng.tokenizer.encode("Hi"), 60,
                                                                          ignore_eos=True)
    events: list[str] = []
    step, submit = sched.batch.step, sched.submit
    monkeypatch.setattr(sched.batch, "step", lambda *a, **kw: (time.sleep(0.005), step(*a, **kw))[1])
    monkeypatch.setattr(sched, "submit", lambda job: (events.append("submitted") if len(job.prompt_ids) > 50 else None,
                                                      submit(job))[1])
    first = threading.Event()
    texts: dict[str, list[str]] = {"short": [], "long": []}

    def read(name: str, prompt: str, n: int) -> None:
        for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            if c.choices and c.choices[0].text:
                texts[name].append(c.choices[0].text)
                events.append(name)
                first.set()

    with ThreadPoolExecutor(2) as pool:
        short = pool.submit(read, "short", "Hi", 60)
        assert first.wait(30)
        pool.submit(read, "long", LONG, 4).result()
        short.result()
    between = events[events.index("submitted"):events.index("long")]
    assert between.count("short") >= len(ids) // 8 // 2  # about one a step of the prompt's (7 rows each)
    assert ("".join(texts["long"]), "".join(texts["short"])) == (want_long, want_short)


def test_models_health_and_api_key(client, served):
    url, _, _ = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    with urllib.request.urlopen(url + "/health") as r:  # no key needed
        assert json.load(r) == {"status": "ok"}
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize("kwargs,param,message", [
    ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be between 1 and 128"),
    ({"max_tokens": 129}, "max_tokens", "'max_tokens' must be between 1 and 128"),
    ({"temperature": -1}, "temperature", "'temperature' must be at least 0"),
    ({"top_p": 2}, "top_p", "'top_p' must be between 0 and 1"),
    ({"n": 2}, "n", "'n' must be 1"),
    ({"stop": [""]}, "stop", "'stop' must be a string or up to 16 strings"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"messages": []}, "messages", "'messages' must be a non-empty array"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]", "'role' of system"),
    ({"messages": [{"role": "user", "content": "word " * 300}]}, "messages", "more than the 128 a sequence holds"),
    ({"extra_body": {"temperature": "hot"}}, "temperature", "'temperature' must be an integer or a number"),
])
def test_bad_requests_are_400_with_a_json_error(client, kwargs, param, message):
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and message in err["message"]


def _post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_malformed_bodies_and_routes(served):
    """Not JSON, a body too large, an unknown path: JSON errors with their status, never a traceback."""
    url, _, _ = served
    status, body = _post(url + "/v1/completions", b'{"prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(url + "/v1/completions", b'["prompt"]')
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = _post(url + "/v1/completions", json.dumps({"prompt": "x" * MAX_BODY}).encode())
    assert status == 413 and "larger than" in body["error"]["message"]
    status, body = _post(url + "/v1/completions", json.dumps({"prompt": [1, 5000]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt" and "vocabulary" in body["error"]["message"]
    status, body = _post(url + "/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["message"] == "no such endpoint: POST /v1/embeddings"


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_slot(served, monkeypatch, stream):
    """A client that disconnects mid-answer (decode steps slowed to 20 ms here): its job stops within a few steps
    and its slot is free again."""
    url, _, sched = served
    jobs = []
    submit, step = sched.submit, sched.batch.step
    monkeypatch.setattr(sched, "submit", lambda job: (jobs.append(job), submit(job))[1])
    monkeypatch.setattr(sched.batch, "step", lambda *a, **kw: (time.sleep(0.02), step(*a, **kw))[1])
    body = json.dumps({"prompt": "Hello", "max_tokens": 100, "stream": stream, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Authorization": f"Bearer {KEY}"})
    if stream:
        with urllib.request.urlopen(req) as r:
            assert r.readline().startswith(b"data: ")
    else:
        with pytest.raises(TimeoutError):
            urllib.request.urlopen(req, timeout=0.3)
    deadline = time.monotonic() + 5
    while (sched.running or len(sched.batch.free) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not sched.running and len(sched.batch.free) == 2
    assert jobs[0].cancelled and jobs[0].n_generated < 50


def test_a_client_that_leaves_while_its_prompt_is_fed_frees_its_slot(served, monkeypatch):
    """A client that disconnects while its long prompt is still being fed (steps of 4 rows, slowed to 20 ms): the
    job is dropped at the next step, before it generates anything, and its slot is free again."""
    url, eng, sched = served
    jobs = []
    submit, step = sched.submit, sched.batch.step
    monkeypatch.setattr(eng, "n_ubatch", 4)
    monkeypatch.setattr(sched, "submit", lambda job: (jobs.append(job), submit(job))[1])
    monkeypatch.setattr(sched.batch, "step", lambda *a, **kw: (time.sleep(0.02), step(*a, **kw))[1])
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": LONG, "max_tokens": 4}),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    deadline = time.monotonic() + 5
    while not (sched.joining and sched.joining[0].fed) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sched.joining and sched.joining[0].fed < len(jobs[0].prompt_ids)  # its prompt is being fed
    conn.close()
    while (sched.joining or sched.running or len(sched.batch.free) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not sched.joining and not sched.running and len(sched.batch.free) == 2
    assert jobs[0].cancelled and jobs[0].n_generated == 0


def test_a_failing_engine_gives_500_and_the_server_goes_on(served, client, monkeypatch):
    """A failure inside the engine (here the step raising): the requests in that step get a 500 JSON error,
    streamed or not, no traceback; the next request is served."""
    _, _, sched = served

    def broken(runs, need=None, launched=None):
        raise RuntimeError("device lost")

    step = sched.batch.step
    monkeypatch.setattr(sched.batch, "step", broken)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert e.value.status_code == 500 and e.value.body["message"] == "the model step failed"
    with pytest.raises(openai.APIError, match="the model step failed"):
        list(client.completions.create(model="tiny", prompt="Hello", max_tokens=3, stream=True))
    monkeypatch.setattr(sched.batch, "step", step)
    again = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 3


def test_serve_cli_refuses_what_it_cannot_do(tmp_path, capsys, monkeypatch):
    """Usage errors and impossible settings: one line naming the values and what to change, no traceback, before
    the model loads: here the model file does not even exist (or, for a hybrid, before its plans are made)."""
    cmd = ["serve", str(tmp_path / "missing.gguf"), "--target", "reference"]
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--port", "70000"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(
        "error: argument --port: expected a port from 0 to 65535, got '70000'")
    assert main([*cmd, "-c", "8", "-np", "5"]) == 1
    assert capsys.readouterr().err == ("error: a context of 8 tokens (-c) cannot hold 5 parallel sequences (-np) of "
                                       "at least 2 tokens each: use -c 10 or more, or -np 4 or less\n")
    assert main([*cmd, "-np", "8", "-ub", "4"]) == 1
    assert capsys.readouterr().err == ("error: -np 8 does not fit a step of 4 rows (-ub 4): a decode step computes "
                                       "one row per sequence; use -ub 8 or more, or -np 4 or less\n")
    assert main([*cmd, "-np", "300"]) == 1  # the default step size
    assert "error: -np 300 does not fit a step of 256 rows (-ub 256)" in capsys.readouterr().err
    with listen("127.0.0.1", 0) as taken:  # the port is taken before the model loads, a busy one refused at once
        port = taken.getsockname()[1]
        assert main([*cmd, "--port", str(port)]) == 1
    assert capsys.readouterr().err == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    with listen("[::1]", 0) as v6:  # an IPv6 address as URLs write it
        assert v6.family == socket.AF_INET6
    with pytest.raises(PolystrataError, match=r"^cannot listen on no-such-host\.invalid:0: \S"):  # resolution's reason
        listen("no-such-host.invalid", 0)
    # A hybrid (one recurrent state per engine): refused once its graph says so, before the plan of the last N
    # rows or anything else is made; `compile -np` likewise, writing nothing.
    hybrid = synth_model("qwen35", tmp_path / "q.gguf", preset="tiny", qtype="Q8_0", seed=7)
    built: list[int] = []
    build = engine_module.build_graph
    monkeypatch.setattr(engine_module, "build_graph", lambda *a, **kw: (built.append(kw.get("last_rows", 1)),
                                                                          build(*a, **kw))[1])
    monkeypatch.setattr(memory, "fit_plans", lambda *a, **kw: pytest.fail("planned"))
    want = "error: qwen35 keeps a recurrent state, one per engine: -np 2 parallel sequences are not supported yet; " \
           "use -np 1\n"
    assert main(["serve", str(hybrid), "--target", "cpu", "-np", "2", "--port", "0"]) == 1
    assert capsys.readouterr().err == want and built == [1]  # the graph of every logit, which says it
    art = tmp_path / "art"
    assert main(["compile", str(hybrid), "--target", "cpu", "-np", "2", "-o", str(art)]) == 1
    assert capsys.readouterr().err == want and not art.exists()
    built.clear()  # an unknown KV cache type: before the model's graph is built
    assert main(["serve", str(hybrid), "--target", "cpu", "--kv-type", "q4", "--port", "0"]) == 1
    assert capsys.readouterr().err == "error: unknown KV cache type 'q4' (known: f16, q8_0, q8_g64)\n" and not built


def test_serve_command_answers_and_stops_on_ctrl_c(tmp_path):
    """`polystrata serve` as a user starts it: the start line gives the URL (port 0: a free one), /health answers,
    Ctrl-C ends it with `error: interrupted` and exit code 130."""
    path = synth_model("llama", tmp_path / "m.gguf", preset="tiny", qtype="Q8_0", seed=7)
    proc = subprocess.Popen([sys.executable, "-m", "polystrata", "serve", str(path), "--target", "reference",
                             "--port", "0", "-np", "2", "-c", "64"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stderr.readline()
        url = re.match(r"serving m.gguf at (http://127.0.0.1:\d+)/v1 on reference .*: 2 parallel sequences of 32 "
                       r"tokens; Ctrl-C stops$", line.strip()).group(1)
        with urllib.request.urlopen(url + "/health") as r:
            assert json.load(r) == {"status": "ok"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
        assert proc.stderr.read() == "error: interrupted\n"
    finally:
        proc.kill()
