"""`k3 train --nproc/--ep/--fsdp/--pp` refuses a mesh that does not factor before starting any process;
`k3 mesh` lays out the ranks; the torchrun re-launch command is well formed."""
import os

import pytest

from k3.cli import main
from k3.parallel.cli import _without_nproc
from k3.parallel.launch import torchrun_command


def test_train_refuses_a_world_that_does_not_factor(capsys):
    assert main(["train", "--preset", "tiny", "--nproc", "3", "--ep", "2"]) == 2
    assert "does not factor" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--ep", "2"]) == 2
    assert "need several processes" in capsys.readouterr().err


def test_mesh_command(capsys):
    assert main(["mesh", "--preset", "mini", "--nproc", "16", "--ep", "8", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "pp 2 x dp 8" in out and "8 per EP rank" in out
    # counted per pipeline stage as prune_to_stage splits the model (it divided the totals by pp: ~2.75M, ~669K);
    # mini's first layer is dense, so stage 1 holds 4 MoE layers' experts and stage 0 three
    assert "routed expert params per rank 3.15M, other params per rank 678K (FSDP shard) on the fullest pipeline " \
        "stage (1)" in out
    assert "per stage (routed / other, before EP and FSDP): 0: 18.9M / 5.54M, 1: 25.2M / 5.42M" in out
    assert "layer 4: 3" in out  # Block AttnRes: the embedding + two finished blocks cross the boundary
    assert main(["mesh", "--preset", "mini", "--nproc", "64", "--ep", "7"]) == 2


def test_stage_param_counts_are_what_each_pruned_stage_holds(capsys):
    """k3 mesh's per-stage counts equal the parameters of each stage pruned as a pipeline run prunes it."""
    from k3.config import get_config
    from k3.model.accounting import build_meta, component_of
    from k3.parallel.cli import stage_param_counts
    from k3.parallel.pipeline import prune_to_stage, stage_layers

    config = get_config("tiny")
    for pp in (1, 2, 4):
        counts = stage_param_counts(build_meta(config), stage_layers(config.n_layers, pp))
        for k in range(pp):
            stage = build_meta(config)
            prune_to_stage(stage, k, pp) if pp > 1 else None
            routed = sum(p.numel() for n, p in stage.named_parameters() if component_of(stage, n) == "moe_routed")
            assert counts[k] == (routed, sum(p.numel() for p in stage.parameters()) - routed), (pp, k)
    assert main(["mesh", "--preset", "tiny", "--nproc", "2"]) == 0  # no expert parallelism: no all-to-all
    assert "all-to-all: none (--ep 1" in capsys.readouterr().out


def test_relaunch_command():
    argv = _without_nproc(["train", "--nproc", "4", "--ep", "2", "--nproc=4", "--steps", "3"])
    assert argv == ["train", "--ep", "2", "--steps", "3"]
    cmd = torchrun_command(4, argv)
    assert cmd[1:6] == ["-m", "k3.parallel.torchrun", "--standalone", "--nproc-per-node=4", "-m"]
    assert cmd[6:] == ["k3.cli", *argv]


def test_a_failed_local_job_names_the_rank_that_started_it(tmp_path):
    """Rank 1 raises while rank 0 waits in a collective and then fails on the closed connection: the report
    names rank 1's error, not the follow-on one of the lower rank."""
    import pickle

    from k3.parallel.launch import _first_error

    (tmp_path / "result_0.pkl").write_bytes(pickle.dumps(
        ("error", "rank 0: RuntimeError: [gloo/transport] Connection closed by peer [127.0.0.1]:1\n...", 0.0)))
    (tmp_path / "result_1.pkl").write_bytes(pickle.dumps(("error", "rank 1: ValueError: the real cause\n...", 0.0)))
    assert _first_error(str(tmp_path), 2).startswith("rank 1: ValueError: the real cause")


def test_expert_parallel_flags_are_checked_before_any_process_starts(capsys, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    tiny = ["train", "--preset", "tiny", "--set", "vocab_size=512"]
    assert main([*tiny, "--set", "n_experts=3", "--nproc", "2", "--ep", "2"]) == 2
    assert "n_experts = 3 is not divisible by --ep 2" in capsys.readouterr().err
    assert main([*tiny, "--ep-redundant", "1"]) == 2  # one process: nothing to replicate over
    assert "--ep-redundant" in capsys.readouterr().err
    assert main([*tiny, "--nproc", "2", "--ep-redundant", "1"]) == 2  # ep 1
    assert "needs --ep > 1" in capsys.readouterr().err
    assert main([*tiny, "--nproc", "2", "--ep", "2", "--ep-redundant", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
    import torch

    other = "cpu" if torch.cuda.is_available() else "cuda"  # not what a distributed run here computes on
    assert main([*tiny, "--nproc", "2", "--device", other]) == 2
    assert "drop --device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ex:  # mesh does not take the flag at all (its --help listed it)
        main(["mesh", "--preset", "mini", "--nproc", "4", "--ep", "2", "--ep-redundant", "1"])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --ep-redundant 1" in err


def test_mesh_errors_name_cli_flags_and_print_nothing_first(capsys):
    assert main(["mesh", "--preset", "tiny", "--nproc", "16", "--ep", "16"]) == 2
    out = capsys.readouterr()
    assert "--ep 16" in out.err and "1, 2, 4, 8" in out.err and "slots_per_rank" not in out.err
    assert main(["mesh", "--preset", "tiny", "--nproc", "8", "--pp", "8"]) == 2
    out = capsys.readouterr()
    assert "cannot split 4 layers" in out.err and out.out == ""  # no partial layout before the error
    for flag, value, says in (("--nproc", "0", "--nproc 0 must be a positive integer"),  # was "world = 0 ..."
                              ("--ep", "0", "--ep 0 must be a positive integer"),
                              ("--fsdp", "-1", "--fsdp -1 must be >= 0")):
        assert main(["mesh", "--preset", "tiny", flag, value]) == 2
        assert says in capsys.readouterr().err
    assert main(["mesh", "--preset", "tiny", "--nproc", "6", "--ep", "3"]) == 2  # offers only --ep sizes that fit
    assert "divides it and the 6 data-parallel ranks (1, 2)" in capsys.readouterr().err


def test_train_checks_data_and_out_before_torchrun(tmp_path, capsys, monkeypatch):
    """Each rank would print the error and torchrun its ~45-line ChildFailedError after it, exit 1."""
    import subprocess
    import sys

    from k3.data import prepare_data

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))

    def train(*argv):
        argv = ["train", "--preset", "tiny", "--nproc", "2", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                *argv]
        monkeypatch.setattr(sys, "argv", ["k3", *argv])  # what the re-launch reads
        code = main(argv)
        return code, capsys.readouterr().err

    code, err = train("--data", str(tmp_path / "nonexist"), "--out", str(tmp_path / "o"))
    assert code == 2 and "--data" in err and "does not exist" in err and "launching" not in err
    data = tmp_path / "data"
    prepare_data(data, vocab_size=512, max_bytes=40_000)
    out = tmp_path / "o"
    (out / "checkpoint" / "step_000001").mkdir(parents=True)
    (out / "checkpoint" / "step_000001" / "k3.json").write_text("{}")
    code, err = train("--set", "vocab_size=512", "--data", str(data), "--out", str(out))
    assert code == 2 and "already holds a checkpoint" in err and "--overwrite" in err
    code, err = train("--set", "vocab_size=512", "--data", str(data), "--out", str(tmp_path / "new"), "--resume")
    assert code == 2 and "no checkpoint found" in err
    code, err = train("--set", "vocab_size=1024", "--data", str(data), "--out", str(tmp_path / "new"))
    assert code == 2 and "vocabulary of 512 tokens" in err
    code, err = train("--set", "vocab_size=512", "--data", str(data), "--out", str(tmp_path / "new"),
                      "--optimizer", "muon")
    assert code == 2 and "use --optimizer adamw" in err
    code, err = train("--set", "vocab_size=512", "--data", str(data), "--out", str(tmp_path / "new"),
                      "--batch-size", "3")
    assert code == 2 and "does not split over 2 data-parallel ranks" in err


def test_train_checks_layout_context_out_and_resume_before_torchrun(tmp_path, capsys, monkeypatch):
    """Tied embeddings under --pp, a --seq-len past max_context, an --out that cannot be written and a resume with
    another config were refused by every rank after the launch (with --ep-redundant, as a placement error)."""
    import json
    import subprocess
    import sys

    from k3.config import get_config
    from k3.data import prepare_data
    from k3.parallel.checkpoint import FORMAT

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    data = tmp_path / "data"
    prepare_data(data, vocab_size=512, max_bytes=40_000)

    def train(*argv):
        argv = ["train", "--preset", "tiny", "--nproc", "2", "--steps", "2", "--batch-size", "2", "--data", str(data),
                *argv]
        monkeypatch.setattr(sys, "argv", ["k3", *argv])
        code = main(argv)
        return code, capsys.readouterr().err

    new = ["--out", str(tmp_path / "new")]
    code, err = train("--seq-len", "16", "--pp", "2", "--set", "tie_embeddings=true", *new)
    assert code == 2 and "--set tie_embeddings=false" in err and err.count("\n") == 1
    max_context = get_config("tiny").max_context
    code, err = train("--seq-len", str(max_context + 1), *new)
    assert code == 2 and f"--seq-len {max_context + 1} exceeds the model's max_context" in err
    (tmp_path / "afile").write_text("")
    code, err = train("--seq-len", "16", "--out", str(tmp_path / "afile" / "o"))
    assert code == 2 and "is not writable" in err and "pass another --out" in err
    step = tmp_path / "old" / "checkpoint" / "step_000002"
    step.mkdir(parents=True)
    other = get_config("tiny", n_experts=4)
    (step / "k3.json").write_text(json.dumps({"format": FORMAT, "step": 2, "config": other.to_dict(),
                                              "train": {"batch_size": 2, "seq_len": 16, "accum": 1, "seed": 0},
                                              "expert_loads": [[1.0] * 4] * 3}))
    (step.parent / "latest").write_text("step_000002")
    for extra in ([], ["--ep", "2", "--ep-redundant", "1"]):
        code, err = train("--seq-len", "16", "--out", str(tmp_path / "old"), "--resume", *extra)
        assert code == 2 and "model config differs from this run's in ['n_experts']" in err, err
    # the same config, trained at another learning rate: a resume needs the run's --lr
    (step / "k3.json").write_text(json.dumps({"format": FORMAT, "step": 2, "config": get_config("tiny").to_dict(),
                                              "train": {"batch_size": 2, "seq_len": 16, "accum": 1, "seed": 0,
                                                        "lr": 1e-3}, "expert_loads": [[1.0] * 8] * 3}))
    code, err = train("--seq-len", "16", "--out", str(tmp_path / "old"), "--resume")
    assert code == 2 and "resume with --lr 0.001" in err, err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "ctrl-c"])  # SIGINT to the launcher alone: as these two
def test_a_signal_to_the_launcher_stops_torchrun_and_its_ranks(tmp_path, sig):
    """`kill PID` (or a supervisor's terminate) of `k3 train --nproc 2`, SIGINT or SIGHUP sent to it alone: the ranks
    stop with it (subprocess.call killed torchrun only, and the ranks went on training, re-parented to init). And a
    real Ctrl-C on a terminal (a pty), which the tty sends to the whole process group: everything stops too, the
    launcher not sending it a second time. On SIGTERM and SIGINT (what torchrun passes on) the ranks first agree
    on a step, save it and say where --resume continues (they lost everything since the last --ckpt-every);
    SIGHUP keeps its default. After SIGTERM, --resume continues from that step."""
    import fcntl
    import json
    import pty
    import signal
    import subprocess
    import sys
    import termios
    import threading
    import time

    from k3.data import prepare_data

    data, out = tmp_path / "data", tmp_path / "out"
    prepare_data(data, vocab_size=512, max_bytes=40_000)
    log = open(tmp_path / "stderr.txt", "w+")  # a file, not a pipe: ranks that outlive the launcher keep a pipe open
    base = [sys.executable, "-m", "k3.cli", "train", "--preset", "tiny", "--data", str(data), "--out", str(out),
            "--nproc", "2", "--ep", "2", "--batch-size", "2", "--seq-len", "16", "--ckpt-every", "0", "-q"]
    cmd = [*base, "--steps", "100000"]
    if sig == "ctrl-c":  # a session of its own whose controlling terminal is a pty: the tty driver sends the SIGINT
        master, slave = pty.openpty()
        launcher = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=log, start_new_session=True,
                                    preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)

        def drain() -> None:  # the pty's buffer is small
            try:
                while os.read(master, 4096):
                    pass
            except OSError:
                pass
        threading.Thread(target=drain, daemon=True).start()
    else:
        launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)

    def ours() -> list[int]:  # every process whose command line names this run's --out (launcher, torchrun, ranks)
        pids = []
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and str(out) in open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace"):
                    pids.append(int(d))
            except OSError:
                pass
        return pids

    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert launcher.poll() is None, (tmp_path / "stderr.txt").read_text()[-2000:]
            assert time.monotonic() < deadline, "the distributed run did not start training"
            time.sleep(0.5)
        if sig == "ctrl-c":
            os.write(master, b"\x03")
        else:
            launcher.send_signal(getattr(signal, sig))
        code = launcher.wait(120)
        err = (tmp_path / "stderr.txt").read_text()
        name = "SIGINT" if sig == "ctrl-c" else sig
        assert code == (130 if name in ("SIGINT", "SIGTERM") else 128 + getattr(signal, name)), err[-2000:]
        assert f"the distributed run was stopped ({name})" in err
        # torchrun's SignalException ended it with a traceback that read like a crash; one line says it now
        assert "Traceback" not in err and f"torchrun: stopped by {name}" in err, err[-3000:]
        deadline = time.monotonic() + 30
        while ours() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ours(), "processes of the run outlived its launcher"
        latest = out / "checkpoint" / "latest"
        if sig == "SIGHUP":
            assert not latest.exists()  # --ckpt-every 0: nothing saved before the end
            return
        last = max(json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
                   if '"train"' in line)
        assert latest.read_text().strip() == f"step_{last:06d}", err[-2000:]  # the step the ranks were in, saved
        assert f"interrupted: `k3 train ... --out {out} --resume` continues from step {last}" in err
        if sig == "SIGTERM":
            r = subprocess.run([*base, "--steps", str(last + 1), "--resume"], capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0 and f"trained to step {last + 1} (1 in this run)" in r.stdout, \
                r.stdout + r.stderr[-2000:]
    finally:
        for pid in ours():
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        log.close()
