"""Getting weights and tokenizers in: GGUF files (header, tensors, block dequantisation), Hugging
Face folders, tokenizers and chat templates, vocabulary checks of a pair, conversion, atomic files
and hashes, the registry of known models and its cache, and the loader that hands the runtime
(:mod:`verispec.models`) its tensors.

Import the submodule you need; this package imports nothing heavy on its own.
"""
