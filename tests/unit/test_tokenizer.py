"""Tokenizer built from GGUF metadata (tiny byte-level BPE files) and from a Hugging Face folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from tests.unit.tiny_gguf import CHAT_TEMPLATE, TinySpec, tokenizer_tokens, write_tiny
from verispec.errors import InputError, ModelLoadError, UnsupportedModelError
from verispec.formats.tokenizer import Tokenizer

TEXTS = [
    "",
    " ",
    "the the  the",
    "def f():\n    return 1\n",
    "  \n\n\t x",
    "héllo wörld",
    "日本語 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>a<|endoftext|>",
    "<tool_call>{}</tool_call>",
    "<|im_start|",
    "[PAD0]",
    "e\u0301",
    "x" * 100,
    "it's 123456 in",
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_tiny(path, TinySpec())
    return path


def ids_of(*tokens: str) -> list[int]:
    vocab = tokenizer_tokens()[0]
    return [vocab.index(t) for t in tokens]


def test_encode_decode_round_trip(tiny_path: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text  # byte-level BPE is lossless


def test_merges_and_special_tokens(tiny_path: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_path)
    assert tok.encode(" the") == ids_of("Ġthe")  # Ġ t -> Ġt, h e -> he, Ġt he -> Ġthe
    assert tok.encode("def") == ids_of("def")
    assert tok.encode("<|im_start|>user") == ids_of("<|im_start|>", "u", "s", "e", "r")
    assert tok.encode("<tool_call>") == ids_of("<tool_call>")  # user-defined: matched whole
    assert len(tok.encode("[PAD0]")) == 6  # unused: an ordinary string
    ids = tok.encode("<|im_start|>hi<tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi<tool_call>"  # control tokens dropped
    assert tok.token_to_id("<|im_end|>") == ids_of("<|im_end|>")[0]
    assert tok.id_to_token(ids_of("Ġthe")[0]) == "Ġthe"
    assert tok.encode_batch(["the", " the"]) == [tok.encode("the"), tok.encode(" the")]


def test_special_ids_and_no_bos_added(tiny_path: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_path)
    eot, end = ids_of("<|endoftext|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (eot, end, eot)
    assert tok.eos_token_ids == (end, eot)  # EOS first, then <|endoftext|> by name
    assert tok.encode("a", add_special_tokens=True) == tok.encode("a", add_special_tokens=False)
    assert tok.vocab_size == len(tokenizer_tokens()[0])


def test_add_bos_token(tmp_path: Path) -> None:
    path = tmp_path / "bos.gguf"
    write_tiny(path, TinySpec(arch="llama", pre="llama-bpe"))
    data = path.read_bytes()  # flip tokenizer.ggml.add_bos_token: False -> True in place
    key = b"tokenizer.ggml.add_bos_token"
    at = data.index(key) + len(key) + 4  # then the u32 value type, then the bool
    path.write_bytes(data[:at] + b"\x01" + data[at + 1 :])
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("a") == [tok.bos_token_id, *tok.encode("a", add_special_tokens=False)]


def test_nfc_option(tiny_path: Path) -> None:
    plain, nfc = Tokenizer.from_gguf(tiny_path), Tokenizer.from_gguf(tiny_path, nfc=True)
    assert plain.encode("e\u0301") != nfc.encode("e\u0301") == nfc.encode("\u00e9") == plain.encode("\u00e9")


def test_chat_template(tiny_path: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_path)
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi 😀"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi 😀<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert messages[1] == {"role": "user", "content": "hi 😀"}  # caller's messages untouched


def test_template_features_match_transformers_environment(tiny_path: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_path)
    tok.chat_template = (
        "{%- for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ tools | tojson(indent=1) }}{% if bad %}{{ raise_exception('bad input') }}{% endif %}"
    )
    out = tok.apply_chat_template([{"role": "u", "content": "é<b>"}, {"role": "x"}], tools=[{"n": 1}])
    assert out == '{"role": "u", "content": "é<b>"}[\n {\n  "n": 1\n }\n]'  # no HTML escaping, no ASCII escaping
    from verispec.formats.chat_template import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="bad input"):
        tok.apply_chat_template([], bad=True)
    tok.chat_template = None
    with pytest.raises(InputError, match="no chat template"):
        tok.apply_chat_template([])


def test_matches_transformers_gguf_conversion(tiny_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_path.parent), gguf_file=tiny_path.name)
    tok = Tokenizer.from_gguf(tiny_path)
    for text in TEXTS:
        for add in (False, True):
            assert tok.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_from_hf_folder(tiny_path: Path, tmp_path: Path) -> None:
    gguf_tok = Tokenizer.from_gguf(tiny_path)
    gguf_tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>"},
        "pad_token": "<|endoftext|>",
        "chat_template": [
            {"name": "default", "template": CHAT_TEMPLATE},
            {"name": "tool_use", "template": "x"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    eot, end = ids_of("<|endoftext|>", "<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert all(tok.encode(t) == gguf_tok.encode(t) and tok.decode(tok.encode(t)) == t for t in TEXTS)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.eos_token_ids) == (
        None,
        end,
        eot,
        (end, eot),
    )
    assert tok.chat_template == CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([{"role": "u", "content": "c"}]) == "c"


def test_folders_with_one_tokenizer_file_share_its_backend(tiny_path: Path, tmp_path: Path) -> None:
    backend = Tokenizer.from_gguf(tiny_path).backend
    a, b, c = (tmp_path / name for name in "abc")
    for folder in (a, b, c):
        folder.mkdir()
        backend.save(str(folder / "tokenizer.json"))
    text = (c / "tokenizer.json").read_text()
    (c / "tokenizer.json").write_text(text.replace('"<|im_end|>"', '"<|im_stop|>"'))  # another vocabulary
    ta, tb, tc = (Tokenizer.from_hf_folder(folder) for folder in (a, b, c))
    assert ta.backend is tb.backend and tc.backend is not ta.backend
    assert tc.token_to_id("<|im_stop|>") is not None and ta.token_to_id("<|im_stop|>") is None


def test_hf_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"not a valid tokenizer\.json"):
        Tokenizer.from_hf_folder(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("tokenizer_model", "llama", "'llama'.*gpt2"), ("pre", "falcon", "'falcon'.*qwen2")],
)
def test_unsupported_tokenizers(tmp_path: Path, field: str, value: str, match: str) -> None:
    path = tmp_path / "t.gguf"
    write_tiny(path, TinySpec(**{field: value}))  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match=match):
        Tokenizer.from_gguf(path)


def test_no_tokenizer_metadata(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_tiny(path, TinySpec(tokenizer=False))
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        Tokenizer.from_gguf(path)
