"""`tpu-lora COMMAND`: one console entry point whose subcommands are the modules they name, each with
its own --help; the `python -m` and `python finetuning_pipeline/main.py` forms stay."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import tomllib
from conftest import REPO

from finetuning_pipeline import cli

pytestmark = pytest.mark.native


def test_the_console_script_is_the_cli():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tpu-lora": "finetuning_pipeline.cli:main"}
    assert list(cli.COMMANDS) == ["train", "prepare", "export", "generate", "evaluate", "preflight", "tpu-check"]


# An argument only that command has: its help is the module's own.
OWN_ARGUMENT = {"train": "--accept-changes", "prepare": "--format", "export": "--adapter-only", "generate": "--prompt",
                "evaluate": "--samples", "preflight": "--no-rehearsal", "tpu-check": "host 0 writes tpu_check.json"}


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_each_subcommand_is_its_module_with_its_own_help(name, capsys):
    assert callable(importlib.import_module(cli.COMMANDS[name][0]).main)
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    # each names itself as tpu-lora does (the python -m forms are the same commands)
    assert help_text.startswith(f"usage: tpu-lora {name} ") and OWN_ARGUMENT[name] in " ".join(help_text.split())
    with pytest.raises(SystemExit):  # `tpu-lora help NAME` is the same help
        cli.main(["help", name])
    assert capsys.readouterr().out == help_text


def test_the_version_and_help_words(capsys):
    from importlib.metadata import version

    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"tpu-lora {version('tpu-lora')}"
    assert cli.main(["help"]) == 0 and "tpu-lora help COMMAND" in capsys.readouterr().out
    assert "plan its TPU or GPU time" in cli.usage()


def test_prepares_phase_is_said_to_be_the_masking_not_the_curriculums(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["prepare", "--phase", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--phase is the masking, not the curriculum's phase: 1 trains every token" in err
    assert err.startswith("usage: tpu-lora prepare ")


def test_no_command_prints_the_list_and_an_unknown_one_is_refused(capsys):
    assert cli.main([]) == 0 and "tpu-check" in capsys.readouterr().out
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_the_module_forms_still_run():
    for command in ([sys.executable, "finetuning_pipeline/main.py", "--help"],
                    [sys.executable, "-m", "dataset.prepare", "--help"],
                    [sys.executable, "-m", "finetuning_pipeline.cli"]):
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: "), (command, proc.stderr[-2000:])
