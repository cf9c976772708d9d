"""Decoding data-parallel over local devices (inference/data_parallel.py): batches stacked
for D devices, and the same hypotheses whether one device or several decode them."""

import numpy as np
import pytest
from helpers import run_python

from tx_jax.inference import data_parallel

# the module's 4-device checks share one process: one xdist worker runs them (launch.sh's
# --dist loadfile; this mark does the same under --dist loadgroup)
pytestmark = pytest.mark.xdist_group("data_parallel")


def _batch(rows, length, first_index):
    inputs = np.zeros((len(rows), length), np.int32)
    for r, n in enumerate(rows):
        inputs[r, :n] = np.arange(1, n + 1) + 4
    index = np.arange(first_index, first_index + len(rows), dtype=np.int32)
    mask = np.array([n > 0 for n in rows], np.int32)
    return {"inputs": inputs, "example_index": np.where(mask, index, -1), "example_mask": mask}


def test_group_batches_stacks_consecutive_batches_one_per_device():
    batches = [_batch([7, 6], 8, 0), _batch([4, 3], 4, 2), _batch([2, 0], 4, 4)]
    groups = data_parallel.group_batches(batches, 2)
    assert [g["inputs"].shape for g in groups] == [(4, 8), (4, 4)]
    first = groups[0]
    np.testing.assert_array_equal(first["inputs"][:2], batches[0]["inputs"])
    np.testing.assert_array_equal(first["inputs"][2:, :4], batches[1]["inputs"])
    assert not first["inputs"][2:, 4:].any()  # padding columns only
    np.testing.assert_array_equal(first["example_index"], [0, 1, 2, 3])
    last = groups[1]  # the short group: a padding batch for the second device
    np.testing.assert_array_equal(last["example_index"], [4, -1, -1, -1])
    np.testing.assert_array_equal(last["example_mask"], [1, 0, 0, 0])
    assert not last["inputs"][2:].any()
    assert data_parallel.group_batches(batches, 1) == batches


DEVICES_FOR = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
from tx_jax.inference import data_parallel
one = {"w": jax.device_put(jnp.ones(4), jax.devices()[2])}
assert data_parallel.devices_for(one) == jax.local_devices()
mesh = Mesh(np.array(jax.devices()), ("d",))
spread = {"w": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("d")))}
assert data_parallel.devices_for(spread) == []
"""


def _decode(tfds_dir, base) -> str:
    """Trains a tiny model, then decodes its validation split on 1 and on 4 devices."""
    return f"""
import jax
jax.config.update("jax_disable_most_optimizations", True)
from helpers import tiny_config
from tx_jax.data import tasks
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.inference import compilation, data_parallel, restore, quality
# two eval shapes (each one program per search and device count); 60 steps: varied outputs
config = tiny_config({str(tfds_dir)!r}, **{{"train.num_steps": 60, "train.warmup_steps": 10,
                                           "checkpoint.every": 60, "data.eval_batch_size": 4,
                                           "data.eval_bucket_boundaries": [16, 32]}})
train_and_evaluate(config, {str(base / "run")!r})
loaded = restore.load({str(base / "run")!r})
task = tasks.Task(loaded.config.data, loaded.tokenizer, loaded.config.seed)
batches = task.eval_batches("validation", 1)
n = len(task.pairs("validation"))
assert len(batches) >= 5 and len({{b["inputs"].shape for b in batches}}) >= 2
seen = []
real = data_parallel.Rows.__call__
def spy(self, fn, static, inputs):
    out = real(self, fn, static, inputs)
    seen.append(len(jax.tree.leaves(out)[0].sharding.device_set))
    return out
data_parallel.Rows.__call__ = spy
for cache, beams in (({str(base / "cache")!r}, (1, 3)), ("", (3,))):
    compilation.use_persistent_cache(cache)
    for beam in beams:
        kw = dict(beam_size=beam)
        one = quality.translate_batches(loaded.model_config, loaded.params, batches,
                                        loaded.tokenizer, n, devices=jax.devices()[:1], **kw)
        four = quality.translate_batches(loaded.model_config, loaded.params, batches,
                                         loaded.tokenizer, n, **kw)
        assert one == four, (cache, beam)
        assert len(set(one)) >= 5
assert set(seen) == {{1, 4}}, seen
"""


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory, tfds_dir) -> str:
    """One process with 4 CPU devices runs the module's checks that need them, each in its
    own namespace: its output, with `PART name ok` or `PART name failed` and the traceback."""
    base = tmp_path_factory.mktemp("four_devices")
    parts = {"devices_for": DEVICES_FOR, "decode": _decode(tfds_dir, base)}
    code = "import sys, traceback\n" + "".join(
        f"try:\n    exec({text!r}, {{}})\n    print('PART {name} ok', flush=True)\n"
        f"except BaseException:\n    print('PART {name} failed', flush=True)\n"
        "    traceback.print_exc(file=sys.stdout)\n"
        for name, text in parts.items()
    )
    return run_python(code, devices=4)


def test_devices_for_params_on_one_device_or_spread(four_devices):
    assert "PART devices_for ok" in four_devices, four_devices[-6000:]


def test_four_devices_decode_what_one_does(four_devices):
    """A tiny model's validation split, greedy and beam 3, decoded on 1 and on 4 CPU devices
    (with the persistent cache on; beam 3 also with it off): the same hypotheses; the
    4-device program's outputs live on all four."""
    assert "PART decode ok" in four_devices, four_devices[-6000:]
