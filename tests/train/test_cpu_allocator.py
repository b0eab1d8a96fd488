"""The CPU allocator tuning: applied once per process on glibc, off by K3_CPU_MALLOPT=0 or glibc's own variables."""
import subprocess
import sys

CODE = ("from k3.train import device as d; a = d.tune_cpu_allocator(); b = d.tune_cpu_allocator(); "
        "print(a, b)")


def _run(env_extra):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "K3_CPU_MALLOPT"))}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_applied_once_on_glibc_and_idempotent():
    import platform
    first, second = _run({})
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert first == second == "True"
    else:
        assert first == second == "False"


def test_opt_out_and_glibc_variables_win():
    assert _run({"K3_CPU_MALLOPT": "0"}) == ["False", "False"]
    assert _run({"MALLOC_MMAP_THRESHOLD_": "131072"}) == ["False", "False"]
