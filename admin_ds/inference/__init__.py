"""After training: decoding, model files, translation, averaging, export, scoring.

    decode.py       greedy, beam search (fairseq semantics) and sampling over token ids
    step.py         one incremental decoder step in few operators (the searches' inner loop)
    int8.py         int8 CPU decoding: dynamic quantization of every linear layer
    translate.py    raw lines -> batches -> a search -> text (one batching path for every caller)
    model_file.py   self-contained fp32 model files; fp32 weights out of any DeepSpeed checkpoint;
                    load_for_decoding, the one model loader of every translating command
    averaging.py    the mean of a run's last N checkpoints
    export.py       Hugging Face Marian and CTranslate2 (serving)
    scoring.py      sacreBLEU with its signature, tokenized BLEU, chrF, TER
"""
