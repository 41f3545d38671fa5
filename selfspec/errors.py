"""The error type for bad input a user can fix.

Entry points print such errors as one line (`selfspec.cli`); every other exception is a bug
and keeps its traceback. ValueError and FileNotFoundError count as user errors too, so
library code raises those where they fit and `SelfspecError` where they do not.
"""


class SelfspecError(Exception):
    """Bad input or an unusable setup; the message names the setting or file and the fix."""
