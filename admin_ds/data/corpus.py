"""A generated English -> "xx" parallel corpus: the project's embedded default data.

Why this exists
---------------
A newcomer should be able to run the whole pipeline (subword training, binarisation,
training, decoding, BLEU) on a laptop CPU in minutes, without downloading anything.
Random token pairs would make BLEU meaningless, and a copy task would be too easy, so
this module defines a small but *structured* synthetic language pair whose translation
a tiny Transformer can visibly learn:

* **Lexicon.** ~225 English lemmas in categories (nouns, adjectives, verbs, determiners,
  numerals 1-20, prepositions, adverbs, pronouns, names, conjunctions).  The target
  language "xx" has an invented lexicon of pronounceable pseudo-words, drawn
  deterministically from :data:`LEXICON_SEED`.
* **Morphology.** Every "xx" noun has a lexical gender (``m``/``f``) that English does not
  show.  Determiners, attributive and predicative adjectives and relative pronouns agree
  with the noun in gender and number via suffixes (:data:`AGREEMENT_SUFFIXES`); verbs
  conjugate for tense and subject person/number (:data:`TENSE_SUFFIXES`,
  :data:`PERSON_SUFFIXES`), so English "will see" is one word; the present-tense copula
  is dropped ("the cat is small" -> "DET-f.sg cat small-f.sg").
* **Word order.** Adjectives follow the noun, in mirrored order ("the big red dog" ->
  "DET dog red big"); frequency adverbs follow the finite verb; in subordinate clauses
  ("because/when/while/although/that ...") and relative clauses the finite verb moves to
  the end of the clause (German-like), a clausal complement being extraposed after it;
  questions drop English do-support/inversion and take a sentence-initial particle.
* **Idioms.** Some multi-word English expressions are one "xx" word ("in front of",
  "a lot of", "every day", ...), some English words are two "xx" words ("always",
  "tomorrow", ...); "and" has two translations (NP coordination vs clause coordination).
* **Surface.** 4-25 English words, coordination and nested clauses, capitalised first
  word and final punctuation on both sides; numbers 11-20 are irregular in English but
  compositional in "xx".

The translation is a deterministic function of the English string (the grammar is
designed to be unambiguous: every string has one derivation, or all its derivations
translate identically), so a perfect model reaches 100 BLEU, while copying the source
scores < 1 BLEU.

Public API: :func:`generate_corpus`, :func:`write_default_corpus`, :func:`build_lexicon`.
"""

from __future__ import annotations

import bisect
import functools
import os
import random
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Iterator, Sequence

from admin_ds import files

__all__ = [
    "SRC_LANG",
    "TGT_LANG",
    "DEFAULT_SEED",
    "LEXICON_SEED",
    "DEFAULT_N_TRAIN",
    "DEFAULT_N_VALID",
    "DEFAULT_N_TEST",
    "AGREEMENT_SUFFIXES",
    "Lexicon",
    "build_lexicon",
    "generate_corpus",
    "write_default_corpus",
]

SRC_LANG = "en"
TGT_LANG = "xx"

DEFAULT_SEED = 1234
# The *language* (the invented lexicon and noun genders) is fixed by its own seed, separate
# from the sampling seed: corpora drawn with different ``seed`` values are different
# samples of the same language, so a model trained on one can be evaluated on another.
LEXICON_SEED = 20_240_601

DEFAULT_N_TRAIN = 30_000
DEFAULT_N_VALID = 500
DEFAULT_N_TEST = 500

MIN_WORDS = 4  # English length bounds, in words (punctuation not counted).
MAX_WORDS = 25

# ---------------------------------------------------------------------------------------
# English grammar tables
# ---------------------------------------------------------------------------------------

# (singular, irregular plural or None, semantic class).  Only "human" and "animal" nouns
# can be the subject of action verbs.  Nouns whose plural equals their singular (sheep,
# fish) are excluded: "the fish slept" would have two translations.
NOUNS: tuple[tuple[str, str | None, str], ...] = (
    ("dog", None, "animal"), ("cat", None, "animal"), ("horse", None, "animal"),
    ("bird", None, "animal"), ("mouse", "mice", "animal"), ("fox", None, "animal"),
    ("wolf", "wolves", "animal"), ("cow", None, "animal"), ("rabbit", None, "animal"),
    ("bear", None, "animal"), ("goat", None, "animal"), ("duck", None, "animal"),
    ("man", "men", "human"), ("woman", "women", "human"), ("child", "children", "human"),
    ("boy", None, "human"), ("girl", None, "human"), ("teacher", None, "human"),
    ("doctor", None, "human"), ("farmer", None, "human"), ("king", None, "human"),
    ("queen", None, "human"), ("friend", None, "human"), ("student", None, "human"),
    ("baker", None, "human"), ("sailor", None, "human"), ("neighbour", None, "human"),
    ("house", None, "thing"), ("tree", None, "thing"), ("car", None, "thing"),
    ("book", None, "thing"), ("letter", None, "thing"), ("apple", None, "thing"),
    ("table", None, "thing"), ("chair", None, "thing"), ("window", None, "thing"),
    ("door", None, "thing"), ("garden", None, "thing"), ("river", None, "thing"),
    ("mountain", None, "thing"), ("city", None, "thing"), ("village", None, "thing"),
    ("ship", None, "thing"), ("boat", None, "thing"), ("box", None, "thing"),
    ("cup", None, "thing"), ("key", None, "thing"), ("flower", None, "thing"),
    ("song", None, "thing"), ("story", None, "thing"), ("ball", None, "thing"),
    ("hat", None, "thing"), ("shoe", None, "thing"), ("road", None, "thing"),
    ("bridge", None, "thing"), ("lamp", None, "thing"), ("stone", None, "thing"),
)
# Human nouns with natural gender keep it in "xx"; all other genders are lexical (random).
NATURAL_GENDER = {"man": "m", "woman": "f", "boy": "m", "girl": "f", "king": "m", "queen": "f"}

ADJECTIVES: tuple[str, ...] = (
    "big", "small", "old", "young", "red", "blue", "green", "black", "white", "happy",
    "sad", "tired", "hungry", "quiet", "loud", "beautiful", "ugly", "new", "strong", "weak",
    "clever", "lazy", "brave", "kind", "angry", "warm", "cold", "dark", "heavy", "famous",
)

# (base, past).  Verbs whose past equals their base (read, put, cut, hit) are excluded:
# "they read the book" would be ambiguous between present and past.
TRANSITIVE_VERBS: tuple[tuple[str, str], ...] = (
    ("see", "saw"), ("eat", "ate"), ("like", "liked"), ("find", "found"), ("buy", "bought"),
    ("carry", "carried"), ("build", "built"), ("paint", "painted"), ("write", "wrote"),
    ("take", "took"), ("bring", "brought"), ("open", "opened"), ("close", "closed"),
    ("wash", "washed"), ("follow", "followed"), ("help", "helped"), ("visit", "visited"),
    ("watch", "watched"), ("catch", "caught"), ("hold", "held"), ("love", "loved"),
    ("call", "called"), ("sell", "sold"), ("draw", "drew"),
)
INTRANSITIVE_VERBS: tuple[tuple[str, str], ...] = (
    ("sleep", "slept"), ("run", "ran"), ("walk", "walked"), ("sing", "sang"),
    ("laugh", "laughed"), ("wait", "waited"), ("arrive", "arrived"), ("work", "worked"),
    ("dance", "danced"), ("swim", "swam"), ("cry", "cried"), ("play", "played"),
    ("sit", "sat"), ("jump", "jumped"),
)
# Verbs taking a "that"-clause complement; the source of recursion.
CLAUSAL_VERBS: tuple[tuple[str, str], ...] = (
    ("think", "thought"), ("say", "said"), ("know", "knew"), ("believe", "believed"),
    ("hope", "hoped"), ("hear", "heard"),
)

# Subject pronouns: English form -> (person/number, gender used for predicate agreement).
# There are no object pronouns, which keeps possessive "her" unambiguous.
PRONOUNS: dict[str, tuple[str, str]] = {
    "I": ("1sg", "m"), "you": ("2sg", "m"), "he": ("3sg", "m"), "she": ("3sg", "f"),
    "we": ("1pl", "m"), "they": ("3pl", "m"),
}

NAMES: dict[str, str] = {  # Names are copied verbatim; gender drives predicate agreement.
    "Anna": "f", "Peter": "m", "Maria": "f", "John": "m", "Lena": "f", "Tom": "m",
    "Sara": "f", "David": "m", "Emma": "f", "Paul": "m", "Lucy": "f", "Oscar": "m",
    "Nina": "f", "Victor": "m", "Rosa": "f", "Hugo": "m",
}

# Determiners: key -> (English singular form, English plural form, weight).  None means
# "not used in that number".  "a" and bare plurals translate to nothing (xx has no
# indefinite article); "a lot of" is an idiom translating to the same word as "many".
DETERMINERS: dict[str, tuple[str | None, str | None, float]] = {
    "the": ("the", "the", 10.0), "a": ("a", None, 5.0), "this": ("this", "these", 2.0),
    "every": ("every", None, 1.0), "some": (None, "some", 1.5), "many": (None, "many", 1.0),
    "a lot of": (None, "a lot of", 0.7), "no": ("no", "no", 0.6), "my": ("my", "my", 1.0),
    "your": ("your", "your", 0.8), "his": ("his", "his", 0.8), "her": ("her", "her", 0.8),
    "our": ("our", "our", 0.6), "their": ("their", "their", 0.6),
    None: (None, "", 1.5),  # bare plural ("Dogs sleep.")
}
DETERMINER_ALIASES = {"a lot of": "many"}  # Idiom: several English words -> one xx word.
ZERO_DETERMINERS = frozenset({"a", None})

NUMERALS: tuple[str, ...] = (
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
)

# Prepositions (the two multi-word ones are single xx words).
PREPOSITIONS: tuple[str, ...] = (
    "in", "on", "under", "near", "with", "behind", "without", "from", "for",
    "in front of", "next to",
)

# End-position adverbs with the tenses they are compatible with (so "yesterday" never
# meets a future verb).  Multi-word entries are one xx word.
END_ADVERBS: dict[str, tuple[str, ...]] = {
    "quickly": ("pres", "past", "fut"), "slowly": ("pres", "past", "fut"),
    "quietly": ("pres", "past", "fut"), "happily": ("pres", "past", "fut"),
    "carefully": ("pres", "past", "fut"), "loudly": ("pres", "past", "fut"),
    "well": ("pres", "past", "fut"), "today": ("pres", "past", "fut"), "now": ("pres",),
    "yesterday": ("past",), "tomorrow": ("fut",), "soon": ("fut",),
    "every day": ("pres",), "last week": ("past",), "next year": ("fut",),
    "at home": ("pres", "past", "fut"),
}
# Manner adverbs describe actions, so copula clauses ("the car was red") never take them.
MANNER_ADVERBS = frozenset({"quickly", "slowly", "quietly", "happily", "carefully", "loudly", "well"})
# Frequency adverbs sit before the main verb in English, after the finite verb in xx.
FREQUENCY_ADVERBS: tuple[str, ...] = ("often", "always", "never", "sometimes", "usually")
# Idioms the other way round: one English word -> two xx words.
ONE_TO_TWO = frozenset({"quickly", "tomorrow", "always", "sometimes"})

SUBORDINATORS: tuple[str, ...] = ("because", "when", "while", "although")
COORDINATORS: tuple[str, ...] = ("and", "but")

TENSES: tuple[str, ...] = ("pres", "past", "fut")
_TENSE_CUM_WEIGHTS = [0.4, 0.75, 1.0]  # present 40%, past 35%, future 25%

# ---------------------------------------------------------------------------------------
# "xx" morphology (fixed; only the stems are random)
# ---------------------------------------------------------------------------------------

# Determiner / adjective / relative-pronoun agreement with (gender, number).
AGREEMENT_SUFFIXES: dict[tuple[str, str], str] = {
    ("m", "sg"): "o", ("f", "sg"): "a", ("m", "pl"): "i", ("f", "pl"): "e",
}
# Verb = stem + tense suffix + person suffix ("vid" + "ar" + "a": "will see", 3sg).
TENSE_SUFFIXES: dict[str, str] = {"pres": "", "past": "ev", "fut": "ar"}
PERSON_SUFFIXES: dict[str, str] = {"1sg": "o", "2sg": "is", "3sg": "a", "1pl": "amo", "3pl": "an"}

_CONSONANTS = "b d f g k l m n p r s t v z".split()
_CLUSTERS = ["br", "tr", "kr", "st", "pl", "sk", "gl", "dr"]
# Two non-ASCII vowels, rare, so the default corpus exercises the UTF-8 path end to end.
_VOWELS = ["a", "e", "i", "o", "u", "å", "ø"]
_VOWEL_WEIGHTS = [5, 4, 4, 4, 3, 0.4, 0.4]
_CODAS = ["n", "r", "l", "s", "k", "m", "t"]


# ---------------------------------------------------------------------------------------
# Lexicon
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NounEntry:
    """An English noun and its "xx" counterpart."""

    sg: str
    pl: str
    kind: str  # "human" | "animal" | "thing"
    stem: str  # xx singular
    gender: str  # "m" | "f"

    @property
    def xx_pl(self) -> str:
        # Vowel-final stems take -n, consonant-final ones -en (kasa -> kasan, gat -> gaten).
        return self.stem + ("n" if self.stem[-1] in "aeiouåø" else "en")


@dataclass(frozen=True)
class Lexicon:
    """The invented "xx" lexicon: English lemma -> xx stem or word(s), per category.

    Multi-word values (idioms) are stored as space-separated strings.
    """

    nouns: dict[str, NounEntry]
    adjectives: dict[str, str]  # stems; inflect with :meth:`agree`
    verbs: dict[str, str]  # English base -> stem; inflect with :meth:`conjugate`
    determiners: dict[str, str]  # key -> stem (zero determiners absent)
    pronouns: dict[str, str]
    numerals: dict[int, str]
    prepositions: dict[str, str]
    adverbs: dict[str, str]  # end-position and frequency adverbs
    function_words: dict[str, str]  # conjunctions, particles, copula, relative stem
    english_past: dict[str, str] = field(repr=False)

    @staticmethod
    def agree(stem: str, gender: str, number: str) -> str:
        """Inflect a determiner/adjective/relative stem for (gender, number)."""
        return stem + AGREEMENT_SUFFIXES[gender, number]

    @staticmethod
    def conjugate(stem: str, tense: str, person: str) -> str:
        """Inflect a verb stem for tense and subject person/number ("3sg", ...)."""
        return stem + TENSE_SUFFIXES[tense] + PERSON_SUFFIXES[person]


def _english_vocabulary() -> set[str]:
    """Every English word form the grammar can emit (the invented words must avoid them)."""
    words: set[str] = {"do", "does", "did", "will", "not", "be", "am", "is", "are", "was",
                       "were", "who", "which", "that", "and", "but", "an"}
    for sg, pl, _ in NOUNS:
        words |= {sg, pl or _plural(sg)}
    words |= set(ADJECTIVES) | set(NUMERALS) | set(FREQUENCY_ADVERBS) | set(SUBORDINATORS)
    for base, past in TRANSITIVE_VERBS + INTRANSITIVE_VERBS + CLAUSAL_VERBS:
        words |= {base, past, _third_singular(base)}
    for phrase in list(DETERMINERS) + list(PREPOSITIONS) + list(END_ADVERBS):
        if phrase:
            words |= set(phrase.split())
    words |= {w.lower() for w in PRONOUNS} | {n.lower() for n in NAMES}
    return words


class _WordMaker:
    """Draws unique, pronounceable pseudo-words from a seeded RNG."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._english = _english_vocabulary()
        self._taken = set(self._english)

    def _syllable(self, onset_p: float = 1.0) -> str:
        rng = self._rng
        onset = ""
        if rng.random() < onset_p:
            onset = rng.choice(_CLUSTERS) if rng.random() < 0.12 else rng.choice(_CONSONANTS)
        return onset + rng.choices(_VOWELS, _VOWEL_WEIGHTS)[0]

    def word(self, syllables: tuple[int, int], closed: bool | None,
             suffixes: Sequence[str] = ("",)) -> str:
        """A fresh word of ``syllables`` (min, max) syllables.

        ``closed`` forces a final consonant (True), a final vowel (False) or lets the
        RNG decide (None).  Stems that take vowel suffixes are closed so inflected forms
        stay pronounceable and segmentable (``grand`` + ``o``).  No ``word + suffix`` for
        the given inflectional ``suffixes`` may be an English word (the determiner stem
        "som" would make xx "som-e" look like English "some").
        """
        rng = self._rng
        while True:
            n = rng.randint(*syllables)
            w = "".join(self._syllable() for _ in range(n))
            if closed or (closed is None and rng.random() < 0.5):
                w += rng.choice(_CODAS)
            # Unique stems (and distinct from English words, so copying never "works").
            if (len(w) >= 2 and w not in self._taken
                    and not any(w + suffix in self._english for suffix in suffixes)):
                self._taken.add(w)
                return w

    def phrase(self, n_words: int, syllables: tuple[int, int]) -> str:
        return " ".join(self.word(syllables, closed=None) for _ in range(n_words))


@functools.lru_cache(maxsize=8)
def build_lexicon(seed: int = LEXICON_SEED) -> Lexicon:
    """Build the (deterministic) xx lexicon for ``seed``.

    The draw order below is part of the language definition: reordering it changes
    every word, so append new categories at the end.
    """
    make = _WordMaker(seed)
    rng = random.Random(seed ^ 0x5EED)  # genders: independent of the word draws

    nouns = {}
    for sg, pl, kind in NOUNS:
        stem = make.word((1, 2), closed=None, suffixes=("", "n", "en"))
        gender = NATURAL_GENDER.get(sg) or rng.choice("mf")
        nouns[sg] = NounEntry(sg, pl or _plural(sg), kind, stem, gender)

    adjectives = {a: make.word((1, 2), closed=True, suffixes=_AGREEMENT) for a in ADJECTIVES}
    verbs = {b: make.word((1, 2), closed=True, suffixes=_VERB_ENDINGS)
             for b, _ in TRANSITIVE_VERBS + INTRANSITIVE_VERBS + CLAUSAL_VERBS}
    determiners = {d: make.word((1, 1), closed=True, suffixes=_AGREEMENT)
                   for d in DETERMINERS if d not in ZERO_DETERMINERS and d not in DETERMINER_ALIASES}
    for alias, target in DETERMINER_ALIASES.items():
        determiners[alias] = determiners[target]
    pronouns = {p: make.word((1, 2), closed=False) for p in PRONOUNS}

    # Numerals: 1-9 and 10 are words; 11-19 are "ten" + unit and 20 is "two" + "ten",
    # written as one word: regular in xx although English "eleven, twelve" are not.
    units = [make.word((1, 1), closed=False) for _ in range(9)]
    ten = make.word((1, 1), closed=True)
    numerals = {i + 1: units[i] for i in range(9)}
    numerals[10] = ten
    numerals.update({10 + i: ten + units[i - 1] for i in range(1, 10)})
    numerals[20] = units[1] + ten

    prepositions = {p: make.word((1, 2), closed=None) for p in PREPOSITIONS}
    adverbs = {}
    for adv in list(END_ADVERBS) + list(FREQUENCY_ADVERBS):
        adverbs[adv] = make.phrase(2, (1, 2)) if adv in ONE_TO_TWO else make.word((2, 3), None)

    function_words = {
        "and:np": make.word((1, 1), closed=False),  # "the cat and the dog"
        "and:clause": make.word((1, 1), closed=False),  # ", and the dog sleeps"
        "but": make.word((1, 2), closed=None),
        "that": make.word((1, 1), closed=False),
        **{s: make.word((1, 2), closed=None) for s in SUBORDINATORS},
        "not": make.word((1, 1), closed=False),
        "question": make.word((1, 1), closed=False),
        # Past/future only (the present copula is zero), so it always carries a suffix.
        "copula": make.word((1, 1), closed=True, suffixes=_VERB_ENDINGS),
        "rel": make.word((1, 1), closed=True, suffixes=_AGREEMENT),  # agrees with its head
    }
    english_past = {b: p for b, p in TRANSITIVE_VERBS + INTRANSITIVE_VERBS + CLAUSAL_VERBS}
    return Lexicon(nouns, adjectives, verbs, determiners, pronouns, numerals, prepositions,
                   adverbs, function_words, english_past)


_AGREEMENT = tuple(AGREEMENT_SUFFIXES.values())
_VERB_ENDINGS = tuple(t + p for t in TENSE_SUFFIXES.values() for p in PERSON_SUFFIXES.values())


def _plural(sg: str) -> str:
    if sg.endswith(("s", "x", "ch", "sh")):
        return sg + "es"
    if sg.endswith("y") and sg[-2] not in "aeiou":
        return sg[:-1] + "ies"
    return sg + "s"


def _third_singular(base: str) -> str:
    if base.endswith(("s", "x", "ch", "sh", "o")):
        return base + "es"
    if base.endswith("y") and base[-2] not in "aeiou":
        return base[:-1] + "ies"
    return base + "s"


# ---------------------------------------------------------------------------------------
# Abstract syntax: sampled once, then realised in both languages
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class NP:
    """A noun phrase.  ``kind``: "noun", "name", "pron" or "coord" (of ``parts``)."""

    kind: str
    head: str = ""
    det: str | None = None
    numeral: int | None = None
    plural: bool = False
    adjs: tuple[str, ...] = ()
    rel: Clause | None = None  # relative clause; its ``subj`` is None (the head)
    parts: tuple[NP, ...] = ()


@dataclass(slots=True)
class Clause:
    """A clause.  ``kind``: "trans", "intrans", "copula" (``pred`` adjective) or "say"
    (clausal verb whose complement ``comp`` is introduced by "that")."""

    kind: str
    subj: NP | None
    verb: str = ""
    obj: NP | None = None
    pred: str = ""
    pps: tuple[tuple[str, NP], ...] = ()
    adv: str | None = None
    freq: str | None = None
    tense: str = "pres"
    neg: bool = False
    comp: Clause | None = None


@dataclass(slots=True)
class Sentence:
    """``clauses[0] (conj clauses[1])* [, sub_conj sub]``, or a question (one clause)."""

    clauses: list[Clause]
    conjs: list[str]
    sub_conj: str | None = None
    sub: Clause | None = None
    question: bool = False


def _person(np: NP) -> str:
    if np.kind == "pron":
        return PRONOUNS[np.head][0]
    if np.kind == "coord":
        return "3pl"  # only third-person NPs are coordinated
    return "3pl" if np.plural else "3sg"


def _gender(np: NP, lex: Lexicon) -> str:
    if np.kind == "pron":
        return PRONOUNS[np.head][1]
    if np.kind == "name":
        return NAMES[np.head]
    if np.kind == "coord":
        # Like French/Spanish: masculine unless every conjunct is feminine.
        return "f" if all(_gender(p, lex) == "f" for p in np.parts) else "m"
    return lex.nouns[np.head].gender


def _number(np: NP) -> str:
    return "pl" if _person(np).endswith("pl") else "sg"


# ---------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------


class _Sampler:
    """Samples :class:`Sentence` trees.  All randomness flows through one ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.animate = [sg for sg, _, kind in NOUNS if kind != "thing"]
        self.all_nouns = [sg for sg, _, _ in NOUNS]
        self.names = list(NAMES)
        self.pronouns = list(PRONOUNS)
        sg = [(d, w) for d, (s, _, w) in DETERMINERS.items() if s is not None]
        pl = [(d, w) for d, (_, p, w) in DETERMINERS.items() if p is not None]
        self.sg_dets = [d for d, _ in sg]
        self.sg_cum = list(accumulate(w for _, w in sg))
        self.pl_dets = [d for d, _ in pl]
        self.pl_cum = list(accumulate(w for _, w in pl))
        self.adverbs_by_tense = {t: [a for a, ts in END_ADVERBS.items() if t in ts] for t in TENSES}
        self.copula_adverbs_by_tense = {
            t: [a for a in advs if a not in MANNER_ADVERBS] for t, advs in self.adverbs_by_tense.items()}
        self.transitive = [base for base, _ in TRANSITIVE_VERBS]
        self.intransitive = [base for base, _ in INTRANSITIVE_VERBS]
        self.clausal = [base for base, _ in CLAUSAL_VERBS]
        self.random = rng.random

    # ``random.choice``/``choices`` dominate the profile; indexing with ``random()`` is
    # ~3x cheaper and just as deterministic (generation speed matters: 40k pairs < 5 s).
    def _choice(self, seq: Sequence):
        return seq[int(self.random() * len(seq))]

    def _pick(self, items: Sequence, cum: list[float]):
        return items[bisect.bisect_right(cum, self.random() * cum[-1])]

    # -- noun phrases -------------------------------------------------------------------

    def noun_np(self, pool: list[str]) -> NP:
        rng = self.rng
        np = NP("noun", self._choice(pool))
        if rng.random() < 0.08:
            np.numeral = 1 + int(rng.random() * 20)
            np.plural = np.numeral != 1
        else:
            np.plural = rng.random() < 0.35
            np.det = (self._pick(self.pl_dets, self.pl_cum) if np.plural
                      else self._pick(self.sg_dets, self.sg_cum))
        r = rng.random()
        n_adj = 0 if r < 0.55 else 1 if r < 0.9 else 2
        if n_adj:
            first = self._choice(ADJECTIVES)
            if n_adj == 1:
                np.adjs = (first,)
            else:
                second = first
                while second == first:
                    second = self._choice(ADJECTIVES)
                np.adjs = (first, second)
        return np

    def object_np(self) -> NP:
        r = self.rng.random()
        if r < 0.12:
            return NP("name", self._choice(self.names))
        if r < 0.17:
            return NP("coord", parts=(self._simple_np(self.all_nouns), self._simple_np(self.all_nouns)))
        return self.noun_np(self.all_nouns)

    def _simple_np(self, pool: list[str]) -> NP:
        """A name or a noun phrase (a conjunct in coordination)."""
        if self.rng.random() < 0.3:
            return NP("name", self._choice(self.names))
        return self.noun_np(pool)

    def subject_np(self, animate: bool, allow_rel: bool) -> NP:
        rng = self.rng
        r = rng.random()
        if r < 0.18:
            return NP("pron", self._choice(self.pronouns))
        if r < 0.32:
            return NP("name", self._choice(self.names))
        pool = self.animate if animate else self.all_nouns
        if r < 0.37:
            # Coordinated subjects never carry relative clauses: in "the dog which sees the
            # cat and the man sleep" the conjunct boundary would be ambiguous.
            return NP("coord", parts=(self._simple_np(pool), self._simple_np(pool)))
        np = self.noun_np(pool)
        if allow_rel and rng.random() < 0.1 and np.head in self.animate:
            np.rel = self.relative_clause()
        return np

    def relative_clause(self) -> Clause:
        # Deliberately plain (no negation, adverbs, coordination or nesting) so that the
        # clause boundary is always unambiguous in English.
        rng = self.rng
        tense = self._choice(TENSES)
        if rng.random() < 0.6:
            verb = self._choice(self.transitive)
            return Clause("trans", None, verb, obj=self.noun_np(self.all_nouns), tense=tense)
        verb = self._choice(self.intransitive)
        pps = ((self._choice(PREPOSITIONS), self.noun_np(self.all_nouns)),) if rng.random() < 0.5 else ()
        return Clause("intrans", None, verb, pps=pps, tense=tense)

    # -- clauses ------------------------------------------------------------------------

    def clause(self, depth: int, question: bool = False) -> Clause:
        rng = self.rng
        r = rng.random()
        kind = ("trans" if r < 0.45 else "intrans" if r < 0.7 else "copula" if r < 0.86
                else "say" if depth < 2 else "trans")
        tense = self._pick(TENSES, _TENSE_CUM_WEIGHTS)
        c = Clause(kind, self.subject_np(animate=kind != "copula", allow_rel=not question),
                   tense=tense)
        # Negation and "never" are mutually exclusive; questions are never negated.
        if not question and rng.random() < 0.12:
            c.neg = True
        elif rng.random() < 0.1:
            c.freq = self._choice(FREQUENCY_ADVERBS)
        if kind == "say":
            c.verb = self._choice(self.clausal)
            c.comp = self.clause(depth + 1)
            return c  # no PPs/adverbs: they would be ambiguous with the complement's
        if kind == "trans":
            c.verb = self._choice(self.transitive)
            c.obj = self.object_np()
        elif kind == "intrans":
            c.verb = self._choice(self.intransitive)
        else:
            c.pred = self._choice(ADJECTIVES)
        r = rng.random()
        n_pp = 0 if r < 0.65 else 1 if r < 0.95 else 2
        c.pps = tuple((self._choice(PREPOSITIONS), self._pp_np()) for _ in range(n_pp))
        if rng.random() < 0.25:
            table = self.copula_adverbs_by_tense if kind == "copula" else self.adverbs_by_tense
            c.adv = self._choice(table[tense])
        return c

    def _pp_np(self) -> NP:
        if self.rng.random() < 0.1:
            return NP("name", self._choice(self.names))
        return self.noun_np(self.all_nouns)

    def sentence(self) -> Sentence:
        rng = self.rng
        if rng.random() < 0.08:
            return Sentence([self.clause(depth=1, question=True)], [], question=True)
        clauses, conjs = [self.clause(depth=0)], []
        if rng.random() < 0.15:
            conjs.append(self._choice(COORDINATORS))
            clauses.append(self.clause(depth=1))
        s = Sentence(clauses, conjs)
        # A subordinate clause is only ever sentence-final: anything after it would be
        # ambiguous between attaching inside it (verb-final order) or outside it.
        if rng.random() < 0.2:
            s.sub_conj = self._choice(SUBORDINATORS)
            s.sub = self.clause(depth=1)
        return s


# ---------------------------------------------------------------------------------------
# Realisation: English
# ---------------------------------------------------------------------------------------


def _en_np(np: NP, lex: Lexicon) -> list[str]:
    if np.kind in ("name", "pron"):
        return [np.head]
    if np.kind == "coord":
        return _en_np(np.parts[0], lex) + ["and"] + _en_np(np.parts[1], lex)
    noun = lex.nouns[np.head]
    out: list[str] = []
    rest = list(np.adjs) + [noun.pl if np.plural else noun.sg]
    if np.numeral is not None:
        out.append(NUMERALS[np.numeral - 1])
    elif np.det is not None:
        sg, pl, _ = DETERMINERS[np.det]
        det = pl if np.plural else sg
        if det == "a" and rest[0][0] in "aeiou":
            det = "an"
        out.extend(det.split())
    out += rest
    if np.rel is not None:
        out.append("who" if noun.kind == "human" else "which")
        out += _en_predicate(np.rel, _person(np), lex)
    return out


def _en_finite(base: str, tense: str, person: str, lex: Lexicon) -> str:
    if tense == "past":
        return lex.english_past[base]
    return _third_singular(base) if person == "3sg" else base


def _en_be(tense: str, person: str) -> str:
    if tense == "pres":
        return "am" if person == "1sg" else "is" if person == "3sg" else "are"
    return "was" if person in ("1sg", "3sg") else "were"


def _en_predicate(c: Clause, person: str, lex: Lexicon, question: bool = False) -> list[str]:
    """English verb group plus complements; for questions, without the fronted auxiliary
    (see :func:`_en_question_aux`)."""
    out: list[str] = []
    freq = [c.freq] if c.freq else []
    if c.kind == "copula":
        if question:
            out += (["be"] if c.tense == "fut" else []) + freq
        elif c.tense == "fut":
            out += ["will"] + (["not"] if c.neg else []) + freq + ["be"]
        else:
            out += [_en_be(c.tense, person)] + (["not"] if c.neg else []) + freq
        out.append(c.pred)
    else:
        if question:
            out += freq + [c.verb]
        elif c.neg:
            aux = "will" if c.tense == "fut" else "did" if c.tense == "past" else (
                "does" if person == "3sg" else "do")
            out += [aux, "not", c.verb]
        elif c.tense == "fut":
            out += ["will"] + freq + [c.verb]
        else:
            out += freq + [_en_finite(c.verb, c.tense, person, lex)]
    if c.kind == "say":
        return out + ["that"] + _en_clause(c.comp, lex)
    if c.obj is not None:
        out += _en_np(c.obj, lex)
    for prep, np in c.pps:
        out += prep.split() + _en_np(np, lex)
    if c.adv:
        out += c.adv.split()
    return out


def _en_question_aux(c: Clause, person: str) -> str:
    if c.tense == "fut":
        return "will"
    if c.kind == "copula":
        return _en_be(c.tense, person)
    return "did" if c.tense == "past" else "does" if person == "3sg" else "do"


def _en_clause(c: Clause, lex: Lexicon) -> list[str]:
    return _en_np(c.subj, lex) + _en_predicate(c, _person(c.subj), lex)


def _en_sentence(s: Sentence, lex: Lexicon) -> list[str]:
    if s.question:
        c = s.clauses[0]
        person = _person(c.subj)
        return ([_en_question_aux(c, person)] + _en_np(c.subj, lex)
                + _en_predicate(c, person, lex, question=True) + ["?"])
    out = _en_clause(s.clauses[0], lex)
    for conj, c in zip(s.conjs, s.clauses[1:]):
        out += [",", conj] + _en_clause(c, lex)
    if s.sub is not None:
        out += [",", s.sub_conj] + _en_clause(s.sub, lex)
    return out + ["."]


# ---------------------------------------------------------------------------------------
# Realisation: xx
# ---------------------------------------------------------------------------------------


def _xx_np(np: NP, lex: Lexicon) -> list[str]:
    if np.kind == "name":
        return [np.head]
    if np.kind == "pron":
        return [lex.pronouns[np.head]]
    if np.kind == "coord":
        return _xx_np(np.parts[0], lex) + [lex.function_words["and:np"]] + _xx_np(np.parts[1], lex)
    noun = lex.nouns[np.head]
    number = "pl" if np.plural else "sg"
    out: list[str] = []
    if np.numeral is not None:
        out.append(lex.numerals[np.numeral])
    elif np.det not in ZERO_DETERMINERS:
        out.append(lex.agree(lex.determiners[np.det], noun.gender, number))
    out.append(noun.xx_pl if np.plural else noun.stem)
    # Adjectives follow the noun, mirrored: "big red dog" -> "dog red big".
    out += [lex.agree(lex.adjectives[a], noun.gender, number) for a in reversed(np.adjs)]
    if np.rel is not None:
        out.append(lex.agree(lex.function_words["rel"], noun.gender, number))
        out += _xx_clause(np.rel, lex, subordinate=True, subj=np)
    return out


def _xx_clause(c: Clause, lex: Lexicon, subordinate: bool, subj: NP | None = None) -> list[str]:
    """Realise a clause in xx.

    Main order:        SUBJ [NEG] VERB [FREQ] OBJ PP* [ADV]
    Subordinate order: SUBJ [FREQ] OBJ PP* [ADV] [NEG] VERB      (verb-final)
    A "that"-complement is extraposed after the verb in both orders.  A relative clause
    passes its head as ``subj`` (for agreement) but does not repeat it.
    """
    head = subj if subj is not None else c.subj
    person, gender, number = _person(head), _gender(head, lex), _number(head)
    fw = lex.function_words
    neg = [fw["not"]] if c.neg else []
    freq = lex.adverbs[c.freq].split() if c.freq else []
    if c.kind == "copula":
        # Present-tense copula is zero; the predicate adjective agrees with the subject.
        verb = [] if c.tense == "pres" else [lex.conjugate(fw["copula"], c.tense, person)]
        pred = [lex.agree(lex.adjectives[c.pred], gender, number)]
        if not verb:  # nothing to move: negation attaches to the adjective
            complements, neg = neg + pred, []
        else:
            complements = pred
    else:
        verb = [lex.conjugate(lex.verbs[c.verb], c.tense, person)]
        complements = []
    if c.obj is not None:
        complements += _xx_np(c.obj, lex)
    for prep, np in c.pps:
        complements += [lex.prepositions[prep]] + _xx_np(np, lex)
    if c.adv:
        complements += lex.adverbs[c.adv].split()
    extraposed = [",", fw["that"]] + _xx_clause(c.comp, lex, subordinate=True) if c.comp else []

    out = [] if subj is not None else _xx_np(c.subj, lex)
    if subordinate:
        out += freq + complements + neg + verb
    else:
        out += neg + verb + freq + complements
    return out + extraposed


def _xx_sentence(s: Sentence, lex: Lexicon) -> list[str]:
    fw = lex.function_words
    if s.question:
        return [fw["question"]] + _xx_clause(s.clauses[0], lex, subordinate=False) + ["?"]
    out = _xx_clause(s.clauses[0], lex, subordinate=False)
    for conj, c in zip(s.conjs, s.clauses[1:]):
        out += [",", fw["and:clause"] if conj == "and" else fw[conj]]
        out += _xx_clause(c, lex, subordinate=False)
    if s.sub is not None:
        out += [",", fw[s.sub_conj]] + _xx_clause(s.sub, lex, subordinate=True)
    return out + ["."]


def _detokenize(tokens: list[str]) -> str:
    text = " ".join(tokens).replace(" ,", ",").replace(" .", ".").replace(" ?", "?")
    return text[0].upper() + text[1:]


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def _sample_pairs(seed: int, lexicon_seed: int = LEXICON_SEED) -> Iterator[tuple[str, str]]:
    """Endless stream of (en, xx) pairs within the length bounds; may repeat."""
    lex = build_lexicon(lexicon_seed)
    sampler = _Sampler(random.Random(seed))
    while True:
        s = sampler.sentence()
        en = _en_sentence(s, lex)
        n_words = len(en) - en.count(",") - 1  # minus commas and the final . or ?
        if MIN_WORDS <= n_words <= MAX_WORDS:
            yield _detokenize(en), _detokenize(_xx_sentence(s, lex))


def generate_corpus(n_pairs: int, seed: int = DEFAULT_SEED, *,
                    lexicon_seed: int = LEXICON_SEED) -> list[tuple[str, str]]:
    """Return ``n_pairs`` distinct (English, xx) sentence pairs, deterministically.

    Pairs are distinct on *both* sides (the xx side can repeat when English idioms
    share a translation, e.g. "many"/"a lot of"), so any split of the result into
    train/valid/test shares no sentence in either language.  The same ``seed`` always
    gives the same list, and a prefix of a longer corpus equals the shorter corpus.
    """
    if n_pairs < 0:
        raise ValueError(f"n_pairs must be >= 0, got {n_pairs}")
    pairs: list[tuple[str, str]] = []
    seen_src: set[str] = set()
    seen_tgt: set[str] = set()
    # The sentence space is astronomically larger than any sensible corpus; the cap only
    # turns a hypothetical exhaustion into an error instead of an endless loop.
    budget = 20 * n_pairs + 1000
    for attempt, (en, xx) in enumerate(_sample_pairs(seed, lexicon_seed)):
        if len(pairs) == n_pairs:
            break
        if attempt >= budget:
            raise RuntimeError(f"could only generate {len(pairs)} distinct pairs of {n_pairs}")
        if en in seen_src or xx in seen_tgt:
            continue
        seen_src.add(en)
        seen_tgt.add(xx)
        pairs.append((en, xx))
    return pairs


def write_default_corpus(
    out_dir: str | os.PathLike,
    n_train: int = DEFAULT_N_TRAIN,
    n_valid: int = DEFAULT_N_VALID,
    n_test: int = DEFAULT_N_TEST,
    seed: int = DEFAULT_SEED,
) -> dict:
    """Generate the default corpus and write ``{train,valid,test}.{en,xx}`` to ``out_dir``.

    The test set is drawn first and the validation set second, so both stay identical
    when ``n_train`` changes (results stay comparable across training-set sizes).  All
    sentences are distinct across splits on both sides.

    Returns ``{"dir", "src_lang", "tgt_lang", "seed", "files": {split: {lang: path}},
    "counts": {split: n}}`` with string paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = generate_corpus(n_test + n_valid + n_train, seed)
    splits = {
        "test": pairs[:n_test],
        "valid": pairs[n_test:n_test + n_valid],
        "train": pairs[n_test + n_valid:],
    }
    paths: dict[str, dict[str, str]] = {}
    for split in ("train", "valid", "test"):
        paths[split] = {}
        for side, lang in enumerate((SRC_LANG, TGT_LANG)):
            path = out / f"{split}.{lang}"
            files.write_text(path, "".join(pair[side] + "\n" for pair in splits[split]))
            paths[split][lang] = str(path)
    return {
        "dir": str(out),
        "src_lang": SRC_LANG,
        "tgt_lang": TGT_LANG,
        "seed": seed,
        "files": paths,
        "counts": {split: len(p) for split, p in splits.items()},
    }
