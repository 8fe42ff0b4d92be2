"""The ways of checking drafts, one module each, behind :class:`~mars.decoding.verifiers.base.Verifier`.

A new verifier is a module with a :class:`Verifier` subclass and one line in :data:`VERIFIERS`; the engine asks
each, in this order, for the rows it verifies (a later one may take over rows an earlier one decided)."""

from .base import Verifier
from .chain import ChainVerifier
from .tree import TreeVerifier

VERIFIERS: list[type[Verifier]] = [
    ChainVerifier,  # every verifying row's chain of drafts
    TreeVerifier,  # greedy lossless rows under tree drafts
]

__all__ = ["VERIFIERS", "ChainVerifier", "TreeVerifier", "Verifier"]
