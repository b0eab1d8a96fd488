"""OpenAI-compatible server: the official `openai` client against a real uvicorn server on 127.0.0.1."""
import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from k3.data.chat import render, stop_token_ids
from k3.serve.engine import Engine
from k3.model.sampling import SamplingParams
from k3.serve.server import create_app, load_for_serving

MODEL = "k3-test"


def serve(engine: Engine, **kw):
    return serve_app(create_app(engine, MODEL, **kw))


@contextlib.contextmanager
def serve_app(app):
    """A uvicorn server in a thread on a free 127.0.0.1 port; yields the base URL; always shut down."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server_url(tiny_model, serve_tokenizer):
    with serve(Engine(tiny_model, serve_tokenizer, max_batch=4, max_queue=8, prefill_chunk=16)) as url:
        yield url


def _greedy(model, tok, ids, n, **kw) -> tuple[list[int], str]:
    r = Engine(model, tok).generate([ids], SamplingParams(max_tokens=n, temperature=0, **kw))[0]
    return r.output_ids, r.text


# ---------------------------------------------------------------------- the happy paths
def test_models_and_health(server_url, tiny_model):
    models = client(server_url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(server_url).models.retrieve(MODEL).id == MODEL
    h = httpx.get(server_url + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["max_batch"] == 4


def test_completion_text_and_usage(server_url, tiny_model, serve_tokenizer):
    tok = serve_tokenizer
    ids = tok.encode("def main():")
    want_ids, want_text = _greedy(tiny_model, tok, ids, 12, skip_special_tokens=True)  # the server's default
    r = client(server_url).completions.create(model=MODEL, prompt="def main():", max_tokens=12, temperature=0)
    assert r.choices[0].text == want_text
    assert r.choices[0].finish_reason == ("stop" if len(want_ids) < 12 else "length")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want_ids)
    assert r.usage.total_tokens == len(ids) + len(want_ids)
    # token-id prompts, n choices with seeds, echo
    r2 = client(server_url).completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=5, temperature=0.9,
                                               seed=11, n=2, echo=True)
    assert [c.index for c in r2.choices] == [0, 1, 2, 3]
    assert r2.choices[0].text.startswith("def main():")
    assert r2.usage.prompt_tokens == len(ids) + 3
    r3 = client(server_url).completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=5, temperature=0.9,
                                               seed=11, n=2, echo=True)
    assert [c.text for c in r3.choices] == [c.text for c in r2.choices]  # seeded: reproducible
    # a text prompt echoes as sent: an empty one is fed to the model as <|eos|>, which is not the caller's text
    r4 = client(server_url).completions.create(model=MODEL, prompt=["", "x = 1"], max_tokens=3, temperature=0,
                                               echo=True)
    plain = client(server_url).completions.create(model=MODEL, prompt=["", "x = 1"], max_tokens=3, temperature=0)
    assert [c.text for c in r4.choices] == [plain.choices[0].text, "x = 1" + plain.choices[1].text]


def test_chat_completion_and_usage(server_url, tiny_model, serve_tokenizer):
    tok = serve_tokenizer
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Say hi."}]
    r = client(server_url).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    prompt = render(messages, tok)
    assert r.usage.prompt_tokens == len(prompt)
    out = Engine(tiny_model, tok).generate([prompt], SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=stop_token_ids(tok)))[0]
    assert r.usage.completion_tokens == len(out.output_ids)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    # tools and a tool result are accepted and rendered
    r = client(server_url).chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0,
        messages=messages + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "hi", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "hello"}],
        tools=[{"type": "function", "function": {"name": "hi", "parameters": {"type": "object"}}}])
    assert r.usage.completion_tokens >= 1


def test_streaming_completion_and_chat(server_url, tiny_model, serve_tokenizer):
    c = client(server_url)
    full = c.completions.create(model=MODEL, prompt="import os\n", max_tokens=15, temperature=0)
    chunks = list(c.completions.create(model=MODEL, prompt="import os\n", max_tokens=15, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len(chunks) > 3  # really streamed, token by token

    messages = [{"role": "user", "content": "hello"}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    parts = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    # the raw wire format: SSE `data:` lines, ending in [DONE]
    with httpx.stream("POST", server_url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"
    # with include_usage, every chunk but the last carries "usage": null, as OpenAI's do
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        with httpx.stream("POST", server_url + path, timeout=30,
                          json={"model": MODEL, "max_tokens": 4, "stream": True, **body,
                                "stream_options": {"include_usage": True}}) as resp:
            data = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln and ln != "data: [DONE]"]
        assert all("usage" in d and d["usage"] is None for d in data[:-1]), path
        assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------------- errors
def _error(resp: httpx.Response, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_bad_requests_get_openai_errors(server_url, tiny_model, serve_tokenizer):
    http = httpx.Client(base_url=server_url, timeout=30)
    post = lambda path, body: http.post(path, json=body)  # noqa: E731
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    _error(r, 400, code="invalid_json")
    _error(post("/v1/completions", [1, 2]), 400, code="invalid_json")
    _error(post("/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model", "model_not_found")
    _error(post("/v1/completions", {"prompt": "x"}), 400, "model")
    _error(post("/v1/completions", {"model": MODEL}), 400, "prompt")
    cases = [("temperature", -0.5), ("temperature", 2.5), ("temperature", "hot"), ("max_tokens", 0),
             ("max_tokens", 1.5), ("top_p", 0), ("top_p", 1.2), ("n", 0), ("top_k", -2), ("seed", "x"),
             ("stop", ["a", "b", "c", "d", "e"]), ("presence_penalty", 3), ("stream", "yes")]
    for field, value in cases:
        _error(post("/v1/completions", {"model": MODEL, "prompt": "x", field: value}), 400, field)
        _error(post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                             field: value}), 400, field)
    _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}), 400, "frobnicate")
    # logprobs: completions take 0..20 alternatives, chat a boolean and top_logprobs 0..20 (with logprobs true);
    # max_tokens 0 only with echo (scoring the prompt)
    for value in (21, -1, True, "3", 2.5):
        _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": value}), 400, "logprobs")
    chat = lambda **kw: post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],  # noqa: E731
                                                     "max_tokens": 2, **kw})
    for value in ("yes", 1, [True]):
        _error(chat(logprobs=value), 400, "logprobs")
    for value in (21, -1, "2", True):
        _error(chat(logprobs=True, top_logprobs=value), 400, "top_logprobs")
    _error(chat(top_logprobs=3), 400, "top_logprobs")  # as OpenAI: top_logprobs needs logprobs
    _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1, "echo": True}), 400, "max_tokens")
    _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "echo": "yes", "logprobs": 1}), 400, "echo")
    _error(post("/v1/completions", {"model": MODEL, "prompt": [0, 99999]}), 400, "prompt")
    _error(post("/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
    _error(post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x", "content": "y"}]}), 400, "messages")
    ctx = tiny_model.config.max_context
    long_prompt = list(range(20, 40)) * (ctx // 20 + 1)
    _error(post("/v1/completions", {"model": MODEL, "prompt": long_prompt}), 400, "prompt", "context_length_exceeded")
    _error(post("/v1/completions", {"model": MODEL, "prompt": [20] * (ctx - 5), "max_tokens": 10}), 400, "prompt",
           "context_length_exceeded")
    long_chat = [{"role": "user", "content": "word " * ctx}]
    _error(post("/v1/chat/completions", {"model": MODEL, "messages": long_chat}), 400, "messages",
           "context_length_exceeded")
    _error(http.get("/v1/nothing-here"), 404)
    # bodies that once gave 500s: a lone surrogate, number literals too big for a float or for int(), a
    # request that can never fit the engine (4 running + 8 queued), fields of the wrong type
    raw = lambda path, text: http.post(path, content=text.encode(), headers={"content-type": "application/json"})  # noqa: E731
    _error(raw("/v1/completions", f'{{"model": "{MODEL}", "prompt": "a\\ud800b"}}'), 400, "prompt")
    _error(raw("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", '
               f'"content": "\\ud800"}}]}}'), 400, "messages")
    _error(raw("/v1/completions", f'{{"model": "{MODEL}", "prompt": "x", "temperature": 1{"0" * 400}}}'),
           400, "temperature")
    _error(raw("/v1/completions", f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 1{"0" * 5000}}}'),
           400, code="invalid_json")
    _error(post("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 7}), 400, "n")
    _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True,
                                    "stream_options": {"include_usage": "yes"}}), 400, "include_usage")
    _error(post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 0, "max_completion_tokens": 1}), 400, "max_tokens")
    # JSON nested thousands deep (a RecursionError in the parser gave a 500)
    _error(raw("/v1/completions", "[" * 5000 + "]" * 5000), 400, code="invalid_json")
    # text that cannot fit is refused from its size, before it is tokenized (4 MB took seconds on the event loop);
    # the bound is exact: the largest text that might fit is still tokenized and measured
    from k3.serve.server import _check_text_fits
    tok = serve_tokenizer
    err = _error(post("/v1/completions", {"model": MODEL, "prompt": "x" * (ctx * tok.max_token_bytes)}), 400,
                 "prompt", "context_length_exceeded")
    assert "bytes of text, at least" in err["message"]
    err = _error(post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "y" * (ctx * tok.max_token_bytes)}]}]}), 400,
        "messages", "context_length_exceeded")
    assert "bytes of text, at least" in err["message"]
    _check_text_fits((ctx - 1) * tok.max_token_bytes, tok, ctx, "prompt")  # might fit: left to the tokenizer
    # tools without a function name, and a bad reasoning_content named as such
    _error(post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "tools": [{"type": "function"}]}), 400, "tools")
    err = _error(post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "content": "a", "reasoning_content": 5}, {"role": "user", "content": "x"}]}), 400)
    assert "messages[0].reasoning_content must be" in err["message"]
    # the official client maps them to its exception types
    with pytest.raises(openai.NotFoundError):
        client(server_url).completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client(server_url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                   temperature=-1)
    assert e.value.body["param"] == "temperature"
    assert http.get("/health").json()["status"] == "ok"  # still serving
    # what OpenAI refuses: a tool message without tool_call_id, tool-call arguments that are not JSON
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = lambda args, tool: [{"role": "user", "content": "x"},  # noqa: E731
                                {"role": "assistant", "content": None, "tool_calls": [
                                    {**call, "function": {"name": "f", "arguments": args}}]}, tool]
    err = _error(post("/v1/chat/completions", {"model": MODEL, "messages": turns(
        "{}", {"role": "tool", "content": "out"})}), 400, "messages")
    assert "messages[2].tool_call_id" in err["message"]
    for args in ("{not json", "[" * 5000, '{"a": 1'):
        err = _error(post("/v1/chat/completions", {"model": MODEL, "messages": turns(
            args, {"role": "tool", "tool_call_id": "c1", "content": "out"})}), 400, "messages")
        assert "messages[1].tool_calls[0].function.arguments" in err["message"]
    # the edges of the new parameters answer 200, never a 5xx
    ok = [post("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 20, "echo": True, "max_tokens": 0}),
          post("/v1/completions", {"model": MODEL, "prompt": [5], "logprobs": 0, "echo": True, "max_tokens": 0,
                                   "stream": True}),
          post("/v1/completions", {"model": MODEL, "prompt": ["", "y"], "logprobs": 2, "echo": True, "n": 2,
                                   "max_tokens": 1, "temperature": 1e-9}),
          chat(logprobs=True, top_logprobs=20, stream=True), chat(logprobs=False, top_logprobs=0),
          chat(logprobs=True, n=3, temperature=2, repetition_penalty=1e-4),
          post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": turns(
              {"a": 1}, {"role": "tool", "tool_call_id": "c1", "content": "out"})})]
    assert [r.status_code for r in ok] == [200] * len(ok), [r.text for r in ok]
    http.close()


def test_overload_gets_429_not_a_hang(tiny_model, serve_tokenizer):
    engine = Engine(tiny_model, serve_tokenizer, max_batch=1, max_queue=1)
    with serve(engine) as url:
        def one(_):
            return httpx.post(url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True})

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = [r.status_code for r in pool.map(one, range(6))]
        assert time.monotonic() - t0 < 60
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        r = one(0)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        small = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert httpx.post(url + "/v1/completions", json=small).status_code == 200
        with pytest.raises(openai.RateLimitError):  # what the client sees when it is full
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futs = [pool.submit(client(url).completions.create, model=MODEL, prompt="x", max_tokens=40,
                                    extra_body={"ignore_eos": True}) for _ in range(4)]
                for f in futs:
                    f.result()
        assert httpx.get(url + "/health").json()["status"] == "ok"


def _wait_idle(url: str, timeout: float = 10.0) -> dict:
    """Until nothing runs. The disconnect test relies on the limit being short of a 1500-token generation's natural
    end: a slot freed only by finishing its generation must fail it, so the limit is not raised for slow hosts."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health").json()
        if h["running"] + h["waiting"] + h["prefilling"] == 0:
            return h
        assert time.monotonic() < deadline, f"the server was still busy after {timeout:.0f} s: {h}"
        time.sleep(0.02)


def test_client_disconnect_frees_the_slot(tiny_model, serve_tokenizer):
    engine = Engine(tiny_model, serve_tokenizer, max_batch=1, max_queue=0)
    with serve(engine) as url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1500, "ignore_eos": True}
        # a stream closed after its first chunk
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())
        h = _wait_idle(url)
        assert h["running"] == 0, h
        # a plain request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        h = _wait_idle(url)
        assert h["running"] == 0, h
        # the one slot is free again (max_queue = 0: a busy slot would be 429); a loaded machine may have submitted
        # the abandoned request only after the client gave up, so its cancellation gets a few seconds
        deadline = time.monotonic() + 10
        while (ok := httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)).status_code \
                == 429 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ok.status_code == 200
    assert engine.steps < 1500


class FlakyEngine(Engine):
    """Fails its next decode step, as an unexpected bug inside the model would."""

    fail_next = False

    def _decode(self, done):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        super()._decode(done)


def test_engine_failure_stopped_worker_and_api_key(tiny_model, serve_tokenizer):
    engine = FlakyEngine(tiny_model, serve_tokenizer)
    app = create_app(engine, MODEL, api_key="sekrit")
    with serve_app(app) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=30)
        assert good.models.list().data[0].id == MODEL
        # a non-ASCII key is a 401, not a 500; the scheme's case does not matter (RFC 7235)
        latin = {"Authorization": "Bearer s\xe9krit".encode("latin-1")}
        assert httpx.get(url + "/v1/models", headers=latin).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "bearer sekrit"}).status_code == 200
        auth = {"Authorization": "Bearer sekrit"}
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "ignore_eos": True}
        engine.fail_next = True
        err = _error(httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30), 500)
        assert "boom" in err["message"] and err["type"] == "server_error"
        engine.fail_next = True
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=auth,
                          timeout=30) as resp:
            lines = [ln for ln in resp.iter_lines() if ln]
        assert any('"error"' in ln and "boom" in ln for ln in lines) and lines[-1] == "data: [DONE]"
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=5).usage.completion_tokens >= 1
        app.state.worker.stop()
        assert httpx.get(url + "/health").status_code == 503
        err = _error(httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30), 503)
        assert err["code"] == "engine_unavailable"


# ---------------------------------------------------------------------- start-up checks and `k3 serve`
def test_startup_rejects_mismatched_checkpoint_and_tokenizer(tiny_checkpoint, tmp_path, serve_tokenizer, capsys):
    from k3.cli import main
    from k3.data.tokenizer import train_tokenizer
    from k3.train.checkpoint import latest_checkpoint

    model, tok, manifest = load_for_serving(tiny_checkpoint)
    assert tok.fingerprint == serve_tokenizer.fingerprint and model.config.vocab_size == 512

    other = train_tokenizer(["some text for another tokenizer " * 50, "more words here " * 40], 300,
                            path=tmp_path / "other", allow_short=True)
    with pytest.raises(ValueError, match="vocab_size is 512"):
        load_for_serving(tiny_checkpoint, other.path)
    assert main(["serve", "--ckpt", str(tiny_checkpoint), "--tokenizer", str(other.path), "--port", "1"]) == 2
    assert "pass the tokenizer the model was trained with" in capsys.readouterr().err
    with socket.socket() as busy:  # a port another server holds: one line, exit 2
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--ckpt", str(tiny_checkpoint), "--port", str(port)]) == 2
        assert f"127.0.0.1:{port} is already in use" in capsys.readouterr().err

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**manifest["config"], "d_model": 128}))
    with pytest.raises(ValueError, match="'d_model' is 64 in the checkpoint but 128"):
        load_for_serving(tiny_checkpoint, config_path=cfg)
    # a partial file checks the fields it names; the rest are the checkpoint's
    cfg.write_text(json.dumps({"d_model": manifest["config"]["d_model"], "attnres": manifest["config"]["attnres"]}))
    load_for_serving(tiny_checkpoint, config_path=cfg)
    cfg.write_text(json.dumps({"n_layers": manifest["config"]["n_layers"] + 1}))
    with pytest.raises(ValueError, match="'n_layers'"):
        load_for_serving(tiny_checkpoint, config_path=cfg)
    # a manifest whose config does not fit its weights
    step = latest_checkpoint(tiny_checkpoint)
    bad_root = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad_root)
    mpath = bad_root / step.name / "manifest.json"
    m = json.loads(mpath.read_text())
    m["config"]["mla_kv_lora_rank"] = 16
    mpath.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="kv_norm.weight.* has shape"):
        load_for_serving(bad_root)
    # a tokenizer of the right size that is not the one the training data was made with
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.json").write_text(json.dumps({"tokenizer_hash": "0" * 64}))
    m = json.loads((tiny_checkpoint / step.name / "manifest.json").read_text())
    m["data"]["data_dir"] = str(data)
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_checkpoint, swapped)
    (swapped / step.name / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="not the one the model's training data"):
        load_for_serving(swapped)


def test_k3_serve_process(tiny_checkpoint):
    """`k3 serve` as a real process: health, the openai client, clean shutdown on SIGINT."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(3):  # a free port found here may be taken by another process before k3 serve binds it
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--ckpt", str(tiny_checkpoint), "--port",
                                 str(port), "--max-batch", "2", "--threads", "1", "--log-level", "warning",
                                 "--model-name", MODEL], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        if attempt < 2 and proc.poll() == 2 and "in use" in proc.communicate()[1]:
            continue
        break
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "k3 serve did not come up"
            time.sleep(0.2)
        r = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(2)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{port}/v1" in err


def test_a_non_ascii_api_key_matches_its_utf8_bytes(tiny_model, serve_tokenizer):
    with serve(Engine(tiny_model, serve_tokenizer, max_batch=1, max_queue=1), api_key="s\xe9krit") as url:
        utf8 = {"Authorization": "Bearer s\xe9krit".encode("utf-8")}  # what a UTF-8 shell's curl sends
        latin = {"Authorization": "Bearer s\xe9krit".encode("latin-1")}
        assert httpx.get(url + "/v1/models", headers=utf8).status_code == 200
        assert httpx.get(url + "/v1/models", headers=latin).status_code == 401


def _scripted_model(make, tok):
    """A tiny model whose greedy choice after token t is SCRIPT[t] (else `<|think|>`), so the reply is
    <|think|> a <|/think|> b c <|eos|> whatever the weights say. The engine's prefill and decode both run
    `hidden_states` then `head`: the first records the last input token, a hook on the second adds a large
    logit. One request at a time (the engine must run with max_batch=1)."""
    think, end_think, eos = (tok.token_to_id(t) for t in ("<|think|>", "<|/think|>", "<|eos|>"))
    a, b, c = (tok.encode(w)[0] for w in ("def", "class", "return"))
    script = {think: a, a: end_think, end_think: b, b: c, c: eos}
    model = make()
    last = []
    hidden_states = model.hidden_states

    def recording(ids, *args, **kw):
        assert ids.shape[0] == 1, "one request at a time"
        last[:] = [int(ids[0, -1])]
        return hidden_states(ids, *args, **kw)

    def hook(module, args, out):
        out = out.clone()
        out[..., script.get(last[0], think)] += 100.0
        return out

    model.hidden_states = recording
    model.head.register_forward_hook(hook)
    return model, [tok.decode([x]) for x in (a, b, c)]


def test_special_tokens_in_completions_and_chat(tiny_model_factory, serve_tokenizer):
    """Completions leave special tokens out of the text by default (vLLM's default) and keep them with
    skip_special_tokens false; a chat reply is parsed with its markers whatever the request says."""
    tok = serve_tokenizer
    model, (a, b, c) = _scripted_model(tiny_model_factory, tok)
    with serve(Engine(model, tok, max_batch=1, max_queue=4, prefill_chunk=16)) as url:
        kw = dict(model=MODEL, prompt="x", max_tokens=8, temperature=0)
        r = client(url).completions.create(**kw)
        assert r.choices[0].text == a + b + c and r.choices[0].finish_reason == "stop"
        r = client(url).completions.create(**kw, extra_body={"skip_special_tokens": False})
        assert r.choices[0].text == "<|think|>" + a + "<|/think|>" + b + c
        for skip in (True, False):  # a stop string naming a special token stops there, skipped from the text or not
            r = client(url).completions.create(**kw, stop=["<|/think|>"], extra_body={"skip_special_tokens": skip})
            assert r.choices[0].text == ("" if skip else "<|think|>") + a and r.choices[0].finish_reason == "stop"
            assert r.usage.completion_tokens == 3
        for skip in (True, False):
            r = client(url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                extra_body={"skip_special_tokens": skip})
            m = r.choices[0].message
            assert m.content == b + c and m.model_extra.get("reasoning_content") == a, (skip, m)


def _sequence_model(make, tok, parts):
    """A tiny model that replies with `parts` (special tokens by name, the rest as text), one token per head call,
    whatever the prompt; the last token repeats. One request at a time (max_batch=1)."""
    ids = []
    for p in parts:
        ids += [tok.token_to_id(p)] if p.startswith("<|") else tok.encode(p, allow_special=False)
    model, calls = make(), [0]

    def hook(module, args, out):
        out = out.clone()
        out[..., ids[min(calls[0], len(ids) - 1)]] += 100.0
        calls[0] += 1
        return out

    model.head.register_forward_hook(hook)
    return model, calls


@pytest.mark.parametrize("stop", [None, "thin", "<", "|", "end"])
def test_chat_stop_strings_never_match_inside_markers(tiny_model_factory, serve_tokenizer, stop):
    """The chat route keeps the marker tokens in the text it parses; a stop string that occurs in their markup
    ("thin" in <|think|>) cut the reply there, losing the reasoning and the answer."""
    parts = ["<|think|>", "plan", "<|/think|>", "hi there", "<|end|>"]
    model, calls = _sequence_model(tiny_model_factory, serve_tokenizer, parts)
    with serve(Engine(model, serve_tokenizer, max_batch=1, max_queue=4)) as url:
        for stream in (False, True):
            calls[0] = 0
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=16, temperature=0)
            if stop:
                kw["stop"] = stop
            if not stream:
                m = client(url).chat.completions.create(**kw).choices[0].message
                content, reasoning = m.content, m.model_extra.get("reasoning_content")
            else:
                content, reasoning = "", ""
                for ch in client(url).chat.completions.create(**kw, stream=True):
                    d = ch.choices[0].delta
                    content += d.content or ""
                    reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            assert (content, reasoning) == ("hi there", "plan"), (stream, stop, content, reasoning)
        # a stop string in the visible text still stops there, in the reasoning as in the answer
        calls[0] = 0
        m = client(url).chat.completions.create(**dict(kw, stop="there")).choices[0].message
        assert (m.content, m.model_extra.get("reasoning_content")) == ("hi ", "plan")
        calls[0] = 0
        r = client(url).completions.create(model=MODEL, prompt="q", max_tokens=16, temperature=0, stop="thin",
                                           extra_body={"skip_special_tokens": False})
        # kept markers do not match either (completions do not end at <|end|>: it repeats to max_tokens)
        assert r.choices[0].text.startswith("<|think|>plan<|/think|>hi there<|end|><|end|>")
        assert r.choices[0].finish_reason == "length"


def test_chat_tool_call_without_text_has_null_content(tiny_model_factory, serve_tokenizer):
    parts = ["<|tool_call|>", '{"name": "f", "arguments": {"x": 1}}', "<|/tool_call|>", "<|end|>"]
    model, _ = _sequence_model(tiny_model_factory, serve_tokenizer, parts)
    with serve(Engine(model, serve_tokenizer, max_batch=1, max_queue=4)) as url:
        r = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                                max_tokens=32, temperature=0)
    m = r.choices[0].message
    assert m.content is None and m.tool_calls[0].function.name == "f" and r.choices[0].finish_reason == "tool_calls"


def test_chat_reply_cut_by_max_tokens_is_length_even_after_a_tool_call(tiny_model_factory, serve_tokenizer):
    """A reply whose second tool call max_tokens cut off finishes with "length", as OpenAI reports it, streamed or
    not: it said "tool_calls", so a client could not tell the reply was truncated. Ended by itself: "tool_calls"."""
    first = ["<|tool_call|>", '{"name": "f", "arguments": {}}', "<|/tool_call|>"]
    parts = first + ["<|tool_call|>", '{"name": "g", "arguments": {}}', "<|/tool_call|>", "<|end|>"]
    model, calls = _sequence_model(tiny_model_factory, serve_tokenizer, parts)
    n_first = 2 + len(serve_tokenizer.encode(first[1], allow_special=False))
    with serve(Engine(model, serve_tokenizer, max_batch=1, max_queue=4)) as url:
        for max_tokens, want, n_calls in ((n_first + 3, "length", 1), (64, "tool_calls", 2)):
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=max_tokens, temperature=0)
            calls[0] = 0
            r = client(url).chat.completions.create(**kw)
            assert (r.choices[0].finish_reason, len(r.choices[0].message.tool_calls)) == (want, n_calls)
            calls[0] = 0
            ends = [ch.choices[0].finish_reason for ch in client(url).chat.completions.create(**kw, stream=True)
                    if ch.choices and ch.choices[0].finish_reason]
            assert ends == [want]


# ---------------------------------------------------------------------- logprobs, prefix cache, metrics
def _direct_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)  # [T, V]


def test_completion_logprobs_and_echo_scoring(server_url, tiny_model, serve_tokenizer):
    c = client(server_url)
    ids = serve_tokenizer.encode("def main():\n    return")
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n_out = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_out
    out_ids = _greedy(tiny_model, serve_tokenizer, ids, 6, skip_special_tokens=True)[0]
    want = _direct_logprobs(tiny_model, ids + out_ids)
    for t, (tok_id, got) in enumerate(zip(out_ids, lp.token_logprobs)):
        assert abs(got - want[len(ids) - 1 + t, tok_id].item()) < 1e-4
    assert all(3 <= len(top) <= 4 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    # echo + max_tokens 0: the prompt scored, nothing generated (what a teacher needs)
    s = c.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=1)
    lp = s.choices[0].logprobs
    assert s.usage.completion_tokens == 0 and s.choices[0].finish_reason == "length"
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _direct_logprobs(tiny_model, ids)
    assert all(abs(lp.token_logprobs[t] - want[t - 1, ids[t]].item()) < 1e-4 for t in range(1, len(ids)))
    assert s.choices[0].text == serve_tokenizer.decode(ids)
    # echo with generation: the prompt's entries, then the completion's; streamed chunks add up to the same
    e = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True, logprobs=2, temperature=0)
    assert len(e.choices[0].logprobs.tokens) == len(ids) + e.usage.completion_tokens
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True, logprobs=2, temperature=0,
                                       stream=True))
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == e.choices[0].logprobs.token_logprobs
    assert [x for ch in chunks for x in ch.choices[0].logprobs.tokens] == e.choices[0].logprobs.tokens
    assert "".join(ch.choices[0].text for ch in chunks) == e.choices[0].text


def test_chat_logprobs_streamed_and_not(server_url, tiny_model, serve_tokenizer):
    c = client(server_url)
    messages = [{"role": "user", "content": "hello there"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.8, seed=5,
                                  logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    prompt = render(messages, serve_tokenizer)
    req = Engine(tiny_model, serve_tokenizer).generate([prompt], SamplingParams(
        max_tokens=8, temperature=0.8, seed=5, stop_token_ids=stop_token_ids(serve_tokenizer)))[0]
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt + req.output_ids]))[0].double()
    want = torch.log_softmax(logits / 0.8, -1)  # after temperature
    for t, (tok_id, entry) in enumerate(zip(req.output_ids, content)):
        assert abs(entry.logprob - want[len(prompt) - 1 + t, tok_id].item()) < 1e-4
        assert len(entry.top_logprobs) == 4
        try:
            assert bytes(entry.bytes).decode("utf-8") == entry.token
        except UnicodeDecodeError:  # part of a character: its bytes spelled out
            assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
    # the raw bytes of the tokens add up to the reply's bytes (a token may hold part of a UTF-8 character)
    text = serve_tokenizer.decode(req.output_ids, skip_special=False)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == text
    parts = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.8, seed=5,
                                           logprobs=True, top_logprobs=4, stream=True))
    streamed = [e for p in parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_prefix_cache_through_the_server_and_metrics(tiny_model, serve_tokenizer):
    engine = Engine(tiny_model, serve_tokenizer, max_batch=4, prefill_chunk=32, prefix_block=16,
                    prefix_cache_bytes=1 << 24)
    with serve(engine) as url:
        c = client(url)
        history = [{"role": "system", "content": "You are a careful assistant. " * 8},
                   {"role": "user", "content": "first question"}]
        first = c.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                    {"role": "user", "content": "and a second one"}]
        second = c.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        ref = Engine(tiny_model, serve_tokenizer).generate([render(history, serve_tokenizer)], SamplingParams(
            max_tokens=4, temperature=0, stop_token_ids=stop_token_ids(serve_tokenizer)))[0]
        assert second.usage.completion_tokens == len(ref.output_ids)
        text = httpx.get(url + "/metrics").text
        metrics = dict(line.split("{")[0:1] + line.rsplit(" ", 1)[1:] for line in text.splitlines()
                       if not line.startswith("#"))
        assert float(metrics["k3_prefix_cache_hits_total"]) >= 1
        assert float(metrics["k3_prefix_cache_tokens_reused_total"]) >= first.usage.prompt_tokens
        assert 0 < float(metrics["k3_prefix_cache_bytes"]) <= 1 << 24
        assert httpx.get(url + "/health").json()["prefix_cache"]["hits"] >= 1


def test_chat_in_kimi_k3_format(tiny_model_factory, serve_tokenizer):
    """--chat-format kimi-k3: the reply's think, response and tools elements come back as reasoning_content,
    content and tool_calls, streamed or not, and <|end_of_msg|> ends it."""
    parts = ["plan", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "hi there", "<|close|>",
             "response", "<|sep|>", "<|open|>", "tools", "<|sep|>", "<|open|>", 'call tool="f" index="1"', "<|sep|>",
             "<|open|>", 'argument key="x" type="number"', "<|sep|>", "1", "<|close|>", "argument", "<|sep|>",
             "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>",
             "<|end_of_msg|>", "never"]
    model, calls = _sequence_model(tiny_model_factory, serve_tokenizer, parts)
    with serve(Engine(model, serve_tokenizer, max_batch=1, max_queue=4), chat_format_name="kimi-k3") as url:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=200, temperature=0)
        r = client(url).chat.completions.create(**kw)
        m = r.choices[0].message
        assert (m.content, m.model_extra.get("reasoning_content")) == ("hi there", "plan")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("f", {"x": 1})]
        assert r.choices[0].finish_reason == "tool_calls"
        calls[0] = 0
        content, reasoning, names = "", "", []
        for ch in client(url).chat.completions.create(**kw, stream=True):
            d = ch.choices[0].delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            names += [c.function.name for c in d.tool_calls or []]
        assert (content, reasoning, names) == ("hi there", "plan", ["f"])
