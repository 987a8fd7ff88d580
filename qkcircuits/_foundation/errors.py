"""The one exception type users see for bad input.

Every message is a single line that names the bad value and says what would be
accepted, so the CLI can print it as ``error: <message>`` and exit with code 2.
"""

from __future__ import annotations


class QKCircuitsError(ValueError):
    """Bad input to qkcircuits: a one-line message naming the value and the way out."""

    def __init__(self, message: str):
        # Fold accidental newlines: the contract is one line, whatever the caller built.
        super().__init__(" ".join(str(message).split()))
