"""Validation during a run: the loss on a split (every rank, through the runner) and BLEU (rank 0
decodes a consolidated fp32 copy of the model with beam search; sacreBLEU and tokenized BLEU).

Decoding and scoring belong to admin_ds/inference, which training does not import (dependencies run
one way, docs/design.md): the entry point hands them in as ``BleuTools``, and a run given none
computes validation losses only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from admin_ds import distributed, logs
from admin_ds.data import EpochBatchIterator
from admin_ds.data.binarize import open_split
from admin_ds.data.subword import SubwordModel
from admin_ds.errors import ConfigError
from admin_ds.model.config import ModelConfig
from admin_ds.model.transformer import build_model
from admin_ds.train.run_config import RunConfig
from admin_ds.train.runners import LN2, Runner


@dataclass(frozen=True)
class BleuTools:
    """What BLEU needs from inference: ``translate(model, subword, lines, beam=, lenpen=, max_tokens=,
    max_len_a=, max_len_b=, progress=)`` -> one string per line (admin_ds.inference.translate.translate)
    and ``score(hyps, refs, "src-tgt")`` -> {"bleu", "tok_bleu", "chrf", "signature", ...}
    (admin_ds.inference.scoring.score)."""

    translate: Callable
    score: Callable


class Evaluator:
    """Validation loss (every rank, through the runner) and BLEU (rank 0 decodes a consolidated
    fp32 copy of the model with beam search; sacreBLEU and tokenized BLEU)."""

    def __init__(self, run: RunConfig, runner: Runner, data_dir: Path, manifest: dict, cfg: ModelConfig,
                 run_dir: Path, bleu_tools: Optional[BleuTools] = None) -> None:
        self.run, self.runner, self.data_dir, self.manifest, self.cfg = run, runner, data_dir, manifest, cfg
        self.run_dir, self.tools = run_dir, bleu_tools

    def iterator(self, split: str, shuffle: bool, gas: int = 1) -> EpochBatchIterator:
        """The batches of ``split``, sharded over the data-parallel ranks."""
        r, data = self.runner, self.run.data
        try:
            return EpochBatchIterator(open_split(self.data_dir, split, self.manifest), data.max_tokens,
                                      self.cfg.pad_idx, self.cfg.eos_idx, seed=self.run.train.seed, num_replicas=r.dp,
                                      rank=r.dp_rank, shuffle=shuffle,
                                      max_positions=min(data.max_positions, self.cfg.max_positions),
                                      pad_to_multiple=data.pad_to_multiple, required_multiple=r.dp * gas)
        except ValueError as e:
            raise ConfigError(f"data.max_tokens={data.max_tokens}: {self.data_dir}, split {split}: {e}; raise "
                              f"data.max_tokens, or lower data.max_positions={data.max_positions} to drop longer "
                              "pairs") from None

    @torch.no_grad()
    def valid_loss(self, split: str) -> dict:
        it = self.iterator(split, shuffle=False)
        sums = self.runner.eval_loss([it.next_batch() for _ in range(it.batches_per_epoch)])
        nll = float(sums[1] / sums[2] / LN2)
        return {"loss": float(sums[0] / sums[2] / LN2), "nll": nll, "ppl": 2 ** nll, "ntokens": int(sums[2])}

    def bleu(self, split: str) -> Optional[dict]:
        """Collective (the state is gathered); the result on rank 0, None elsewhere, and None
        everywhere without ``bleu_tools``. Rank 0 decodes alone, for as long as the split takes: the
        other ranks wait for it outside any collective (distributed.rank0_alone)."""
        if self.tools is None:
            return None
        state = self.runner.state_dict()
        with distributed.rank0_alone():
            return None if state is None else self._decode_and_score(split, state)

    def _decode_and_score(self, split: str, state: dict) -> dict:
        s, t = self.manifest["src_lang"], self.manifest["tgt_lang"]
        srcs = (self.data_dir / f"{split}.{s}").read_text(encoding="utf-8").splitlines()
        refs = (self.data_dir / f"{split}.{t}").read_text(encoding="utf-8").splitlines()
        n = self.run.train.bleu_max_sentences
        if n:
            srcs, refs = srcs[:n], refs[:n]
        model = build_model(self.cfg, seed=0).to(self.runner.device)
        model.load_state_dict({k: v.float() for k, v in state.items()})
        tr = self.run.train
        t0 = time.perf_counter()
        with logs.progress(len(srcs), f"bleu {split}") as bar:
            hyps = self.tools.translate(model, SubwordModel(self.data_dir / self.manifest["subword_model"]), srcs,
                                        beam=tr.bleu_beam, lenpen=tr.bleu_lenpen, max_tokens=self.run.data.max_tokens,
                                        max_len_a=tr.bleu_max_len_a, max_len_b=tr.bleu_max_len_b,
                                        progress=bar.update)
        elapsed = time.perf_counter() - t0
        (self.run_dir / f"{split}.hyp.{t}").write_text("\n".join(hyps) + "\n", encoding="utf-8")
        result = self.tools.score(hyps, refs, f"{s}-{t}")
        copy = self.tools.score(srcs, refs, f"{s}-{t}")  # output = input: what BLEU a copy would get
        return {"bleu": result["bleu"], "tok_bleu": result["tok_bleu"], "chrf": result["chrf"],
                "signature": result["signature"], "copy_bleu": copy["bleu"], "sentences": len(hyps),
                "decode_s": round(elapsed, 2)}
