"""The `k3` entry point: how it ends when its output pipe closes, and when another pipe breaks."""
import os
import subprocess
import sys

import pytest

from k3 import cli


def test_output_piped_into_a_reader_that_leaves_ends_quietly():
    """`k3 params --json | true` and `| head -1`: the reader closes the pipe before (true) or while (head) k3
    writes; k3 itself exits 0 without a traceback or an error line, buffered or not."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    for reader, unbuffered in (("true", False), ("true", True), ("head -1", False)):
        e = {**env, "PYTHONUNBUFFERED": "1"} if unbuffered else env
        proc = subprocess.run(["bash", "-c", f"{sys.executable} -m k3.cli params --preset mini --json | {reader}; "
                               "exit ${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=120, env=e)
        assert proc.returncode == 0 and proc.stderr == "", (reader, unbuffered, proc.returncode, proc.stderr[-500:])
        assert proc.stdout.strip() == ("{" if reader.startswith("head") else "")


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    def boom(args):
        raise BrokenPipeError(32, "a worker's pipe")
    parser = cli.build_parser()
    args = parser.parse_args(["params", "--preset", "tiny"])
    monkeypatch.setattr(args, "func", boom, raising=False)
    monkeypatch.setattr(parser, "parse_args", lambda argv: args)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["params"]) == 1
    assert "a worker's pipe" in capsys.readouterr().err


def test_output_into_a_socket_whose_reader_left_ends_quietly():
    """stdout a socket whose peer has closed (poll reports POLLHUP there, not POLLERR): exit 0, no error line."""
    import socket

    mine, peer = socket.socketpair()
    peer.close()
    try:
        proc = subprocess.run([sys.executable, "-m", "k3.cli", "params", "--preset", "mini", "--json"], stdout=mine,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        mine.close()
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-500:]


def test_params_summary_line_says_when_no_layer_is_moe(capsys):
    assert cli.main(["params", "--preset", "tiny"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("2/8 experts, latent 32")
    assert cli.main(["params", "--preset", "tiny", "--set", "n_dense_layers=4"]) == 0
    out = capsys.readouterr().out
    assert "no MoE layer (every layer dense)" in out and "experts, latent" not in out


def test_empty_values_that_mean_something_pass_and_positionals_are_named(capsys):
    """`k3 serve --host ""` binds every interface (IPv4 and IPv6); `k3 export ""` names its CKPT argument, not a
    --ckpt of other commands."""
    from k3.cli import build_parser, check_empty_values, main

    p = build_parser()
    check_empty_values(p, p.parse_args(["serve", "--host", ""]))
    check_empty_values(p, p.parse_args(["train", "--qat"]))
    assert main(["export", "", "--out", "x"]) == 2
    assert "the CKPT argument is empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["tokenize", "--data", ""], "--data"), (["train", "--out", ""], "--out"),
                                        (["eval", "--ckpt", ""], "--ckpt"), (["rl", "train", "--root", ""], "--root"),
                                        (["distill", "mopd", "--teachers", ""], "--teachers")])
def test_an_empty_option_value_is_an_error_not_the_current_directory(argv, flag, capsys, tmp_path, monkeypatch):
    """`--data "$DATA"` with DATA unset: `k3 tokenize` tokenized the current directory."""
    from k3.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert f"{flag} is empty (an unset shell variable?)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_open_corpus_refuses_an_empty_spec():
    from k3.data.corpus import open_corpus

    with pytest.raises(ValueError, match="is empty"):
        open_corpus("")


@pytest.mark.parametrize("argv", [["sample"], ["train"], ["rl", "train"], ["distill", "mopd"], ["agentenv", "run"]])
def test_a_seed_torch_cannot_take_is_refused_naming_the_flag(argv, capsys):
    """`k3 sample --seed 99999999999999999999999` said only 'Overflow when unpacking long long'."""
    from k3.cli import main

    for bad in ("99999999999999999999999", "-1"):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--seed", bad])
        assert e.value.code == 2
        assert f"argument --seed: {bad} is outside [0, 2^62)" in capsys.readouterr().err


def test_output_checks(tmp_path):
    """A directory that holds a subfolder named x is a fine output directory (the parents check once looked at
    DIR/x and called it 'a directory; give a file path')."""
    from k3.cli_checks import output_dir, output_file

    (tmp_path / "run" / "x").mkdir(parents=True)
    output_dir("--out", tmp_path / "run")
    output_dir("--out", tmp_path / "new" / "deeper")
    (tmp_path / "afile").write_text("hi")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        output_dir("--out", tmp_path / "afile")
    with pytest.raises(ValueError, match="afile is a file, not a directory"):
        output_dir("--out", tmp_path / "afile" / "sub")
    with pytest.raises(ValueError, match="is a directory; give a file path"):
        output_file("--out", tmp_path / "run")
    with pytest.raises(ValueError, match="afile is a file, not a directory"):
        output_file("--out", tmp_path / "afile" / "x.json")


def test_plots_and_jsonl_outputs_do_not_replace_other_files(tmp_path):
    """`k3 rl plot --out notes.txt` wrote a PNG over the user's file, and `agentenv run --out` replaced any file."""
    from k3.cli_checks import output_jsonl, output_png

    mine = tmp_path / "notes.png"
    mine.write_text("my notes")
    with pytest.raises(ValueError, match="exists and is not a PNG plot"):
        output_png("--out", mine)
    with pytest.raises(ValueError, match="the plot is written as PNG; give a file name ending in .png"):
        output_png("--out", tmp_path / "reward.jsonl")
    # where matplotlib picks the format from the suffix, SVG and PDF are plots too
    plots = (".png", ".svg", ".pdf")
    output_png("--out", tmp_path / "reward.svg", "reward.png", plots)
    with pytest.raises(ValueError, match="written as PNG or SVG or PDF"):
        output_png("--out", tmp_path / "reward.jpg", "reward.png", plots)
    (tmp_path / "old.svg").write_text('<?xml version="1.0"?><svg/>')
    output_png("--out", tmp_path / "old.svg", "reward.png", plots)
    (tmp_path / "mine.pdf").write_text("notes")
    with pytest.raises(ValueError, match="is not a PDF plot"):
        output_png("--out", tmp_path / "mine.pdf", "reward.png", plots)
    png = tmp_path / "old.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 16)
    output_png("--out", png)  # an earlier plot is replaced
    output_png("--out", tmp_path / "new.png")
    hi = tmp_path / "afile"
    hi.write_text("hi\n")
    with pytest.raises(ValueError, match="does not hold JSON lines"):
        output_jsonl("--out", hi, "rollouts.jsonl")
    old = tmp_path / "rollouts.jsonl"
    old.write_text('{"task": "x"}\n')
    output_jsonl("--out", old, "rollouts.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    output_jsonl("--out", tmp_path / "empty.jsonl", "rollouts.jsonl")
    big = tmp_path / "big.jsonl"  # a first record longer than what is read of it (a whole transcript)
    big.write_text('{"transcript": "' + "x" * (2 << 20) + '"}\n')
    output_jsonl("--out", big, "rollouts.jsonl")
