"""The `k3` entry point: how it ends when its output pipe closes, and when another pipe breaks."""
import os
import subprocess
import sys

from k3 import cli


def test_output_piped_into_a_reader_that_leaves_ends_quietly():
    """`k3 params --json | head -1`: the reader closes the pipe early; no traceback, exit 0."""
    proc = subprocess.run(f"{sys.executable} -m k3.cli params --preset mini --json | head -1", shell=True,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "0"})
    assert proc.stdout.strip() == "{" and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    def boom(args):
        raise BrokenPipeError(32, "a worker's pipe")
    parser = cli.build_parser()
    args = parser.parse_args(["params", "--preset", "tiny"])
    monkeypatch.setattr(args, "func", boom, raising=False)
    monkeypatch.setattr(cli, "build_parser", lambda: type("P", (), {"parse_args": lambda self, argv: args})())
    assert cli.main(["params"]) == 1
    assert "a worker's pipe" in capsys.readouterr().err
