"""After training: decoding, model files, translation, averaging, export, scoring.

    decode.py       greedy, beam search (fairseq semantics) and sampling over token ids
    packed.py       CPU decoding: weights packed for oneDNN once (or int8), FFN activation fused
    translate.py    raw lines -> batches -> a search -> text (one batching path for every caller)
    model_file.py   self-contained fp32 model files; fp32 weights out of any DeepSpeed checkpoint;
                    load_for_decoding, the one model loader of every translating command
    averaging.py    the mean of a run's last N checkpoints
    export.py       Hugging Face Marian and CTranslate2
    scoring.py      sacreBLEU with its signature, tokenized BLEU, chrF, TER
"""
