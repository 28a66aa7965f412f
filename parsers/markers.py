"""What every streaming parser needs of the tags it looks for."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker`: what a stream holds
    back, as it may be the tag arriving in pieces."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
