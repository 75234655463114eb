"""Source-side noise for noised-beam back-translation (Edunov et al. 2018; fairseq's
``WordDropout`` / ``WordShuffle`` / blanking, applied to whitespace words of the synthetic source):

- word dropout: each word is deleted with probability ``drop`` (0.1);
- blanking: each remaining word is replaced by ``BLANK`` with probability ``blank`` (0.1). The
  placeholder is the unknown piece ``<unk>`` (fairseq blanks with the unk word); when the noised
  text is binarized, :func:`encode_with_blanks` maps each placeholder to the unknown id (3), so a
  blank is one token the model cannot read;
- local shuffle: word i gets the score ``i + U(0, k)`` (k = 3) and the words are sorted by score,
  so no word ends more than ``k - 1`` (< 3) positions away from where it was.

Everything is drawn from one ``numpy.random.Generator`` (seeded per shard): reproducible.
"""

from __future__ import annotations

import numpy as np

BLANK = "<unk>"


def noise_words(words: list[str], rng: np.random.Generator, drop: float = 0.1, blank: float = 0.1,
                shuffle_k: float = 3.0) -> list[str]:
    """Dropout, then blanking, then local shuffle of one sentence's words. A sentence never
    loses all its words to dropout (one survivor is kept, as in fairseq)."""
    if not words:
        return []
    n = len(words)
    keep = rng.random(n) >= drop
    if not keep.any():
        keep[rng.integers(n)] = True
    words = [w for w, k in zip(words, keep) if k]
    blanks = rng.random(len(words)) < blank
    words = [BLANK if b else w for w, b in zip(words, blanks)]
    if shuffle_k > 1 and len(words) > 1:
        scores = np.arange(len(words)) + rng.uniform(0, shuffle_k, size=len(words))
        words = [words[i] for i in np.argsort(scores, kind="stable")]
    return words


def noise_line(line: str, rng: np.random.Generator, **kw) -> str:
    return " ".join(noise_words(line.split(), rng, **kw))


def encode_with_blanks(sp, lines: list[str]) -> list[list[int]]:
    """``sp.encode`` (a SubwordModel), except that each whitespace word equal to ``BLANK``
    becomes the single unknown id. Encoding the word runs between blanks separately gives the
    same pieces as encoding them together (every word starts with SentencePiece's space mark)."""
    out: list[list[int]] = []
    plain = [i for i, line in enumerate(lines) if BLANK not in line.split()]
    encoded = dict(zip(plain, sp.encode([lines[i] for i in plain]))) if plain else {}
    for i, line in enumerate(lines):
        if i in encoded:
            out.append(list(encoded[i]))
            continue
        ids: list[int] = []
        run: list[str] = []
        for w in line.split() + [None]:
            if w is None or w == BLANK:
                if run:
                    ids += sp.encode([" ".join(run)])[0]
                    run = []
                if w is not None:
                    ids.append(sp.unk_id)
            else:
                run.append(w)
        out.append(ids)
    return out
