"""Training: everything that knows about ranks and engines.

    run_config.py   the configuration tree (model, data, admin, optim, train, engine, guard)
    engine.py       DeepSpeed engines: config resolution, initialize, omega into every copy
    pipeline.py     a pipeline stage: the same model classes holding only its layers
    runners.py      DataParallelRunner / PipelineRunner: train_step, eval_loss, profile, state_dict
    loop.py         the training loop and the run log; no layout branches
    evaluator.py    validation loss and BLEU (decoding and scoring handed in by the entry point)
    checkpoints.py  CheckpointManager: atomic save, verify, plan the resume, universal conversion
    guard.py        the divergence guard: non-finite skip, spike detection, rollback decisions
    hooks.py        callbacks at fixed points (tests inject faults through them)
"""
