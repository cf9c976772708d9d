"""Compilation paid once: traced programs kept with jax.export, compile time measured."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.inference import compilation


def _affine(params, x, *, scale):
    return {"y": x @ params["w"] * scale + params["b"]}


@pytest.fixture
def export_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(compilation, "_export_dir", tmp_path / "exported")
    monkeypatch.setattr(compilation, "_calls", {})
    return tmp_path / "exported"


def test_cached_call_keeps_the_traced_program_and_reuses_it(export_dir, monkeypatch):
    params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
    x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    want = _affine(params, x, scale=2.0)["y"]
    got = compilation.cached_call(_affine, {"scale": 2.0}, params, x)["y"]
    np.testing.assert_array_equal(got, want)
    files = list(export_dir.glob("*.jaxexport"))
    assert len(files) == 1
    # Another static value or shape is another program; the same ones are not traced again.
    compilation.cached_call(_affine, {"scale": 3.0}, params, x)
    compilation.cached_call(_affine, {"scale": 2.0}, params, x[:2])
    assert len(list(export_dir.glob("*.jaxexport"))) == 3

    # A new process (the in-memory table emptied) deserializes: tracing would fail here.
    monkeypatch.setattr(compilation, "_calls", {})

    def no_tracing(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(jax.export, "export", no_tracing)
    again = compilation.cached_call(_affine, {"scale": 2.0}, params, x)["y"]
    np.testing.assert_array_equal(again, want)

    # A damaged file is traced again and replaced, never an error.
    monkeypatch.undo()
    monkeypatch.setattr(compilation, "_export_dir", export_dir)
    monkeypatch.setattr(compilation, "_calls", {})
    files[0].write_bytes(b"not a program")
    np.testing.assert_array_equal(
        compilation.cached_call(_affine, {"scale": 2.0}, params, x)["y"], want
    )
    assert files[0].read_bytes() != b"not a program"


def test_cached_call_is_a_plain_call_without_the_cache(monkeypatch):
    monkeypatch.setattr(compilation, "_export_dir", None)
    calls = []

    def fn(x, *, k):
        calls.append(k)
        return x + k

    assert compilation.cached_call(fn, {"k": 1}, 2) == 3 and calls == [1]


def test_compile_timer_counts_programs_and_time():
    with compilation.CompileTimer() as t:
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.25)(jnp.arange(7.0)).block_until_ready()
    assert t.programs >= 1 and t.seconds > 0
    with compilation.CompileTimer() as t:  # nothing new to compile
        jnp.arange(3.0).block_until_ready()
    assert t.programs <= 1


def test_default_cache_dir_follows_jax_variable(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    assert compilation.default_cache_dir() == "/somewhere"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert compilation.default_cache_dir() == "/xdg/tx_jax/jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
    assert compilation.use_persistent_cache() is None  # '' turns it off


def test_dispatch_returns_every_result_in_order_and_builds_each_key_first():
    """Results in call order whatever thread ran them; a key's first call ends before any
    other call of that key starts (it builds the program the others use)."""
    log, lock = [], threading.Lock()
    keys = ["a", "b", "a", "c", "b", "a", "c", "a"]

    def make(i):
        def call():
            with lock:
                log.append(("start", i))
            time.sleep(0.01 if i < 4 else 0.0)
            with lock:
                log.append(("end", i))
            return i * i

        return call

    out = compilation.dispatch([make(i) for i in range(len(keys))], keys, workers=3)
    assert out == [i * i for i in range(len(keys))]
    for key in set(keys):
        first = keys.index(key)
        first_end = log.index(("end", first))
        for i in (j for j, k in enumerate(keys) if k == key and j != first):
            assert log.index(("start", i)) > first_end, (key, i)


def test_dispatch_builds_one_program_at_a_time_and_runs_ready_calls_meanwhile(monkeypatch):
    """With one build slot, keys' first calls never overlap; a ready key's call runs while
    another key builds (here the build waits for it: run one after the other, it would time
    out), and a call's error reaches the caller."""
    monkeypatch.setattr(compilation, "_build_slots", threading.BoundedSemaphore(1))
    ran = threading.Event()
    running, most, lock = [0], [0], threading.Lock()

    def build(result, wait=False):
        def call():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            if wait:
                assert ran.wait(timeout=10), "the ready call did not run during the build"
            else:
                time.sleep(0.02)
            with lock:
                running[0] -= 1
            return result

        return call

    def ready_call():
        ran.set()
        return "a2"

    calls = [build("a0"), build("b1", wait=True), ready_call, build("c3")]
    out = compilation.dispatch(calls, ["a", "b", "a", "c"], workers=2)
    assert out == ["a0", "b1", "a2", "c3"] and most[0] == 1

    def fails():
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        compilation.dispatch([lambda: 1, fails, lambda: 3, lambda: 4], [0, 1, 0, 1], workers=2)
    assert compilation.dispatch([lambda: 5], ["only"], workers=4) == [5]
    assert compilation._build_slots.acquire(blocking=False)  # every slot given back
