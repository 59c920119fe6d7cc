"""Draft distillation (Zhou et al. 2024, "DistillSpec: Improving Speculative Decoding via
Knowledge Distillation", ICLR 2024): fine-tune the draft model toward the target.

On the self-distillation data (:mod:`verispec.train.data`: the target's own answers, and its
hidden states, from which its LM head gives its law at every answer position), the draft's law
``q`` after each answer prefix is pulled toward the target's ``p``, both at the sampling
``temperature``, over the ids the draft scores at decode time (the first ``head_size``; the
target's law renormalised there), by one of:

- ``fkl``: the forward KL divergence ``KL(p || q)`` (the usual distillation loss);
- ``tv``: the total variation distance ``1/2 sum |p - q|``, whose complement ``sum min(p, q)`` is
  exactly the rejection rule's acceptance probability (DistillSpec §3).

DistillSpec found that the better divergence depends on the task and the sampling settings, so
both are offered, and the held-out figures say what each did: the expected acceptance rate
``sum min(p, q)`` at ``temperature`` (the target's full law, the draft's restricted one) and the
greedy agreement (the draft's top token is the target's), before and after.

The draft is trained through low-rank adapters (LoRA, Hu et al. 2022, via ``peft``) on every
projection of a differentiable copy of it (:class:`Decoder`: the runtime's arithmetic in fp32,
checked against it in the tests), merged into the weights when done. The result is a model folder
the loader takes like any other draft (``config.json``, the tokenizer's files, ``model.safetensors``
in bf16, and ``distill.json`` naming the base draft, the target, the objective and the figures).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.drafters.heads import target_fingerprint
from verispec.errors import ConfigError
from verispec.formats.files import write_json
from verispec.models.config import ModelConfig
from verispec.models.protocol import LanguageModel
from verispec.train.data import Sequences, load_split

#: The manifest a distilled folder carries.
MANIFEST = "distill.json"
FORMAT = "verispec-distill/1"
OBJECTIVES = ("fkl", "tv")
#: The projections the adapters go on.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

Progress = Callable[[str, int, int, dict[str, float]], None]


@dataclass(frozen=True)
class DistillConfig:
    objective: str = "fkl"
    temperature: float = 1.0
    head_size: int = 32768
    epochs: int = 1
    lr: float = 2e-4
    rank: int = 16
    batch: int = 512  # answer positions per step, whole sequences
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not 0.05 <= self.temperature <= 5.0:
            raise ConfigError(f"--temperature must be in [0.05, 5] (laws of sampling), got {self.temperature}")
        if self.head_size < 1 or self.epochs < 1 or self.batch < 1 or not 1 <= self.rank <= 256:
            raise ConfigError("--head-size, --epochs and --batch must be >= 1, --rank in 1..256")
        if not 0.0 < self.lr < 1.0:
            raise ConfigError(f"--lr must be in (0, 1), got {self.lr}")


# ------------------------------------------------------------------------------ the decoder
class _Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        d = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * d, c.hidden_size, bias=False)
        self.heads, self.kv_heads, self.d = c.num_heads, c.num_kv_heads, d

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # [L, C] -> [L, C]
        n = x.shape[0]
        q = _rotate(self.q_proj(x).view(n, self.heads, self.d), cos, sin).transpose(0, 1)  # [H, L, D]
        k = _rotate(self.k_proj(x).view(n, self.kv_heads, self.d), cos, sin).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.d).transpose(0, 1)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [H, L, D]
        projected: Tensor = self.o_proj(out.transpose(0, 1).reshape(n, -1))
        return projected


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # [L, H, D]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class _Body(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([_Layer(c) for _ in range(c.num_layers)])
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class Decoder(nn.Module):
    """A differentiable Llama / Qwen2 decoder under the runtime's state-dict names (one sequence
    at a time, causal, no cache): what distillation trains."""

    def __init__(self, config: ModelConfig, state: Mapping[str, Tensor]) -> None:
        super().__init__()
        if config.rope_scaling is not None:
            raise ConfigError("distillation does not support RoPE scaling yet; distil a draft without it")
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        wanted = dict(state)
        if config.tie_word_embeddings or "lm_head.weight" not in wanted:
            wanted["lm_head.weight"] = wanted["model.embed_tokens.weight"]
        missing, unexpected = self.load_state_dict({k: v.float() for k, v in wanted.items()}, strict=False)
        if missing or unexpected:
            raise ConfigError(f"the draft's weights do not fit its decoder: {missing[:3]} {unexpected[:3]}")
        d = config.head_dim
        self.inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D / 2] (not saved)

    def hidden(self, tokens: Tensor) -> Tensor:  # [L] -> [L, C] after the final norm
        inv_freq = self.inv_freq.to(tokens.device)
        angles = torch.arange(len(tokens), dtype=torch.float32, device=tokens.device)[:, None] * inv_freq  # [L, D / 2]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]  # [L, 1, D]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        out: Tensor = self.model.norm(x)
        return out

    def logits(self, hidden: Tensor, head_size: int | None = None) -> Tensor:  # [N, C] -> [N, H]
        weight = self.lm_head.weight if head_size is None else self.lm_head.weight[:head_size]
        return F.linear(hidden, weight)


def decoder_of(model: LanguageModel) -> Decoder:
    """A trainable copy of a runtime model loaded in fp32 (its weights, its names)."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("inv_freq")}  # type: ignore[attr-defined]
    return Decoder(model.config, state)


# ------------------------------------------------------------------------------ objectives
def divergence(objective: str, target_logits: Tensor, draft_logits: Tensor, temperature: float) -> Tensor:
    """Mean over rows of ``fkl`` or ``tv`` between the laws of ``[N, H]`` logits at ``temperature``."""
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    if objective == "fkl":
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1).mean()


def _answer(seqs: Sequences, i: int) -> tuple[Tensor, Tensor, int]:
    """Sequence ``i``'s tokens, its hidden states at positions ``P - 1 .. L - 2`` (each gives an
    answer token), and ``P``."""
    p = seqs.prompt_lens[i]
    return seqs.tokens[i], seqs.answer_hidden(i)[:-1], p


@torch.no_grad()
def evaluate(decoder: Decoder, target_lm: Tensor, seqs: Sequences, config: DistillConfig) -> dict[str, float]:
    """Held-out expected acceptance ``sum min(p, q)`` at the temperature (the target's full law,
    the draft's over its scored ids), greedy agreement, and the mean divergence trained on."""
    accept = agree = loss = 0.0
    count = 0
    for i in range(len(seqs.tokens)):
        tokens, hidden, p = _answer(seqs, i)
        if len(hidden) == 0:
            continue
        mine = decoder.logits(decoder.hidden(tokens[:-1])[p - 1 :], config.head_size)  # [n, H]
        theirs = hidden.float() @ target_lm.T  # [n, V]
        t = config.temperature
        p_full = torch.softmax(theirs / t, -1)
        q = torch.softmax(mine / t, -1)
        accept += float(torch.minimum(p_full[:, : q.shape[1]], q).sum(-1).sum())
        agree += float((mine.argmax(-1) == theirs.argmax(-1)).sum())
        loss += float(divergence(config.objective, theirs[:, : config.head_size], mine, t)) * len(hidden)
        count += len(hidden)
    n = max(count, 1)
    return {"acceptance": accept / n, "greedy_agreement": agree / n, config.objective: loss / n, "positions": count}


# ------------------------------------------------------------------------------ training
def distill(
    data: Path,
    target: LanguageModel,
    draft: LanguageModel,
    config: DistillConfig = DistillConfig(),
    *,
    device: str = "cpu",
    progress: Progress | None = None,
) -> tuple[Decoder, dict[str, Any]]:
    """Fine-tune ``draft`` (loaded in fp32) toward ``target`` on ``data``; returns the merged decoder
    and the figures (held-out before and after, steps, seconds)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ConfigError("verispec train distill needs peft: pip install 'verispec[train]'") from exc

    manifest, train = load_split(data, "train")
    _, heldout = load_split(data, "heldout")
    if manifest.fingerprint != target_fingerprint(target):
        raise ConfigError(f"{data} was made with {manifest.target!r}, not this target; make data for it first")
    if target.lm_weight is None:
        raise ConfigError(f"{type(target).__name__} does not expose its LM head; distillation needs the target's laws")
    head = min(config.head_size, draft.config.vocab_size, target.config.vocab_size)
    config = DistillConfig(**{**asdict(config), "head_size": head})
    target_lm = target.lm_weight.detach().float().to(device)  # [V, C]
    decoder = decoder_of(draft).to(device)
    decoder.requires_grad_(False)
    before = evaluate(decoder, target_lm, heldout, config) if heldout.tokens else {}
    torch.manual_seed(config.seed)
    lora = LoraConfig(r=config.rank, lora_alpha=2 * config.rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = get_peft_model(decoder, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    order = [torch.randperm(len(train.tokens), generator=gen).tolist() for _ in range(config.epochs)]
    steps = [_group(train, o, config.batch) for o in order]
    total = sum(len(s) for s in steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    start, step, last = time.perf_counter(), 0, math.nan
    inner = model.base_model.model  # the Decoder, with adapters inside
    assert isinstance(inner, Decoder)
    for epoch in range(config.epochs):
        for group in steps[epoch]:
            loss = torch.zeros(())
            positions = 0
            for i in group:
                tokens, hidden, p = _answer(train, i)
                if len(hidden) == 0:
                    continue
                mine = inner.logits(inner.hidden(tokens[:-1].to(device))[p - 1 :], head)
                with torch.no_grad():
                    theirs = hidden.float().to(device) @ target_lm[:head].T
                loss = loss + divergence(config.objective, theirs, mine, config.temperature) * len(hidden)
                positions += len(hidden)
            if positions == 0:
                continue
            loss = loss / positions
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            schedule.step()
            step += 1
            last = float(loss.detach())
            if progress is not None:
                progress("train", step, total, {"loss": last, "epoch": epoch + 1})
    merged = model.merge_and_unload()
    assert isinstance(merged, Decoder)
    merged.requires_grad_(False)
    after = evaluate(merged, target_lm, heldout, config) if heldout.tokens else {}
    info = {
        "objective": config.objective, "temperature": config.temperature, "head_size": head, "rank": config.rank,
        "epochs": config.epochs, "steps": step, "loss": last, "seconds": time.perf_counter() - start,
        "data": str(data), "heldout_before": before, "heldout": after,
    }  # fmt: skip
    if progress is not None:
        progress("done", step, total, {"acceptance": float(after.get("acceptance", math.nan))})
    return merged, info


def _group(seqs: Sequences, order: list[int], size: int) -> list[list[int]]:
    """Whole sequences in ``order``, about ``size`` answer positions a step."""
    out: list[list[int]] = [[]]
    count = 0
    for i in order:
        n = len(seqs.tokens[i]) - seqs.prompt_lens[i]
        if out[-1] and count + n > size:
            out.append([])
            count = 0
        out[-1].append(i)
        count += n
    return [g for g in out if g]


# ------------------------------------------------------------------------------ the folder
def hf_config(config: ModelConfig) -> dict[str, Any]:
    """``config.json`` in the transformers spelling (:func:`verispec.formats.hf.config_from_hf` reads it)."""
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[config.architecture]
    return {
        "architectures": [arch], "model_type": config.architecture, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, "torch_dtype": "bfloat16",
    }  # fmt: skip


def save_folder(decoder: Decoder, tokenizer: Any, vocab_size: int, out: Path, manifest: dict[str, Any]) -> None:
    """Write the distilled draft as a model folder (see the module docstring); the folder is built
    beside ``out`` and renamed into place, so an interrupted save leaves nothing half-written.
    ``vocab_size``: the ids the base's tokenizer really defines (a GGUF's trailing padding
    placeholders, ``[PAD151665]`` .., are left out of ``tokenizer.json``, as the base leaves them out)."""
    import shutil

    from safetensors.torch import save_file

    if out.exists() and not (out / MANIFEST).is_file():
        raise ConfigError(f"--out {str(out)!r} exists and is not a distilled draft; choose a new folder")
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in decoder.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", hf_config(decoder.config))
        (tmp / "tokenizer.json").write_text(_without_placeholders(tokenizer.backend.to_str(), vocab_size), "utf-8")
        t = tokenizer
        ids = {"bos_token": t.bos_token_id, "eos_token": t.eos_token_id, "pad_token": t.pad_token_id}
        special = {key: tokenizer.backend.id_to_token(value) for key, value in ids.items() if value is not None}
        if tokenizer.chat_template:
            special["chat_template"] = tokenizer.chat_template
        write_json(tmp / "tokenizer_config.json", special)
        write_json(tmp / "generation_config.json", {"eos_token_id": list(tokenizer.eos_token_ids)})
        write_json(tmp / MANIFEST, {"format": FORMAT, **manifest})
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _without_placeholders(text: str, vocab_size: int) -> str:
    """A ``tokenizer.json`` without the ids from ``vocab_size`` on."""
    data = json.loads(text)
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        data["model"]["vocab"] = {k: v for k, v in vocab.items() if v < vocab_size}
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t.get("id", 0) < vocab_size]
    return json.dumps(data, ensure_ascii=False)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """A distilled folder's ``distill.json`` (None when it is not one)."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None
