"""The scheduling half of the engine: which tokens run next and where their outputs go.

Plain synchronous classes (scheduler policy, sequences, page allocator, prefix
cache, detokenizer, stop strings, the output router); no Trio and no torch
forward here, so each is unit-tested by calling its methods.
"""
