"""``tqexport serve``: the official openai client and plain httpx against a live server bound to
127.0.0.1 on a free port (the tiny artifact with a byte-level tokenizer)."""

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import schemathesis
from helpers import assert_same_generation, serving, teacher_forced, with_byte_tokenizer
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.specs.openapi.checks import positive_data_acceptance
from starlette.testclient import TestClient

from tqexport.runtime.engine import Engine, EngineConfig
from tqexport.runtime.executor import Executor
from tqexport.runtime.sequence import SamplingParams
from tqexport.serve.app import create_app

MODEL, KEY = "tiny", "test-key"
BODY_LIMIT = 64 * 2**10
IDS = [5, 9, 200, 3]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
CONCURRENT = [[7, 1, 99], list(range(40, 60)), [250, 3, 3, 3, 8], [17] * 11]
AUTH = {"Authorization": f"Bearer {KEY}"}
#: tokens each request generates while another in its batch fails
VICTIM_TOKENS = 160


def alone(engine, prompt, max_tokens, chat_template=False, **kw):
    """(token ids, text, finish reason) of one request served alone, as the server submits it."""
    ids = engine.encode(prompt, chat_template=chat_template)
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens), **kw)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {rid}
    tokens = [t for o in outs for t in o.new_token_ids]
    return tokens, "".join(o.text for o in outs), outs[-1].finish_reason


class Live:
    def __init__(self, path, engine, base, ref):
        self.path, self.engine, self.base, self.ref = path, engine, base, ref
        self.client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def texty(artifacts, tmp_path_factory):
    tiny = artifacts("tiny-llama", "turboquant_4bit_nc")
    return with_byte_tokenizer(tiny, tmp_path_factory.mktemp("serve") / "art")


@pytest.fixture(scope="module")
def live(texty):
    """A server on 127.0.0.1 (uvicorn in a thread) and each reference output computed on the
    same engine, alone, before the server owns it."""
    engine = Engine.from_artifact(texty, EngineConfig(num_blocks=64))
    ref = {
        "ids": alone(engine, IDS, 24),
        "text": alone(engine, "The cat", 32, ignore_eos=True),
        "chat": alone(engine, MESSAGES, 12, chat_template=None),
        "long": alone(engine, IDS, 64, ignore_eos=True),
    }
    for i, p in enumerate(CONCURRENT):
        ref[i] = alone(engine, p, 32, ignore_eos=True)
        ref["victim", i] = alone(engine, p, VICTIM_TOKENS, ignore_eos=True)
    app = create_app(engine, MODEL, api_key=KEY, max_body_bytes=BODY_LIMIT)
    with serving(app) as base:
        yield Live(texty, engine, base, ref)


def scrape(base) -> dict:
    """/metrics as {(sample name, labels): value}."""
    r = httpx.get(base + "/metrics", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    text = r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_completions_equal_the_engine_alone(live):
    tokens, text, reason = live.ref["ids"]
    assert [m.id for m in live.client.models.list().data] == [MODEL]
    r = live.client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert (choice.token_ids, choice.text, choice.finish_reason) == (tokens, text, reason)
    assert choice.prompt_token_ids == IDS and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, len(tokens))
    chunks = list(
        live.client.completions.create(
            model=MODEL, prompt=IDS, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    assert [t for c in chunks[:-1] for t in c.choices[0].token_ids] == tokens
    assert "".join(c.choices[0].text for c in chunks[:-1]) == text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + [
        reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)


def test_text_prompt_and_stop_strings(live):
    tokens, full, _ = live.ref["text"]
    body = dict(model=MODEL, prompt="The cat", max_tokens=32, temperature=0)
    r = live.client.completions.create(**body, extra_body={"ignore_eos": True})
    assert r.choices[0].text == full and r.usage.prompt_tokens == len(b"The cat")
    j = next(j for j in range(1, len(full) - 1) if full.find(full[j : j + 2]) == j)
    for stream in (False, True):
        r = live.client.completions.create(
            **body, stop=[full[j : j + 2]], stream=stream, extra_body={"ignore_eos": True}
        )
        choices = [c.choices[0] for c in r] if stream else r.choices
        assert "".join(c.text for c in choices) == full[:j]
        assert choices[-1].finish_reason == "stop"


def test_chat_completions_whole_and_streamed(live):
    tokens, text, reason = live.ref["chat"]
    r = live.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert (r.choices[0].message.role, r.choices[0].message.content) == ("assistant", text)
    assert r.choices[0].finish_reason == reason and r.object == "chat.completion"
    want_prompt = len(b"<system>be brief\n<user>hi\n<assistant>")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want_prompt, len(tokens))
    chunks = list(
        live.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_concurrent_requests_share_steps_and_match_alone(live):
    barrier = threading.Barrier(len(CONCURRENT))
    results: dict[int, list[int]] = {}

    def send(i):
        barrier.wait(10)
        r = live.client.completions.create(
            model=MODEL, prompt=CONCURRENT[i], max_tokens=32, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        results[i] = r.choices[0].token_ids

    steps = live.engine.executor.steps
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(len(CONCURRENT)))
    shared = live.engine.executor.steps - steps
    assert shared < 2 * 32, f"{shared} steps: one after another would take {4 * 32}"
    module = None
    for i, p in enumerate(CONCURRENT):
        want, got = live.ref[i][0], results[i]
        if got != want:  # batched rows may round differently: agree up to a near tie
            if module is None:
                module = Executor(live.engine.artifact, "torch", num_blocks=2).backend.module
                module.mode = "functional"
            spec = live.engine.artifact.spec
            assert_same_generation(teacher_forced(module, spec, p, want), want, got)


def error(r, status, param=None, code=None, message=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    e = body["error"]
    assert (e["param"], e["code"]) == (param, code), e
    if message:
        assert re.search(message, e["message"]), e["message"]


def test_errors_are_openai_json_and_disturb_nobody(live):
    tokens, _, _ = live.ref["long"]
    got = {}

    def long_stream():
        r = live.client.completions.create(
            model=MODEL, prompt=IDS, max_tokens=64, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        got["tokens"] = [t for c in r for t in c.choices[0].token_ids]

    runner = threading.Thread(target=long_stream)
    runner.start()
    url = live.base + "/v1/completions"
    chat_url = live.base + "/v1/chat/completions"
    ok = {"model": MODEL, "prompt": [1, 2]}
    chat = {"model": MODEL, "messages": MESSAGES}
    with httpx.Client(timeout=30) as c:
        error(c.post(url, json=ok), 401, code="invalid_api_key")
        error(c.post(url, json=ok, headers={"Authorization": "Bearer nope"}), 401,
              code="invalid_api_key")  # fmt: skip
        error(c.get(live.base + "/v1/models"), 401, code="invalid_api_key")
        json_auth = {**AUTH, "Content-Type": "application/json"}
        post = lambda u, **kw: c.post(u, headers=json_auth, **kw)  # noqa: E731
        error(post(url, content=b'{"model": '), 400, message="not valid JSON")
        error(post(url, content=b"[1, 2]"), 400, message="must be a JSON object")
        error(post(url, json={**ok, "model": "gpt-4"}), 404, "model", "model_not_found")
        error(post(url, json={"prompt": [1]}), 400, "model", message="model is required")
        for name, value in [("n", 2), ("logprobs", 1), ("best_of", 3), ("echo", True),
                            ("presence_penalty", 0.5), ("logit_bias", {"1": 5})]:  # fmt: skip
            error(post(url, json={**ok, name: value}), 400, name, "unsupported_parameter")
        error(post(url, json={**ok, "frobnicate": 1}), 400, "frobnicate", "unsupported_parameter")
        error(post(url, json={**ok, "temperature": 3}), 400, "temperature")
        error(post(url, json={**ok, "max_tokens": 0}), 400, "max_tokens")
        error(post(url, json={**ok, "top_p": 0}), 400, "top_p")
        error(post(url, json={**ok, "max_tokens": "5"}), 400, "max_tokens")
        error(post(url, json={**ok, "stop": [""]}), 400, "stop")
        error(post(url, json={**ok, "stream_options": {"include_usage": True}}), 400,
              "stream_options")  # fmt: skip
        error(post(url, json={**ok, "prompt": [[1], [2]]}), 400, "prompt", "unsupported_parameter")
        error(post(url, json={**ok, "prompt": [300]}), 400, message=r"must be in \[0, 256\)")
        error(post(url, json={**ok, "prompt": [1] * 500, "max_tokens": 13}), 400,
              message="exceeds the model's position limit of 512 tokens")  # fmt: skip
        error(post(url, json={**ok, "prompt": ""}), 400, message="empty prompt")
        tools = [{"type": "function", "function": {"name": "f"}}]
        error(post(chat_url, json={**chat, "tools": tools}), 400, "tools", "unsupported_parameter")
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        error(post(chat_url, json={**chat, "messages": image}), 400, "messages[0]",
              "unsupported_parameter")  # fmt: skip
        error(post(chat_url, json={**chat, "messages": [{"role": "robot", "content": "x"}]}),
              400, message="role must be one of")  # fmt: skip
        big = json.dumps({**ok, "user": "x" * BODY_LIMIT}).encode()
        error(post(url, content=big), 413, code="request_too_large")
        error(post(url, content=iter([big[:1000], big[1000:]])), 413, code="request_too_large")
        error(c.get(live.base + "/v1/nothing", headers=AUTH), 404)
        error(c.get(url, headers=AUTH), 405)
        assert c.get(live.base + "/health").status_code == 200
    runner.join(60)
    assert got["tokens"] == tokens


UNAUTHORIZED = {"error": {"message": "missing or wrong API key: send 'Authorization: Bearer "
                           "<key>'", "type": "invalid_request_error", "param": None,
                           "code": "invalid_api_key"}}  # fmt: skip


def test_the_key_guards_every_route_but_health(live):
    with httpx.Client(base_url=live.base, timeout=30) as c:
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect",
                     "/v1/models", "/v1/nothing"):  # fmt: skip
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
                r = c.get(path, headers=headers)
                assert (r.status_code, r.json()) == (401, UNAUTHORIZED), path
                assert r.headers["www-authenticate"] == "Bearer"
            assert c.get(path, headers=AUTH).status_code == (404 if "nothing" in path else 200)
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", content=b"x" * 100, headers={"Content-Type": "text/plain"})
        assert (r.status_code, r.json()) == (401, UNAUTHORIZED)  # the key is checked first
        described = c.get("/openapi.json", headers=AUTH).json()
    assert described["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    secured = {
        p for p, ops in described["paths"].items() if all("security" in o for o in ops.values())
    }
    assert secured == {"/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}


@pytest.fixture(scope="module")
def small_engine(texty):
    """An engine of 8 blocks: a request can never generate more than 112 tokens."""
    return Engine.from_artifact(texty, EngineConfig(num_blocks=8))


def test_metrics_public_opens_metrics_only(texty):
    engine = Engine.from_artifact(texty, EngineConfig(num_blocks=8))
    app = create_app(engine, MODEL, api_key=KEY, metrics_public=True)
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 200
        assert "tqexport_num_requests_running 0.0" in c.get("/metrics").text
        for path in ("/openapi.json", "/docs", "/v1/models"):
            assert (c.get(path).status_code, c.get(path).json()) == (401, UNAUTHORIZED), path
        secured = {p for p, ops in app.openapi()["paths"].items()
                   if all("security" in o for o in ops.values())}  # fmt: skip
        assert secured == {"/v1/models", "/v1/completions", "/v1/chat/completions"}


def unsupported(got):
    return {"error": {"message": "the request body must be JSON sent with 'Content-Type: "
                      f"application/json', got {got}", "type": "invalid_request_error",
                      "param": None, "code": "unsupported_media_type"}}  # fmt: skip


def test_request_bodies_must_be_application_json(live, texty):
    body = json.dumps({"model": MODEL, "prompt": IDS, "max_tokens": 2}).encode()
    sent = [("text/plain", "'text/plain'"),
            ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'"),
            ("multipart/form-data; boundary=x", "'multipart/form-data; boundary=x'"),
            ("application/jsonp", "'application/jsonp'"), (None, "no Content-Type")]  # fmt: skip
    with httpx.Client(timeout=30) as c:
        for ctype, got in sent:
            headers = AUTH if ctype is None else {**AUTH, "Content-Type": ctype}
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = c.post(live.base + path, content=body, headers=headers)
                assert (r.status_code, r.json()) == (415, unsupported(got)), ctype
        for ctype in ("application/json", "Application/JSON; charset=utf-8"):
            r = c.post(live.base + "/v1/completions", content=body,
                       headers={**AUTH, "Content-Type": ctype})  # fmt: skip
            assert r.status_code == 200, r.text
    # without a key too: a cross-site form or text/plain "simple request" never reaches the model
    engine = Engine.from_artifact(texty, EngineConfig(num_blocks=8))
    with TestClient(create_app(engine, MODEL)) as c:
        r = c.post("/v1/completions", content=body, headers={"Content-Type": "text/plain"})
        assert (r.status_code, r.json()) == (415, unsupported("'text/plain'"))
        r = c.post("/v1/completions", data={"model": MODEL, "prompt": "hi"})
        assert (r.status_code, r.json()) == (
            415,
            unsupported("'application/x-www-form-urlencoded'"),
        )
        assert c.post("/v1/completions", content=body,
                      headers={"Content-Type": "application/json"}).status_code == 200  # fmt: skip


def test_wrong_method_is_405_naming_the_allowed_one(live):
    r = httpx.get(live.base + "/v1/completions", headers=AUTH, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "Method Not Allowed"


def _streamed(case):
    if isinstance(case.body, dict):
        case.body["stream"] = True
    return case


@pytest.mark.parametrize("mode", ["positive", "streamed", "negative"])
def test_openapi_property_based_no_5xx_and_no_schema_violation(small_engine, mode):
    """schemathesis against the server's own /openapi.json, bounded (60 examples over every
    operation, the same ones each run): valid requests (also all streamed) and invalid ones get
    no 5xx and every status, content type, header, body and SSE event as described; invalid
    data is refused, the key enforced. A schema-valid request may still get a 400 (a prompt
    longer than the context, token ids outside the vocabulary, 5.0 as an integer), so
    positive_data_acceptance is not checked."""
    app = create_app(small_engine, MODEL, api_key=KEY)
    negative = mode == "negative"
    seen: dict[tuple[str, int], int] = {}
    with serving(app) as base:
        schema = schemathesis.openapi.from_url(base + "/openapi.json", headers=AUTH, timeout=30)
        strategy = schema.as_strategy(generation_mode=schemathesis.GenerationMode(
            "negative" if negative else "positive"))  # fmt: skip
        if mode == "streamed":
            strategy = strategy.map(_streamed)

        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=strategy)
        def check(case):
            r = case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance],
                                       timeout=30)  # fmt: skip
            key = (case.operation.label, r.status_code)
            seen[key] = seen.get(key, 0) + 1

        check()
    generating = ("POST /v1/completions", "POST /v1/chat/completions")
    for label in generating:  # the run reached the engine, not only the refusals
        assert seen.get((label, 400 if negative else 200)), seen


def hang_up_while_running(base, body):
    """POST a completion on a raw socket and close it as soon as the engine runs the request
    (no response read): a hang-up at a known point, not a client timeout racing the model."""
    url = httpx.URL(base)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(head.encode() + payload)
        deadline = time.monotonic() + 20
        while scrape(base)[("tqexport_num_requests_running", ())] != 1:
            sock.setblocking(False)
            try:
                assert not sock.recv(1), "the request finished before the client hung up"
            except BlockingIOError:
                pass
            sock.setblocking(True)
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.005)


def test_disconnect_mid_stream_aborts_and_frees_blocks(live):
    abort = ("tqexport_request_success_total", (("finished_reason", "abort"),))
    used = ("tqexport_kv_blocks_used", (("group", "0"),))
    running = ("tqexport_num_requests_running", ())
    before = scrape(live.base)
    assert before[used] == 0 and before[running] == 0
    body = {"model": MODEL, "prompt": IDS, "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", live.base + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            data = [ln for ln in (next(lines) for _ in range(8)) if ln.startswith("data: ")]
            assert len(data) >= 3  # tokens are flowing
            mid = scrape(live.base)
            assert mid[running] == 1 and mid[used] >= 1
    deadline = time.monotonic() + 20
    while True:  # the abort reaches the engine loop within a step
        after = scrape(live.base)
        if after.get(abort, 0) == before.get(abort, 0) + 1 and after[used] == 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after[running] == 0 and after[("tqexport_num_requests_waiting", ())] == 0
    free = ("tqexport_kv_blocks_free", (("group", "0"),))
    assert after[free] == 63  # every block but the null block is back in the pool
    # a client that gives up on a whole (non-streamed) response aborts it too
    hang_up_while_running(live.base, {**body, "stream": False, "max_tokens": 480})
    deadline = time.monotonic() + 20
    while scrape(live.base).get(abort) != before.get(abort, 0) + 2:
        assert time.monotonic() < deadline, scrape(live.base)
        time.sleep(0.05)
    assert scrape(live.base)[used] == 0


#: a server whose steps take at least 10 ms, so the tiny model's 160 tokens outlast the scrape
#: that checks the request is still running when SIGTERM comes (a fast CPU ran them all first)
SERVE = """
import sys, time
from tqexport.runtime.engine import Engine, EngineConfig
from tqexport.serve import serve
step = Engine.step
Engine.step = lambda self: (time.sleep(0.01), step(self))[1]
serve(sys.argv[1], EngineConfig(num_blocks=64), port=0, served_model_name="tiny", grace_seconds=30)
"""


def test_sigterm_finishes_in_flight_requests_and_exits_0(texty):
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(texty)], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        deadline, base = time.monotonic() + 90, None
        while base is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)/v1", line)
            base = m and m[1]
        body = {"model": "tiny", "prompt": IDS, "max_tokens": 160, "temperature": 0,
                "stream": True, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        with (
            httpx.Client(timeout=60) as c,
            c.stream("POST", base + "/v1/completions", json=body) as r,
        ):
            events = r.iter_lines()
            first = next(e for e in events if e.startswith("data: "))
            assert scrape(base)[("tqexport_num_requests_running", ())] == 1
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while True:  # new connections are refused (or reset) while the stream goes on
                try:
                    httpx.get(base + "/health", timeout=1)
                except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                    break
                assert time.monotonic() < deadline, "still accepting after SIGTERM"
                time.sleep(0.05)
            rest = [e for e in events if e.startswith("data: ")]
        chunks = [json.loads(e[6:]) for e in [first] + rest[:-1]]
        assert rest[-1] == "data: [DONE]"
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 160
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_failing_request_fails_alone_and_the_batch_goes_on(live, monkeypatch):
    """The repro: a request with top_p 1e-300 (0 in float32) made sampling raise, and every
    request in its batch got a 503. Now it is a 400 at admission, and a request whose sampling
    does raise (injected) gets its own 500 (whole) or error event (streamed); the requests
    running beside it complete with exactly the tokens they get alone."""
    from tqexport.runtime import executor

    real, calls, running = executor.sample, {666: 0, 667: 0}, []

    def faulty(logits, params, rng):
        if params.seed in calls:
            calls[params.seed] += 1
            if calls[params.seed] == 8:
                running.append(len(live.engine.executor.scheduler.running))
                raise RuntimeError("injected sampling fault")
        return real(logits, params, rng)

    monkeypatch.setattr(executor, "sample", faulty)
    before = scrape(live.base)
    url = live.base + "/v1/completions"
    got, first = {}, [threading.Event() for _ in CONCURRENT]

    def victim(i):
        body = {"model": MODEL, "prompt": CONCURRENT[i], "max_tokens": VICTIM_TOKENS,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        tokens = []
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    first[i].set()
        got[i] = tokens

    def failing(seed, stream):
        body = {"model": MODEL, "prompt": [7, 7, 7], "max_tokens": 32, "temperature": 0,
                "seed": seed, "stream": stream, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(url, json=body, headers=AUTH, timeout=60)
        got[seed] = r.status_code, r.text

    threads = [threading.Thread(target=victim, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in first)  # every victim is generating: the failing ones join
    threads += [threading.Thread(target=failing, args=(666, False)),
                threading.Thread(target=failing, args=(667, True))]  # fmt: skip
    for t in threads[len(CONCURRENT) :]:
        t.start()
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 1.0, "top_p": 1e-300}
    r = httpx.post(live.base + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    error(r, 400, "top_p", message=r"^top_p must be > 0 and <= 1, got 1e-300, which is 0 in fl")
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(len(CONCURRENT))] == [
        live.ref["victim", i][0] for i in range(len(CONCURRENT))
    ]
    assert min(running) >= len(CONCURRENT) + 1  # the victims were in its batch when it failed
    status, text = got[666]
    assert status == 500 and json.loads(text) == {"error": {
        "message": "internal server error while generating this request",
        "type": "server_error", "param": None, "code": None}}  # fmt: skip
    status, text = got[667]
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-2]) == 7
    after = scrape(live.base)
    key = ("tqexport_request_success_total", (("finished_reason", "error"),))
    assert after[key] - before.get(key, 0) == 2
    assert after[("tqexport_kv_blocks_used", (("group", "0"),))] == 0


def test_the_engine_thread_only_steps(live, monkeypatch):
    """The repro: a 7 MiB prompt was tokenized on the engine thread, and a 4-token request
    sent beside it waited 37.6 s. Now prompts are tokenized on worker threads: a small request
    runs its own 4 steps while a big prompt is still being tokenized (held there on purpose),
    and a prompt too long to fit is refused before it is tokenized at all."""
    engine, big = live.engine, "The cat sat. " * 30
    real, threads = engine.encode, []
    entered, release = threading.Event(), threading.Event()

    def encode(prompt, *args, **kw):
        if isinstance(prompt, str):  # token ids (what the engine thread admits) are no work
            threads.append(threading.current_thread().name)
        if prompt == big:
            entered.set()
            assert release.wait(60)
        return real(prompt, *args, **kw)

    monkeypatch.setattr(engine, "encode", encode)
    url, done = live.base + "/v1/completions", {}
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    def send_big():
        done["big"] = httpx.post(url, json={**body, "prompt": big}, headers=AUTH, timeout=90)

    sender = threading.Thread(target=send_big)
    sender.start()
    try:
        assert entered.wait(30)
        steps = engine.executor.steps
        r = httpx.post(url, json={**body, "prompt": "hi"}, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert engine.executor.steps - steps == 4  # its own 4 steps: it waited for nothing
        assert "big" not in done
        r = httpx.post(url, json={**body, "prompt": "x" * 2049}, headers=AUTH, timeout=30)
        error(r, 400, message=r"^a prompt of 2049 characters cannot fit the model's position "
              r"limit of 512 tokens: one token stands for at most 4 characters")  # fmt: skip
    finally:
        release.set()
        sender.join(60)
    assert done["big"].status_code == 200, done["big"].text
    assert len(threads) == 2 and all(t.startswith("tqexport-prepare") for t in threads), threads


def test_large_chat_bodies_never_delay_a_short_request(live, monkeypatch):
    """The repro: concurrent 7.5 MB chat bodies took every tokenizing worker and a short
    request waited 10-22 s. Large prompts now queue on their own worker: with more of them
    held there than there are workers, a short request still runs at once."""
    from tqexport.serve import loop as serve_loop

    monkeypatch.setattr(serve_loop, "LARGE_PROMPT_CHARS", 1000)  # the body limit here: 64 KiB
    engine = live.engine
    real, entered, release = engine.prompt_ids, threading.Semaphore(0), threading.Event()

    def prompt_ids(prompt, *args, **kw):
        if isinstance(prompt, list) and len(prompt) == 200:
            entered.release()
            assert release.wait(60)
        return real(prompt, *args, **kw)

    monkeypatch.setattr(engine, "prompt_ids", prompt_ids)
    big = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x" * 20}] * 200,
    }

    def send_big():
        httpx.post(live.base + "/v1/chat/completions", json=big, headers=AUTH, timeout=90)

    senders = [threading.Thread(target=send_big) for _ in range(serve_loop.PREPARE_WORKERS + 1)]
    for t in senders:
        t.start()
    try:
        assert entered.acquire(timeout=30)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(live.base + "/v1/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert not entered.acquire(timeout=0.5)  # the large ones wait for each other only
    finally:
        release.set()
        for t in senders:
            t.join(90)


def test_too_many_chat_messages_are_a_400_before_any_work(small_engine, monkeypatch):
    from tqexport.serve.protocol import MAX_MESSAGES

    monkeypatch.setattr(small_engine, "prompt_ids", pytest.fail)
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}  # fmt: skip
    with TestClient(create_app(small_engine, MODEL)) as c:
        r = c.post("/v1/chat/completions", json=body)
    error(r, 400, "messages", "too_many_messages",
          f"^messages has {MAX_MESSAGES + 1} items, more than {MAX_MESSAGES}; send a shorter "
          "conversation$")  # fmt: skip


def test_a_template_past_its_time_limit_leaves_nothing_to_report(monkeypatch):
    """Its generator is closed untimed: closed later, while another render traces the thread,
    it raised TemplateLimit where nothing catches it ("Exception ignored in: <generator>")."""
    import gc

    from tqexport.runtime.text import TemplateLimit, render_chat_template

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    slow = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    messages = [{"role": "user", "content": "x"}] * 200_000
    for _ in range(3):
        with pytest.raises(TemplateLimit, match="took longer than 0.05 s"):
            render_chat_template(slow, {"messages": messages}, seconds=0.05)
        assert render_chat_template("{{ 1 }}", {}) == "1"  # traced while the old one goes
        gc.collect()
    assert unraisable == []
