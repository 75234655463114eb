"""Decoding: greedy, beam search, sampling and translate against independent references (CPU).

Most tests use a debug-tiny model trained (once per module, ~10 s) to copy its input: the "half"
snapshot (45 steps, loss ~2) ends hypotheses at varied, source-dependent lengths with uncertain
tokens, which exercises early stopping and beam reordering; the "full" one (180 steps) copies.
Untrained models are degenerate here (every sentence runs to the max length repeating a token).
"""

import copy
import dataclasses
import itertools
import math
import os
import random
import sys
import time

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


def stepwise_logits(model, step, src, tgt, beams):
    """Logits (R, T, V) of ``tgt`` (R = beams x sentences, each sentence's rows adjacent) decoded
    position by position through ``step``, with a beam-search-like reorder of the cached rows
    after every position (rows of a sentence swapped among themselves)."""
    from admin_ds.model.layers import IncrementalState

    enc, src_pad = model.encode(src, skip_padding=True)
    # capacity 2: the cache grows while decoding
    state, out = IncrementalState(capacity=2), []
    swap = torch.arange(tgt.size(0)).view(-1, beams).flip(1).reshape(-1)
    for t in range(tgt.size(1)):
        out.append(step(tgt[:, t:t + 1], enc, src_pad, state))
        state.reorder(swap)
        tgt = tgt.index_select(0, swap)
        out = [o.index_select(0, swap) for o in out]
    return torch.stack(out, 1)


@pytest.mark.parametrize("kw", [dict(init="admin"), dict(init="admin", fold=True),
                                dict(activation="gelu", init="deepnorm"), dict(init="t-fixup"),
                                dict(share_all_embeddings=False, share_decoder_input_output_embed=False,
                                     norm_order="pre", init="default")])
@pytest.mark.parametrize("rewrite", ["plain", "int8"])
def test_decoder_step_computes_what_model_decode_computes(kw, rewrite):
    """The flat step against the modules' incremental path (model.decode, itself checked against
    the full forward in test_model.py): every residual kind (omega, DeepNorm's alpha, plain), no
    LayerNorm (T-Fixup), Pre-LN with its final norm, a folded model's embedding scale, GELU; on
    the plain model and in int8; three beams per sentence over sources of
    mixed lengths (padding masked), reordered between steps, the cache grown twice."""
    from admin_ds.inference.int8 import quantize_for_decoding
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
    if rewrite == "int8":
        model = quantize_for_decoding(model)
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
    assert_same_step_logits(*one, int8=rewrite == "int8")  # one row


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


def int8_copy(model):
    from admin_ds.inference.int8 import quantize_for_decoding

    return quantize_for_decoding(copy.deepcopy(model))


def count_linear(model):
    """(Int8Linear modules, nn.Linear modules left)."""
    from admin_ds.inference.int8 import Int8Linear

    mods = list(model.modules())
    return sum(isinstance(m, Int8Linear) for m in mods), sum(isinstance(m, torch.nn.Linear) for m in mods)


def test_int8_linear_computes_the_dynamic_quantization_formula():
    """Int8Linear against the formula written out: weight rows w_q = round(w / s_w) with s_w =
    max|row| / 127; input x_q = clamp(round(x / s) + z, 0, 255) with s = (max(x, 0) - min(x, 0)) / 255
    over the whole input, z = round(-min / s); y = s * s_w * (x_q - z) w_q^T + b. Also: the
    float product is a different thing (the rounding shows), so the check can fail."""
    from admin_ds.inference.int8 import Int8Linear

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
from admin_ds.inference.int8 import Int8Linear, _int8_engine, _int8_works, quantize_for_decoding
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
    q = quantize_for_decoding(model)
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
    from admin_ds.inference.int8 import quantize_for_decoding

    with pytest.raises(ValueError, match="int8 decoding runs on the CPU from a float32 model, not cpu bfloat16"):
        quantize_for_decoding(copy.deepcopy(copy_models.full).to(torch.bfloat16))
