"""Decoding: greedy, beam search, sampling and translate against independent references (CPU).

Most tests use a debug-tiny model trained (once per module, ~10 s) to copy its input: the "half"
snapshot (45 steps, loss ~2) ends hypotheses at varied, source-dependent lengths with uncertain
tokens, which exercises early stopping and beam reordering; the "full" one (180 steps) copies.
Untrained models are degenerate here (every sentence runs to the max length repeating a token).
"""

import collections
import contextlib
import copy
import dataclasses
import itertools
import math
import os
import random
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from admin_ds.inference.decode import Hypothesis, beam_search, greedy, sample
from admin_ds.inference.translate import make_batches, translate
from admin_ds.model import build_model
from admin_ds.presets import get_preset

BOS, PAD, EOS, UNK = 0, 1, 2, 3
NO_DROPOUT = dict(dropout_p=0.0, attention_dropout_p=0.0, activation_dropout_p=0.0)
COPY_VOCAB = 24


def random_model(seed=0, vocab=1000, eos_boost=1.0, **kw):
    """An untrained debug-tiny model. ``eos_boost`` scales EOS's (tied) embedding row."""
    torch.manual_seed(seed)
    model = build_model(get_preset("debug-tiny", init="default", vocab_size=vocab, **NO_DROPOUT, **kw))
    with torch.no_grad():
        model.src_embed.weight[EOS] *= eos_boost
    return model.eval()


def copy_batch(g, n, min_len=3, max_len=8):
    """n random sequences over the copy vocabulary; src = seq+EOS, tgt_in = EOS+seq, tgt_out = seq+EOS."""
    seqs = [[g.randrange(4, COPY_VOCAB) for _ in range(g.randint(min_len, max_len))] for _ in range(n)]
    w = max(map(len, seqs)) + 1
    src, tin, tout = (torch.full((n, w), PAD) for _ in range(3))
    for i, s in enumerate(seqs):
        src[i, :len(s) + 1] = torch.tensor(s + [EOS])
        tin[i, :len(s) + 1] = torch.tensor([EOS] + s)
        tout[i, :len(s) + 1] = torch.tensor(s + [EOS])
    return seqs, src, tin, tout


class CopyModels:
    pass


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """These tensors are tiny: intra-op threads only add synchronisation, and on a busy machine
    spinning OpenMP workers slow the module down several-fold."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def copy_models():
    torch.manual_seed(0)
    cfg = get_preset("debug-tiny", init="default", vocab_size=COPY_VOCAB, max_positions=32, **NO_DROPOUT)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98), foreach=True)
    g = random.Random(0)
    out = CopyModels()
    t0 = time.time()
    steps = 180
    for step in range(steps):
        for group in opt.param_groups:  # warmup, then linear decay to 10%
            group["lr"] = 5e-3 * min((step + 1) / 20, 1.0 - 0.9 * step / steps)
        _, src, tin, tout = copy_batch(g, 48)
        loss = F.cross_entropy(model(src, tin).view(-1, COPY_VOCAB), tout.view(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 40:  # half-trained: sentences end early or at their max length (tests below)
            out.half = copy.deepcopy(model).eval()
            out.half_loss = float(loss.detach())
    out.full = model.eval()
    out.final_loss = float(loss.detach())
    out.train_seconds = time.time() - t0
    return out


def sources(seed, n, min_len=1, max_len=8):
    """A right-padded (n, S) batch of EOS-terminated copy-vocabulary sources, and the list."""
    seqs, src, _, _ = copy_batch(random.Random(seed), n, min_len, max_len)
    return src, [s + [EOS] for s in seqs]


def with_logit_bias(model, bias: dict):
    """The same model with constants added to some logits (decode is what decoding calls, and
    forward calls it too, so full-forward references see the bias as well)."""
    model = copy.deepcopy(model)
    b = torch.zeros(model.cfg.vocab_size)
    for tok, value in bias.items():
        b[tok] = value
    dec = model.decode
    model.decode = lambda *a, **k: dec(*a, **k) + b
    return model


def full_lprobs(model, src1, tgt_in):
    """Log-probs (T, V) of a whole target prefix by the full, non-incremental forward."""
    with torch.no_grad():
        logits = model(torch.tensor([src1]), torch.tensor([tgt_in]))[0]
    return F.log_softmax(logits.float(), dim=-1)


def sequence_score(model, src1, hyp, lenpen):
    """sum log p(hyp + [EOS]) / len**lenpen by one full forward (fairseq's normalized score)."""
    out = hyp + [EOS]
    lp = full_lprobs(model, src1, [EOS] + hyp)
    pos = lp[torch.arange(len(out)), torch.tensor(out)]
    return float(pos.sum()) / len(out) ** lenpen, pos


def assert_same_searches(model, reference, src, **kw):
    """Greedy and beam search (4-best, with their scores) of ``model`` equal ``reference``'s."""
    assert greedy(model, src, **kw) == greedy(reference, src, **kw)
    got = beam_search(model, src, beam=4, nbest=4, lenpen=0.6, **kw)
    want = beam_search(reference, src, beam=4, nbest=4, lenpen=0.6, **kw)
    assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
    for hs, ws in zip(got, want):
        for h, w in zip(hs, ws):
            assert h.score == pytest.approx(w.score, abs=1e-5)


# ---- 1. beam 1 is greedy ------------------------------------------------------------------------


def test_beam1_equals_greedy(copy_models):
    model = copy_models.half
    src, _ = sources(0, 24)
    g = greedy(model, src, max_len_a=1.0, max_len_b=3)
    b = beam_search(model, src, beam=1, max_len_a=1.0, max_len_b=3)
    assert [h[0].tokens for h in b] == g
    assert len({len(x) for x in g}) >= 4  # sentences stop at different steps
    assert any(len(x) == len(s) - 1 + 3 for x, s in zip(g, sources(0, 24)[1]))  # some hit max length
    assert all(EOS not in x and PAD not in x for x in g)
    # an untrained model with a large vocabulary: every sentence runs to its max length
    rnd = random_model(seed=1, vocab=1000)
    src = torch.randint(4, 1000, (6, 9))
    src[:, -1] = EOS
    src[0, 5:] = PAD
    src[0, 4] = EOS
    g = greedy(rnd, src, max_len_a=0.5, max_len_b=3)
    assert [h[0].tokens for h in beam_search(rnd, src, beam=1, max_len_a=0.5, max_len_b=3)] == g
    assert [len(x) for x in g] == [int(0.5 * 5 + 3)] + [int(0.5 * 9 + 3)] * 5


# ---- 2. scores equal a full-forward recomputation -------------------------------------------------


@pytest.mark.parametrize("lenpen", [1.0, 0.6, 0.0])
def test_beam_score_equals_full_forward_recomputation(copy_models, lenpen):
    model = copy_models.half
    src, seqs = sources(1, 10)
    results = beam_search(model, src, beam=5, lenpen=lenpen, max_len_a=1.0, max_len_b=3, nbest=3)
    assert len(results) == 10
    for hyps, s in zip(results, seqs):
        assert len(hyps) == 3
        assert hyps[0].score >= hyps[1].score >= hyps[2].score
        for h in hyps:
            want, pos = sequence_score(model, s, h.tokens, lenpen)
            assert h.score == pytest.approx(want, abs=1e-4)
            assert len(h.positional_scores) == len(h.tokens) + 1
            torch.testing.assert_close(torch.tensor(h.positional_scores), pos, atol=1e-4, rtol=0)
    assert len({len(h.tokens) for hyps in results for h in hyps}) >= 4


def test_unk_penalty_and_min_len(copy_models):
    model = with_logit_bias(copy_models.half, {UNK: 6.0})
    src, seqs = sources(2, 12, min_len=1, max_len=3)
    base = greedy(model, src, max_len_b=10)
    assert any(UNK in h for h in base)
    assert min(map(len, base)) < 4
    assert all(UNK not in h for h in greedy(model, src, max_len_b=10, unk_penalty=100.0))
    assert all(len(h) >= 4 for h in greedy(model, src, max_len_b=10, min_len=4))
    for hyps, s in zip(beam_search(model, src, beam=3, max_len_b=10, min_len=4, unk_penalty=100.0,
                                   nbest=3), seqs):
        for h in hyps:
            assert len(h.tokens) >= 4 and UNK not in h.tokens
            want, _ = sequence_score(model, s, h.tokens, 1.0)
            assert h.score == pytest.approx(want, abs=1e-4)
    # min_len never blocks the forced EOS at max length
    assert all(len(h) == 2 for h in greedy(model, src, max_len_b=2, min_len=5))


# ---- 3. a large enough beam is an exact search ----------------------------------------------------


@pytest.mark.parametrize("lenpen", [1.0, 0.3])
def test_beam_matches_exhaustive_search(lenpen):
    """Vocab 8: after the 4 specials, 6 tokens can continue a hypothesis (bos, unk, 4..7; pad
    never), 7 can follow a prefix (with EOS). With max length 3 there are 6**3 = 216 prefixes at
    the last step, so beam 216 never prunes, and every EOS candidate is among the first `beam`
    ranks: fairseq's beam search becomes exact (its early stop only drops length-3 hypotheses
    ranked below 216 - 6 - 36 = 174 among length-3 ones). Exhaustive: score all 6 + 36 + 216
    sequences (min_len=1 rules out the empty one) by a full forward."""
    model = random_model(seed=4, vocab=8, eos_boost=1.5)
    src1 = [5, 6, 7, 4, EOS]
    cont = [BOS, UNK, 4, 5, 6, 7]
    seqs = [list(p) for n in range(1, 4) for p in itertools.product(cont, repeat=n)]
    tgt_in = torch.tensor([[EOS] + s + [PAD] * (3 - len(s)) for s in seqs])
    with torch.no_grad():
        lp = F.log_softmax(model(torch.tensor([src1] * len(seqs)), tgt_in).float(), dim=-1)
    exhaustive = []
    for i, s in enumerate(seqs):
        out = s + [EOS]
        total = float(lp[i, torch.arange(len(out)), torch.tensor(out)].sum())
        exhaustive.append((total / len(out) ** lenpen, s))
    exhaustive.sort(key=lambda x: -x[0])

    got = beam_search(model, torch.tensor([src1]), beam=216, lenpen=lenpen, max_len_b=3, nbest=20)[0]
    assert got[0].tokens == exhaustive[0][1]
    assert [h.tokens for h in got] == [s for _, s in exhaustive[:20]]
    for h, (score, _) in zip(got, exhaustive):
        assert h.score == pytest.approx(score, abs=1e-4)
    assert len({len(h.tokens) for h in got}) > 1
    # a small beam is not exact here (so the comparison above can fail)
    small = beam_search(model, torch.tensor([src1]), beam=2, lenpen=lenpen, max_len_b=3, nbest=2)[0]
    assert [h.tokens for h in small] != [s for _, s in exhaustive[:2]]


# ---- a plain reference of fairseq's algorithm, one sentence at a time, no cache ----------------


def reference_beam(model, src1, beam, lenpen, max_len, min_len=1, unk_penalty=0.0):
    """fairseq SequenceGenerator + BeamSearch written out per sentence, full recomputation."""
    live = [([], 0.0)]  # (tokens, cumulative log-prob)
    finalized = []  # (normalized score, tokens)
    for step in range(max_len + 1):
        with torch.no_grad():
            logits = model(torch.tensor([src1] * len(live)), torch.tensor([[EOS] + t for t, _ in live]))
        lp = F.log_softmax(logits[:, -1].float(), dim=-1)
        lp[:, PAD] = -math.inf
        lp[:, UNK] -= unk_penalty
        if step >= max_len:
            eos_col = lp[:, EOS].clone()
            lp[:] = -math.inf
            lp[:, EOS] = eos_col
        elif step < min_len:
            lp[:, EOS] = -math.inf
        cands = sorted(((score + float(lp[i, v]), i, v) for i, (_, score) in enumerate(live)
                        for v in range(lp.size(1)) if lp[i, v] > -math.inf), key=lambda c: -c[0])
        cands = cands[:2 * beam]
        for rank, (score, i, v) in enumerate(cands):
            if v == EOS and rank < beam and len(finalized) < beam:
                finalized.append((score / (step + 1) ** lenpen, live[i][0]))
        if len(finalized) == beam or step == max_len:
            break
        live = [(live[i][0] + [v], score) for score, i, v in cands if v != EOS][:beam]
    finalized.sort(key=lambda f: -f[0])
    return finalized


@pytest.mark.parametrize("beam,lenpen,max_len_a", [(4, 1.0, 1.0), (3, 0.6, 0.5)])
def test_batched_beam_matches_reference_implementation(copy_models, beam, lenpen, max_len_a):
    """A batch of varied lengths: sentences finish at different steps (early stop or max length)
    and leave the batch; every sentence's n-best must equal the reference's."""
    model = copy_models.half
    src, seqs = sources(3, 12)
    got = beam_search(model, src, beam=beam, lenpen=lenpen, max_len_a=max_len_a, max_len_b=3, nbest=beam)
    early = 0
    for hyps, s in zip(got, seqs):
        max_len = int(max_len_a * len(s) + 3)
        want = reference_beam(model, s, beam, lenpen, max_len)
        assert [h.tokens for h in hyps] == [t for _, t in want]
        for h, (score, _) in zip(hyps, want):
            assert h.score == pytest.approx(score, abs=1e-4)
        early += all(len(h.tokens) < max_len for h in hyps)
    assert 2 <= early < len(seqs)  # both ways of finishing were exercised


def test_beam_over_a_large_vocabulary_matches_reference_implementation():
    """4 beams x 1,000 subwords: the candidates' top-k runs over blocks (decode._topk)."""
    model = random_model(seed=5, vocab=1000)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(4, 1000, (n,), generator=g).tolist() + [EOS] for n in (6, 3, 8)]
    src = torch.full((3, 9), PAD)
    for i, s in enumerate(seqs):
        src[i, :len(s)] = torch.tensor(s)
    got = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=0.5, max_len_b=2, nbest=4)
    for hyps, s in zip(got, seqs):
        want = reference_beam(model, s, 4, 0.6, int(0.5 * len(s) + 2))
        assert [h.tokens for h in hyps] == [t for _, t in want]


def test_block_topk_equals_torch_topk():
    """decode._topk against torch.topk: the same values in the same order, indices that point at
    them (one each); the same indices where no two values are equal."""
    from admin_ds.inference.decode import _topk

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(3, 4000, generator=g), 8), (torch.randn(5, 4100, generator=g), 8),
             (torch.randn(2, 1000, generator=g), 2), (torch.randn(2, 100, generator=g), 8),
             (torch.randn(1, 40000, generator=g), 10)]
    for x, k in cases:
        values, idx = _topk(x, k)
        want = x.topk(k, dim=1)
        assert torch.equal(values, want.values) and torch.equal(idx, want.indices)
    # the maximum in the tail that fills no block, in the first and the last block
    x = torch.randn(4, 4100, generator=g)
    x[0, 4099], x[1, 4050], x[2, 0], x[3, 4095] = 10.0, 10.0, 10.0, 10.0
    assert _topk(x, 8)[1][:, 0].tolist() == [4099, 4050, 0, 4095]
    # ties, -inf and a row without a finite value
    x = torch.randint(0, 4, (6, 4100), generator=g).float()
    x[1, ::2] = -math.inf
    x[2, :] = -math.inf
    x[3, 4000:] = 7.0
    for k in (1, 8, 16):
        values, idx = _topk(x, k)
        assert torch.equal(values, x.topk(k, dim=1).values)
        assert torch.equal(x.gather(1, idx), values)
        assert all(len(set(row)) == k for row in idx.tolist())


def test_greedy_choice_is_argmax_first_of_ties():
    """decode._largest (torch.max's positions) against argmax and a hand-written first maximum:
    ties (the first wins), -inf, a row of -inf only, one row and many."""
    from admin_ds.inference.decode import _largest

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (64, 8000), generator=g).float()  # every row has many equal maxima
    x[1, :] = -math.inf
    x[2, ::2] = -math.inf
    x[3, 7999] = 5.0
    first = [row.index(max(row)) for row in x.tolist()]
    assert _largest(x).tolist() == x.argmax(dim=-1).tolist() == first
    assert _largest(x[3:4]).tolist() == [7999]
    y = torch.randn(16, 8000, generator=g)
    assert torch.equal(_largest(y), y.argmax(dim=-1))


# ---- 4. a trained copy model decodes correctly ----------------------------------------------------


def test_copy_task_greedy_and_beam_reproduce_inputs(copy_models):
    model = copy_models.full
    assert copy_models.final_loss < 0.1, copy_models.final_loss
    seqs, src, _, _ = copy_batch(random.Random(12345), 100)
    model.train()  # decoding must switch to eval and restore the mode
    g = greedy(model, src, max_len_a=1.0, max_len_b=5)
    assert model.training
    b = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=1.0, max_len_b=5)
    assert model.training
    model.eval()
    assert sum(h == s for h, s in zip(g, seqs)) >= 90
    assert sum(h[0].tokens == s for h, s in zip(b, seqs)) >= 90
    assert sum(h == s for h, s in zip(greedy(copy_models.half, src, max_len_a=1.0, max_len_b=5), seqs)) < 50


def test_decoding_turns_every_module_to_eval_and_puts_each_flag_back(copy_models):
    """The copy model's weights in a model with dropout, its top module in eval mode and only some
    layers training: decoding runs all of it in eval mode (no dropout: the no-dropout model's
    outputs), and afterwards each module has the training flag it had before."""
    cfg = copy_models.full.cfg
    model = build_model(dataclasses.replace(cfg, dropout_p=0.5, attention_dropout_p=0.5, activation_dropout_p=0.5))
    model.load_state_dict(copy_models.full.state_dict())
    model.eval()
    model.decoder_layers[0].train()
    model.encoder_layers[-1].train()
    flags = [m.training for m in model.modules()]
    assert any(flags) and not model.training
    src = sources(21, 16)[0]
    kw = dict(max_len_a=1.0, max_len_b=5)
    assert greedy(model, src, **kw) == greedy(copy_models.full, src, **kw)
    assert [m.training for m in model.modules()] == flags
    got, want = (beam_search(m, src, beam=3, nbest=3, **kw) for m in (model, copy_models.full))
    assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
    assert [m.training for m in model.modules()] == flags


def test_training_modules_are_those_modules_yields():
    """decode's walk for the training modules against ``nn.Module.modules()``: the same modules,
    each once, where one module is registered under two names, a child slot is None, and only
    some subtrees are training."""
    from admin_ds.inference.decode import _training_modules

    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(shared, torch.nn.Dropout()), shared,
                                torch.nn.ModuleDict({"a": torch.nn.ReLU(), "b": torch.nn.Sequential(shared)}))
    model.register_module("empty", None)
    for flags in ([True] * 7, [False] * 7, [False, True, False, True, False, True, False]):
        for module, flag in zip(model.modules(), flags):
            module.training = flag
        got = _training_modules(model)
        assert len(got) == len({id(m) for m in got})
        assert {id(m) for m in got} == {id(m) for m in model.modules() if m.training}


# ---- 5. translate restores the input order -------------------------------------------------------


class IntTokenizer:
    """Whitespace-separated integers <-> ids (ids without EOS; decode stops at EOS)."""

    def encode(self, lines):
        return [[int(w) for w in line.split()] for line in lines]

    def decode(self, ids_lists):
        out = []
        for ids in ids_lists:
            ids = list(ids)
            if EOS in ids:
                ids = ids[:ids.index(EOS)]
            out.append(" ".join(str(i) for i in ids))
        return out


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_translate_restores_order_for_any_batching(copy_models, method):
    model = copy_models.half
    g = random.Random(7)
    lines = [" ".join(str(g.randrange(4, COPY_VOCAB)) for _ in range(g.randint(1, 12))) for _ in range(30)]
    lines[3] = ""
    lines[17] = "   "
    tok = IntTokenizer()
    kw = dict(method=method, beam=3, lenpen=0.6, max_len_a=1.0, max_len_b=2)
    one_by_one = [translate(model, tok, [line], **kw)[0] for line in lines]
    assert one_by_one[3] == "" and one_by_one[17] == ""
    assert len(set(one_by_one)) > 20  # outputs differ from sentence to sentence
    for seed, max_tokens in [(0, 20), (1, 60), (2, 4096)]:
        perm = list(range(len(lines)))
        random.Random(seed).shuffle(perm)
        got = translate(model, tok, [lines[i] for i in perm], max_tokens=max_tokens, **kw)
        assert got == [one_by_one[i] for i in perm]
    assert translate(model, tok, [], **kw) == []
    assert translate(model, tok, ["", ""], **kw) == ["", ""]


def test_translate_truncates_long_sources_with_warning(copy_models):
    model = copy_models.full  # max_positions 32
    tok = IntTokenizer()
    g = random.Random(8)
    words = [str(g.randrange(4, COPY_VOCAB)) for _ in range(40)]
    kw = dict(method="greedy", max_len_a=1.0, max_len_b=0)
    with pytest.warns(UserWarning, match="1 source sentence"):
        got = translate(model, tok, [" ".join(words), "5 6 7"], **kw)
    assert got[0] == translate(model, tok, [" ".join(words[:31])], **kw)[0]  # 31 tokens + EOS
    assert got[0] != translate(model, tok, [" ".join(words[:30])], **kw)[0]
    assert got[1] == "5 6 7"
    # the output length is capped by the decoder's positions as well (max_positions - 1)
    rnd = random_model(seed=7, vocab=60, max_positions=16)
    assert len(translate(rnd, tok, ["5 6 7"], method="greedy", max_len_b=100)[0].split()) == 15


def test_make_batches_respects_token_budget():
    g = random.Random(0)
    lengths = [g.randint(1, 40) for _ in range(200)]
    batches = make_batches(lengths, 100)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 100
    assert len(batches) < 100  # batches are filled, not one sentence each
    assert make_batches([150, 3], 100) == [[0], [1]]  # an oversized sentence goes alone


# ---- 6. sampling ---------------------------------------------------------------------------------


def test_sampling_reproducible_and_topk1_is_greedy(copy_models):
    model = copy_models.half
    src, seqs = sources(4, 12)
    kw = dict(max_len_a=1.0, max_len_b=3)
    a = sample(model, src, seed=11, **kw)
    assert a == sample(model, src, seed=11, **kw)
    assert a != sample(model, src, seed=12, **kw)
    assert a != greedy(model, src, **kw)
    gen = torch.Generator().manual_seed(11)
    assert sample(model, src, generator=gen, **kw) == a
    assert sample(model, src, topk=1, seed=3, temperature=0.7, **kw) == greedy(model, src, **kw)
    assert sample(model, src, topp=1e-6, seed=3, **kw) == greedy(model, src, **kw)
    # top-k 2: every sampled token is among the 2 most likely (pad excluded) given its prefix
    for seed in range(3):
        for hyp, s in zip(sample(model, src, topk=2, seed=seed, **kw), seqs):
            lp = full_lprobs(model, s, [EOS] + hyp + [EOS])
            lp[:, PAD] = -math.inf
            lp[0, EOS] = -math.inf  # min_len=1
            for t, tokid in enumerate(hyp + ([EOS] if len(hyp) < len(s) - 1 + 3 else [])):
                assert tokid in lp[t].topk(2).indices.tolist()


def test_bfloat16_model(copy_models):
    """Search runs in the model's dtype; log-probs and scores are float32 all the same."""
    model = copy.deepcopy(copy_models.full).to(torch.bfloat16)
    seqs, src, _, _ = copy_batch(random.Random(99), 20)
    assert sum(h == s for h, s in zip(greedy(model, src, max_len_a=1.0, max_len_b=5), seqs)) >= 17
    hyps = beam_search(model, src, beam=4, max_len_a=1.0, max_len_b=5, nbest=2)
    assert sum(h[0].tokens == s for h, s in zip(hyps, seqs)) >= 17
    assert all(isinstance(h.score, float) and math.isfinite(h.score) for hs in hyps for h in hs)
    assert model.src_embed.weight.dtype == torch.bfloat16


# ---- 7. batch independence -----------------------------------------------------------------------


def test_output_independent_of_batch_padding(copy_models):
    model = copy_models.half
    src, seqs = sources(5, 10, min_len=1, max_len=8)
    kw = dict(max_len_a=1.0, max_len_b=2)
    g_batch = greedy(model, src, **kw)
    b_batch = beam_search(model, src, beam=3, nbest=3, **kw)
    for i, s in enumerate(seqs):
        alone = torch.tensor([s])
        assert greedy(model, alone, **kw)[0] == g_batch[i]
        b_alone = beam_search(model, alone, beam=3, nbest=3, **kw)[0]
        assert [h.tokens for h in b_alone] == [h.tokens for h in b_batch[i]]
        for x, y in zip(b_alone, b_batch[i]):
            assert x.score == pytest.approx(y.score, abs=1e-5)
    assert isinstance(b_batch[0][0], Hypothesis)


# ---- 8. the CPU inference rewrite (admin_ds/inference.py) ----------------------------------------


def tiny_model_and_batch(kw):
    """(an untrained debug-tiny model with ``kw``, omega profiled when Admin; sources; targets)."""
    from admin_ds.profiling import profile_omega

    torch.manual_seed(0)
    plain = build_model(get_preset("debug-tiny", vocab_size=1000, **NO_DROPOUT, **kw)).eval()
    src, _ = sources(1, 6)
    tgt = torch.cat([torch.full((6, 1), EOS), torch.randint(4, 1000, (6, 5))], dim=1)
    if kw["init"] == "admin":
        profile_omega(plain, (src, tgt), seed=0)
    return plain, src, tgt


def packed_copy(model):
    from admin_ds.inference.packed import optimize_for_decoding

    return optimize_for_decoding(copy.deepcopy(model))


def count_packed(model):
    from admin_ds.inference.packed import PackedLinear

    return sum(isinstance(m, PackedLinear) for m in model.modules())


needs_onednn = pytest.mark.skipif(
    not __import__("admin_ds.inference.packed", fromlist=["x"]).packed_linear_available(),
    reason="this PyTorch build has no oneDNN linear ops (the rewrite is then a no-op)")


def require_mkl_packed():
    """Skip where PyTorch was built without MKL (ARM builds): nothing to pack for. A build with MKL
    must have its packed GEMM ops: their absence fails rather than skips."""
    from admin_ds.inference.packed import mkl_packed_available

    if not torch.backends.mkl.is_available():
        pytest.skip("this PyTorch build has no MKL (an ARM build, for one): there is no MKL backend to test")
    assert mkl_packed_available(), "PyTorch has MKL but not torch.ops.mkl._mkl_linear / _mkl_reorder_linear_weight"


@pytest.fixture(params=["onednn", "mkl"])
def step_backend(request, monkeypatch):
    """Each backend of a decoder step's packed products, whatever the CPU's default."""
    if request.param == "mkl":
        require_mkl_packed()
    monkeypatch.setenv("ADMIN_DS_PACKED_LINEAR", request.param)
    return request.param


@needs_onednn
@pytest.mark.parametrize("kw", [dict(init="admin"), dict(activation="gelu", init="default"),
                                dict(share_all_embeddings=False, share_decoder_input_output_embed=False,
                                     norm_order="pre", init="default")])
def test_packed_model_computes_what_the_plain_model_computes(kw, step_backend):
    """Every Linear packed (FFN activation fused, Q/K/V of a decoder step in one product, the tied
    output projection too; a step's products for oneDNN or MKL, the encoder's for oneDNN):
    full-forward logits and step-by-step logits equal the plain model's to float32 rounding, and
    the rewritten model's own step-by-step path equals its full forward."""
    from admin_ds.inference.packed import PackedLinear

    plain, src, tgt = tiny_model_and_batch(kw)
    packed = packed_copy(plain)
    layers = plain.cfg.num_encoder_layers + plain.cfg.num_decoder_layers
    expected = 6 * plain.cfg.num_encoder_layers + 11 * plain.cfg.num_decoder_layers + 1  # + output projection
    assert count_packed(packed) == expected and count_packed(plain) == 0 and layers > 0
    backends = [m.backend for m in packed.modules() if isinstance(m, PackedLinear)]
    assert backends.count(step_backend) >= 6 * plain.cfg.num_decoder_layers + 1
    with torch.no_grad():
        want = plain(src, tgt)
        scale = want.abs().max()
        assert (packed(src, tgt) - want).abs().max() <= 1e-5 * scale
        enc, src_pad = packed.encode(src, skip_padding=True)
        from admin_ds.model.layers import IncrementalState

        state = IncrementalState()
        steps = torch.cat([packed.decode(tgt[:, t:t + 1], enc, src_pad, state) for t in range(tgt.size(1))], 1)
        assert (steps - want).abs().max() <= 1e-5 * scale
        # One sentence: every product of a step has one row and takes the plain weight (F.linear).
        one_row = [m for m in packed.modules() if isinstance(m, PackedLinear) and m.weight is not None]
        assert len(one_row) == 6 * plain.cfg.num_decoder_layers + 1
        want1 = plain(src[:1], tgt[:1])
        enc, src_pad = packed.encode(src[:1], skip_padding=True)
        state = IncrementalState()
        steps = torch.cat([packed.decode(tgt[:1, t:t + 1], enc, src_pad, state) for t in range(tgt.size(1))], 1)
        assert (steps - want1).abs().max() <= 1e-5 * want1.abs().max()


@needs_onednn
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", "AuthenticAMD without AVX-512"])
def test_packed_linear_takes_the_plain_weight_for_few_rows_and_oneDNN_for_more(activation, vendor, monkeypatch):
    """A decoder-step product (few_rows=True) packed for oneDNN multiplies with F.linear, on an
    Intel CPU, up to 8 rows by a weight of at most 1 MiB and one row by a larger weight; on an AMD
    CPU with AVX-512, up to 8 rows by a weight of at most 256 KiB and no row by a larger one;
    without AVX-512, also one row by a weight of at most 1 MiB, stored transposed where it has more
    outputs than inputs. Other row counts go through oneDNN's packed weight. Each path, and the
    weight that keeps no plain copy, computes activation(x W^T + b) as F.linear on the original
    weight does."""
    from admin_ds.inference import packed
    from admin_ds.inference.packed import PackedLinear

    monkeypatch.setattr(packed, "_cpu_vendor", lambda: vendor.split()[0])
    monkeypatch.setattr(packed, "_cpu_has_avx512", lambda: "without" not in vendor)
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape[0]) or onednn(*a))
    act = {"none": lambda y: y, "relu": F.relu, "gelu": F.gelu}[activation]
    torch.manual_seed(0)

    def weight(out_f, in_f):
        return torch.randn(out_f, in_f) / 16, torch.randn(out_f)

    # (weight, few_rows, rows through the plain or transposed weight, rows through oneDNN, transposed)
    tall = weight(1024, 256)  # 1 MiB, more outputs than inputs
    if vendor == "GenuineIntel":
        small, large = weight(512, 512), weight(520, 512)  # exactly 1 MiB, and just over
        cases = [(small, True, [1, 2, 8], [9, 64], False), (large, True, [1], [2, 8, 64], False),
                 (small, False, [], [1, 8, 64], False), (tall, True, [1, 2, 8], [9, 64], False)]
    else:
        small, large = weight(128, 512), weight(130, 512)  # exactly 256 KiB, and just over
        cases = [(small, True, [1, 2, 8], [9, 64], False), (large, True, [], [1, 2, 8, 64], False),
                 (small, False, [], [1, 8, 64], False), (tall, True, [], [1, 2, 64], False)]
        if "without" in vendor:
            mib, over = weight(512, 512), weight(520, 512)  # exactly 1 MiB, and just over
            cases[1] = (large, True, [1], [2, 8, 64], False)
            cases[3] = (tall, True, [1], [2, 8, 64], True)
            cases += [(mib, True, [1], [2, 8, 64], False), (over, True, [], [1, 2, 64], False),
                      (weight(1028, 256), True, [], [1, 2, 64], False)]  # tall, just over 1 MiB
    for (w, b), few_rows, plain_rows, onednn_rows, transposed in cases:
        layer = PackedLinear(w, b, activation, few_rows=few_rows, backend="onednn")
        assert (layer.weight_t is not None) == transposed, w.shape
        # a plain (or transposed) copy only where it is used
        assert (layer.weight is not None) == (bool(plain_rows) and not transposed), w.shape
        for rows in plain_rows + onednn_rows:
            x = torch.randn(rows, w.size(1))
            calls.clear()
            got = layer(x.view(rows, 1, -1)).view(rows, -1)  # 3-D input, as the model passes it
            assert calls == ([] if rows in plain_rows else [rows]), (w.shape, few_rows, rows)
            want = act(F.linear(x, w, b))
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (w.shape, few_rows, rows)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_packed_linear_on_mkl_takes_the_plain_weight_for_one_row_and_the_packed_gemm_for_more(activation,
                                                                                           monkeypatch):
    """Packed for MKL (a decoder step's products on Intel CPUs), one row goes through F.linear and
    any other count, below, at and above the row count the weight was packed for, through MKL's
    packed GEMM; each computes activation(x W^T + b) as float64 arithmetic does."""
    from admin_ds.inference.packed import _MKL_ROWS_HINT, PackedLinear

    require_mkl_packed()
    calls = []
    mkl = torch.ops.mkl._mkl_linear
    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", lambda *a: calls.append(a[0].shape[0]) or mkl(*a))
    act = {"none": lambda y: y, "relu": F.relu, "gelu": F.gelu}[activation]
    torch.manual_seed(0)
    for out_f, in_f in ((512, 512), (300, 70)):
        w, b = torch.randn(out_f, in_f) / 16, torch.randn(out_f)
        layer = PackedLinear(w, b, activation, few_rows=True, backend="mkl")
        assert layer.backend == "mkl" and layer.weight is not None
        for rows in (1, 2, 7, _MKL_ROWS_HINT - 1, _MKL_ROWS_HINT, _MKL_ROWS_HINT + 3, 700):
            x = torch.randn(rows, in_f)
            calls.clear()
            got = layer(x.view(rows, 1, in_f)).view(rows, -1)
            assert calls == ([] if rows == 1 else [rows]), (w.shape, rows)
            want = act(F.linear(x.double(), w.double(), b.double()))
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (w.shape, rows)


def test_packed_backend_choice(monkeypatch):
    """ADMIN_DS_PACKED_LINEAR picks a step's backend (mkl only where MKL's packed GEMM works; by
    default on Intel CPUs only); a value it does not know is refused, naming the variable."""
    from admin_ds.inference import packed

    assert packed._mkl_packed_works() == packed.mkl_packed_available()  # the self-check passes where the ops exist
    mkl = "mkl" if packed.mkl_packed_available() else "onednn"
    for vendor, choice, want in (("GenuineIntel", "", mkl), ("AuthenticAMD", "", "onednn"),
                                 ("AuthenticAMD", "mkl", mkl), ("GenuineIntel", "onednn", "onednn")):
        monkeypatch.setattr(packed, "_cpu_vendor", lambda v=vendor: v)
        monkeypatch.setenv("ADMIN_DS_PACKED_LINEAR", choice)
        assert packed._step_backend() == want, (vendor, choice)
    monkeypatch.setenv("ADMIN_DS_PACKED_LINEAR", "fast")
    with pytest.raises(ValueError, match="ADMIN_DS_PACKED_LINEAR='fast'"):
        packed.optimize_for_decoding(tiny_model_and_batch(dict(init="default"))[0])


@needs_onednn
def test_packed_model_translates_like_the_plain_model(copy_models, step_backend):
    """Greedy, beam (n-best with scores) and translate on the half-trained copy model (hypotheses
    of varied lengths and uncertain tokens): the same outputs with and without packed weights."""
    plain = copy_models.half
    packed = packed_copy(plain)
    assert count_packed(packed) > 0
    kw = dict(max_len_a=1.0, max_len_b=3)
    assert_same_searches(packed, plain, sources(11, 24)[0], **kw)
    tok = IntTokenizer()
    lines = [" ".join(map(str, s[:-1])) for s in sources(12, 30)[1]]
    assert translate(packed, tok, lines, max_tokens=40, **kw) == translate(plain, tok, lines, max_tokens=40, **kw)


def test_inference_rewrite_leaves_other_models_alone(copy_models, monkeypatch):
    """bf16 (or a GPU) and ADMIN_DS_PACKED_LINEAR=0 keep the plain model; the model is in eval mode."""
    bf16 = copy.deepcopy(copy_models.full).to(torch.bfloat16).train()
    out = packed_copy(bf16)
    assert count_packed(out) == 0 and not out.training
    monkeypatch.setenv("ADMIN_DS_PACKED_LINEAR", "0")
    assert count_packed(packed_copy(copy_models.full)) == 0


# ---- 8b. the flat decoder step (admin_ds/inference/step.py) -------------------------------------


def stepwise_logits(model, step, src, tgt, beams, like_beam_search=False):
    """Logits (R, T, V) of ``tgt`` (R = beams x sentences, each sentence's rows adjacent) decoded
    position by position through ``step``, with a beam-search-like reorder of the cached rows
    after every position (rows of a sentence swapped among themselves). ``like_beam_search``: the
    first position as beam search runs it, one row per sentence (``tgt``'s first column must be
    the same in a sentence's rows) whose cache rows the reorder then spreads over its beams, and the
    state made as beam search makes it (a compiled step keeps the caches in place)."""
    from admin_ds.model.layers import IncrementalState

    enc, src_pad = model.encode(src, skip_padding=True)
    # capacity 2: the cache grows while decoding
    state, out = IncrementalState(capacity=2, reorders_every_step=like_beam_search), []
    rows = tgt.size(0)
    swap = torch.arange(rows).view(-1, beams).flip(1).reshape(-1)
    for t in range(tgt.size(1)):
        if t == 0 and like_beam_search:
            spread = torch.arange(rows // beams).repeat_interleave(beams)
            assert torch.equal(tgt[:, 0], tgt[::beams, 0].index_select(0, spread))
            out.append(step(tgt[::beams, :1], enc, src_pad, state).index_select(0, spread))
            state.reorder(spread.index_select(0, swap))
        else:
            out.append(step(tgt[:, t:t + 1], enc, src_pad, state))
            state.reorder(swap)
        tgt = tgt.index_select(0, swap)
        out = [o.index_select(0, swap) for o in out]
    return torch.stack(out, 1)


@pytest.mark.parametrize("kw", [dict(init="admin"), dict(init="admin", fold=True),
                                dict(activation="gelu", init="deepnorm"), dict(init="t-fixup"),
                                dict(share_all_embeddings=False, share_decoder_input_output_embed=False,
                                     norm_order="pre", init="default")])
@pytest.mark.parametrize("rewrite", ["plain", pytest.param("fp32", marks=needs_onednn), "int8"])
def test_decoder_step_computes_what_model_decode_computes(kw, rewrite):
    """The flat step against the modules' incremental path (model.decode, itself checked against
    the full forward in test_model.py): every residual kind (omega, DeepNorm's alpha, plain), no
    LayerNorm (T-Fixup), Pre-LN with its final norm, a folded model's embedding scale, GELU; on
    the plain model, with packed weights and in int8; three beams per sentence over sources of
    mixed lengths (padding masked), reordered between steps, the cache grown twice."""
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.inference.step import DecoderStep, decoder_step
    from admin_ds.model.fold import fold_omega

    kw = dict(kw)
    fold = kw.pop("fold", False)
    model, src, _ = tiny_model_and_batch(kw)
    if fold:  # omega != 1 at the first sub-layer of a stack: the folded model scales its embeddings
        from admin_ds.model.residual import iter_residuals

        for r in iter_residuals(model):
            r.set_omega(1.0 + 0.5 * torch.rand(r.omega.shape, generator=torch.Generator().manual_seed(r.index)))
        model = fold_omega(model)
        assert model.cfg.embedding_output_scale
    if rewrite != "plain":
        model = optimize_for_decoding(model, rewrite)
    step = decoder_step(model)
    assert isinstance(step, DecoderStep)
    beams = 3
    src = src[:4]
    assert bool(src.eq(PAD).any())  # mixed lengths: the encoder-attention mask matters
    tgt = torch.cat([torch.full((4 * beams, 1), EOS), torch.randint(4, 1000, (4 * beams, 6))], dim=1)
    with torch.no_grad():
        want = stepwise_logits(model, lambda *a: model.decode(*a)[:, -1], src, tgt, beams)
        got = stepwise_logits(model, step, src, tgt, beams)
    assert_same_step_logits(got, want, int8=rewrite == "int8")
    one = [stepwise_logits(model, f, src[:1], tgt[:1], 1) for f in (step, lambda *a: model.decode(*a)[:, -1])]
    assert_same_step_logits(*one, int8=rewrite == "int8")  # one row: the F.linear path


def assert_same_step_logits(got: torch.Tensor, want: torch.Tensor, int8: bool) -> None:
    """got == want (rows, positions, vocabulary) to float32 rounding; in int8, in most rows.

    An int8 product rounds its input to 256 levels. Where the two paths' float operators (attention,
    LayerNorm) round differently, by ~1e-7, a value on a level boundary can land on the next level,
    and that row's logits move by up to ~1% from there on (seen on an AMD EPYC: one row in twelve,
    by 0.5% of the largest logit). So in int8 three rows in four must agree to float rounding, and
    none may be off by more than 2%; a wrong step (a scale, a mask, a norm) moves every row."""
    scale = want.abs().max()
    if not int8:
        assert (got - want).abs().max() <= 1e-5 * scale
        return
    row_err = (got - want).abs().flatten(1).amax(1)
    assert row_err.le(1e-5 * scale).float().mean() >= 0.75 or len(row_err) == 1, row_err / scale
    assert row_err.max() <= 0.02 * scale, row_err / scale


def test_decoder_step_leaves_a_replaced_or_recorded_decode_to_the_model(copy_models):
    """A decode replaced on the instance (with_logit_bias) or a residual recorder attached
    (profiling): decoding calls model.decode, and the searches see what it returns."""
    from admin_ds.inference.step import DecoderStep, decoder_step
    from admin_ds.model.residual import attach_recorder

    model = copy_models.half
    assert isinstance(decoder_step(model), DecoderStep)
    biased = with_logit_bias(model, {5: 50.0})
    assert not isinstance(decoder_step(biased), DecoderStep)
    src, _ = sources(3, 4)
    assert all(set(h) == {5} for h in greedy(biased, src, max_len_a=0, max_len_b=4, min_len=4))
    with attach_recorder(model, lambda residual, x, y: residual.combine(x, y)):
        assert not isinstance(decoder_step(model), DecoderStep)


def test_searches_through_the_flat_step_equal_searches_through_the_modules(copy_models):
    """Greedy, sampling and beam search (n-best, scores) on the half-trained copy model, whose
    hypotheses end at varied lengths (rows leave the batch, beams reorder): the same results when
    every step goes through model.decode (a decode set on the instance is always used)."""
    model = copy_models.half
    modules = copy.deepcopy(model)
    modules.decode = modules.decode  # the bound method, set on the instance: no flat step
    src, _ = sources(21, 24)
    kw = dict(max_len_a=1.0, max_len_b=3)
    assert_same_searches(model, modules, src, **kw)
    assert sample(model, src, seed=3, **kw) == sample(modules, src, seed=3, **kw)


needs_cpp_compiler = pytest.mark.skipif(
    not any(map(shutil.which, ("g++", "c++", "clang++"))),
    reason="torch.compile's CPU code generation needs a C++ compiler")


@needs_cpp_compiler
def test_compiled_decoder_step_computes_what_model_decode_computes(monkeypatch):
    """translate.py --compile: the decoder step as graphs compiled by torch.compile (generated C++
    products over weights frozen in at compile time; the cache grown outside the graph; sizes
    marked symbolic) against model.decode on an Admin model: logits of three beams per sentence,
    reordered between steps, over sources of mixed lengths, the cache grown from 2 positions, the
    first position one row a sentence and the caches kept in place, as beam search runs them (the
    reference's reorders copy; the beam searches below reuse two of these graphs); then
    beam search (sentences finishing and leaving the batch; its choices between steps compiled
    while one sentence is left) against the flat step's, with its scores, on a batch of two
    sentences and one of eight: steps of few rows and of many, and encoders of few source tokens
    and of many, each sent to its own kind (all four must run). Every position runs compiled, the
    first ones included; the logits read encoder keys and values cached eagerly by the step, beam
    search those of the compiled encoder. Compiling takes one to two
    minutes here; it is done once. (Greedy, one hypothesis per sentence, is two more graphs, a
    minute more: bench/decode.py --compile checks its output.)

    The products are ATen's, not autotuned: choosing between them and inductor's C++ matrix-product
    kernels compiles and times every candidate kernel, over two more minutes on a 2-core machine
    for the graph semantics checked here, which do not depend on the product's kernel.
    bench/decode.py --compile runs the autotuned step and reports how many of its outputs equal the
    uncompiled step's."""
    from torch._dynamo.utils import counters

    from admin_ds.inference import step as step_module
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.inference.step import CompiledDecoderStep, DecoderStep, decoder_step

    monkeypatch.setitem(step_module.COMPILE_OPTIONS, "max_autotune", False)

    model, src, _ = tiny_model_and_batch(dict(init="admin"))
    flat = packed_copy(model)
    compiled = optimize_for_decoding(model, "fp32", compile_step=True)
    step = decoder_step(compiled)
    assert isinstance(step, CompiledDecoderStep) and type(decoder_step(flat)) is DecoderStep
    assert not any(p.requires_grad for p in compiled.parameters())  # frozen in only without gradients
    graphs = counters["stats"]["unique_graphs"]
    beams, src = 3, src[:4]
    assert bool(src.eq(PAD).any())
    tgt = torch.cat([torch.full((4 * beams, 1), EOS), torch.randint(4, 1000, (4 * beams, 7))], dim=1)
    with torch.inference_mode():
        want = stepwise_logits(flat, lambda *a: flat.decode(*a)[:, -1], src, tgt, beams, like_beam_search=True)
        got = stepwise_logits(compiled, step, src, tgt, beams, like_beam_search=True)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, not run eagerly
    assert_same_step_logits(got, want, int8=False)

    # Few rows and many, few source tokens and many, run in graphs of their own: two sentences (at
    # most 16 tokens; 2 rows at the first step, then 8) and eight (32 rows).
    ran = []
    frozen = step_module._frozen
    monkeypatch.setattr(step_module, "_frozen", lambda compiled, *args, **kw: ran.append(compiled) or frozen(compiled, *args, **kw))
    monkeypatch.setattr(step, "few_rows", 4)
    monkeypatch.setattr(step, "few_tokens", 16)
    # With autotuning off the graphs of few and many compile with the same options, and their sizes
    # are symbolic: the many-row kinds run the few-row graphs through wrappers of their own, so the
    # routing is checked without compiling the same graphs twice (over a minute here).
    monkeypatch.setattr(step, "_compiled_many", lambda *args: step._compiled(*args))
    monkeypatch.setattr(step, "_compiled_encoder_many", lambda *args: step._compiled_encoder(*args))
    many, _ = sources(21, 10)
    assert int(many[:2].ne(PAD).sum()) <= 16 < int(many[2:].ne(PAD).sum())
    kw = dict(max_len_a=1.0, max_len_b=2)
    for batch in (many[:2], many[2:]):
        got, want = (beam_search(m, batch, beam=4, nbest=2, **kw) for m in (compiled, flat))
        assert [[h.tokens for h in n] for n in got] == [[h.tokens for h in n] for n in want]
        assert [h.score for n in got for h in n] == pytest.approx([h.score for n in want for h in n], abs=1e-5)
    kinds = (step._compiled, step._compiled_many, step._compiled_encoder, step._compiled_encoder_many)
    assert [any(kind is c for c in ran) for kind in kinds] == [True] * 4
    # Beam search's choices ran compiled as well, once one sentence was left (the flat step's: eagerly).
    from admin_ds.inference import decode as decode_module
    assert list(step._searches) == [decode_module._beam_choices]
    assert any(c is step._searches[decode_module._beam_choices] for c in ran)

    # Every graph guards on its arguments alone (step._argument_guards), the encoder's too: a model
    # setting that the encoder reads (dropout, off in eval mode) makes no new graph.
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(compiled.cfg, "dropout_p", compiled.cfg.dropout_p + 0.1)
    beam_search(compiled, many[:2], beam=4, nbest=2, **kw)
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_step_of_few_rows_takes_generated_products_without_a_benchmark():
    """The compiled step's graphs of few rows multiply with inductor's generated C++ kernels wherever
    its template applies, chosen without timing them against ATen's (a benchmark on a busy machine
    can pick the slower one, and inductor would keep that choice on disk): autotuning on, as
    translate.py --compile runs, no benchmark runs while the step's graphs compile, no product of a
    step is a library call, and the logits are model.decode's. The encoder runs eagerly here, so
    that only the step compiles."""
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.inference.step import CompiledDecoderStep, decoder_step
    from admin_ds.model.layers import IncrementalState

    model, src, tgt = tiny_model_and_batch(dict(init="admin"))
    src, tgt = src[:1], tgt[:1]
    compiled = optimize_for_decoding(copy.deepcopy(model), "fp32", compile_step=True)
    step = decoder_step(compiled)
    assert isinstance(step, CompiledDecoderStep) and tgt.size(0) <= step.template_rows
    benchmarks = counters["inductor"]["select_algorithm_autotune"]
    last = tgt.size(1) - 1  # every graph is compiled by then: its step is profiled
    with torch.inference_mode():
        enc, src_pad = model.encode(src, skip_padding=True)
        state, want_state = IncrementalState(capacity=tgt.size(1) + 2), IncrementalState(capacity=2)
        got, want = [], []
        for t in range(tgt.size(1)):
            with profile() if t == last else contextlib.nullcontext() as prof:
                got.append(step(tgt[:, t:t + 1], enc, src_pad, state))
            want.append(model.decode(tgt[:, t:t + 1], enc, src_pad, want_state)[:, -1])
    assert counters["inductor"]["select_algorithm_autotune"] == benchmarks
    library = [e.key for e in prof.key_averages() if "linear" in e.key or e.key in ("aten::addmm", "aten::mm")]
    assert library == []
    assert_same_step_logits(torch.stack(got, 1), torch.stack(want, 1), int8=False)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_compiled_decoder_step_refused_off_cpu_fp32(copy_models, precision):
    """A compiled step decodes on the CPU from float32 weights: a bf16 model is refused with the
    reason, before anything is compiled."""
    from admin_ds.inference.packed import optimize_for_decoding

    with pytest.raises(ValueError, match="from a float32 model, not cpu bfloat16"):
        optimize_for_decoding(copy.deepcopy(copy_models.half).to(torch.bfloat16), precision, compile_step=True)


def test_compilation_seconds_grows_when_something_compiles():
    """translate.py --compile reports how much of its time went to compiling
    (step.compilation_seconds, read from torch.compile's own record): it must grow when a function
    is compiled, and stay where it was when the compiled function runs again."""
    from admin_ds.inference.step import compilation_seconds

    def twice_plus_one(x):
        return x * 2 + 1

    before = compilation_seconds()
    f = torch.compile(twice_plus_one, backend="eager")
    assert torch.equal(f(torch.arange(3.0)), torch.tensor([1.0, 3.0, 5.0]))
    after = compilation_seconds()
    assert after > before
    f(torch.arange(3.0))
    assert compilation_seconds() == after



@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="pages are handed back on Linux only (madvise), and counted in its /proc/self/smaps")
def test_the_pages_a_package_was_loaded_from_are_handed_back(tmp_path):
    """packages._release_pages, called once a package is loaded: the pages of a file under the
    package's directory that the process maps read-only (its library, whose weights loading copied
    out) leave the resident set as /proc/self/smaps counts it; a file mapped from elsewhere keeps
    its pages; both read back unchanged. On a kernel without MADV_PAGEOUT (before Linux 5.4, as
    asked of an anonymous page of the test's own) nothing is released and nothing breaks."""
    import ctypes
    import mmap

    from admin_ds.inference.packages import _release_pages

    def resident(path: Path) -> int:
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                fields = line.split()
                if "-" in fields[0] and len(fields) >= 5 and fields[0][0] in "0123456789abcdef":
                    inside = len(fields) >= 6 and fields[5] == str(path)
                elif inside and fields[0] == "Rss:":
                    total += int(fields[1]) * 1024
        return total

    data = os.urandom(4 << 20)
    mapped = {}
    for name in ("package", "elsewhere"):
        path = tmp_path / name / "library.so"
        path.parent.mkdir()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # clean pages, as a library's are once written back
        with open(path, "rb") as f:
            mapped[name] = path, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert mapped[name][1][:] == data and resident(path) >= 3 << 20  # read: resident
    released = _release_pages(os.path.realpath(tmp_path / "package"))

    probe = mmap.mmap(-1, mmap.PAGESIZE)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(ctypes.addressof(ctypes.c_char.from_buffer(probe)), mmap.PAGESIZE, 21) == 0:
        assert released == len(data) and resident(mapped["package"][0]) < 1 << 20
    else:  # this kernel keeps the pages
        assert released == 0 and resident(mapped["package"][0]) >= 3 << 20
    assert resident(mapped["elsewhere"][0]) >= 3 << 20
    assert all(m[:] == data for _, m in mapped.values())
    for _, m in mapped.values():
        m.close()


def test_packages_are_named_for_the_cpu_they_were_built_on(monkeypatch, tmp_path):
    """A graphs directory in a home that machines of several kinds share (a cluster's partitions):
    a package's name covers the CPU's instruction-set flags, its vendor and oneDNN's limit, so that
    another kind of CPU builds its own packages instead of loading code compiled for instructions
    it may lack. The same CPU names them alike (a later process loads them)."""
    from admin_ds.inference import packages, packed
    from admin_ds.inference.step import compile_decoder_step

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    model, _, _ = tiny_model_and_batch(dict(init="admin"))
    step = compile_decoder_step(model, compiled_dir=tmp_path / "graphs")
    here = step.packages.key
    assert packages._digest(step) == here
    info = dict(packed._cpuinfo())
    flags = info.get("flags", "avx2 fma").split()
    others = [{**info, "flags": " ".join(flags + ["amx_tile"])},  # one instruction set more
              {**info, "flags": " ".join(flags[:-1])},  # one fewer
              {**info, "vendor_id": "GenuineIntel" if info.get("vendor_id") != "GenuineIntel" else "AuthenticAMD"}]
    for other in others:
        monkeypatch.setattr(packed, "_cpuinfo", lambda other=other: other)
        assert packages._digest(step) != here, other
    monkeypatch.setattr(packed, "_cpuinfo", lambda: {**info, "flags": " ".join(reversed(flags))})
    assert packages._digest(step) == here  # the flags as a set
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert packages._digest(step) != here


@needs_cpp_compiler
def test_compiled_graphs_kept_on_disk_are_loaded_by_the_next_process(tmp_path, monkeypatch):
    """translate.py --compile --compiled-dir: the step's and the encoder's graphs exported and
    compiled ahead of time into packages on disk (packages.py). Greedy and beam search over two
    sentences, and beam search over one (greedy's caches one a row, beam search's kept in place,
    one buffer row at one sentence's first step) give the flat step's tokens and scores, every step
    and encoder call and beam search's choices at one sentence running from a package, none through
    torch.compile's graphs; a package refuses inputs of other sizes than it was compiled for; a second model, as a later process makes
    it, loads every package and builds none, with the same results; a package that does not load
    (a truncated file) is built again; other weights are other packages. Products are ATen's, not
    autotuned, as in the test above (minutes less here)."""
    from admin_ds.inference import step as step_module
    from admin_ds.inference.packages import GraphPackages
    from admin_ds.inference.packed import optimize_for_decoding

    monkeypatch.setitem(step_module.COMPILE_OPTIONS, "max_autotune", False)
    temporary = tmp_path / "tmp"  # where the loader extracts a package's library
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    model, _, _ = tiny_model_and_batch(dict(init="admin"))
    flat = packed_copy(model)
    src, _ = sources(21, 2)
    assert bool(src.eq(PAD).any())
    kw = dict(max_len_a=1.0, max_len_b=3)
    want = greedy(flat, src, **kw), beam_search(flat, src, beam=4, nbest=2, **kw) + beam_search(flat, src[:1], beam=4, nbest=2, **kw)
    compiled_graphs = []  # torch.compile's step and encoder graphs that ran
    frozen = step_module._frozen

    def record(compiled, *args, **kw):
        step = compiled_graphs_of.get(id(compiled))
        if step is not None:
            compiled_graphs.append(step)
        return frozen(compiled, *args, **kw)

    monkeypatch.setattr(step_module, "_frozen", record)
    compiled_graphs_of = {}

    def searched(directory):
        m = optimize_for_decoding(copy.deepcopy(model), "fp32", compile_step=True, compiled_dir=directory)
        step = m.compiled_decoder_step
        for name in ("_compiled", "_compiled_many", "_compiled_encoder", "_compiled_encoder_many"):
            compiled_graphs_of[id(getattr(step, name))] = name
        beams = beam_search(m, src, beam=4, nbest=2, **kw) + beam_search(m, src[:1], beam=4, nbest=2, **kw)
        return (greedy(m, src, **kw), beams), step.packages

    def assert_same(got):
        assert got[0] == want[0]
        assert [[h.tokens for h in n] for n in got[1]] == [[h.tokens for h in n] for n in want[1]]
        assert [h.score for n in got[1] for h in n] == pytest.approx([h.score for n in want[1] for h in n], abs=1e-5)

    calls = {}  # kind -> the arguments of its first call
    run = GraphPackages._run

    def recorded(self, kind, package, *args):
        calls.setdefault(kind, args)
        return run(self, kind, package, *args)

    monkeypatch.setattr(GraphPackages, "_run", recorded)
    got, packages = searched(tmp_path / "graphs")
    assert_same(got)
    assert compiled_graphs == [] and packages.step._searches == {}
    kinds = {"encoder-few", "step-few-first-per1", "step-few-later-per1",
             "step-few-first-per1-in-place", "step-few-later-per4-in-place", "step-few-first-per1-in-place-one-row"}
    searches = {k for k in packages.built if k.startswith("search-beam_choices-")}
    assert len(searches) >= 2  # one sentence's first step (one row) and its later ones
    assert set(packages.built) == set(packages.loaded) == kinds | searches
    assert stat.S_IMODE((tmp_path / "graphs").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "graphs").glob("*.pt2")} == {0o600}
    assert not list((tmp_path / "graphs").glob(".*.lock"))  # removed once their packages were in place
    # The loaded packages' libraries, extracted under $TMPDIR, were removed once loaded (they run
    # mapped): a process killed now leaves nothing there.
    assert not [p.name for p in temporary.iterdir() if p.name.startswith(("aotinductor_", "admin_ds_package_"))]

    # A package reads its inputs as the sizes it was compiled for say: one that does not match
    # (the one-row step's mask, whose rows are fixed at the heads of one sentence, with two
    # sentences' rows) is refused before anything is computed, and the kind falls back.
    one_row = "step-few-first-per1-in-place-one-row"
    args = list(calls[one_row])
    assert run(packages, one_row, packages._loaded[one_row], *args) is not None
    args[-1] = torch.cat([args[-1], args[-1]])
    assert run(packages, one_row, packages._loaded[one_row], *args) is None and one_row not in packages.loaded

    got, again = searched(tmp_path / "graphs")
    assert_same(got)
    assert compiled_graphs == [] and again.step._searches == {}
    assert again.built == [] and set(again.loaded) == kinds | searches and again.key == packages.key

    again.path("encoder-few").write_bytes(again.path("encoder-few").read_bytes()[:1000])
    got, rebuilt = searched(tmp_path / "graphs")
    assert_same(got)
    assert rebuilt.built == ["encoder-few"] and set(rebuilt.loaded) == kinds | searches

    # Steps of more rows than template_rows (lowered to 1 here) up to few_rows are kinds of their own,
    # exported at few_rows rows (16 sentences at one row each, 4 at four) and valid down to
    # template_rows + 1: greedy's steps and beam search's over two sentences run there.
    # (Lowered after the packages are named, so that the other kinds load instead of building again.)
    m = optimize_for_decoding(copy.deepcopy(model), "fp32", compile_step=True, compiled_dir=tmp_path / "graphs")
    m.compiled_decoder_step.template_rows = 1
    assert greedy(m, src, **kw) == want[0]
    beams = beam_search(m, src, beam=4, nbest=2, **kw)
    assert [[h.tokens for h in n] for n in beams] == [[h.tokens for h in n] for n in want[1][:2]]
    some = m.compiled_decoder_step.packages
    assert compiled_graphs == [] and some.key == packages.key
    assert set(some.built) == {"step-some-first-per1", "step-some-later-per1", "step-some-first-per1-in-place",
                               "step-some-later-per4-in-place"}

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.decoder_layers[0].ffn.fc1.weight[0, 0] += 1e-3
    other_step = optimize_for_decoding(other, "fp32", compile_step=True, compiled_dir=tmp_path / "graphs").compiled_decoder_step
    assert isinstance(other_step.packages, GraphPackages) and other_step.packages.key != packages.key


def test_compiled_graphs_directory_must_be_the_users_own(tmp_path):
    """A package is a shared library that the process runs: a directory others may write to is
    refused with its name and mode, before anything is compiled or loaded; so is a file."""
    from admin_ds.inference.packed import optimize_for_decoding

    model, _, _ = tiny_model_and_batch(dict(init="admin"))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=rf"{shared}: writable by others \(mode 777\)"):
        optimize_for_decoding(copy.deepcopy(model), "fp32", compile_step=True, compiled_dir=shared)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory|File exists"):
        optimize_for_decoding(copy.deepcopy(model), "fp32", compile_step=True, compiled_dir=tmp_path / "file")
    with pytest.raises(ValueError, match="compiled fp32 step only"):
        optimize_for_decoding(copy.deepcopy(model), "int8", compile_step=True, compiled_dir=tmp_path / "graphs")


_BUILD_WHEN_TOLD = """
import json, sys, time
from pathlib import Path
import torch
from admin_ds.inference import step as step_module
from admin_ds.inference.decode import greedy
from admin_ds.inference.packed import optimize_for_decoding
from admin_ds.model import build_model
from admin_ds.presets import get_preset
step_module.COMPILE_OPTIONS["max_autotune"] = False
directory, ready, go = map(Path, sys.argv[1:])
torch.manual_seed(0)
model = build_model(get_preset("debug-tiny", vocab_size=1000, dropout_p=0.0, attention_dropout_p=0.0,
                               activation_dropout_p=0.0)).eval()
model = optimize_for_decoding(model, "fp32", compile_step=True, compiled_dir=directory)
src = torch.tensor([[5, 6, 7, 8, model.cfg.eos_idx], [9, 10, model.cfg.eos_idx, model.cfg.pad_idx, model.cfg.pad_idx]])
ready.touch()
deadline = time.monotonic() + 900
while not go.exists():
    assert time.monotonic() < deadline, "never told to start"
    time.sleep(0.05)
out = greedy(model, src, max_len_a=1.0, max_len_b=3)
packages = model.compiled_decoder_step.packages
print("RESULT", json.dumps({"out": out, "built": packages.built, "loaded": packages.loaded}))
"""


@needs_cpp_compiler
def test_processes_that_need_a_missing_compiled_graph_at_once_build_it_once(tmp_path):
    """Back-translation's ranks on one machine start together with an empty --compiled-dir: two
    processes, released at the same moment (each has built its model and waits for a file), decode
    the same batch. Each package must be built by one of them only, the other loading it, and
    both must output the same tokens. (Without the lock each found every package missing and built
    all of them.)"""
    import json
    import subprocess
    import sys

    repo, go = Path(__file__).resolve().parents[1], tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_WHEN_TOLD, str(tmp_path / "graphs"), str(r), str(go)],
                              cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ready]
    try:
        deadline = time.monotonic() + 600
        while not all(r.exists() for r in ready):
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
            assert time.monotonic() < deadline, "the processes did not get ready"
            time.sleep(0.1)
        go.touch()
        done = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in done]
    first, second = (json.loads(out.split("RESULT ", 1)[1]) for out, _ in done)
    assert first["out"] == second["out"]
    built = first["built"] + second["built"]
    kinds = {"encoder-few", "step-few-first-per1", "step-few-later-per1"}
    assert sorted(built) == sorted(kinds), built  # each once, by either process
    assert set(first["loaded"]) == set(second["loaded"]) == kinds

# ---- 9. int8 decoding (translate.py --int8) -----------------------------------------------------


def int8_copy(model):
    from admin_ds.inference.packed import optimize_for_decoding

    return optimize_for_decoding(copy.deepcopy(model), "int8")


@needs_cpp_compiler
def test_int8_compiled_step_computes_what_the_int8_model_computes(monkeypatch):
    """translate.py --int8 --compile: the int8 products (Int8Linear's quantized operator, which the
    compiled graphs call by a key) with the operators between them compiled. Against model.decode of
    the same int8 model (its modules eagerly): the logits of three beams per sentence over sources
    of mixed lengths, reordered between steps, as beam search runs the compiled step; then beam
    search over eight sentences (steps of many rows, the compiled encoder) against the eager int8
    step's. Every product of the compiled model is int8 (no float weight is left to freeze in), and
    the graphs called each kind of product through the operator."""
    from torch._dynamo.utils import counters

    from admin_ds.inference import packed
    from admin_ds.inference import step as step_module
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.inference.step import CompiledDecoderStep, decoder_step

    monkeypatch.setitem(step_module.COMPILE_OPTIONS, "max_autotune", False)  # as in the fp32 test above
    model, src, _ = tiny_model_and_batch(dict(init="admin"))
    eager = int8_copy(model)
    compiled = optimize_for_decoding(model, "int8", compile_step=True)
    step = decoder_step(compiled)
    assert isinstance(step, CompiledDecoderStep)
    assert count_linear(compiled)[1] == 0 and isinstance(step.encoder_kv, packed.Int8Linear)
    called = collections.Counter()

    class Counted(dict):
        def __getitem__(self, key):
            called[key] += 1
            return super().__getitem__(key)

    monkeypatch.setattr(packed, "_INT8_WEIGHTS", Counted(packed._INT8_WEIGHTS))
    graphs = counters["stats"]["unique_graphs"]
    beams, src = 3, src[:4]
    tgt = torch.cat([torch.full((4 * beams, 1), EOS), torch.randint(4, 1000, (4 * beams, 6))], dim=1)
    with torch.inference_mode():
        want = stepwise_logits(compiled, lambda *a: compiled.decode(*a)[:, -1], src, tgt, beams)
        got = stepwise_logits(compiled, step, src, tgt, beams, like_beam_search=True)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, not run eagerly
    assert_same_step_logits(got, want, int8=True)

    many, _ = sources(21, 10)
    kw = dict(max_len_a=1.0, max_len_b=2)
    got, want = (beam_search(m, many, beam=4, **kw) for m in (compiled, eager))
    same = sum(g[0].tokens == w[0].tokens for g, w in zip(got, want))
    assert same >= 6, same  # int8 rounding may flip a near-tie of this untrained model
    layer, encoder_layer = compiled.decoder_layers[0], compiled.encoder_layers[0]
    products = (layer.self_attn.qkv_proj, layer.encoder_attn.q_proj, layer.ffn.fc1, layer.ffn.fc2,
                compiled.output_proj, step.encoder_kv, encoder_layer.ffn.fc1)
    assert all(called[p._key] for p in products), [called[p._key] for p in products]


def count_linear(model):
    """(Int8Linear modules, float Linear-like modules left: nn.Linear or PackedLinear)."""
    from admin_ds.inference.packed import Int8Linear, PackedLinear

    mods = list(model.modules())
    return (sum(isinstance(m, Int8Linear) for m in mods),
            sum(isinstance(m, (torch.nn.Linear, PackedLinear)) for m in mods))


def test_int8_linear_computes_the_dynamic_quantization_formula():
    """Int8Linear against the formula written out: weight rows w_q = round(w / s_w) with s_w =
    max|row| / 127; input x_q = clamp(round(x / s) + z, 0, 255) with s = (max(x, 0) - min(x, 0)) / 255
    over the whole input, z = round(-min / s); y = s * s_w * (x_q - z) w_q^T + b. Also: the
    float product is a different thing (the rounding shows), so the check can fail."""
    from admin_ds.inference.packed import Int8Linear

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 40, generator=g) * 0.2, torch.randn(48, generator=g)
    x = torch.randn(2, 7, 40, generator=g) * 3 + 0.5
    lin = Int8Linear(w, b)
    s_w = w.abs().amax(1) / 127
    w_q = (w / s_w[:, None]).round()
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    s = (hi - lo) / (127 if lin._reduce_range else 255)
    z = round(-lo / s)
    x_q = (x / s).round().add(z).clamp(0, 127 if lin._reduce_range else 255)
    want = s * ((x_q - z) @ w_q.T) * s_w + b
    got = lin(x)
    assert got.shape == (2, 7, 48)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    exact = F.linear(x, w, b)
    assert (got - exact).abs().max() > 1e-3 * exact.abs().max()  # int8 rounding is visible
    relu = Int8Linear(w, b, "relu")(x)
    assert torch.equal(relu, F.relu(got))


@pytest.mark.parametrize("kw", [dict(init="admin"), dict(share_all_embeddings=False,
                                                           share_decoder_input_output_embed=False, init="default")])
def test_int8_replaces_every_linear_and_stays_close_to_fp32(kw):
    """Every linear product of the model becomes an Int8Linear (the tied output projection too;
    nothing float is left), and the logits stay within 5% of their range of the fp32 model's,
    on the full forward and step by step."""
    from admin_ds.model.layers import IncrementalState
    plain, src, tgt = tiny_model_and_batch(kw)
    q = int8_copy(plain)
    expected = 6 * plain.cfg.num_encoder_layers + 11 * plain.cfg.num_decoder_layers + 1
    assert count_linear(q) == (expected, 0)
    assert count_linear(plain)[0] == 0
    with torch.no_grad():
        want = plain(src, tgt)
        spread = want.max() - want.min()
        full = q(src, tgt)
        assert (full - want).abs().max() <= 0.05 * spread
        assert (full - want).abs().max() > 0  # it is not the float model
        enc, src_pad = q.encode(src, skip_padding=True)
        state = IncrementalState()
        steps = torch.cat([q.decode(tgt[:, t:t + 1], enc, src_pad, state) for t in range(tgt.size(1))], 1)
        assert (steps - want).abs().max() <= 0.05 * spread


def test_int8_translates_like_fp32(copy_models):
    """The trained copy model: int8 greedy and beam outputs equal fp32's on at least 95% of 40
    sentences (the tolerance: int8 rounding may flip a near-tie), and int8 copies its input as
    often as fp32 does, give or take one sentence."""
    plain = copy_models.full
    q = int8_copy(plain)
    src, seqs = sources(21, 40)
    kw = dict(max_len_a=1.0, max_len_b=3)
    for search in (lambda m: greedy(m, src, **kw),
                   lambda m: [h[0].tokens for h in beam_search(m, src, beam=4, lenpen=0.6, **kw)]):
        got, want = search(q), search(plain)
        assert sum(a == b for a, b in zip(got, want)) >= 0.95 * len(seqs)
        copied = [sum(a == s[:-1] for a, s in zip(out, seqs)) for out in (got, want)]
        assert copied[1] >= 0.75 * len(seqs) and abs(copied[0] - copied[1]) <= 1, copied


_INT8_WITHOUT_VNNI = """
import torch
from admin_ds.inference.packed import Int8Linear, _int8_engine, _int8_works, optimize_for_decoding
from admin_ds.model import build_model
from admin_ds.presets import get_preset
torch.manual_seed(0)
engine = _int8_engine()
assert engine is not None and _int8_works(*engine), engine
model = build_model(get_preset("debug-tiny", vocab_size=1000, dropout_p=0.0, attention_dropout_p=0.0,
                               activation_dropout_p=0.0)).eval()
src = torch.randint(4, 1000, (3, 9))
tgt = torch.randint(4, 1000, (3, 7))
with torch.no_grad():
    want = model(src, tgt)
    q = optimize_for_decoding(model, "int8")
    got = q(src, tgt)
assert all(m.engine == engine[0] for m in q.modules() if isinstance(m, Int8Linear))
err = float((got - want).abs().max() / (want.max() - want.min()))
assert err <= 0.05, err
print("ENGINE", engine, "ONEDNN_FULL_RANGE", _int8_works("onednn", False), "ERR", round(err, 4))
"""


def test_int8_on_a_cpu_without_vnni_picks_an_engine_that_computes_right():
    """oneDNN limited to AVX2 (as on CPUs without VNNI: AMD EPYC before Zen 4) adds pairs of
    uint8 x int8 products in 16 bits, which full-range activations overflow: a product built to
    overflow (all activations 255, all weights 127) comes out wrong. int8 decoding must then pick
    another engine or 7-bit activations, and its logits must stay close to fp32's (before: int8
    decoding was refused on such a CPU)."""
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", _INT8_WITHOUT_VNNI], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.split("ENGINE", 1)[1]
    if "ONEDNN_FULL_RANGE False" in line:  # the overflow shows on this CPU: it was not chosen
        assert "('onednn', False)" not in line


def test_int8_refused_off_cpu_fp32(copy_models):
    from admin_ds.inference.packed import optimize_for_decoding

    with pytest.raises(ValueError, match="int8 decoding runs on the CPU from a float32 model"):
        optimize_for_decoding(copy.deepcopy(copy_models.full).to(torch.bfloat16), "int8")
    with pytest.raises(ValueError, match="unknown decoding precision 'int4'"):
        optimize_for_decoding(copy.deepcopy(copy_models.full), "int4")
