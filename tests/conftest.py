"""Shared fixtures: a small generated corpus, prepared once per session, and one Admin profile
shared by runs whose layouts must not change omega."""

import pytest

from distributed import SMALL_DATA, spawn

NO_DROPOUT = ["--model.dropout_p=0", "--model.attention_dropout_p=0", "--model.activation_dropout_p=0"]
ZERO = {s: {"zero_optimization": {"stage": s}, "gradient_accumulation_steps": 1} for s in (0, 1, 2, 3)}
PIPE = {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}


def overrides(tmp, data_dir, *extra) -> list:
    return [f"--data.path={data_dir}", f"--data.max_tokens={SMALL_DATA['max_tokens']}", f"--train.run_dir={tmp}",
            "--optim.warmup_updates=4", "--optim.lr=2e-3", "--train.final_eval=false", *extra]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    from admin_ds.data.binarize import prepare_default_data

    out = tmp_path_factory.mktemp("data") / "default"
    prepare_default_data(out, n_pairs=SMALL_DATA["default_pairs"], vocab_size=SMALL_DATA["default_vocab_size"],
                         seed=1, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def fixed_profile(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("profile")
    spawn(1, "profile_only", tmp / "out", run_overrides=overrides(tmp / "run", data_dir, *NO_DROPOUT),
          ds=ZERO[0], tmp=str(tmp))
    return tmp / "run" / "admin_profile.json"
