"""The k3 policies: the local model through the generation engine, and k3's own OpenAI-compatible server over
HTTP, each running real sandboxed episodes end to end."""
import contextlib
import json
import socket
import threading
import time

import pytest
import torch

from k3.agentenv.dialects import make_dialect, make_variant
from k3.agentenv.policies import ContextExceeded, EpisodeInfo, K3EnginePolicy, OpenAIChatPolicy, make_policy
from k3.agentenv.rollout import EpisodeConfig, run_episode
from k3.agentenv.tasks import load_tasks

MODEL = "k3-agent-test"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread for every test here (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from k3.agentenv.dialects import choose_variant
    from k3.data.tokenizer import train_tokenizer
    texts = [make_dialect(choose_variant(s)).system_prompt() for s in range(6)]
    return train_tokenizer(texts, 360, path=tmp_path_factory.mktemp("k3pol_tok") / "tokenizer.json",
                           allow_short=True)


@pytest.fixture(scope="module")
def model(tok):
    from k3.config import get_config
    from k3.model.transformer import K3Model
    torch.manual_seed(0)
    return K3Model(get_config("tiny", n_layers=2, vocab_size=tok.vocab_size, max_context=4096)).eval()


@pytest.fixture(scope="module")
def task():
    return load_tasks("files-rename-ext")[0]


def _well_formed(rec, steps):
    assert rec["status"] in ("max_steps", "policy_error", "finished") and rec["reward"] == 0.0
    assert rec["steps"] == steps and rec["transcript"][0]["role"] == "system"
    json.dumps(rec)  # a JSONL record


def test_engine_policy_runs_real_episodes(model, tok, task, sandbox):
    """An untrained tiny model fails the task: well-formed records, reward 0, malformed calls answered."""
    for seed in (0, 1):
        p = K3EnginePolicy(model, tok, temperature=1.0, max_tokens=12, seed=seed)
        rec = run_episode(task, p, seed, EpisodeConfig(max_steps=3, sandbox=sandbox))
        _well_formed(rec, 3 if rec["status"] == "max_steps" else rec["steps"])
        assert rec["policy"] == "k3" and len(p.turns) == rec["steps"]
        if rec["status"] == "max_steps":
            assert rec["parse_errors"] == 3  # random text is no tool call; each gets an error message back
            assert all(m["content"].strip() for m in rec["transcript"][3::2])
        # the policy's token ids: the first turn is the chat template of the transcript, then its own samples
        from k3.data.chat import render
        first = render(rec["transcript"][:2], tok)
        assert p.ids[:len(first)] == first
        assert sum(p.policy_mask) == sum(len(t["output_ids"]) for t in p.turns)


def test_malformed_and_special_token_replies_are_errors_not_crashes(tok, task, sandbox):
    replies = iter([([5, 7], "<|think|>hmm", "stop"), ([9], "Action: nope\nAction Input: {bad", "length"),
                    ([1], "", "stop")])
    p = K3EnginePolicy(None, tok, generate=lambda ids, params: next(replies), max_context=4096, max_tokens=8)
    rec = run_episode(task, p, 3, EpisodeConfig(max_steps=5, sandbox=sandbox, dialects=("react",)))
    assert rec["status"] == "policy_error" and "returned nothing" in rec["error"] and rec["parse_errors"] == 2
    end = tok.special_id("end")
    assert p.ids.count(end) >= 3 and p.policy_mask.count(True) == 4  # a length-cut reply is closed, unmarked
    assert p.failure is None  # the model answered badly; the policy itself did not fail


def test_context_overflow_ends_the_episode(model, tok, task, sandbox):
    p = K3EnginePolicy(model, tok, max_tokens=model.config.max_context)
    rec = run_episode(task, p, 0, EpisodeConfig(max_steps=2, sandbox=sandbox))
    assert rec["status"] == "policy_error" and "ContextExceeded" in rec["error"] and rec["reward"] == 0.0
    assert p.context_exceeded and p.failure == "context"
    with pytest.raises(ContextExceeded):
        p.act(rec["transcript"][:2])


def test_k3_policy_by_spec_from_a_checkpoint(tmp_path, model, tok, task, sandbox, monkeypatch):
    from k3.train.checkpoint import save_checkpoint
    save_checkpoint(tmp_path / "checkpoint", 1, model, config=model.config, data_state={"tokenizer": str(tok.path)})
    p = make_policy({"kind": "k3", "ckpt": str(tmp_path / "checkpoint"), "max_tokens": 8, "temperature": 0.0})
    assert isinstance(p, K3EnginePolicy) and p.max_tokens == 8
    rec = run_episode(task, p, 0, EpisodeConfig(max_steps=2, sandbox=sandbox))
    _well_formed(rec, rec["steps"])
    with pytest.raises(ValueError, match="--ckpt"):
        make_policy({"kind": "k3"})
    from k3.cli import main
    out = tmp_path / "r.jsonl"
    assert main(["agentenv", "run", "--tasks", "files-rename-ext", "--policy", "k3", "--ckpt",
                 str(tmp_path / "checkpoint"), "--max-tokens", "6", "--max-steps", "2", "--episodes", "1",
                 "--workers", "1", "--out", str(out), "--json"]) == 0
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["policy"] == "k3"
    assert main(["agentenv", "run", "--policy", "k3"]) == 2  # no --ckpt: a clear error
    # a checkpoint that is not there fails before any episode (it used to be one policy_error per episode, exit 0)
    assert main(["agentenv", "run", "--tasks", "files-rename-ext", "--policy", "k3", "--ckpt",
                 str(tmp_path / "nope"), "--out", str(tmp_path / "n.jsonl")]) == 2
    assert not (tmp_path / "n.jsonl").exists()
    # a reply budget no prompt leaves room for: refused before any episode (it failed each one, ContextExceeded)
    ctx = model.config.max_context
    assert main(["agentenv", "run", "--tasks", "files-rename-ext", "--policy", "k3", "--ckpt",
                 str(tmp_path / "checkpoint"), "--max-tokens", str(ctx), "--out", str(tmp_path / "n.jsonl")]) == 2
    assert not (tmp_path / "n.jsonl").exists()
    # --max-tokens reaches the http policy too (it always asked for 2048)
    import k3.agentenv.rollout as rollout
    seen = {}
    monkeypatch.setattr(rollout, "run_rollouts", lambda tasks, spec, *a, **k: seen.update(spec) or [])
    from k3.agentenv.policies import OpenAIChatPolicy
    monkeypatch.setattr(OpenAIChatPolicy, "check_endpoint", lambda self, **k: None)  # no server on port 9
    main(["agentenv", "run", "--tasks", "files-rename-ext", "--policy", "http", "--base-url", "http://127.0.0.1:9",
          "--model", "m", "--max-tokens", "64", "--json"])
    assert seen.get("max_tokens") == 64


@contextlib.contextmanager
def _serve(app):
    import uvicorn
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def test_http_policy_against_k3_server(model, tok, task, sandbox):
    """OpenAIChatPolicy -> `k3 serve`'s app on 127.0.0.1 -> engine -> reply -> dialect -> sandbox -> verifier.
    The server's first reply is the local engine policy's greedy reply to the same transcript."""
    from k3.data.chat import parse_reply
    from k3.serve.engine import Engine
    from k3.serve.server import create_app
    app = create_app(Engine(model, tok, max_batch=2, max_queue=4), MODEL)
    with _serve(app) as url:
        http = OpenAIChatPolicy(url, MODEL, max_tokens=10, temperature=0.0)
        rec = run_episode(task, http, 4, EpisodeConfig(max_steps=2, sandbox=sandbox, dialects=("react",)))
        with pytest.raises(Exception, match="does not exist"):
            OpenAIChatPolicy(url, "other-model", retries=0).act(rec["transcript"][:2])
    _well_formed(rec, rec["steps"])
    assert rec["policy"] == f"http:{MODEL}" and rec["steps"] >= 1
    local = K3EnginePolicy(model, tok, max_tokens=10, temperature=0.0)
    local.begin_episode(EpisodeInfo(task.id, task.family, 4, make_dialect(make_variant("react"))))
    text = local.act(rec["transcript"][:2])
    content, _, calls = parse_reply(text)
    if rec["status"] == "policy_error":  # the model's reply had no visible text
        assert not content.strip() and not calls
    else:
        # both sides stripped: str.strip() also drops control characters such as \x1d that a random model emits
        assert rec["transcript"][2]["content"].strip() == content.strip() or calls
