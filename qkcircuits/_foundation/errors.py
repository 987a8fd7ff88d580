"""The one exception type users see for bad input.

Every message is a single line that names the bad value and says what would be
accepted, so the CLI can print it as ``error: <message>`` and exit with code 2.

>>> try:
...     qk.parse_heads("5.x")
... except qk.QKCircuitsError as e:
...     print(e)
cannot read a head from '5.x'; use '5.1', 'L5H1', '5.*', '5.0-3' or a comma-separated list of these
>>> isinstance(qk.QKCircuitsError("x"), ValueError)          # code catching ValueError keeps working
True
"""

from __future__ import annotations


class QKCircuitsError(ValueError):
    """Bad input to qkcircuits: a one-line message naming the value and the way out."""

    def __init__(self, message: str):
        # Fold accidental newlines: the contract is one line, whatever the caller built.
        super().__init__(" ".join(str(message).split()))
