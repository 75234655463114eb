"""argparse types that refuse a bad value at parse time, through argparse's own error path (the
usage line, ``error: argument --beam: must be an integer >= 1, got 0``, exit status 2).

    p.add_argument("--beam", type=int_in(1), default=4)
    p.add_argument("--topp", type=float_in(0, 1, low_open=True), default=1.0)
    p.add_argument("--out", type=output_file, required=True)
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable, Optional

# ISO 639-1 language codes: a language pair names two of these (plus a few three-letter codes
# that MT test sets use).
LANGUAGES = frozenset("""
aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co cr cs cu cv cy da de
dv dz ee el en eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia id
ie ig ii ik io is it iu ja jv ka kg ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu
lv mg mh mi mk ml mn mr ms mt my na nb nd ne ng nl nn no nr nv ny oc oj om or os pa pi pl ps pt qu
rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st su sv sw ta te tg th ti tk tl tn to tr
ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu fil yue mni tdt
""".split())


def int_in(low: Optional[int] = None, high: Optional[int] = None) -> Callable[[str], int]:
    """An integer in [low, high] (either end may be None: unbounded)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {_range(low, high)}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def float_in(low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high]; ``low_open`` / ``high_open`` exclude an end."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad = not math.isfinite(value)
        bad |= low is not None and (value <= low if low_open else value < low)
        bad |= high is not None and (value >= high if high_open else value > high)
        if bad:
            lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
            hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
            bounds = " and ".join(x for x in (lo, hi) if x)
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + bounds if bounds else ''}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


def _range(low, high) -> str:
    if low is not None and high is not None:
        return f"in {low}..{high}"
    return f">= {low}" if low is not None else f"<= {high}"


def output_file(text: str) -> Path:
    """A file to write: not an existing directory, in a directory that exists or can be made and
    can be written (``_writable_place``)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; give the path of the file to write")
    _writable_place(path)
    return path


def output_dir(text: str) -> Path:
    """A directory to write into: an existing one, or one that can be made (``_writable_place``)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file, not a directory")
    _writable_place(path)
    return path


def _writable_place(path: Path) -> None:
    """Refuse at parse time what would fail only after the work is done: a path through a loop of
    symbolic links, under a file, or in a directory where nothing can be created (read-only, or
    another user's). Writability is tried, not read from the mode bits, which do not bind root
    and say nothing of a read-only mount: a temporary file is made in the nearest existing
    directory and removed at once."""
    import tempfile

    try:
        resolved = path.resolve()
    except (RuntimeError, OSError) as e:  # Python < 3.13 raises RuntimeError for a loop
        raise argparse.ArgumentTypeError(f"{path}: cannot be resolved ({e})") from None
    if resolved.is_file():
        parent = resolved.parent  # an existing file is replaced: a new one is made beside it
    else:
        parent = next(q for q in [resolved, *resolved.parents] if q.exists())
        if parent == resolved and not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is not a regular file (a device, a pipe or a socket)")
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{parent} is a file, so {path} cannot be created")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".write-test.")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot write in {parent} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def input_file(text: str) -> Path:
    """A file to read (``-`` is standard input and passes as it is)."""
    path = Path(text)
    if text != "-":
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a directory, not a file")
        if not path.exists():
            raise argparse.ArgumentTypeError(f"no such file: {path}")
    return path


def existing_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {path}")
    return path


def checkpoint_tag(text: str) -> str:
    """The name of a checkpoint inside a run's ``checkpoints/`` (``update_001000``): a plain name,
    so that it cannot point elsewhere (``../x``, an absolute path)."""
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected the name of a checkpoint in the run's checkpoints/ directory "
                                         f"(e.g. update_001000), got {text!r}")
    return text


def _pair(text: str) -> list:
    parts = text.split("-")
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected a language pair like en-de, got {text!r}")
    return parts


def corpus_pair(text: str) -> str:
    """``src-tgt`` naming a corpus's two file suffixes: 2-3 lowercase letters each, different.

    Data preparation needs no more than that (the generated corpus is en-xx); scoring, which picks
    a tokenizer by language, takes `language_pair`.
    """
    parts = _pair(text)
    bad = [p for p in parts if not (2 <= len(p) <= 3 and p.isascii() and p.isalpha() and p.islower())]
    if bad:
        raise argparse.ArgumentTypeError(f"language code {bad[0]!r} in {text!r} is not 2-3 lowercase letters (e.g. en-de)")
    if parts[0] == parts[1]:
        raise argparse.ArgumentTypeError(f"source and target are the same language in {text!r}")
    return text


def language_pair(text: str) -> str:
    """``src-tgt``, two known language codes (ISO 639-1) that differ."""
    parts = _pair(text)
    unknown = [p for p in parts if p not in LANGUAGES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown language code {unknown[0]!r} in {text!r} (ISO 639-1 codes, e.g. en-de)")
    if parts[0] == parts[1]:
        raise argparse.ArgumentTypeError(f"source and target are the same language in {text!r}")
    return text
