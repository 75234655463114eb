"""Tests for the generated default corpus (admin_ds.data.corpus) and the joint SentencePiece
model wrapper (admin_ds.data.subword).

Linguistic properties are checked on the *strings* the generator emits, using the
lexicon only to know what the right xx word is, so the tests exercise the same
realisation code a training run consumes.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from pathlib import Path

import pytest
import sacrebleu
import sentencepiece as spm

from admin_ds.data import corpus
from admin_ds.data.corpus import (
    ADJECTIVES, AGREEMENT_SUFFIXES, LEXICON_SEED, PRONOUNS, SRC_LANG, TGT_LANG,
    build_lexicon, generate_corpus, write_default_corpus,
)
from admin_ds.data.subword import (
    BOS, EOS, PAD, UNK, SubwordModel, VocabSizeError, train_subword_model,
)

LEX = build_lexicon(LEXICON_SEED)
NOUN_FORMS = {}  # English noun form -> (entry, "sg"|"pl")
for _entry in LEX.nouns.values():
    NOUN_FORMS[_entry.sg] = (_entry, "sg")
    NOUN_FORMS[_entry.pl] = (_entry, "pl")


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str]]:
    return generate_corpus(6000, seed=99)


def _words(sentence: str) -> list[str]:
    return re.findall(r"[^\s,.?]+|[,.?]", sentence)


def _cap(word: str) -> str:
    return word[0].upper() + word[1:]


# --------------------------------------------------------------------------------------
# Corpus: determinism and surface form
# --------------------------------------------------------------------------------------


def test_same_seed_same_corpus_different_seed_different():
    a = generate_corpus(500, seed=7)
    assert a == generate_corpus(500, seed=7)
    assert generate_corpus(200, seed=7) == a[:200]  # a prefix of a longer corpus
    b = generate_corpus(500, seed=8)
    assert a != b and len(set(a) & set(b)) < 50  # only a few short sentences coincide


def test_lexicon_is_deterministic_and_invented():
    assert build_lexicon.__wrapped__(LEXICON_SEED) == LEX  # rebuilt from scratch
    stems = [n.stem for n in LEX.nouns.values()] + list(LEX.adjectives.values()) + list(LEX.verbs.values())
    assert len(stems) == len(set(stems)), "content stems must be unique"
    english = corpus._english_vocabulary()
    assert not set(stems) & english
    assert {n.gender for n in LEX.nouns.values()} == {"m", "f"}
    assert 150 <= len(english) <= 400


def test_surface_form(pairs):
    for en, xx in pairs:
        assert 4 <= sum(w not in ",.?" for w in _words(en)) <= 25, en
        for s in (en, xx):
            assert s[0].isupper() and s[-1] in ".?" and s == s.strip() and "  " not in s, s
        assert en[-1] == xx[-1]
    assert len({en for en, _ in pairs}) == len({xx for _, xx in pairs}) == len(pairs)
    # Structure is actually exercised.
    joined = "\n".join(en for en, _ in pairs)
    for marker in (", because", " that ", " who ", " which ", "?", ", and", " a lot of ",
                   " in front of ", "twelve", " will "):
        assert marker in joined, marker


def test_translation_is_a_function_of_the_source():
    # Sample with repetitions (no dedupe): one English string must never receive two
    # different translations, otherwise a perfect model could not reach 100 BLEU.
    seen: dict[str, str] = {}
    repeats = 0
    for en, xx in itertools.islice(corpus._sample_pairs(seed=5), 40_000):
        if en in seen:
            repeats += 1
            assert seen[en] == xx, en
        seen[en] = xx
    assert repeats > 10  # the check had something to compare


# --------------------------------------------------------------------------------------
# Corpus: morphology and word order
# --------------------------------------------------------------------------------------


def test_adjectives_follow_the_noun_and_agree(pairs):
    """"The ADJ [ADJ] NOUN ..." -> "DET.agr NOUN [ADJ.agr] ADJ.agr ..." (mirrored)."""
    checked = set()
    for en, xx in pairs:
        e, x = _words(en), _words(xx)
        n_adj = 2 if e[1] in ADJECTIVES and e[2] in ADJECTIVES else 1
        if e[0] != "The" or e[1] not in ADJECTIVES or e[1 + n_adj] not in NOUN_FORMS:
            continue
        noun, number = NOUN_FORMS[e[1 + n_adj]]
        adjs = e[1:1 + n_adj]
        xx_noun = noun.stem if number == "sg" else noun.xx_pl
        expected = ([_cap(LEX.agree(LEX.determiners["the"], noun.gender, number)), xx_noun]
                    + [LEX.agree(LEX.adjectives[a], noun.gender, number) for a in reversed(adjs)])
        assert x[:len(expected)] == expected, (en, xx)
        suffix = AGREEMENT_SUFFIXES[noun.gender, number]
        assert all(w.endswith(suffix) for w in expected[2:])
        checked.add((noun.gender, number, n_adj))
    # Every gender x number combination, with one and two adjectives, was seen.
    assert len(checked) == 8, checked


def test_gender_is_lexical():
    """Same English determiner and adjective, different xx suffixes by noun gender."""
    masc = next(n for n in LEX.nouns.values() if n.gender == "m")
    fem = next(n for n in LEX.nouns.values() if n.gender == "f")
    the, big = LEX.determiners["the"], LEX.adjectives["big"]
    assert LEX.agree(the, masc.gender, "sg") != LEX.agree(the, fem.gender, "sg")
    assert LEX.agree(big, masc.gender, "pl") != LEX.agree(big, fem.gender, "pl")


def _verb_tables():
    """English finite form -> (base, tense, person-numbers it can have)."""
    table = {}
    for base, past in corpus.TRANSITIVE_VERBS + corpus.INTRANSITIVE_VERBS:
        table[past] = (base, "past", None)
        table[base] = (base, "pres", {"1sg", "2sg", "1pl", "3pl"})
        table[corpus._third_singular(base)] = (base, "pres", {"3sg"})
    return table


def test_verb_conjugation_and_verb_final_subordinate_clauses(pairs):
    """Main clause "PRON VERB the NOUN ..." keeps SVO; after a subordinator the same
    clause is SOV: "..., because PRON VERB the NOUN." -> "..., X PRON DET NOUN VERB."."""
    verbs = _verb_tables()
    main = r"^(I|You|He|She|We|They) (\w+) the (\w+)[ .,]"
    sub = r", (because|when|while|although) (I|you|he|she|we|they) (\w+) the (\w+)\.$"
    n_main = n_sub = 0
    for en, xx in pairs:
        for m, is_sub in ((re.search(main, en), False), (re.search(sub, en), True)):
            if not m:
                continue
            conj, pron, verb, noun = (m.groups() if is_sub else (None, *m.groups()))
            pron = pron if pron == "I" else pron.lower()
            if verb not in verbs or noun not in NOUN_FORMS:
                continue
            base, tense, persons = verbs[verb]
            person = PRONOUNS[pron][0]
            assert persons is None or person in persons, en
            entry, number = NOUN_FORMS[noun]
            v = LEX.conjugate(LEX.verbs[base], tense, person)
            obj = [LEX.agree(LEX.determiners["the"], entry.gender, number),
                   entry.stem if number == "sg" else entry.xx_pl]
            p = LEX.pronouns[pron]
            if is_sub:
                expected = " ".join([",", LEX.function_words[conj], p, *obj, v]) + "."
                assert xx.replace(",", " ,").endswith(expected.replace(",", " ,")), (en, xx)
                n_sub += 1
            else:
                assert xx.startswith(" ".join([_cap(p), v, *obj])), (en, xx)
                n_main += 1
    assert n_main >= 20 and n_sub >= 5, (n_main, n_sub)


def test_questions_idioms_and_numerals(pairs):
    q, tomorrow, front = LEX.function_words["question"], LEX.adverbs["tomorrow"], LEX.prepositions["in front of"]
    assert len(tomorrow.split()) == 2 and len(front.split()) == 1
    n_q = 0
    for en, xx in pairs:
        if en.endswith("?"):
            assert xx.startswith(_cap(q) + " "), (en, xx)
            assert en.split()[0] in {"Do", "Does", "Did", "Will", "Am", "Is", "Are", "Was", "Were"}
            n_q += 1
        if en.endswith(" tomorrow."):
            assert f" {tomorrow}" in xx, (en, xx)  # verb-final clauses put it before the verb
        if " in front of " in en:
            assert f" {front} " in xx, (en, xx)
    assert n_q >= 100
    # xx numerals are compositional: 13 = 10 + 3, 20 = 2 + 10.
    assert LEX.numerals[13] == LEX.numerals[10] + LEX.numerals[3]
    assert LEX.numerals[20] == LEX.numerals[2] + LEX.numerals[10]


# --------------------------------------------------------------------------------------
# Corpus: files, splits, baseline
# --------------------------------------------------------------------------------------


def test_write_default_corpus_splits_are_disjoint_and_atomic(tmp_path):
    info = write_default_corpus(tmp_path / "data", n_train=3000, n_valid=200, n_test=200, seed=11)
    assert info["counts"] == {"train": 3000, "valid": 200, "test": 200}
    assert (info["src_lang"], info["tgt_lang"]) == (SRC_LANG, TGT_LANG) == ("en", "xx")
    text = {}
    for split in ("train", "valid", "test"):
        for lang in (SRC_LANG, TGT_LANG):
            path = Path(info["files"][split][lang])
            assert path == tmp_path / "data" / f"{split}.{lang}"
            raw = path.read_bytes().decode("utf-8")
            assert raw.endswith("\n")
            text[split, lang] = raw.splitlines()
            assert len(text[split, lang]) == info["counts"][split]
    for lang in (SRC_LANG, TGT_LANG):
        train = set(text["train", lang])
        assert not train & set(text["valid", lang])
        assert not train & set(text["test", lang])
        assert not set(text["valid", lang]) & set(text["test", lang])
    assert not list((tmp_path / "data").glob("*.tmp"))
    # Held-out sets do not move when the training set grows.
    info2 = write_default_corpus(tmp_path / "data2", n_train=500, n_valid=200, n_test=200, seed=11)
    for split in ("valid", "test"):
        assert Path(info2["files"][split]["xx"]).read_text("utf-8").splitlines() == text[split, "xx"]


def test_copy_baseline_bleu_is_low(pairs):
    src = [en for en, _ in pairs[:2000]]
    ref = [xx for _, xx in pairs[:2000]]
    assert sacrebleu.corpus_bleu(src, [ref]).score < 5.0
    assert sacrebleu.corpus_bleu(ref, [ref]).score == pytest.approx(100.0)


# --------------------------------------------------------------------------------------
# Subword model
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("spm")
    info = write_default_corpus(root / "data", n_train=4000, n_valid=200, n_test=100, seed=5)
    files = [info["files"]["train"][SRC_LANG], info["files"]["train"][TGT_LANG]]
    model = train_subword_model(files, root / "model" / "spm.joint", vocab_size=600,
                                user_defined_symbols=["<BT>"], seed=1)
    return {"root": root, "info": info, "files": files, "model": model}


@pytest.fixture(scope="module")
def sw(spm_dir) -> SubwordModel:
    return SubwordModel(spm_dir["model"])


def test_training_writes_atomically(spm_dir):
    model_dir = spm_dir["model"].parent
    assert sorted(p.name for p in model_dir.iterdir()) == ["spm.joint.model", "spm.joint.vocab"]
    assert spm_dir["model"] == model_dir / "spm.joint.model"


def test_special_ids_and_reserved_symbol(sw):
    assert (sw.bos_id, sw.pad_id, sw.eos_id, sw.unk_id) == (BOS, PAD, EOS, UNK) == (0, 1, 2, 3)
    assert [sw.piece(i) for i in range(5)] == ["<s>", "<pad>", "</s>", "<unk>", "<BT>"]
    assert sw.id_of("<BT>") == 4 and sw.id_of("</s>") == EOS
    assert sw.vocab_size == len(sw) == 600
    ids = sw.encode(["<BT> The dog sleeps."])[0]
    assert ids.count(4) == 1
    assert sw.decode([ids]) == ["<BT> The dog sleeps."]
    with pytest.raises(KeyError):
        sw.id_of("<bt>")
    with pytest.raises(IndexError):
        sw.piece(600)


def test_round_trip_is_exact(sw, spm_dir):
    info = spm_dir["info"]
    for lang in (SRC_LANG, TGT_LANG):
        lines = Path(info["files"]["valid"][lang]).read_text("utf-8").splitlines()
        ids = sw.encode(lines)
        assert all(ids) and all(UNK not in seq for seq in ids)
        assert sw.decode(ids) == lines
    assert sw.encode([]) == [] and sw.decode([]) == []
    with pytest.raises(TypeError):
        sw.encode("a bare string")


def test_decode_stops_at_eos_and_drops_specials(sw):
    ids = sw.encode(["The dog sleeps.", "Anna runs."], add_eos=True)
    assert all(seq[-1] == EOS and seq.count(EOS) == 1 for seq in ids)
    a, b = ids
    padded = [[BOS] + a + [PAD, PAD], b + [PAD] * 3, [BOS] + b[:-1] + [EOS] + a]
    assert sw.decode(padded) == ["The dog sleeps.", "Anna runs.", "Anna runs."]
    np = pytest.importorskip("numpy")
    assert sw.decode([np.array(a)]) == ["The dog sleeps."]


def test_sha256_and_reproducible_training(sw, spm_dir, tmp_path):
    assert sw.sha256 == hashlib.sha256(spm_dir["model"].read_bytes()).hexdigest()
    again = train_subword_model(spm_dir["files"], tmp_path / "again", vocab_size=600,
                                user_defined_symbols=["<BT>"], seed=1)
    assert SubwordModel(again).sha256 == sw.sha256
    # Retraining over an existing model replaces it in place (bpe this time).
    bpe = train_subword_model(spm_dir["files"], tmp_path / "again", vocab_size=400, model_type="bpe")
    assert bpe == again and SubwordModel(bpe).vocab_size == 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.model", "again.vocab"]


def test_too_large_vocab_gives_clear_error(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("the cat sat on the mat\nthe dog sat on the log\n", encoding="utf-8")
    with pytest.raises(VocabSizeError, match=r"too large.*smaller vocab_size \(<= \d+\)") as err:
        train_subword_model([tiny], tmp_path / "out" / "m", vocab_size=1000)
    assert isinstance(err.value, ValueError) and 4 < err.value.suggested < 100
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written left behind
    model = train_subword_model([tiny], tmp_path / "out" / "m", vocab_size=err.value.suggested)
    assert SubwordModel(model).vocab_size == err.value.suggested
    with pytest.raises(FileNotFoundError):
        train_subword_model([tmp_path / "missing.txt"], tmp_path / "m2", vocab_size=100)


def test_non_fairseq_model_is_rejected(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("the cat sat on the mat\nthe dog sat on the log\n", encoding="utf-8")
    # SentencePiece defaults: <unk>=0, <s>=1, </s>=2, no pad.
    spm.SentencePieceTrainer.train(input=str(tiny), model_prefix=str(tmp_path / "plain"),
                                   vocab_size=30, hard_vocab_limit=False, minloglevel=2)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "plain.model"))):
        SubwordModel(tmp_path / "plain.model")
