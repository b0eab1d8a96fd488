import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Tiny models: intra-op threads only add synchronisation (and spinning on a shared machine).
    Folders of tiny-model tests use it from an autouse fixture of their own."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark(NAME) -> benchmarks/NAME.py as a module (the scripts are not a package)."""
    return _load_benchmark


@pytest.fixture(scope="session")
def load_training_benchmark(tmp_path_factory):
    """load_training_benchmark(NAME): load_benchmark for the scripts that train on data (`--data`, default the
    checkout's runs/data): their main(argv) trains on a data directory of this test session unless argv names
    --data, so that tests neither read nor rebuild runs/data (it may hold another corpus, or be rebuilt by a
    second test run at the same time)."""
    data_dir = tmp_path_factory.mktemp("bench_data") / "data"

    def load(name: str):
        mod = _load_benchmark(name)
        main = mod.main
        mod.main = lambda argv: main(argv if "--data" in argv else [*argv, "--data", str(data_dir)])
        return mod
    return load


def _load_benchmark(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def default_signals():
    """SIGINT and SIGTERM at Python's defaults for the test: an earlier test may have left a handler, and a run
    started in the background by a non-interactive shell (nohup, `&`) inherits SIGINT ignored, which the graceful
    stop leaves alone as someone else's choice."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture(autouse=True, scope="session")
def _precision_cache(tmp_path_factory):
    """`--precision auto` (the default of k3 train, demo, eval, sample and serve) reads this host's probe from a
    cache of the test session's own that says bf16 is slower: tests never run the probe, and compute in fp32."""
    import os

    from k3.train.precision import host_key, store_probe

    folder = tmp_path_factory.mktemp("k3_cache")
    before = os.environ.get("K3_CACHE_DIR")
    os.environ["K3_CACHE_DIR"] = str(folder)  # subprocesses (distributed runs) inherit it
    slower = {"matmul_fp32_s": 1.0, "matmul_bf16_s": 1.0, "step_fp32_s": 1.0, "step_bf16_s": 2.0,
              "measured_at": "a test's fake probe"}
    for threads in range(1, max(os.cpu_count() or 1, torch.get_num_threads()) + 1):
        store_probe(host_key(threads), slower)
    yield folder
    if before is None:
        os.environ.pop("K3_CACHE_DIR", None)
    else:
        os.environ["K3_CACHE_DIR"] = before
