"""Decoding: greedy, beam search (fairseq ``SequenceGenerator`` semantics) and sampling over a
batch of token ids. translate.py turns raw lines into such batches and back.

Every search runs the decoder incrementally (one new position per step, past keys/values cached in
an ``IncrementalState``), keeps the whole batch in one tensor, and drops sentences from the batch as
soon as they are finished, so a long sentence never makes the short ones pay for its steps.

Conventions (fairseq): ids bos 0, pad 1, eos 2, unk 3; the decoder's first input token is EOS;
hypotheses are returned without their final EOS. The maximum output length of a sentence is
``max_len_a * src_len + max_len_b`` real tokens (src_len counts its non-pad tokens, EOS included),
capped at ``model max_positions - 1``; at that length EOS is forced. Scores are log-probabilities
computed in float32 whatever the model's dtype.

Each step runs through ``step.decoder_step`` (the same computation as ``model.decode`` in fewer
operators). This file imports torch, model.py and step.py only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from admin_ds.inference.step import decoder_step
from admin_ds.model.layers import IncrementalState

__all__ = ["Hypothesis", "greedy", "beam_search", "sample"]

NEG_INF = -math.inf


@dataclass
class Hypothesis:
    """One finished hypothesis. ``tokens`` excludes the EOS; ``score`` is fairseq's normalized
    score sum(log p) / len**lenpen with len counting the EOS; ``positional_scores`` has one
    log-probability per output token, the EOS's last (len(tokens) + 1 entries)."""

    tokens: list[int]
    score: float
    positional_scores: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _inference(model) -> Iterator[None]:
    """Every module in eval mode and inference_mode for the block; the modules that were training
    are put back after. Only those are switched: eval() and train() set the flag on every module
    through nn.Module.__setattr__ (~0.4 ms each on a 6+6-layer model of 209 modules), at every
    batch, which is every sentence when they are decoded one at a time."""
    training = _training_modules(model)
    for m in training:
        m.training = False
    try:
        with torch.inference_mode():
            yield
    finally:
        for m in training:
            m.training = True


def _training_modules(model) -> list:
    """The modules of ``model`` (itself included) in training mode, each once. A walk over the
    children, not ``model.modules()``, whose nested generators pass every module up through each
    level above it: on a 6+6-layer model of 208 modules 75-94 us against 178-363 us a call."""
    found, seen, todo = [], {id(model)}, [model]
    while todo:
        module = todo.pop()
        if module.training:
            found.append(module)
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return found


def _specials(model) -> tuple[int, int, int, int]:
    cfg = model.cfg
    return cfg.bos_idx, cfg.pad_idx, cfg.eos_idx, cfg.unk_idx


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _max_lens(model, src: torch.Tensor, max_len_a: float, max_len_b: int) -> torch.Tensor:
    """(B,) per-sentence max output length (real tokens, EOS excluded), as in fairseq:
    int(a * src_len + b) capped so that decoder inputs fit into the model's positions."""
    src_len = src.ne(model.cfg.pad_idx).sum(dim=1).double()
    lens = (src_len * float(max_len_a) + float(max_len_b)).floor().long()
    return lens.clamp(min=0, max=model.cfg.max_positions - 1)


def _lprobs(logits: torch.Tensor, force_eos: Optional[torch.Tensor], no_eos: bool, pad: int, eos: int,
            unk: int, unk_penalty: float, temperature: float = 1.0, normalize: bool = True) -> torch.Tensor:
    """(N, V) logits -> float32 log-probs with fairseq's constraints: pad never, unk penalised,
    EOS forbidden where ``no_eos`` (before min_len), only EOS in the rows where ``force_eos`` (N,)
    is set (the max length is reached; this wins over min_len so every hypothesis terminates).
    ``force_eos=None``: no row is at its max length.

    ``normalize=False``: the constraints on the logits themselves, in place where they are float32,
    for a caller that only takes each row's largest (greedy decoding): log-softmax subtracts one
    number from a whole row, so the largest stays where it is, and its pass over rows x vocabulary
    is saved."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    lp = F.log_softmax(x, dim=-1) if normalize else x
    eos_lp = lp[:, eos].clone() if force_eos is not None else None
    lp[:, pad] = NEG_INF
    if unk_penalty:
        lp[:, unk] -= unk_penalty
    if no_eos:
        lp[:, eos] = NEG_INF
    if force_eos is not None:
        lp.masked_fill_(force_eos[:, None], NEG_INF)
        lp[:, eos] = torch.where(force_eos, eos_lp, lp[:, eos])
    return lp


# Elements per block of _topk: of 32, 64, 128 and 256, 64 was the fastest or within 10% of it at
# 1-64 sentences, beam 4, vocabularies 10,000 and 32,000 (timed when it was chosen).
_TOPK_BLOCK = 64


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=1)`` of a (B, N) CPU tensor, in a fraction of the time when N is large.

    torch's CPU top-k copies every element into a (value, index) pair and partially sorts them,
    ~1.6 ns an element: beam search's top 2 x beam over beam x vocabulary took ~10 ms a step at 64
    sentences, beam 5, 40,000 subwords. Here the maxima of blocks of 64 elements
    are compared first: the k blocks with the largest maxima hold the k largest values (a block
    left out has k blocks whose maxima are >= every element of it), so the top-k runs over those
    k blocks and the tail that fills no block. The values are torch.topk's, largest first; equal
    values may come with other indices than torch.topk gives (it defines no order among them)."""
    rows, n = x.shape
    blocks = n // _TOPK_BLOCK
    if x.device.type != "cpu" or blocks < 4 * k:
        return x.topk(k, dim=1)
    full = blocks * _TOPK_BLOCK
    grid = x[:, :full].reshape(rows, blocks, _TOPK_BLOCK)
    best = grid.amax(dim=2).topk(k, dim=1).indices  # (B, k)
    cand = grid.gather(1, best[:, :, None].expand(rows, k, _TOPK_BLOCK)).view(rows, k * _TOPK_BLOCK)
    if full < n:
        cand = torch.cat([cand, x[:, full:]], dim=1)
    values, j = cand.topk(k, dim=1)
    in_block = torch.div(j, _TOPK_BLOCK, rounding_mode="floor")
    idx = best.gather(1, in_block.clamp(max=k - 1)) * _TOPK_BLOCK + j % _TOPK_BLOCK
    if full < n:  # positions past the k blocks are the tail's
        idx = torch.where(j < k * _TOPK_BLOCK, idx, j - k * _TOPK_BLOCK + full)
    return values, idx


def _prepare(model, src_tokens: torch.Tensor) -> torch.Tensor:
    src = torch.as_tensor(src_tokens)
    if src.dim() == 1:
        src = src[None]
    return src.to(_device(model), dtype=torch.long)


# --------------------------------------------------------------------------------------------
# Greedy and sampling: one hypothesis per sentence
# --------------------------------------------------------------------------------------------


def _one_best(model, src: torch.Tensor, choose: Callable[[torch.Tensor], torch.Tensor],
              max_len_a: float, max_len_b: int, unk_penalty: float, min_len: int,
              temperature: float = 1.0, normalize: bool = True) -> list[list[int]]:
    """One hypothesis per sentence: ``choose`` picks each row's next token from its constrained
    log-probs, or from its constrained logits where ``normalize`` is False (see _lprobs)."""
    _, pad, eos, unk = _specials(model)
    B = src.size(0)
    if B == 0:
        return []
    max_lens = _max_lens(model, src, max_len_a, max_len_b)
    max_len, min_max_len = (int(v) for v in torch.stack([max_lens.max(), max_lens.min()]).tolist())
    state = IncrementalState(capacity=max_len + 1)
    step_logits = decoder_step(model)
    enc, src_pad = model.encode(src, skip_padding=True)
    out = torch.full((B, max_len + 1), pad, dtype=torch.long, device=src.device)
    orig = torch.arange(B, device=src.device)
    cur = torch.full((B, 1), eos, dtype=torch.long, device=src.device)
    for step in range(max_len + 1):
        logits = step_logits(cur, enc, src_pad, state)
        force = max_lens.le(step) if step >= min_max_len else None
        lp = _lprobs(logits, force, step < min_len, pad, eos, unk, unk_penalty, temperature, normalize)
        tok = choose(lp)
        out[orig, step] = tok
        done = tok.eq(eos)
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            orig, max_lens, tok = orig[keep], max_lens[keep], tok[keep]
            min_max_len = int(max_lens.min())
            enc, src_pad = enc.index_select(0, keep), src_pad.index_select(0, keep)
            state.reorder(keep)
            state.reorder_encoder(keep)
        cur = tok[:, None]
    hyps = []
    for row in out.tolist():
        hyps.append(row[:row.index(eos)] if eos in row else row)
    return hyps


def _largest(scores: torch.Tensor) -> torch.Tensor:
    """Each row's position of its largest value (N, V) -> (N,), the first of equal ones, as
    ``argmax`` gives it: torch.max's reduction over the rows, which takes about three quarters of
    argmax's time on the CPU (1, 16 and 64 rows of 8,000 logits: 0.75-0.78x)."""
    return scores.max(dim=-1).indices


def greedy(model, src_tokens: torch.Tensor, max_len_a: float = 0.0, max_len_b: int = 200,
           unk_penalty: float = 0.0, min_len: int = 1) -> list[list[int]]:
    """Greedy decoding of ``src_tokens`` (B, S) (EOS-terminated, right- or left-padded with pad).
    Returns one token list per sentence, without EOS. Same constraints as ``beam_search``, whose
    beam=1 result it equals."""
    with _inference(model):
        src = _prepare(model, src_tokens)
        return _one_best(model, src, _largest, max_len_a, max_len_b,
                         unk_penalty, min_len, normalize=False)


def sample(model, src_tokens: torch.Tensor, topk: int = 0, topp: float = 0.0,
           temperature: float = 1.0, max_len_a: float = 0.0, max_len_b: int = 200,
           seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
           unk_penalty: float = 0.0, min_len: int = 1) -> list[list[int]]:
    """Sampling (back-translation, Edunov et al. 2018): each token drawn from the model's
    distribution at ``temperature``; ``topk`` > 0 restricts to the k most likely tokens (0: the
    whole vocabulary), ``topp`` in (0, 1) to the nucleus of that probability mass. ``seed`` (or a
    ``generator`` on the model's device) makes it reproducible. topk=1 is greedy."""
    if generator is None and seed is not None:
        generator = torch.Generator(device=_device(model)).manual_seed(seed)

    def choose(lp: torch.Tensor) -> torch.Tensor:
        if topk > 0:
            lp, idx = _topk(lp, min(topk, lp.size(-1)))
        else:
            idx = None
        probs = lp.softmax(dim=-1)  # renormalise what survived the restriction
        if 0.0 < topp < 1.0:
            sp, order = probs.sort(dim=-1, descending=True)
            before = sp.cumsum(dim=-1) - sp  # mass of the strictly more likely tokens
            sp = sp.masked_fill(before >= topp, 0.0)
            pick = torch.multinomial(sp, 1, generator=generator)
            pick = order.gather(1, pick)
        else:
            pick = torch.multinomial(probs, 1, generator=generator)
        if idx is not None:
            pick = idx.gather(1, pick)
        return pick.squeeze(1)

    with _inference(model):
        src = _prepare(model, src_tokens)
        return _one_best(model, src, choose, max_len_a, max_len_b, unk_penalty, min_len,
                         temperature)


# --------------------------------------------------------------------------------------------
# Beam search
# --------------------------------------------------------------------------------------------


def beam_search(model, src_tokens: torch.Tensor, beam: int = 5, lenpen: float = 1.0,
                max_len_a: float = 0.0, max_len_b: int = 200, nbest: int = 1,
                unk_penalty: float = 0.0, min_len: int = 1) -> list[list[Hypothesis]]:
    """Beam search with fairseq's ``SequenceGenerator`` semantics; returns, per sentence, its
    ``nbest`` hypotheses best first.

    Per step: the top 2*beam candidates over (beam x vocab) by cumulative log-prob; the EOS
    candidates among the first ``beam`` of them are finalized (normalized score
    sum / len**lenpen, len counting EOS), the first ``beam`` non-EOS candidates continue. A sentence
    is finished once it holds ``beam`` finalized hypotheses (fairseq's early stop) or has reached
    its max length (EOS forced); it then leaves the batch.
    """
    if nbest > beam:
        raise ValueError(f"nbest={nbest} exceeds beam={beam}")
    with _inference(model):
        src = _prepare(model, src_tokens)
        return _beam_search(model, src, beam, lenpen, max_len_a, max_len_b, nbest,
                            unk_penalty, min_len)


def _beam_search(model, src, K, lenpen, max_len_a, max_len_b, nbest, unk_penalty, min_len):
    _, pad, eos, unk = _specials(model)
    dev = src.device
    B = src.size(0)
    if B == 0:
        return []
    max_lens = _max_lens(model, src, max_len_a, max_len_b)  # per live sentence
    max_len, min_max_len = (int(v) for v in torch.stack([max_lens.max(), max_lens.min()]).tolist())

    # One encoder row per live sentence throughout: the K rows of a sentence's beams are adjacent
    # and share its encoder output (see MultiheadAttention._encoder_attention_step).
    state = IncrementalState(capacity=max_len + 1)
    step_logits = decoder_step(model)
    enc, src_pad = model.encode(src, skip_padding=True)

    # Finalized hypotheses per original sentence: K slots plus one dummy slot that absorbs
    # writes beyond the K-th (fairseq ignores those), so writing needs no per-sentence loop.
    fin_tok = torch.full((B, K + 1, max_len + 1), pad, dtype=torch.long, device=dev)
    fin_pos = torch.zeros((B, K + 1, max_len + 1), dtype=torch.float32, device=dev)
    fin_score = torch.full((B, K + 1), NEG_INF, dtype=torch.float32, device=dev)
    fin_len = torch.zeros((B, K + 1), dtype=torch.long, device=dev)
    fin_cnt = torch.zeros(B, dtype=torch.long, device=dev)

    orig = torch.arange(B, device=dev)  # live sentence -> original index
    counts = torch.zeros(B, dtype=torch.long, device=dev)  # finalized hypotheses per live sentence
    tokens = torch.full((B, 1), eos, dtype=torch.long, device=dev)  # decoder inputs so far
    scores = torch.zeros((B, 1), dtype=torch.float32, device=dev)  # cumulative log-probs, 0 first

    for step in range(max_len + 1):
        logits = step_logits(tokens[:, -1:], enc, src_pad, state)
        at_max = max_lens.le(step) if step >= min_max_len else None
        flags, counts, done, ok, slot, cand_rows, cand_scores, sel_rows, next_tokens, next_scores = _beam_choices(
            logits, tokens, scores, counts, at_max, K, step < min_len, pad, eos, unk, unk_penalty)
        any_fin, any_done, all_done = flags.tolist()
        if any_fin:  # EOS candidates into their sentences' slots
            s_idx, c_idx = ok.nonzero(as_tuple=True)
            src_rows = cand_rows[s_idx, c_idx]
            eos_scores = cand_scores[s_idx, c_idx]
            hyp = torch.cat([tokens.index_select(0, src_rows)[:, 1:],
                             torch.full_like(src_rows, eos)[:, None]], dim=1)  # (n, step+1)
            cum = torch.cat([scores.index_select(0, src_rows), eos_scores[:, None]], dim=1)
            o, sl = orig[s_idx], slot[s_idx, c_idx]
            fin_tok[o, sl, :step + 1] = hyp
            fin_pos[o, sl, :step + 1] = cum[:, 1:] - cum[:, :-1]
            fin_score[o, sl] = eos_scores / float(step + 1) ** lenpen
            fin_len[o, sl] = step
        if any_done:  # finished sentences leave the batch
            fin_cnt[orig] = counts
            if all_done:
                break
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep[:, None] * K + torch.arange(K, device=dev)).view(-1)
            sel_rows, counts, orig, max_lens = sel_rows[keep], counts[keep], orig[keep], max_lens[keep]
            next_tokens = next_tokens.index_select(0, keep_rows)
            next_scores = next_scores.index_select(0, keep_rows)
            min_max_len = int(max_lens.min())
            enc, src_pad = enc.index_select(0, keep), src_pad.index_select(0, keep)
            state.reorder_encoder(keep)
        state.reorder(sel_rows.view(-1))
        tokens, scores = next_tokens, next_scores

    # Best first (a stable sort, like fairseq's sorted(); empty slots score -inf and sort last),
    # then one transfer of the n-best to the host.
    order = fin_score[:, :K].sort(dim=1, descending=True, stable=True).indices[:, :nbest]
    n_keep = fin_cnt.clamp(max=nbest).tolist()
    best_score = fin_score.gather(1, order).tolist()
    best_len = fin_len.gather(1, order).tolist()
    idx = order[:, :, None].expand(-1, -1, fin_tok.size(2))
    best_tok = fin_tok.gather(1, idx).tolist()
    best_pos = fin_pos.gather(1, idx).tolist()
    results: list[list[Hypothesis]] = []
    for b in range(B):
        results.append([Hypothesis(tokens=best_tok[b][j][:best_len[b][j]], score=best_score[b][j],
                                   positional_scores=best_pos[b][j][:best_len[b][j] + 1])
                        for j in range(n_keep[b])])
    return results


def _beam_choices(logits: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor,
                  at_max: Optional[torch.Tensor], K: int, no_eos: bool, pad: int, eos: int, unk: int,
                  unk_penalty: float) -> tuple[torch.Tensor, ...]:
    """One beam-search step's choices for every live sentence at once, from the step's logits
    (R, V): R rows, K per sentence (one at the first step, when every beam is the same), b = R / K
    sentences. ``tokens`` (R, T) are the rows' decoder inputs so far, ``scores`` (R, T) their
    cumulative log-probs (0 first, at the EOS that starts every row), ``counts`` (b,) the finalized
    hypotheses of each sentence, ``at_max`` (b,) the sentences at their max length (EOS forced;
    None: none is).

    The top 2K candidates over (beam x vocab) per sentence by cumulative log-prob; the EOS
    candidates among the first K are finalized in rank order into the sentence's next slots (slots
    from K on are fairseq's ignored ones), the first K other candidates continue. Returns

    - ``flags`` (3,): whether any EOS candidate is finalized, any sentence is done (K finalized or
      at its max length), all are;
    - ``counts`` and ``done`` (b,) after this step;
    - ``ok``, ``slot`` (b, K): which of the first K candidates are finalized, and into which slots;
      the first K candidates' rows and cumulative log-probs (b, K);
    - ``sel_rows`` (b, K): the row each continuing beam extends; the continuing beams' ``tokens``
      and ``scores`` (b * K, T + 1), finished sentences' included."""
    bsz, V = counts.size(0), logits.size(1)
    rows_per = 1 if scores.size(1) == 1 else K
    force = None if at_max is None else at_max[:, None].expand(bsz, rows_per).reshape(-1)
    lp = _lprobs(logits, force, no_eos, pad, eos, unk, unk_penalty)
    if rows_per > 1:
        lp.add_(scores[:, -1:])

    # Candidates: top 2K over (beam x vocab) per sentence, best first.
    flat = lp.view(bsz, rows_per * V)
    k2 = min(2 * K, flat.size(1))
    cand_scores, cand_idx = _topk(flat, k2)
    if k2 < 2 * K:  # tiny vocabulary at the first step: pad with impossible candidates
        fill = 2 * K - k2
        cand_scores = torch.cat([cand_scores, cand_scores.new_full((bsz, fill), NEG_INF)], 1)
        cand_idx = torch.cat([cand_idx, cand_idx.new_full((bsz, fill), pad)], 1)
    cand_beams = torch.div(cand_idx, V, rounding_mode="floor")
    cand_tok = cand_idx - cand_beams * V
    cand_rows = cand_beams + torch.arange(bsz, device=logits.device)[:, None] * rows_per
    eos_mask = cand_tok.eq(eos) & cand_scores.ne(NEG_INF)

    # Finalize EOS candidates among the first K, in rank order, up to K per sentence.
    fin_mask = eos_mask[:, :K]
    slot = counts[:, None] + fin_mask.long().cumsum(dim=1) - 1
    ok = fin_mask & slot.lt(K)
    counts = counts + ok.sum(dim=1)
    done = counts.ge(K) if at_max is None else counts.ge(K) | at_max
    flags = torch.stack([ok.any(), done.any(), done.all()])

    # Continue with the first K non-EOS candidates (EOS ranks pushed behind all others).
    rank = eos_mask.long() * (2 * K) + torch.arange(2 * K, device=logits.device)
    active = rank.topk(K, dim=1, largest=False).indices  # ascending: rank order kept
    sel_rows = cand_rows.gather(1, active)
    rows = sel_rows.view(-1)
    tokens = torch.cat([tokens.index_select(0, rows), cand_tok.gather(1, active).view(-1, 1)], dim=1)
    scores = torch.cat([scores.index_select(0, rows), cand_scores.gather(1, active).view(-1, 1)], dim=1)
    return flags, counts, done, ok, slot, cand_rows[:, :K], cand_scores[:, :K], sel_rows, tokens, scores

