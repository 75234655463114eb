#!/usr/bin/env python
"""Score a translation file: sacreBLEU (+ signature), tokenized BLEU, chrF and TER.

    python launch/evaluate.py --hyp hyp.de --ref newstest2014.de --lang en-de [--src ...] [--json]
    python launch/evaluate.py --hyp 6L.de --ref test.de --lang en-de --compare 18L.de 60L.de

``--compare`` adds sacreBLEU's paired bootstrap test (BLEU and chrF, ``--bootstrap-samples``
resamples): each named system against ``--hyp`` on the same resampled segments, with the 95%
confidence interval of each and the p-value of each difference.

Prints a table by default; with ``--json`` stdout holds exactly one JSON object (see
``admin_ds.inference.scoring.score`` for its keys) so that it can be piped into other tools.  Bad input
(missing or unreadable file, invalid UTF-8, mismatched line counts, malformed ``--lang``) is
reported on stderr with exit status 2, the conventional status for usage errors (as argparse
uses), without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from admin_ds.arguments import input_file, int_in, language_pair
from admin_ds.inference.scoring import (
    check_same_length,
    format_paired,
    format_table,
    paired_bootstrap,
    read_lines,
    score,
)

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--hyp", required=True, type=input_file,
        help="detokenized system output, UTF-8, one segment per line; '-' reads stdin",
    )
    parser.add_argument("--ref", required=True, type=input_file, help="detokenized reference, UTF-8")
    parser.add_argument("--src", type=input_file, help="source file; only checked for line alignment")
    parser.add_argument("--lang", required=True, type=language_pair, help="language pair src-tgt, e.g. en-de")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    parser.add_argument("--compare", nargs="+", type=input_file, metavar="HYP",
                        help="other systems' outputs: paired bootstrap test of each against --hyp")
    parser.add_argument("--bootstrap-samples", type=int_in(100), default=1000, help="resamples for --compare")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        files = {"--hyp": args.hyp, "--ref": args.ref, "--src": args.src,
                 **{f"--compare {path}": path for path in args.compare or ()}}
        lines = {}
        for opt, path in files.items():
            if path is None:
                continue
            try:
                lines[opt] = read_lines(path)
            except OSError as err:
                raise ValueError(f"{opt}: cannot read {path}: {err.strerror or err}") from err
        # Name the files, not just "hypotheses"/"references", in a line-count mismatch.
        check_same_length({f"{opt} {files[opt]}": text for opt, text in lines.items()})
        result = score(lines["--hyp"], lines["--ref"], args.lang, lines.get("--src"))
        if args.compare:
            others = {str(path): lines[f"--compare {path}"] for path in args.compare}
            result["paired_bootstrap"] = paired_bootstrap(lines["--hyp"], others, lines["--ref"],
                                                          args.bootstrap_samples, baseline_name=str(args.hyp))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE

    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(format_table(result))
        if "paired_bootstrap" in result:
            print("\n" + format_paired(result["paired_bootstrap"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
