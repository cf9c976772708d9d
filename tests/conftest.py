"""Shared test setup: CPU, fast compiles, and a float64 NumPy attention reference."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compile time dominates these tiny models; XLA's optimisation passes buy nothing here, and
# the persistent cache lets the many tiny training runs share their compilations. Set in the
# environment so that the subprocesses of multi-device and signal tests inherit them.
_CACHE = os.environ.get(
    "TX_JAX_TEST_CACHE",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".jax_cache"),
)
# XLA:CPU's newer fusion emitters take a third more compile time on these tiny programs than
# the elemental emitters they replace (BENCHMARKS.md "Test suite"); what a test checks does not
# depend on which emitter wrote a fusion's loop. helpers.forced_devices keeps the flag.
TEST_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TEST_XLA_FLAGS).strip()
for _key, _value in {
    "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
    "JAX_COMPILATION_CACHE_DIR": _CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}.items():
    os.environ.setdefault(_key, _value)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

assert jax.config.read("jax_disable_most_optimizations")


def reference_attention(q, k, v, mask=None, bias=None):
    """float64 NumPy softmax(q k^T / sqrt(Dk) + bias) v; q [B,L,H,Dk], k/v [B,S,K,Dk/Dv]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, L, H, D = q.shape
    K = k.shape[2]
    k = np.repeat(k, H // K, axis=2)
    v = np.repeat(v, H // K, axis=2)
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(D)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask), s.shape)
        s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    w = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 0.0)
    return np.einsum("bhls,bshd->blhd", w, v), w


# The test files, longest first (seconds in a full run: BENCHMARKS.md "Test suite"). launch.sh
# runs `--dist loadfile --no-loadscope-reorder`: xdist hands whole files to the two workers in
# this order, so the long ones start first and the workers finish together instead of one
# waiting on a long file that came last. A file not listed runs after these.
LONGEST_FIRST = (
    "test_tpu_sweep.py",
    "test_gcs.py",
    "test_translate_corpus.py",
    "test_evaluate.py",
    "test_multiprocess.py",
    "test_import_model.py",
    "test_planning.py",
    "test_robustness.py",
    "test_train.py",
    "test_elastic.py",
    "test_decoding.py",
    "test_multilingual.py",
    "test_sweep.py",
    "test_models.py",
    "test_import.py",
    "test_docs.py",
    "test_hosts.py",
    "test_budget.py",
    "test_attention.py",
    "test_output_loss.py",
    "test_export.py",
    "test_language_similarity.py",
    "test_kernels.py",
    "test_visualize.py",
    "test_losses_optim.py",
    "test_data_parallel.py",
    "test_sizing.py",
    "test_multi30k_ende.py",
    "test_data_text.py",
    "test_flops.py",
    "test_attention_splash.py",
    "test_lm.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True, scope="module")
def _jax_caches_per_file():
    """Each test file's compiled programs go when it ends (jax.clear_caches; the persistent
    cache serves them again). JAX keeps the executables of every live function (module-level
    jits keyed by config, eager ops) and XLA:CPU maps each one's code in several memory
    mappings: run in one process (no xdist), test_attention.py .. test_evaluate.py held
    45,000 and the suite more than the kernel's vm.max_map_count (65530), where LLVM's mmap
    fails ('Cannot allocate memory') and XLA:CPU aborts or segfaults (put_executable_and_time)."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """One TFDS data dir per test session: the tiny synthetic corpus is prepared once."""
    return tmp_path_factory.getbasetemp() / "tfds"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A local GCS server for the module (tests/gcs_server.py), and this process's clients
    pointed at it (its environment, which the module's subprocesses inherit)."""
    import gcs_server

    server = gcs_server.start(str(tmp_path_factory.mktemp("gcs_data")), lifetime=1800)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# ------------------------------------------------------------ where a test's time goes
# TX_JAX_TEST_PROFILE=FILE: one JSON line per test with the seconds JAX spent tracing,
# lowering and compiling in this process (subprocesses not included): what to cut first.
_PROFILE = os.environ.get("TX_JAX_TEST_PROFILE")
if _PROFILE:
    import json
    import time

    from jax import monitoring

    _spent: dict[str, float] = {}
    _EVENTS = {
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
        "/jax/core/compile/backend_compile_duration": "compile",
    }

    def _listen(event: str, seconds: float, **_) -> None:
        if event in _EVENTS:
            _spent[_EVENTS[event]] = _spent.get(_EVENTS[event], 0.0) + seconds

    monitoring.register_event_duration_secs_listener(_listen)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _spent.clear()
        started = time.time()
        yield
        record = {"test": item.nodeid, "seconds": round(time.time() - started, 3)}
        record.update({k: round(v, 3) for k, v in _spent.items()})
        with open(_PROFILE, "a") as f:
            f.write(json.dumps(record) + "\n")
