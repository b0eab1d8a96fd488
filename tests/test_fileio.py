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
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "x", "rb"):
            pass
