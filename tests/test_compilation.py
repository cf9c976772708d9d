"""Compilation paid once: traced programs kept with jax.export, compile time measured."""

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
