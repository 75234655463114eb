"""WMT14 data preparation: local or `datasets` sources -> cleaned text -> joint SentencePiece ->
binarized data directory (the format of :mod:`admin_ds.data.binarize`). Entry point:
``bash data_prep/prepare_wmt14.sh`` (``python -m data_prep.prepare``); see ``data_prep/README.md``.
"""


from admin_ds.errors import DataError


class PrepError(DataError):
    """A problem with the user's input or environment, reported as ``error: <message>`` on stderr
    with exit status 2 and no traceback. The message names the file concerned."""
