"""The real test data beside the repository (``../shared/data``: WMT newstest sets, News
Commentary, Multi30k; see its README). It is not part of the repository, so a clone without it
skips the tests that need it, with that reason. Once the directory is there, a missing file is a
failure: a renamed or incomplete data directory must not turn real-data tests into silent passes."""

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
ABSENT = f"real test data not beside the repository: {DATA} does not exist"

needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=ABSENT)


def data_file(relative: str) -> Path:
    """``DATA / relative``; skips when the data directory is absent, fails when only the file is."""
    if not DATA.is_dir():
        pytest.skip(ABSENT)
    path = DATA / relative
    assert path.is_file(), f"{path} is missing from the shared test data"
    return path
