"""What one decoding argument may ask for, checked before a model is loaded.

A search holds, for every sentence of a batch and every beam, a row of target positions (tokens,
scores, and each decoder layer's cached keys and values): memory grows with beam x sentences x
positions, the decoder cells. A batch holds n sentences of at most L tokens with n x L <=
max_tokens (each sentence has at least its EOS), and each may reach floor(a x L + b) output tokens
plus EOS, so the worst batch holds at most

    beam x max_tokens x (max_len_a + max_len_b + 1)

cells (n = max_tokens one-token sentences). ``DEFAULT_MAX_DECODE_CELLS`` bounds that product: the
defaults of translate (beam 4, 4,096 tokens, 1.2 x + 10) and of training's BLEU evaluation (the same
with data.max_tokens; train.bleu_*) reach 0.2M, over a hundred times below it; a mistyped --beam
4000 or --max-len-b 100000 is far above it and is refused before it fills the memory. The commands
take --max-decode-cells (training: train.bleu_max_decode_cells) to raise it.
"""

from __future__ import annotations

import math
from typing import Optional

DEFAULT_MAX_DECODE_CELLS = 1 << 25


def decode_cells(beam: int, max_tokens: int, max_len_a: float, max_len_b: int) -> int:
    """The most decoder cells one batch can hold (module docstring)."""
    return math.ceil(beam * max_tokens * (max_len_a + max_len_b + 1))


def check_decoding(beam: int, max_tokens: int, max_len_a: float, max_len_b: int, min_len: Optional[int],
                   max_cells: int, name: dict) -> Optional[str]:
    """A one-line refusal of decoding options that contradict each other or ask for more than
    ``max_cells``, or None. ``name`` maps beam, max_tokens, max_len_a, max_len_b, min_len and
    max_cells to the option names the user typed."""
    if max_len_a == 0 and max_len_b == 0:
        return (f"{name['max_len_a']} 0 and {name['max_len_b']} 0 leave no output token for any sentence "
                f"(the maximum length is {name['max_len_a']} x source length + {name['max_len_b']})")
    if min_len is not None and max_len_a == 0 and min_len > max_len_b:
        return (f"{name['min_len']} {min_len} exceeds the maximum length {name['max_len_b']} {max_len_b} "
                f"({name['max_len_a']} is 0): no hypothesis can satisfy both")
    cells = decode_cells(beam, max_tokens, max_len_a, max_len_b)
    if cells > max_cells:
        return (f"{name['beam']} {beam} x {name['max_tokens']} {max_tokens} x ({name['max_len_a']} {max_len_a:g} + "
                f"{name['max_len_b']} {max_len_b} + 1) allows {cells:,} decoder cells in one batch, above the bound "
                f"{max_cells:,}; lower one of them, or raise {name['max_cells']} if the memory is there")
    return None


def add_limit_arguments(p) -> None:
    """--max-decode-cells, for the commands that decode (launch/translate.py, data_prep/backtranslate.py)."""
    from admin_ds.arguments import int_in

    p.add_argument("--max-decode-cells", type=int_in(1), default=DEFAULT_MAX_DECODE_CELLS,
                   help="refuse options whose largest batch could hold more than this many beam x sentence x "
                        f"position cells (default {DEFAULT_MAX_DECODE_CELLS:,}; admin_ds/inference/limits.py)")


def check_decoding_arguments(p, args, min_len: bool = True) -> None:
    """``check_decoding`` on parsed arguments; a refusal goes through ``p.error``."""
    name = {"beam": "--beam", "max_tokens": "--max-tokens", "max_len_a": "--max-len-a",
            "max_len_b": "--max-len-b", "min_len": "--min-len", "max_cells": "--max-decode-cells"}
    beam = args.beam if getattr(args, "method", "beam") in ("beam", "noised-beam") else 1
    problem = check_decoding(beam, args.max_tokens, args.max_len_a, args.max_len_b,
                             args.min_len if min_len else None, args.max_decode_cells, name)
    if problem:
        p.error(problem)
