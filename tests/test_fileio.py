import pytest

from k3.fileio import atomic_open, atomic_write_json, atomic_write_text


def test_round_trip_and_no_temp_left(tmp_path):
    p = tmp_path / "sub" / "a.txt"
    atomic_write_text(p, "héllo")
    assert p.read_text(encoding="utf-8") == "héllo"
    atomic_write_json(tmp_path / "b.json", {"x": 1})
    assert (tmp_path / "b.json").read_text() == '{\n  "x": 1\n}\n'
    assert sorted(q.name for q in tmp_path.rglob("*")) == ["a.txt", "b.json", "sub"]
    assert (p.stat().st_mode & 0o777) != 0o600  # the usual mode, not mkstemp's


def test_failure_keeps_old_file_and_removes_temp(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(p, "wb") as f:
            f.write(b"new partial")
            raise RuntimeError("crash mid-write")
    assert p.read_bytes() == b"old"
    assert [q.name for q in tmp_path.iterdir()] == ["a.bin"]


def test_rejects_read_modes(tmp_path):
    with pytest.raises(AssertionError, match="mode"):  # a caller's mistake, not a user's: an assertion
        with atomic_open(tmp_path / "x", "rb"):
            pass


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    """A process killed between writing its temporary file and the rename leaves `.NAME.PID-*.tmp` behind; the next
    write of the same target removes it (its process is gone), not one a live process is writing, nor another
    target's. The export of an MX checkpoint refused a folder holding such a file from its `latest`."""
    import os

    target = tmp_path / "latest"
    dead = tmp_path / ".latest.999999999-abc.tmp"  # no such process
    live = tmp_path / f".latest.{os.getppid()}-abc.tmp"  # a live process (the parent), writing now
    other = tmp_path / ".other.999999999-abc.tmp"
    for p in (dead, live, other):
        p.write_text("partial")
    atomic_write_text(target, "step_000003\n")
    assert target.read_text() == "step_000003\n"
    assert not dead.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])


def test_an_hf_export_killed_between_its_renames_is_recovered(tmp_path):
    """Killed after moving the previous export aside and before moving the new one in, an HF export left no `hf`
    folder, the previous one only under `.hf.old-*`; the next export puts it back (or removes it when the new one
    is in place) and removes the unfinished `.hf.tmp-*`."""
    import os

    from k3.io.hf import _recover_killed_export

    out = tmp_path / "hf"
    old = tmp_path / ".hf.old-999999999-abc"
    tmp = tmp_path / ".hf.tmp-999999999-def"
    running = tmp_path / f".hf.tmp-{os.getppid()}-xyz"  # a live export's: left alone
    for d in (old, tmp, running):
        d.mkdir()
    (old / "config.json").write_text("{}")
    _recover_killed_export(out)
    assert (out / "config.json").read_text() == "{}" and not old.exists() and not tmp.exists() and running.is_dir()
    old.mkdir()  # the new export was in place: the old one is only removed
    _recover_killed_export(out)
    assert not old.exists() and (out / "config.json").is_file()


def test_loads_json_refuses_absurd_nesting_with_a_decode_error(tmp_path):
    import json

    from k3.fileio import MAX_JSON_DEPTH, JSONTooDeep, loads_json, read_json

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(JSONTooDeep, match="nested deeper than") as e:
        loads_json(deep)
    assert isinstance(e.value, json.JSONDecodeError) and e.value.pos == MAX_JSON_DEPTH  # where the limit was passed
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads_json(ok) == json.loads(ok)
    assert loads_json(b'{"a": "[[[[{{{{", "b": [1]}', max_depth=2) == {"a": "[[[[{{{{", "b": [1]}  # strings don't nest
    (tmp_path / "m.json").write_text('{"a": ' * 5000 + "1" + "}" * 5000)
    with pytest.raises(ValueError, match=r"m.json: the manifest is not valid JSON \(nested deeper") as e:
        read_json(tmp_path / "m.json", "manifest")
    assert "\n" not in str(e.value)


def test_a_deeply_nested_checkpoint_manifest_is_a_one_line_error(tmp_path):
    """`k3 eval` and `--resume` read manifest.json through read_manifest: a RecursionError traceback before."""
    from k3.train.checkpoint import CheckpointError, read_manifest

    (tmp_path / "manifest.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="manifest.json: not valid JSON \\(nested deeper than") as e:
        read_manifest(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("what", ["tokenizer", "metrics", "data", "kimi_config", "kimi_index"])
def test_files_a_user_supplies_refuse_absurd_nesting_in_one_line(tmp_path, what):
    """Tokenizers, metrics logs, datasets and released checkpoints' JSON: 100,000 levels of nesting give a one-line
    error (or a skipped line), never a RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    if what == "tokenizer":
        from k3.data import load_tokenizer

        (tmp_path / "tokenizer.json").write_text(deep)
        call = lambda: load_tokenizer(tmp_path / "tokenizer.json")  # noqa: E731
    elif what == "metrics":
        from k3.train.metrics import read_metrics

        (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n' + deep + "\n")
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1
        return
    elif what == "data":
        from k3.data import load_data

        (tmp_path / "tokenizer.json").write_text("{}")
        (tmp_path / "data.json").write_text(deep)
        call = lambda: load_data(tmp_path)  # noqa: E731
    else:
        import k3

        (tmp_path / "config.json").write_text(deep if what == "kimi_config" else '{"model_type": "kimi_k3"}')
        (tmp_path / "model.safetensors.index.json").write_text(deep)
        call = lambda: k3.load(tmp_path)  # noqa: E731
    with pytest.raises(ValueError) as e:
        call()
    assert "\n" not in str(e.value).strip()
