"""Hidden Python cases runner: executes each case beside the agent's code and reports its result.

Runs as `python3 -s -S -P -c` in the verification sandbox, with the environment the host pinned (so
PYTHONHASHSEED=0 holds here as in the episode; -I would ignore it): -s skips the user site, -S skips `site`
(no .pth files, no sitecustomize/usercustomize), -P leaves the current directory off sys.path (Python 3.10,
which lacks -P, gets the same from the first lines below). The workspace is *appended* to sys.path, so a
workspace `json.py`/`unittest.py`/`signal.py` cannot shadow the standard library. The host imports this module for `encode` (the same encoding on both sides).

A case is code that sets `result`; the runner reports `{"id", "value": encode(result)}` or
`{"id", "raises": name, "mro": [builtin exception names]}`. Reports are observations only — the
expected values never come here.
"""
import sys

if sys.path and sys.path[0] == "":  # `-c` without -P: the current directory, before any other import
    del sys.path[0]

import builtins  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

_dumps = json.dumps
_write = os.write
_BUILTIN_EXC = {id(v): k for k, v in vars(builtins).items()
                if isinstance(v, type) and issubclass(v, BaseException)}


def encode(x, depth=0):
    """Exact-type JSON encoding: subclasses (e.g. a str whose __eq__ is always true) do not pass."""
    if depth > 64:
        return {"$unserializable": "nested too deeply"}
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if -(2 ** 53) < x < 2 ** 53 else {"$int": str(x)}
    if t is float:
        return x if math.isfinite(x) else {"$float": repr(x)}
    if t is list:
        return [encode(v, depth + 1) for v in x]
    if t is tuple:
        return {"$tuple": [encode(v, depth + 1) for v in x]}
    if t is dict:
        items = [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]
        return {"$dict": sorted(items, key=lambda kv: _dumps(kv[0], sort_keys=True))}
    if t is set or t is frozenset:
        items = sorted((encode(v, depth + 1) for v in x), key=lambda v: _dumps(v, sort_keys=True))
        return {"$set" if t is set else "$frozenset": items}
    if t is bytes:
        return {"$bytes": x.hex()}
    return {"$unserializable": "%s.%s" % (getattr(t, "__module__", "?"), t.__qualname__)}


def exc_report(e):
    t = type(e)
    mro = [_BUILTIN_EXC[id(k)] for k in t.__mro__ if id(k) in _BUILTIN_EXC]
    name = _BUILTIN_EXC.get(id(t)) or "%s.%s" % (t.__module__, t.__qualname__)
    try:
        msg = str(e)[:300]
    except BaseException:
        msg = "<unprintable>"
    return {"raises": name, "mro": mro, "message": msg}


class _CaseTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _CaseTimeout()


def main():
    payload = json.loads(sys.stdin.buffer.read())
    fd = int(payload["result_fd"])
    root = payload["root"]
    os.chdir(root)
    sys.path.append(root)
    signal.signal(signal.SIGALRM, _on_alarm)
    for case in payload["cases"]:
        ns = {"__name__": "__k3_case__", "__builtins__": builtins}
        signal.alarm(max(1, int(case.get("timeout", 5))))
        try:
            exec(compile(case["code"], "<case %s>" % case["id"], "exec"), ns)
            obs = {"value": encode(ns.get("result"))}
        except _CaseTimeout:
            obs = {"timeout": True}
        except BaseException as e:  # SystemExit and KeyboardInterrupt are results too
            obs = exc_report(e)
        finally:
            signal.alarm(0)
        obs["id"] = case["id"]
        try:
            line = _dumps(obs)
        except Exception as e:
            line = _dumps({"id": case["id"], "error": "unreportable result: %s" % type(e).__name__})
        data = (line + "\n").encode("utf-8", "replace")
        while data:
            data = data[_write(fd, data):]


if __name__ == "__main__":
    main()
