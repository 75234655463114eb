"""admin-ds: very deep Post-LN encoder-decoder Transformers made trainable by Admin, trained with
DeepSpeed.

    model/       the model on one device: config, presets, residuals, layers, init, profiling, fold
    train/       ranks and engines: run config, DeepSpeed engine, runners, the loop, checkpoints, guard
    data/        generated corpus, subword model, indexed datasets, batching, binarization
    inference/   decoding, model files, translation, averaging, export, scoring
    checkpoint_format.py  the checkpoint files: COMPLETE marker, digests, newest verified tag
    distributed.py  joining and leaving the process group; small collectives
    files.py     atomic writes and digests
    errors.py    the errors a user can fix (one-line messages at the command line)
"""
