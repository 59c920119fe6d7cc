"""Drafters: where draft tokens come from (the :class:`~verispec.drafters.base.Drafter` protocol).

- ``ngram``: prompt lookup, point-mass drafts, free to run (:mod:`verispec.drafters.ngram`).
"""

from verispec.drafters.base import BatchView, Drafter
from verispec.drafters.ngram import NgramDrafter

__all__ = ["BatchView", "Drafter", "NgramDrafter"]
