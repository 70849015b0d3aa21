"""The one error type of moeshard.data."""

from __future__ import annotations


class DataError(ValueError):
    """Input the data layer cannot use: one line naming the file/record/key and the fix."""
