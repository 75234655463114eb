"""The README's commands, checked against the code from the quick-start install: every script it
runs exists and starts (``--help`` in a subprocess: its imports work with requirements.txt), every
option it uses is one of that script's options, every run-config override names a real field, and
every file of the repository it names exists. The commands that need data or a trained model are
run for real by the tests of their scripts (test_translate.py, test_data_prep.py, ...)."""

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from distributed import REPO

ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
# The module whose argument parser each entry point of the README uses.
ENTRY = {"launch/train.py": "launch/train.py", "launch/translate.py": "launch/translate.py",
         "launch/average_checkpoints.py": "launch/average_checkpoints.py", "launch/export.py": "launch/export.py",
         "launch/evaluate.py": "launch/evaluate.py", "launch/models.py": "launch/models.py",
         "launch/analyze.py": "launch/analyze.py", "launch/cluster_env.py": "launch/cluster_env.py",
         "data_prep/prepare_wmt14.sh": "data_prep.prepare", "data_prep/backtranslate.sh": "data_prep.backtranslate"}


def readme_commands() -> list[list[str]]:
    """The shell commands of the README's indented code blocks, continuation lines joined."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    commands, current = [], ""
    for line in lines:
        if not line.startswith("    ") or line.strip().startswith("#"):
            current = ""
            continue
        text = current + line.strip()
        if text.endswith("\\"):
            current = text[:-1] + " "
            continue
        current = ""
        text = re.sub(r"\s+#.*$", "", text)  # a trailing comment
        text = text.replace("[", "").replace("]", "")  # optional parts: [--json]
        if not any(entry in text for entry in ENTRY) and ".sbatch " not in text:
            continue  # not a command (the layout listing, a table)
        tokens = shlex.split(text)
        if any(t in ENTRY or t.endswith(".sbatch") for t in tokens):
            commands.append(tokens)
    return commands


COMMANDS = readme_commands()


def _parser(entry: str) -> argparse.ArgumentParser:
    """The argparse parser of an entry point: its parse_args is stopped before parsing."""
    class Got(Exception):
        pass

    caught = {}

    def grab(self, args=None, namespace=None):
        caught["parser"] = self
        raise Got

    target = ENTRY[entry]
    if target.endswith(".py"):
        import runpy

        module = runpy.run_path(str(REPO / target), run_name="readme")
        call = module.get("parse_args") or module.get("build_parser") or module["main"]
    else:
        call = importlib.import_module(target).parse_args
    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = grab
    try:
        parser = call([]) if call.__name__ != "build_parser" else call()
        return parser if isinstance(parser, argparse.ArgumentParser) else caught["parser"]
    except Got:
        return caught["parser"]
    finally:
        argparse.ArgumentParser.parse_known_args = original


def _options(parser: argparse.ArgumentParser, words: list[str]) -> set[str]:
    options = set(parser._option_string_actions)
    for action in parser._actions:  # sub-commands (models.py list / demo)
        if isinstance(action, argparse._SubParsersAction):
            for word in words:
                if word in action.choices:
                    options |= set(action.choices[word]._option_string_actions)
    return options


def test_the_readme_has_commands_for_every_entry_point():
    used = {t for cmd in COMMANDS for t in cmd if t in ENTRY}
    assert used == set(ENTRY), sorted(set(ENTRY) - used)


@pytest.mark.parametrize("entry", sorted(ENTRY))
def test_every_entry_point_starts_from_the_install(entry):
    """`--help` in a fresh process: the script's imports resolve with the installed requirements."""
    cmd = ["bash", str(REPO / entry)] if entry.endswith(".sh") else [sys.executable, str(REPO / entry)]
    if entry == "launch/models.py":
        cmd.append("list")
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in (out.stdout + out.stderr).lower()  # translate.py keeps stdout for translations


@pytest.mark.parametrize("cmd", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_readme_command_uses_real_options_and_files(cmd):
    from admin_ds.train.run_config import load_run_config

    entry = next((t for t in cmd if t in ENTRY), None)
    if entry is None:  # sbatch launch/slurm.sbatch ...: the script exists and passes its arguments on
        sbatch = next(t for t in cmd if t.endswith(".sbatch"))
        assert (REPO / sbatch).is_file(), sbatch
        entry, words = "launch/train.py", cmd[cmd.index(sbatch) + 1:]
    else:
        words = cmd[cmd.index(entry) + 1:]
    words = [w for w in words if w not in (">", "<") and not w.startswith((">", "<"))]
    options = _options(_parser(entry), words)
    overrides = []
    for word in words:
        if not word.startswith("--"):
            continue
        name = word.split("=", 1)[0]
        if entry == "launch/train.py" and "." in name and name not in options:
            overrides.append(word)  # --section.key=value
            continue
        assert name in options, f"{entry}: the README uses {name}, which it does not accept"
    if overrides:
        load_run_config(None, overrides)  # every override names a field and has its type
    for word in words:
        if word.startswith(("ds_configs/", "launch/configs/")):
            assert (REPO / word).is_file(), f"the README names {word}, which does not exist"
