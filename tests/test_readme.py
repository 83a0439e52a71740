"""The front page holds: at most about 150 lines; every command in its code blocks runs as written,
as far as a CPU without a TPU, a GPU or gcloud can tell (each `make` target dry-run with its
variables, each `tpu-lora` and `python` command parsed by that command's own parser, each script's
flags found in its own argument loop, each file it names present, each extra in pyproject.toml);
and every link of the README and docs/ reaches a file, and a heading there where it names one."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import tomllib
from conftest import REPO

from finetuning_pipeline import cli

README = REPO / "README.md"
# Programs the front page names that are not this repository's: their commands are theirs to check.
ELSEWHERE = {"gcloud", "llama-cli"}
ENVIRONMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")  # PJRT_DEVICE=TPU before a command


def commands(markdown: str) -> list[list[str]]:
    """The commands of the ```bash blocks (continuation lines joined, comments dropped, `a && b`
    as two commands, a leading `cd DIR` and the environment's assignments left out), and of the
    tables whose last column is a command (the performance table's)."""
    lines = [line for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"^\|.*\| `([^`]+)` \|$", markdown, flags=re.M)
    found = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while words:
            command = words[:words.index("&&")] if "&&" in words else words
            words = words[len(command) + 1:]
            while command and ENVIRONMENT.match(command[0]):
                command = command[1:]
            if command and command[0] != "cd":
                found.append(command)
    return found


class Parsed(Exception):
    """Raised where a command's parser has read its arguments: nothing of the command runs."""


def parse_only(monkeypatch, module: str, argv: list[str]) -> argparse.Namespace:
    """`module`'s main(argv) up to its argument parser's first pass, which parses for real (choices,
    types, required flags; an error is argparse's exit 2): the namespace, or a failure naming the
    flags the parser does not know."""
    original = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = original(self, args, namespace)
        raise Parsed(parsed, [extra for extra in extras if extra.startswith("-")])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    with pytest.raises(Parsed) as caught:
        importlib.import_module(module).main(argv)
    parsed, unknown = caught.value.args
    assert unknown == [], f"{module}: {unknown} unknown to its parser"
    return parsed


def check_command(monkeypatch, command: list[str]) -> None:
    program, args = command[0], command[1:]
    name = Path(program).name
    if name == "make":
        variables = [arg for arg in args if "=" in arg]
        for value in (arg.split("=", 1)[1] for arg in variables if arg.startswith("CONFIG=")):
            assert (REPO / value).is_file(), f"make {args}: {value} is not in the repository"
        done = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, f"make {args}: {done.stderr}"
    elif name == "tpu-lora":
        assert args[0] in cli.COMMANDS, f"tpu-lora {args[0]}: no such command ({sorted(cli.COMMANDS)})"
        parsed = parse_only(monkeypatch, cli.COMMANDS[args[0]][0], args[1:])
        config = getattr(parsed, "config", None)
        if config and "/" in config:  # a repository's config, not a placeholder like my.yaml
            assert (REPO / config).is_file(), config
    elif name in ("python", "python3"):
        assert args[0] == "-m", command
        parse_only(monkeypatch, args[1], args[2:])
    elif name == "pip":
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for wanted in re.findall(r"\.\[([\w,-]+)\]", " ".join(args)):
            assert set(wanted.split(",")) <= set(extras), f"pip {args}: extras {wanted} (pyproject: {sorted(extras)})"
    elif name.endswith(".sh") or name == "bash":
        script = args[0] if name == "bash" else program
        flags = args[1:] if name == "bash" else args
        path = REPO / script if (REPO / script).is_file() else REPO / "utils" / "tpu_vm" / Path(script).name
        assert path.is_file(), f"{script}: no such script"
        text = path.read_text()
        for flag in (flag for flag in flags if flag.startswith("--")):
            assert re.search(rf"^\s*{re.escape(flag)}\)", text, flags=re.M), f"{script}: {flag} is not in its arguments"
    else:
        assert name in ELSEWHERE, f"{command}: a program the README test does not know"


def test_the_front_page_is_short():
    assert len(README.read_text().splitlines()) <= 150


def test_the_readme_names_the_commands_it_is_checked_by():
    """What the test below checks is there: the set-up commands, tpu-lora, and the other kinds."""
    kinds = {Path(command[0]).name for command in commands(README.read_text())}
    assert {"make", "tpu-lora", "pip", "python", "gcloud", "bash", "llama-cli"} <= kinds, kinds
    assert ["make", "demo"] in commands(README.read_text()) and ["make", "test"] in commands(README.read_text())


@pytest.mark.parametrize("command", commands(README.read_text()), ids=" ".join)
def test_each_command_on_the_front_page_runs_as_written(monkeypatch, command):
    check_command(monkeypatch, command)


def test_a_command_written_wrong_is_caught(monkeypatch):
    """The checks can fail: an unknown flag, a bad choice, a missing make target, script flag or
    extra, and an unknown program each fail."""
    wrong = [["tpu-lora", "train", "--confg", "my.yaml"], ["tpu-lora", "export", "--format", "onnx"],
             ["tpu-lora", "trian"], ["make", "demoo"], ["utils/tpu_vm/gcloud_tpuvm.sh", "--spott"],
             ["pip", "install", "-e", ".[gpus]"], ["python", "-m", "benchmarks.gpu_bench", "--stepz", "10"],
             ["curl", "example.com"]]
    for command in wrong:
        with pytest.raises((AssertionError, SystemExit)):
            check_command(monkeypatch, command)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, what is not a letter, digit, space, `-` or `_`
    dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.+)$", text, flags=re.M)}


PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_each_link_reaches_its_page_and_heading(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading in {linked.relative_to(REPO)}")
    assert broken == []
