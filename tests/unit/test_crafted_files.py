"""A corpus of crafted model files, written here: absurd counts, truncations, sizes that overflow
64 bits, inconsistent metadata, paths out of the model folder, JSON and chat-template bombs. Each
must be refused with a typed error within a few seconds and without allocating what it claims."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.tiny_gguf import TinySpec, write_tiny
from verispec.errors import ModelLoadError, VerispecError
from verispec.formats.chat_template import ChatTemplateError, TemplateRenderer
from verispec.formats.gguf import GGUFModel
from verispec.formats.hf import load_hf_folder, read_hf_config
from verispec.formats.loader import load_model
from verispec.formats.tokenizer import Tokenizer

MAX_SECONDS = 10.0  # a class detector (a hang or a blow-up), not a speed test
MAX_PYTHON_BYTES = 64 << 20


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def header(n_tensors: int, n_kv: int, body: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body + b"\0" * 64


def kv_u32(key: str, value: int) -> bytes:
    return gstr(key) + struct.pack("<II", 4, value)


def tensor(name: str, dims: list[int], type_id: int = 0, offset: int = 0) -> bytes:
    return (
        gstr(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", type_id, offset)
    )


ARCH = gstr("general.architecture") + struct.pack("<I", 8) + gstr("qwen2")

RAW_GGUF: dict[str, bytes] = {
    "metadata count 2**63": header(0, 2**63),
    "tensor count 2**64 - 1": header(2**64 - 1, 0),
    "key length 2**64 - 1": header(0, 1, struct.pack("<Q", 2**64 - 1)),
    "string array of 2**40": header(0, 1, gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**40)),
    "numeric array of 2**62": header(0, 1, gstr("x") + struct.pack("<IIQ", 9, 4, 2**62)),
    "unknown value type": header(0, 1, gstr("x") + struct.pack("<I", 99)),
    "key not UTF-8": header(0, 1, gstr(b"\xff\xfe") + struct.pack("<II", 4, 1)),
    "duplicate key": header(0, 2, kv_u32("a", 1) + kv_u32("a", 2)),
    "alignment 0": header(0, 1, kv_u32("general.alignment", 0)),
    "alignment 3": header(0, 1, kv_u32("general.alignment", 3)),
    "alignment 2**31": header(0, 1, kv_u32("general.alignment", 2**31)),
    "tensor of 2**80 elements": header(1, 1, ARCH + tensor("token_embd.weight", [2**40, 2**40])),
    "dims whose int64 product wraps to 0": header(1, 1, ARCH + tensor("token_embd.weight", [2**32, 2**32])),
    "rank 9": header(1, 1, ARCH + tensor("token_embd.weight", [1] * 9)),
    "empty dimension": header(1, 1, ARCH + tensor("token_embd.weight", [64, 0])),
    "unknown tensor type": header(1, 1, ARCH + tensor("token_embd.weight", [32], type_id=999)),
    "unaligned tensor offset": header(1, 1, ARCH + tensor("token_embd.weight", [8], offset=3)),
    "duplicate tensor": header(2, 1, ARCH + tensor("token_embd.weight", [8]) + tensor("token_embd.weight", [8])),
    "version 2**31": header(0, 0, version=2**31),
    "no magic": b"GGML" + b"\0" * 60,
    "empty": b"",
}


def refused(action: Callable[[], object], error: type[BaseException] = VerispecError) -> BaseException:
    """Run ``action``; it must raise ``error`` fast and without allocating much (Python heap)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(error) as info:
            action()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - start < MAX_SECONDS
    assert peak < MAX_PYTHON_BYTES, f"{peak / 2**20:.0f} MiB allocated"
    return info.value


@pytest.mark.parametrize("case", sorted(RAW_GGUF))
def test_crafted_gguf_headers_are_refused(tmp_path: Path, case: str) -> None:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(RAW_GGUF[case])
    refused(lambda: load_model(path, dtype="fp32"), ModelLoadError)


METADATA = {
    "layers 2**31": {"qwen2.block_count": 2**31},
    "layers 4096 (more than the file has)": {"qwen2.block_count": 4096},
    "hidden 2**30": {"qwen2.embedding_length": 2**30},
    "zero heads": {"qwen2.attention.head_count": 0},
    "more kv heads than heads": {"qwen2.attention.head_count_kv": 8},
    "context 2**32 - 1": {"qwen2.context_length": 2**32 - 1},
    "MLP width 2**31": {"qwen2.feed_forward_length": 2**31},
    "NaN rms epsilon": {"qwen2.attention.layer_norm_rms_epsilon": float("nan")},
    "vocab 2**32 - 1": {"qwen2.vocab_size": 2**32 - 1},
}


@pytest.mark.parametrize("case", sorted(METADATA))
def test_absurd_metadata_in_a_well_formed_file_is_refused(tmp_path: Path, case: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinySpec(metadata=METADATA[case]))
    refused(lambda: load_model(path, dtype="fp32"), ModelLoadError)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_truncated_files_are_refused(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinySpec())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    refused(lambda: GGUFModel(path), ModelLoadError)


def hf_folder(root: Path, config: dict | str, index: dict | None = None) -> Path:
    root.mkdir()
    (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if index is not None:
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


QWEN = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        QWEN | {"num_hidden_layers": 10**9},
        QWEN | {"vocab_size": 2**40},
        QWEN | {"hidden_size": 2**40},
        QWEN | {"rope_theta": 1e400},  # json gives inf
        "[" * 200_000,  # nesting deeper than the JSON parser's recursion
        '{"a": ' * 200_000,
    ],
    ids=["layers", "vocab", "hidden", "theta", "array bomb", "object bomb"],
)
def test_crafted_hf_configs_are_refused(tmp_path: Path, config: dict | str) -> None:
    folder = hf_folder(tmp_path / "m", config)
    refused(lambda: read_hf_config(folder), ModelLoadError)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x", "..", "a\\..\\b"])
def test_index_shards_must_stay_in_the_model_folder(tmp_path: Path, shard: str) -> None:
    (tmp_path / "outside.safetensors").write_bytes(b"\0" * 16)
    folder = hf_folder(tmp_path / "m", QWEN, {"weight_map": {"model.embed_tokens.weight": shard}})
    error = refused(lambda: load_hf_folder(folder, "fp32"), ModelLoadError)
    assert "inside the model folder" in str(error)


BOMBS = {
    "nested loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "a 10 GB string": "{{ 'x' * 10000000000 }}",
    "a 10 GB list": "{% set l = [0] * 2000000000 %}{{ l | length }}",
    "100 MB of output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "endless recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "a syntax error": "{% for %}",
    "a raised exception": "{{ raise_exception('no system messages') }}",
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "a lone surrogate": "{{ '\\ud800' }}",
}


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_chat_template_bombs_are_stopped(tmp_path: Path, case: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinySpec())
    tok = Tokenizer.from_gguf(path)
    good = tok.chat_template
    tok.chat_template = BOMBS[case]
    refused(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}]), ChatTemplateError)
    tok.chat_template = good  # the renderer recovers: the next render works
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi")


def test_a_renderer_past_its_time_is_stopped_and_replaced() -> None:
    renderer = TemplateRenderer(timeout=0.5)
    try:
        with pytest.raises(ChatTemplateError, match=r"longer than 0\.5 s"):
            renderer.render("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", {})
        assert renderer.render("{{ x }}!", {"x": "ok"}) == "ok!"
    finally:
        renderer.close()
