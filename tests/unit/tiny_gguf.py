"""Write tiny Llama / Qwen2 GGUF files with gguf.GGUFWriter, for loader and tokenizer tests.

Tensors are random, in Hugging Face layout (``weights[name]``); the writer converts names to
llama.cpp's, permutes llama q/k rows as llama.cpp's converter does, and stores each tensor in
the GGML type ``types`` asks for (default F32; quantised ones through ``gguf.quants.quantize``,
or raw random blocks for types the gguf package cannot quantise, like Q4_K / Q6_K).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFEndian, GGUFWriter, TokenType
from gguf import quants as gq

# HF suffix -> llama.cpp suffix, the inverse of verispec.formats.gguf's table.
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}"


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A byte-level BPE vocabulary: the 256 byte symbols, a few merges, special tokens.
def byte_symbols() -> list[str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ Ġ", "ĠĠ ĠĠ", "d e", "de f", "Ġ 1"]
SPECIALS = [
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<tool_call>", TokenType.USER_DEFINED),
    ("[PAD0]", TokenType.UNUSED),
]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_tokens() -> tuple[list[str], list[int]]:
    tokens = byte_symbols() + ["".join(m.split(" ")) for m in MERGES] + [t for t, _ in SPECIALS]
    types = [int(TokenType.NORMAL)] * (len(tokens) - len(SPECIALS)) + [int(k) for _, k in SPECIALS]
    return tokens, types


@dataclass
class TinySpec:
    arch: str = "qwen2"
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 256
    layers: int = 2
    tied: bool = False
    types: dict[str, str] = field(default_factory=dict)  # HF name (or "*") -> GGML type name
    seed: int = 0
    metadata: dict[str, object] = field(default_factory=dict)  # extra/overriding keys (None = drop)
    skip_tensors: tuple[str, ...] = ()
    extra_tensors: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)  # gguf name -> data
    big_endian: bool = False
    tokenizer: bool = True
    pre: str = "qwen2"
    tokenizer_model: str = "gpt2"

    @property
    def vocab(self) -> int:
        return len(tokenizer_tokens()[0])

    def hf_weights(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        hd = self.hidden // self.heads
        w = {
            "model.embed_tokens.weight": rng.standard_normal((self.vocab, self.hidden)),
            "model.norm.weight": 1 + 0.1 * rng.standard_normal(self.hidden),
        }
        if not self.tied:
            w["lm_head.weight"] = rng.standard_normal((self.vocab, self.hidden))
        for i in range(self.layers):
            p = f"model.layers.{i}."
            w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(self.hidden)
            w[p + "self_attn.q_proj.weight"] = rng.standard_normal((self.heads * hd, self.hidden))
            w[p + "self_attn.k_proj.weight"] = rng.standard_normal((self.kv_heads * hd, self.hidden))
            w[p + "self_attn.v_proj.weight"] = rng.standard_normal((self.kv_heads * hd, self.hidden))
            if self.arch == "qwen2":
                w[p + "self_attn.q_proj.bias"] = rng.standard_normal(self.heads * hd)
                w[p + "self_attn.k_proj.bias"] = rng.standard_normal(self.kv_heads * hd)
                w[p + "self_attn.v_proj.bias"] = rng.standard_normal(self.kv_heads * hd)
            w[p + "self_attn.o_proj.weight"] = rng.standard_normal((self.hidden, self.heads * hd))
            w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(self.hidden)
            w[p + "mlp.gate_proj.weight"] = rng.standard_normal((self.ffn, self.hidden))
            w[p + "mlp.up_proj.weight"] = rng.standard_normal((self.ffn, self.hidden))
            w[p + "mlp.down_proj.weight"] = rng.standard_normal((self.hidden, self.ffn))
        return {k: (0.05 * v).astype(np.float32) for k, v in w.items()}


def stored(value: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """The bytes (or float array) GGUFWriter should store for ``value`` in ``type_name``."""
    if type_name == "F32":
        return value.astype(np.float32)
    if type_name == "F16":
        return value.astype(np.float16)
    qtype = GGMLQuantizationType[type_name]
    try:
        return gq.quantize(value, qtype)
    except NotImplementedError:  # K-quants: random but valid blocks (finite float16 scales)
        block, size = gq.GGML_QUANT_SIZES[qtype]
        rows = value.reshape(-1, value.shape[-1])
        raw = rng.integers(0, 256, size=(rows.shape[0], rows.shape[1] // block, size), dtype=np.uint8)
        scales = (0.01 * rng.standard_normal((*raw.shape[:2], 2))).astype(np.float16).view(np.uint8)
        if type_name == "Q6_K":
            raw[..., size - 2 :] = scales[..., :2]
        else:
            raw[..., :4] = scales
        return raw.reshape(rows.shape[0], -1)


def write_tiny(path: Path, spec: TinySpec) -> dict[str, np.ndarray]:
    """Write the model; returns the HF-layout float32 weights it was made from."""
    weights = spec.hf_weights()
    rng = np.random.default_rng(spec.seed + 1)
    writer = GGUFWriter(str(path), spec.arch, endianess=GGUFEndian.BIG if spec.big_endian else GGUFEndian.LITTLE)
    meta: dict[str, object] = {
        f"{spec.arch}.block_count": spec.layers,
        f"{spec.arch}.context_length": 512,
        f"{spec.arch}.embedding_length": spec.hidden,
        f"{spec.arch}.feed_forward_length": spec.ffn,
        f"{spec.arch}.attention.head_count": spec.heads,
        f"{spec.arch}.attention.head_count_kv": spec.kv_heads,
        f"{spec.arch}.rope.freq_base": 1_000_000.0,
        f"{spec.arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "general.name": "tiny",
    }
    meta.update(spec.metadata)
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            raise TypeError(key)
    if spec.tokenizer:
        tokens, types = tokenizer_tokens()
        writer.add_tokenizer_model(spec.tokenizer_model)
        writer.add_tokenizer_pre(spec.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    hd = spec.hidden // spec.heads
    for name, value in weights.items():
        if name in spec.skip_tensors:
            continue
        data = value
        if spec.arch == "llama" and ".self_attn.q_proj." in name:
            data = llama_permute(value, spec.heads)
        elif spec.arch == "llama" and ".self_attn.k_proj." in name:
            data = llama_permute(value, spec.kv_heads)
        assert data.shape[0] % hd == 0 or data.ndim == 1 or "proj" not in name
        type_name = spec.types.get(name, spec.types.get("*", "F32")) if value.ndim == 2 else "F32"
        out = stored(data, type_name, rng)
        if type_name in ("F32", "F16"):
            writer.add_tensor(gguf_name(name), out)
        else:
            writer.add_tensor(gguf_name(name), out, raw_dtype=GGMLQuantizationType[type_name])
    for name, (data, type_name) in spec.extra_tensors.items():
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
