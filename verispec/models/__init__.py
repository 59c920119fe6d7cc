"""Models: the transformer runtime, its KV cache, loaders (GGUF, Hugging Face folders), the default
model pairs, and toy Markov-chain models with exactly computable laws (:mod:`verispec.models.toy`).

Import the submodule you need; this package imports nothing heavy on its own.
"""
