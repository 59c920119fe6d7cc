"""The GGUF loader and tokenizer on the real Qwen2.5-Coder Q4_K_M files.

The files are looked for in $VERISPEC_TEST_GGUF_DIR (default /tmp/verispec-models); each test skips
when its file is absent. Comparisons with transformers also skip when it is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf import quants as gq  # noqa: E402

from verispec.formats.dequant import dequantize_blocks  # noqa: E402
from verispec.formats.gguf import GGUFModel  # noqa: E402
from verispec.formats.gguf_file import GGUFFile  # noqa: E402
from verispec.formats.tokenizer import Tokenizer  # noqa: E402

MODEL_DIR = Path(os.environ.get("VERISPEC_TEST_GGUF_DIR", "/tmp/verispec-models"))
DRAFT = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
# file -> (hidden, intermediate, layers, heads, kv_heads, head_dim, {type: count})
EXPECTED = {
    DRAFT: (896, 4864, 24, 14, 2, 64, {"Q5_0": 133, "F32": 121, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}),
    TARGET: (1536, 8960, 28, 12, 2, 128, {"Q4_K": 169, "F32": 141, "Q6_K": 29}),
}
TEXTS = [
    "",
    " ",
    "\n\n",
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "x = [1,2,3]\r\n",
    "1234567890 3.14159",
    "I'm, you're, they'll",
    "héllo wörld café",
    "日本語のテキストです。",
    "中文文本，包含标点符号！",
    "Привет мир",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "   leading and trailing   ",
    "\t\ttabs\tand  spaces",
    " " * 33 + "x",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>a<|endoftext|>",
    '<tool_call>{"name": "f"}</tool_call>',
    "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "<|im_start|",
    "[PAD151665]",
    "e\u0301 vs \u00e9",
    "zero\u200bwidth",
    "a" * 200,
]
CONVERSATIONS = [
    [{"role": "user", "content": "Write fizzbuzz in Python."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "日本語で 😀"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"t": 3}'},
        {"role": "assistant", "content": "3°C"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "w",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]},
        },
    }
]


def path_of(name: str) -> Path:
    path = MODEL_DIR / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (set VERISPEC_TEST_GGUF_DIR to the folder of the joined GGUF files)")
    return path


@pytest.mark.parametrize("name", [DRAFT, TARGET])
def test_config_and_tensor_types(name: str) -> None:
    model = GGUFModel(path_of(name))
    hidden, ffn, layers, heads, kv, head_dim, types = EXPECTED[name]
    cfg = model.config
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        "qwen2",
        hidden,
        ffn,
        layers,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (heads, kv, head_dim, 151936)
    assert (cfg.rope_theta, cfg.max_position, cfg.rope_scaling) == (1e6, 32768, None)
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert cfg.attention_bias and not cfg.tie_word_embeddings  # both files store output.weight
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (151643, 151645, 151643)
    counts: dict[str, int] = {}
    for n in model.tensor_names:
        counts[model.tensor_info(n).type_name] = counts.get(model.tensor_info(n).type_name, 0) + 1
        assert model.tensor_info(n).rope_heads == 0  # qwen2: never permuted
    assert counts == types


@pytest.mark.parametrize("name", [DRAFT, TARGET])
def test_dequantisation_equals_gguf_reference(name: str) -> None:
    """For each storage type, its first tensors (up to 4096 rows each) equal gguf.quants bit for bit."""
    model = GGUFModel(path_of(name))
    file = GGUFFile(model.path)
    checked: dict[str, int] = {}
    for hf_name in model.tensor_names:
        info = model.tensor_info(hf_name)
        if checked.get(info.type_name, 0) >= 3:
            continue
        checked[info.type_name] = checked.get(info.type_name, 0) + 1
        raw = file.data(info.gguf_name)
        rows = raw if raw.ndim == 1 else raw[:4096]
        ref = gq.dequantize(np.array(rows), GGMLQuantizationType[info.type_name]).astype(np.float32)
        ours = model.load(hf_name)
        ours = ours if ours.dim() == 1 else ours[: rows.shape[0]]
        assert np.array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32)), hf_name
        if info.type_name != "F32":
            q = model.quantized(hf_name)
            blocks = torch.from_numpy(np.array(q.blocks[:64])).reshape(-1, q.type_size)
            assert torch.equal(dequantize_blocks(blocks, q.type_name).reshape(64, -1), model.load(hf_name)[:64])
    assert set(checked) == set(EXPECTED[name][6])


def test_bf16_state_dict_of_draft() -> None:
    model = GGUFModel(path_of(DRAFT))
    sd = model.state_dict(torch.bfloat16)
    assert len(sd) == 291 and all(t.dtype == torch.bfloat16 and torch.isfinite(t).all() for t in sd.values())
    assert sum(t.numel() for t in sd.values()) == 630_167_424
    name = "model.layers.3.mlp.down_proj.weight"
    assert torch.equal(sd[name], model.load(name).to(torch.bfloat16))


def test_weights_equal_transformers_gguf_loading() -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = path_of(DRAFT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reference = hf.state_dict()
    model = GGUFModel(path)
    assert set(model.tensor_names) == set(reference)
    for name in model.tensor_names:
        assert torch.equal(model.load(name).view(torch.int32), reference[name].view(torch.int32)), name


@pytest.mark.parametrize("name", [DRAFT, TARGET])
def test_tokenizer_equals_transformers(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = path_of(name)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = Tokenizer.from_gguf(path)
    assert tok.eos_token_ids == (151645, 151643) and tok.vocab_size == len(hf) == 151936
    rng = np.random.default_rng(0)
    for text in TEXTS:
        for add in (False, True):
            assert tok.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf.decode(ids) and tok.decode(ids, True) == hf.decode(ids, skip_special_tokens=True)
    for _ in range(200):  # arbitrary ids, including cut UTF-8 sequences and special tokens
        ids = rng.integers(0, 151665, rng.integers(1, 12)).tolist()
        assert tok.decode(ids) == hf.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    for conv in CONVERSATIONS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                ours = tok.apply_chat_template(conv, add_generation_prompt=gen, tools=tools)
                assert ours == hf.apply_chat_template(conv, add_generation_prompt=gen, tools=tools, tokenize=False)


def test_nfc_tokenizer_equals_transformers_qwen2_tokenizer() -> None:
    transformers = pytest.importorskip("transformers")
    path = path_of(DRAFT)
    file = GGUFFile(path)
    tokens, merges = file.get("tokenizer.ggml.tokens"), file.get("tokenizer.ggml.merges")
    assert isinstance(tokens, list) and isinstance(merges, list)
    reference = transformers.Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]
    )
    tok = Tokenizer.from_gguf(file, nfc=True)
    for text in [t for t in TEXTS if "<" not in t] + ["Å Å", "ﬁ", "\u1e9b\u0323"]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False), text
