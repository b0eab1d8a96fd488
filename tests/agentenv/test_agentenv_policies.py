import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k3.agentenv.actions import Action
from k3.agentenv.dialects import make_dialect, make_variant, parse_patch
from k3.agentenv.policies import (CallablePolicy, EpisodeInfo, OpenAIChatPolicy, PolicyError, TextPolicy,
                                  make_policy)
from k3.agentenv.rollout import EpisodeConfig, run_episode
from k3.agentenv.tasks import load_task, tasks_root


class FakeServer:
    """A tiny OpenAI-compatible endpoint on 127.0.0.1 that replays scripted replies."""

    def __init__(self, replies, models=None, get_status=200):
        self.replies, self.requests = list(replies), []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # GET /v1/models: `models` listed, or 404 (a server without the route) when None
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization")})
                code = get_status if models is not None else 404
                data = json.dumps({"object": "list", "data": [m if isinstance(m, dict) else {"id": m, "object": "model"}
                                                              for m in models or ()]})
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body,
                                       "auth": self.headers.get("Authorization")})
                status, payload = outer.replies.pop(0) if outer.replies else (200, {"choices": [
                    {"message": {"role": "assistant", "content": ""}}]})
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def msg(content=None, tool_calls=None):
    return (200, {"choices": [{"message": {"role": "assistant", "content": content,
                                           **({"tool_calls": tool_calls} if tool_calls else {})}}]})


def test_http_policy_request_and_reply():
    srv = FakeServer([(500, {"error": "busy"}), msg("hello"), (400, {"error": "bad request"}),
                      (200, b"not json"), (200, b"not json"), (200, b"not json")])
    try:
        p = OpenAIChatPolicy(srv.url, "k3-tiny", api_key="sk-test", retries=1)
        assert p.act([{"role": "user", "content": "hi"}]) == "hello"  # retried after the 500
        req = srv.requests[-1]
        assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
        assert req["body"]["model"] == "k3-tiny" and req["body"]["messages"][0]["content"] == "hi"
        with pytest.raises(PolicyError, match="HTTP 400"):
            p.act([{"role": "user", "content": "hi"}])
        with pytest.raises(PolicyError, match="failed"):
            p.act([{"role": "user", "content": "hi"}])
    finally:
        srv.close()
    with pytest.raises(ValueError, match="http://"):
        OpenAIChatPolicy("127.0.0.1:8000", "m")


def test_native_tool_calls_are_rendered_into_the_dialect():
    d = make_dialect(make_variant("claude"))
    srv = FakeServer([msg(None, [{"id": "1", "type": "function", "function": {
        "name": "Bash", "arguments": json.dumps({"command": "ls", "timeout": 2000})}}])])
    try:
        p = OpenAIChatPolicy(srv.url, "m")
        p.begin_episode(EpisodeInfo("t", "files", 0, d))
        assert d.parse(p.act([{"role": "user", "content": "x"}])) == [Action("run", {"command": "ls", "timeout": 2.0})]
    finally:
        srv.close()


def test_native_patch_calls_and_object_arguments_are_rendered_into_the_dialect():
    # a server that parses tool calls itself may send apply_patch natively, and its arguments as an object
    d = make_dialect(make_variant("codex"))
    patch = ("*** Begin Patch\n*** Add File: a.txt\n+hello\n*** Update File: b.py\n@@\n-x = 1\n+x = 2\n"
             "*** Delete File: c.txt\n*** End Patch")
    name, arg = d.tool_name("patch"), d.arg_name("patch", "input")
    replies = [msg(None, [{"function": {"name": name, "arguments": json.dumps({arg: patch})}}]),
               msg(None, [{"function": {"name": name, "arguments": {arg: patch}}}]),
               msg(None, [{"function": {"name": name, "arguments": "{not json"}}])]
    srv = FakeServer(replies)
    try:
        p = OpenAIChatPolicy(srv.url, "m")
        p.begin_episode(EpisodeInfo("t", "files", 0, d))
        want = parse_patch(patch)
        assert [a.tool for a in want] == ["write", "edit", "run"]
        assert d.parse(p.act([{"role": "user", "content": "x"}])) == want
        assert d.parse(p.act([{"role": "user", "content": "x"}])) == want
        assert "malformed tool call 'apply_patch'" in p.act([{"role": "user", "content": "x"}])
    finally:
        srv.close()


def test_http_policy_solves_a_task_end_to_end(sandbox):
    task = load_task(tasks_root() / "files-unique-sorted")
    steps = ['Thought: look.\nAction: run\nAction Input: {"command": "head -3 names.txt"}',
             'Thought: sort.\nAction: run\nAction Input: {"command": "LC_ALL=C sort -u names.txt > unique_names.txt"}',
             'Thought: done.\nAction: finish\nAction Input: {"summary": "sorted"}']
    srv = FakeServer([msg(s) for s in steps])
    try:
        cfg = EpisodeConfig(dialects=("react",), augment=False, sandbox=sandbox)
        rec = run_episode(task, make_policy({"kind": "http", "base_url": srv.url, "model": "m"}), 0, cfg)
    finally:
        srv.close()
    assert rec["status"] == "finished" and rec["reward"] == 1.0, rec["error"]
    assert len(srv.requests) == 3
    last = srv.requests[-1]["body"]["messages"]
    assert last[0]["role"] == "system" and "Observation:" in last[-1]["content"]


def test_broken_policies_never_succeed(sandbox):
    task = load_task(tasks_root() / "files-unique-sorted")
    cfg = EpisodeConfig(sandbox=sandbox, max_steps=4)
    for policy, status in [(TextPolicy([""]), "policy_error"), (TextPolicy([None]), "policy_error"),
                           (CallablePolicy(lambda t: 1 / 0), "policy_error"),
                           (TextPolicy(["I refuse to use tools", "<invoke name=", "Action: run"]), "max_steps")]:
        rec = run_episode(task, policy, 0, cfg)
        assert rec["status"] == status and rec["reward"] == 0.0, rec
    rec = run_episode(task, TextPolicy(["no tools here"]), 0, cfg)
    assert rec["parse_errors"] == 4 and "error:" in rec["transcript"][-1]["content"]
    # doing the work without calling finish is not a success either
    d_text = 'Action: run\nAction Input: {"command": "LC_ALL=C sort -u names.txt > unique_names.txt"}'
    rec = run_episode(task, TextPolicy([d_text]), 0, EpisodeConfig(dialects=("react",), augment=False,
                                                                    sandbox=sandbox, max_steps=2))
    assert rec["status"] == "max_steps" and rec["reward"] == 0.0


def test_http_endpoint_check_names_the_fix():
    """Before any episode: a server that is not running, or whose chat route refuses the model, is one clear
    error; a model missing from GET /models (or a list the key may not read) is asked for one chat token first,
    since some servers list other names than they take, and so is a server without a models route; a models list
    of another shape is not judged."""
    refuse = (404, {"error": {"message": "the model 'k3-mini' does not exist"}})
    srv = FakeServer([refuse, msg("ok")], models=["k3-tiny"])
    try:
        OpenAIChatPolicy(srv.url, "k3-tiny", api_key="sk").check_endpoint()
        assert srv.requests[-1] == {"path": "/v1/models", "auth": "Bearer sk"}  # listed: no chat request
        with pytest.raises(PolicyError, match="refused a chat request for the model 'k3-mini' .*does not exist.*"
                                              "it lists k3-tiny: pass --model k3-tiny"):
            OpenAIChatPolicy(srv.url, "k3-mini").check_endpoint()
        OpenAIChatPolicy(srv.url, "k3-tiny:latest").check_endpoint()  # not listed, but the chat route takes it
        assert srv.requests[-1]["body"]["max_tokens"] == 1
    finally:
        srv.close()
    srv = FakeServer([(401, {"error": "bad key"}), msg("ok")], models=["m"], get_status=401)
    try:
        with pytest.raises(PolicyError, match="HTTP 401.*--api-key-env"):
            OpenAIChatPolicy(srv.url, "m").check_endpoint()
        OpenAIChatPolicy(srv.url, "m").check_endpoint()  # a key that may chat but not list models
    finally:
        srv.close()
    srv = FakeServer([], models=[])  # a list of another shape: not judged
    try:
        OpenAIChatPolicy(srv.url, "anything").check_endpoint()
        assert all(r["path"] == "/v1/models" for r in srv.requests)
    finally:
        srv.close()
    srv = FakeServer([msg("ok")], models=None)  # no models route (404): the chat route is asked instead, and takes it
    try:
        OpenAIChatPolicy(srv.url, "anything").check_endpoint()
        assert srv.requests[-1]["body"]["max_tokens"] == 1
    finally:
        srv.close()
    # a web server that is no OpenAI API (404 for the models route; 501 for POST, or a page that is not JSON):
    # one error before any episode (every episode failed, after retries)
    for reply, says in (((501, {"error": "Unsupported method ('POST')"}), "HTTP 501"),
                        ((200, b"<html>hello</html>"), "answered, but not as an OpenAI-compatible chat API")):
        srv = FakeServer([reply], models=None)
        try:
            with pytest.raises(PolicyError, match=says):
                OpenAIChatPolicy(srv.url, "m").check_endpoint()
        finally:
            srv.close()
    with pytest.raises(PolicyError, match="cannot reach http://127.0.0.1:9/v1 .*start the server first"):
        OpenAIChatPolicy("http://127.0.0.1:9/v1", "m").check_endpoint(timeout_s=5)
    # entries without a string id are a list of another shape; a rate-limited chat probe is not a refusal
    srv = FakeServer([], models=[{"name": "llama3"}])
    try:
        OpenAIChatPolicy(srv.url, "llama3").check_endpoint()
        assert all(r["path"] == "/v1/models" for r in srv.requests)  # not judged: no chat probe
    finally:
        srv.close()
    srv = FakeServer([(429, {"error": "slow down"})], models=["a"])
    try:
        OpenAIChatPolicy(srv.url, "b").check_endpoint()  # not listed, probe rate-limited: left to the episodes
    finally:
        srv.close()
    # something that answers, but not HTTP (an SSH port): a clear error, not a traceback
    import socket
    import threading
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def not_http():
        conn, _ = sock.accept()
        conn.recv(1024)
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        conn.close()

    threading.Thread(target=not_http, daemon=True).start()
    with pytest.raises(PolicyError, match="cannot reach .*BadStatusLine"):
        OpenAIChatPolicy(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", "m").check_endpoint(timeout_s=5)
    sock.close()


def test_run_http_checks_the_server_before_any_episode(tmp_path, capsys, monkeypatch):
    """A server that is not running, or serves another model, failed every episode (after retries) and exited 0;
    now it is one line and exit 2 before any episode; a run whose every episode failed exits 1."""
    import k3.agentenv.rollout as rollout
    import k3.agentenv.sandbox as sandbox

    from k3.cli import main

    def _err(capsys, *argv):
        code = main(["agentenv", *argv])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, err

    def boom(*a, **k):
        raise AssertionError("episodes started")

    monkeypatch.setattr(rollout, "run_rollouts", boom)
    monkeypatch.setattr(sandbox, "check_sandbox", lambda: "ok")
    out = ["--tasks", "sqlite-restock", "--out", str(tmp_path / "r.jsonl")]
    code, err = _err(capsys, "run", "--policy", "http", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", *out)
    assert code == 2 and "cannot reach http://127.0.0.1:9/v1" in err and "k3 serve" in err
    srv = FakeServer([(404, {"error": "no such model"})], models=["k3-tiny"])
    try:
        code, err = _err(capsys, "run", "--policy", "http", "--base-url", srv.url, "--model", "k3-mini", *out)
        assert code == 2 and "pass --model k3-tiny" in err
        monkeypatch.setattr(rollout, "run_rollouts", lambda tasks, spec, n, **kw: [
            {"task_id": "t", "family": "sqlite", "dialect": "react", "reward": 0.0, "steps": 1, "duration_s": 0.1,
             "parse_errors": 0, "status": "policy_error", "error": "HTTP 500"}] * n)
        code, err = _err(capsys, "run", "--policy", "http", "--base-url", srv.url, "--model", "k3-tiny",
                         "--episodes", "2", *out)
        assert code == 1 and "every episode ended in a policy, sandbox or worker error" in err
    finally:
        srv.close()
    assert not (tmp_path / "r.jsonl").exists()
