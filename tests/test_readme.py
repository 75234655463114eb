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
# The documents whose commands are checked: the front page, the training guide and every recipe.
DOCS = ["README.md", "docs/training.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs/recipes").glob("*.md"))]
# The module whose argument parser each entry point uses (a script, or a module run with -m).
ENTRY = {"launch/train.py": "launch/train.py", "launch/translate.py": "launch/translate.py",
         "launch/average_checkpoints.py": "launch/average_checkpoints.py", "launch/export.py": "launch/export.py",
         "launch/evaluate.py": "launch/evaluate.py", "launch/models.py": "launch/models.py",
         "launch/analyze.py": "launch/analyze.py", "launch/cluster_env.py": "launch/cluster_env.py",
         "launch/atlas.py": "launch/atlas.py",
         "data_prep/prepare_wmt14.sh": "data_prep.prepare", "data_prep/backtranslate.sh": "data_prep.backtranslate",
         "data_prep.prepare": "data_prep.prepare", "data_prep.backtranslate": "data_prep.backtranslate"}


def code_lines(path: str) -> list[str]:
    """The lines of a Markdown file's shell code: fenced ```bash blocks and indented blocks."""
    lines, out, fence = (REPO / path).read_text(encoding="utf-8").splitlines(), [], None
    for line in lines:
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence is not None:
            out.append(line if fence in ("bash", "sh", "") else "")
        else:
            out.append(line[4:] if line.startswith("    ") else "")
    return out


def doc_commands(path: str) -> list[list[str]]:
    """The shell commands of one document, continuation lines joined."""
    commands, current = [], ""
    for line in code_lines(path):
        if not line.strip() or line.strip().startswith("#"):
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
            continue  # not a command (a log excerpt, a listing)
        tokens = shlex.split(text)
        if any(t in ENTRY or t.endswith(".sbatch") for t in tokens):
            commands.append(tokens)
    return commands


def readme_commands() -> list[list[str]]:
    return [cmd for path in DOCS for cmd in doc_commands(path)]


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
    if entry.endswith(".sh"):
        cmd = ["bash", str(REPO / entry)]
    elif entry.endswith(".py"):
        cmd = [sys.executable, str(REPO / entry)]
    else:
        cmd = [sys.executable, "-m", entry]
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


def test_the_front_page_is_short_and_its_links_resolve():
    """The README is a front page (<= ~150 lines); every relative link of it and of the docs it
    points to names a file of the repository."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "docs/recipes").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to {target}, which does not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_every_document_names_files_that_exist(doc):
    """Repository paths in a document's code (scripts, configs, JSONs) exist."""
    for line in code_lines(doc):
        for word in re.findall(r"(?:launch|ds_configs|data_prep|bench)/[\w./-]+\.(?:py|sh|json|yaml|sbatch)", line):
            assert (REPO / word).is_file(), f"{doc} names {word}, which does not exist"
