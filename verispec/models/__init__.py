"""The runtime that executes a model: the transformer (Llama / Qwen2 family), its KV cache, RoPE,
layers by precision, the config dataclass, the :class:`~verispec.models.protocol.LanguageModel`
protocol, and the transformers fallback adapter. Weights come from :mod:`verispec.formats`.

Import the submodule you need; this package imports nothing heavy on its own.
"""
