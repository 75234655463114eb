"""Raw lines in, translations out: subword encoding, length-sorted batches, a search, decoding.

    translate(model, subword, lines, beam=4, lenpen=0.6)          -> one string per line
    translate_nbest(model, subword, lines, beam=5, nbest=5)       -> (score, text) lists per line

One batching path for every caller (launch/translate.py on one or several ranks, the BLEU
evaluation during training, back-translation): a line becomes its subword ids plus EOS,
truncated to the model's positions; batches hold length-sorted sentences whose cost,
n_sentences x longest, stays within ``max_tokens``. Output order is input order, and an empty
(or blank) line gives an empty translation. ``progress(n)`` is called after each batch.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterator, Optional, Sequence

import torch

from admin_ds.inference.decode import Hypothesis, beam_search, greedy, sample

METHODS = ("beam", "greedy", "sample")


def make_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches over length-sorted input (longest first): a batch's cost,
    n_sentences * its longest length, stays within ``max_tokens`` (a single longer sentence
    forms a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def _sources(model, subword, lines: Sequence[str]) -> tuple[list[int], list[list[int]]]:
    """(indices of the non-empty lines, their ids + EOS), truncated to the model's positions."""
    cfg = model.cfg
    todo, srcs, truncated = [], [], 0
    for i, (line, ids) in enumerate(zip(lines, subword.encode(list(lines)))):
        ids = list(ids)
        if not line.strip() or not ids:
            continue
        if len(ids) + 1 > cfg.max_positions:
            ids = ids[:cfg.max_positions - 1]
            truncated += 1
        todo.append(i)
        srcs.append(ids + [cfg.eos_idx])
    if truncated:
        warnings.warn(f"translate: {truncated} source sentence(s) longer than max_positions="
                      f"{cfg.max_positions} were truncated", stacklevel=3)
    return todo, srcs


def _batches(model, subword, lines: Sequence[str], max_tokens: int,
             progress: Optional[Callable[[int], None]]) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(line indices, right-padded source ids (n, S) on the model's device) per batch."""
    todo, srcs = _sources(model, subword, lines)
    device = next(model.parameters()).device
    pad = model.cfg.pad_idx
    for batch in make_batches([len(s) for s in srcs], max_tokens):
        width = max(len(srcs[j]) for j in batch)
        src = torch.full((len(batch), width), pad, dtype=torch.long)
        for r, j in enumerate(batch):
            src[r, :len(srcs[j])] = torch.tensor(srcs[j])
        yield [todo[j] for j in batch], src.to(device)
        if progress is not None:
            progress(len(batch))


def translate(model, subword, lines: Sequence[str], method: str = "beam", beam: int = 4, lenpen: float = 0.6,
              max_tokens: int = 4096, progress: Optional[Callable[[int], None]] = None,
              seed: Optional[int] = None, generator: Optional[torch.Generator] = None, **search) -> list[str]:
    """The best translation of each line. ``method`` "beam" | "greedy" | "sample"; ``search``
    goes to the search (max_len_a, max_len_b, unk_penalty, min_len; topk, topp, temperature for
    sampling). Sampling draws from ``generator`` (or one seeded with ``seed``) across batches, as
    one call would."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    lines = list(lines)
    if method == "sample" and generator is None and seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    hyps: dict[int, list[int]] = {}
    for idx, src in _batches(model, subword, lines, max_tokens, progress):
        if method == "beam":
            res = [h[0].tokens for h in beam_search(model, src, beam=beam, lenpen=lenpen, **search)]
        elif method == "greedy":
            res = greedy(model, src, **search)
        else:
            res = sample(model, src, generator=generator, **search)
        hyps.update(zip(idx, res))
    order = sorted(hyps)
    texts = dict(zip(order, subword.decode([hyps[i] for i in order]))) if order else {}
    return [texts.get(i, "") for i in range(len(lines))]


def translate_nbest(model, subword, lines: Sequence[str], beam: int = 5, nbest: int = 5, lenpen: float = 1.0,
                    max_tokens: int = 4096, progress: Optional[Callable[[int], None]] = None,
                    **search) -> list[list[tuple[float, str]]]:
    """Per line, its ``nbest`` beam-search hypotheses as (score, text), best first; an empty line
    gives ``[(0.0, "")]``. The score is fairseq's length-normalised log-probability."""
    lines = list(lines)
    out: list[list[tuple[float, str]]] = [[(0.0, "")] for _ in lines]
    for idx, src in _batches(model, subword, lines, max_tokens, progress):
        results: list[list[Hypothesis]] = beam_search(model, src, beam=beam, lenpen=lenpen, nbest=nbest, **search)
        for i, sent in zip(idx, results):
            out[i] = list(zip([h.score for h in sent], subword.decode([h.tokens for h in sent])))
    return out
