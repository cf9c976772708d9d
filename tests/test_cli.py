"""The `tx_jax` console script (tx_jax/cli/__init__.py): its verbs, their help, a wrong verb;
the same through `python -m tx_jax` and `python -m tx_jax.main`, and setup.cfg's entry point."""

from __future__ import annotations

import configparser
import os
import pathlib
import sys

import forked
import pytest

from tx_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
EVERY_VERB = (
    "train",
    "evaluate",
    "translate",
    "score",
    "prepare",
    "export",
    "import",
    "plan",
    "sweep",
    "visualize",
    "generate",
)


def test_every_verb_has_its_module_and_one_line():
    assert tuple(cli.VERBS) == EVERY_VERB
    for verb, (module, line) in cli.VERBS.items():
        assert (ROOT / "tx_jax" / "cli" / f"{module}.py").is_file(), verb
        assert line and "\n" not in line and len(line) <= 80, verb


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["help"], []])
def test_help_lists_every_verb_one_line_each(argv, capsys):
    status = cli.main(["tx_jax", *argv])
    assert status == (2 if not argv else 0)  # no verb at all is a usage error
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == list(EVERY_VERB)
    for verb in EVERY_VERB:
        (line,) = [x for x in out.splitlines() if x.split()[:1] == [verb]]
        assert line.split(None, 1)[1] == cli.VERBS[verb][1]


def test_an_unknown_verb_exits_2_with_one_line_naming_it(capsys):
    assert cli.main(["tx_jax", "evalute", "--workdir=w"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "'evalute'" in line and all(verb in line for verb in EVERY_VERB)


def test_setup_cfg_installs_the_console_script():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = setup["options.entry_points"]["console_scripts"].split("\n")
    assert [s.strip() for s in scripts if s.strip()] == ["tx_jax = tx_jax.cli:main"]


def test_the_module_forms_answer_as_the_console_script():
    """`python -m tx_jax ...` is the console script; `python -m tx_jax.main` is `train`; each
    verb's --help shows its usage as `tx_jax VERB` and its own flags (absl's --help lists
    the flags of the program's module; here the verb's)."""
    commands = [
        ("tx_jax", ["--help"]),
        ("tx_jax", ["nope"]),
        ("tx_jax", ["train", "--help"]),
        ("tx_jax.main", ["--help"]),
        ("tx_jax", ["help", "evaluate"]),
        ("tx_jax", ["plan", "--help"]),
        ("tx_jax", ["generate", "--help"]),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    runs = forked.run_modules(commands, cwd=ROOT, env=env, parallel=2, timeout=300)
    (code, out, err), (bad_code, bad_out, bad_err), *verbs = runs
    assert code == 0 and all(f"  {verb} " in out for verb in EVERY_VERB), out + err
    assert bad_code == 2 and bad_out == "" and len(bad_err.splitlines()) == 1, bad_err
    train, main, evaluate, plan, generate = [out + err for _, out, err in verbs]
    for text in (train, main):
        assert "tx_jax train --config=configs/default.py" in text and "--workdir:" in text
    assert "tx_jax evaluate --workdir=" in evaluate and "--beam_size:" in evaluate
    assert "--average_last:" in evaluate  # the checkpoint flags cli/common.py defines
    assert "usage: tx_jax plan" in plan and "--target TARGET" in plan
    assert "tx_jax generate --workdir=" in generate and "--num_samples" in generate
    assert all("Traceback" not in text for text in (train, main, evaluate, plan, generate))
    assert [code for code, _, _ in verbs] == [1, 1, 1, 0, 0]  # absl's --help exits 1


def test_run_hands_the_verb_its_arguments_as_sys_argv(monkeypatch, capsys):
    """A verb's module sees `tx_jax VERB` as the program and the arguments after the verb."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys.modules["__main__"], "__doc__", sys.modules["__main__"].__doc__)
    status = cli.main(["tx_jax", "sweep", "experiments/table3_cpu.py", "--tpu=vm", "--parallel=2"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("tx_jax sweep: "), err
    assert sys.argv == ["tx_jax sweep", "experiments/table3_cpu.py", "--tpu=vm", "--parallel=2"]
