"""The PyTorch runtime of the Llama family (Llama 2/3, Mistral, SmolLM, Qwen2/2.5), built for speculation.

One decoder-only transformer (Touvron et al. 2023, "LLaMA"): token embedding, ``L`` pre-norm blocks
``h += Attn(RMSNorm(h)); h += MLP(RMSNorm(h))``, a final RMSNorm and the LM head (tied to the
embedding or not). The parts:

- RMSNorm (Zhang & Sennrich 2019), computed in fp32 and cast back, as transformers does.
- Rotary position embeddings (Su et al. 2021) with the checkpoint's theta and scaling
  (:mod:`verispec.models.rope`).
- Grouped-query attention (Ainslie et al. 2023): ``H`` query heads share ``H_kv`` key/value heads.
  The ``G = H / H_kv`` query heads of a group are stacked along the query axis, so attention reads
  the cached keys once per group and never copies them (``scaled_dot_product_attention`` over
  ``[B, H_kv, G*T, D]`` queries with an explicit mask); bf16 CPU models with verispec's kernels
  attend one query row at a time instead (:class:`Transformer` with ``cpu_kernels=True``: batch-invariant).
- SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``; optional q/k/v biases (Qwen2).

**One forward serves every step of speculative decoding** (Leviathan et al. 2023; Chen et al. 2023):
prefill (``T`` = prompt length), plain decode (``T = 1``), chain verification (the last committed
token plus ``K`` draft tokens, ``T = K + 1``) and tree verification (SpecInfer, Miao et al. 2024;
Medusa, Cai et al. 2024) with a within-step ``attn_mask``: a node sees the cached prefix, its
ancestors and itself (a tree drafted level by level passes a wider window, whose first columns
are the tree's nodes already cached, so each level feeds only its new nodes). Rows of a batch
have their own cached lengths and their own number of new tokens (right padding, ``num_new``);
padding tokens neither see nor are seen by real tokens and
are written to the cache's scratch column. New keys/values are appended in place to the static
:class:`~verispec.models.kv_cache.KVCache` before attention, which then reads positions
``[0, span)`` of the buffers under a mask built once per step and shared by all layers (as in
gpt-fast). The forward pass never synchronises with the device. On verispec's CPU kernels a
pass that is not a prompt's chunk (plain decoding, chain and tree verification, a draft model's
passes) is one native call, step plan and LM head included, with RoPE's rows looked up in a table
of every position (:meth:`Transformer._chain_natively`).

Weights are a plain module tree with Hugging Face names (``model.layers.N.self_attn.q_proj.weight``,
...), so a transformers state dict loads as is. The model holds no per-request state: everything a
request owns lives in the cache handle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.errors import InputError, ModelLoadError
from verispec.models.config import ModelConfig
from verispec.models.kv_cache import KVCache, StepPlan
from verispec.models.linear import DenseLinear, Linear, dense_linear, packed_linear, packed_prefixes
from verispec.models.rope import RotaryEmbedding, apply_rotary

ROPE_FREQS_KEY = "model.rope_freqs"  # [D/2] RoPE frequency divisors (llama.cpp's rope_freqs)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in fp32 (Zhang & Sennrich 2019)."""

    def __init__(self, size: int, eps: float, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., C] -> [..., C] in x's dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over the cached prefix plus the step's new tokens."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        bias = config.attention_bias
        self.q_proj: nn.Module = DenseLinear(hidden, config.num_heads * d, bias, device)
        self.k_proj: nn.Module = DenseLinear(hidden, config.num_kv_heads * d, bias, device)
        self.v_proj: nn.Module = DenseLinear(hidden, config.num_kv_heads * d, bias, device)
        self.o_proj: nn.Module = DenseLinear(config.num_heads * d, hidden, False, device)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # [M, C] -> [M, H*D], [M, Hkv*D] x2
        """q, k, v of ``x`` (views of one fused projection's output when :meth:`fuse` succeeded)."""
        fused = getattr(self, "qkv_proj", None)
        if fused is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = fused(x)  # [M, (H + 2 Hkv) * D]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv[:, :q_width], qkv[:, q_width : q_width + kv_width], qkv[:, q_width + kv_width :]

    def fuse(self) -> bool:
        """Replace q/k/v by one packed projection (:func:`verispec.kernels.linear.fuse_linears`)
        when they allow it; True if they did."""
        from verispec.kernels.linear import fuse_linears

        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return False
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = fused
        return True

    def forward(
        self,
        x: Tensor,  # [B, T, C]
        cos: Tensor,  # [B, T, 1, D]
        sin: Tensor,  # [B, T, 1, D]
        cache: KVCache,
        layer: int,
        plan: StepPlan,
        mask: Tensor,  # [B, 1, G*T, span] additive: 0 = may attend, -inf = may not
    ) -> Tensor:  # [B, T, C]
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        g = h // hkv
        q = self.q_proj(x).view(b, t, h, d)
        k = self.k_proj(x).view(b, t, hkv, d)
        v = self.v_proj(x).view(b, t, hkv, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.write(layer, plan, k, v)
        keys, values = cache.read(layer, plan)  # [B, H_kv, span, D] each
        # Query head h = kv * G + g (transformers' repeat_kv order); stack a group's heads along T.
        qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)  # [B, H_kv, G*T, D]
        out = out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
        return self.o_proj(out)  # type: ignore[no-any-return]


class MLP(nn.Module):
    """SwiGLU feed-forward block (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        c, f = config.hidden_size, config.intermediate_size
        self.gate_proj: nn.Module = DenseLinear(c, f, False, device)
        self.up_proj: nn.Module = DenseLinear(c, f, False, device)
        self.down_proj: nn.Module = DenseLinear(f, c, False, device)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, C] -> [B, T, C]
        gate = F.silu(self.gate_proj(x))  # [B, T, F]
        return self.down_proj(gate * self.up_proj(x))  # type: ignore[no-any-return]

    def project_gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:  # [M, C] -> [M, F] x2
        """gate and up of ``x`` (views of one fused projection's output when :meth:`fuse` succeeded)."""
        fused = getattr(self, "gate_up_proj", None)
        if fused is None:
            return self.gate_proj(x), self.up_proj(x)
        gate_up = fused(x)  # [M, 2F]
        f = gate_up.shape[-1] // 2
        return gate_up[:, :f], gate_up[:, f:]

    def fuse(self) -> bool:
        """Replace gate/up by one packed projection when they allow it; True if they did."""
        from verispec.kernels.linear import fuse_linears

        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is None:
            return False
        del self.gate_proj, self.up_proj
        self.gate_up_proj = fused
        return True


class DecoderLayer(nn.Module):
    """One pre-norm block: ``h += Attn(norm(h)); h += MLP(norm(h))``."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = Attention(config, device)
        self.mlp = MLP(config, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        # (uninitialised: the checkpoint's weight replaces it; nn.Embedding's own random init of a
        # 150k x 1.5k table took ~1 s per model, and its first call imported torch._dynamo)
        empty = torch.empty(config.vocab_size, config.hidden_size, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, _weight=empty)
        self.layers = nn.ModuleList([DecoderLayer(config, device) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)


#: A prompt's piece of at least this many tokens takes the prefill path (``forward(prefill=True)``):
#: whole int4 passes on the amx tier (Intel Xeon with AMX, 2 threads), the decoding path's time
#: over the prefill path's: the 1.5B 0.77x at 32 tokens, 0.99x at 64, 1.21x at 96, 1.37x at 128;
#: the 0.5B 0.90x at 64, 0.97x at 96, 1.02x at 128, 1.24x at 512.
PREFILL_MIN_TOKENS = 96


@dataclass(frozen=True)
class ForwardOutput:
    """What :meth:`Transformer.forward_with_hidden` returns. Both are inference tensors (made
    under ``torch.inference_mode``): ``clone()`` them before feeding autograd (e.g. to train draft
    heads on the hidden states)."""

    logits: Tensor  # [B, N, V] fp32 (N = T, or the number of positions in logits_at)
    hidden: Tensor  # [B, T, C] model dtype: last hidden states after the final norm


class Transformer(nn.Module):
    """A Llama-family decoder with weights in Hugging Face naming (see the module docstring).

    ``state_dict`` holds ``model.embed_tokens.weight``,
    ``model.layers.N.self_attn.{q,k,v,o}_proj.weight`` (and ``.bias`` of q/k/v when
    ``config.attention_bias``), ``model.layers.N.mlp.{gate,up,down}_proj.weight``,
    ``model.layers.N.{input,post_attention}_layernorm.weight``, ``model.norm.weight``, unless the
    embeddings are tied ``lm_head.weight``, and optionally ``model.rope_freqs`` (RoPE frequency
    divisors from GGUF files, see :mod:`verispec.models.rope`). Tensors already in ``dtype`` on
    ``device`` are used without a copy. Weights and activations are in ``dtype`` (fp32 for
    reference, bf16 for speed); logits always come back in fp32. ``cpu_kernels=True`` builds the
    model on verispec's CPU kernels (see :meth:`_move_to_cpu_kernels`): the form is chosen once,
    at construction, never changed on a model someone holds.
    """

    def __init__(
        self,
        config: ModelConfig,
        state_dict: Mapping[str, Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        cpu_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, "meta")
        packed = packed_prefixes(state_dict)
        # Tied embeddings share the embedding matrix as the LM head, unless the head comes packed.
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings and "lm_head" not in packed
            else DenseLinear(config.hidden_size, config.vocab_size, False, "meta")
        )
        rest = self._install_packed(state_dict, packed, torch.device(device))
        self._load(rest, dtype, torch.device(device))
        self.requires_grad_(False)
        self.rope = RotaryEmbedding(config, device, state_dict.get(ROPE_FREQS_KEY))
        #: decoder layers on verispec's CPU kernels (see :meth:`_move_to_cpu_kernels`)
        self.cpu_kernels = False
        self._native_layers: Any = None  # the kernels' one-call layer loop, when every layer allows it
        self._native_head: Any = None  # the kernels' Projection of the LM head, when it is packed
        if cpu_kernels:
            self._move_to_cpu_kernels()

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights and activations."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.model.embed_tokens.weight.device

    def _install_packed(
        self, state_dict: Mapping[str, Tensor], packed: Mapping[str, str], device: torch.device
    ) -> dict[str, Tensor]:
        """Put a packed module (:mod:`verispec.models.linear`) in place of each projection the state
        dict holds packed; return the entries left for the dense parts."""
        rest = dict(state_dict)
        for prefix, kind in packed.items():
            try:
                current = self.get_submodule(prefix)
            except AttributeError:
                current = None
            if not isinstance(current, DenseLinear):
                raise ModelLoadError(
                    f"packed weights {prefix}.* name no projection of {self.config.architecture} "
                    f"({self.config.num_layers} layers); check that the packed file belongs to this model"
                )
            if device.type != "cpu":
                raise ModelLoadError(f"packed (int4/int8) weights run on the CPU only; {prefix} was asked for {device}")
            try:
                module, used = packed_linear(prefix, kind, state_dict, current.out_features, current.in_features)
            except (KeyError, ValueError) as exc:
                raise ModelLoadError(
                    f"packed weights of {prefix} are incomplete or have the wrong size ({exc}); delete the packed "
                    "cache file (int4/int8.safetensors in the model folder) to rebuild it"
                ) from exc
            self.set_submodule(prefix, module)
            for key in used:
                rest.pop(key)
        return rest

    def _load(self, state_dict: Mapping[str, Tensor], dtype: torch.dtype, device: torch.device) -> None:
        packed = {n for n, m in self.named_modules() if not isinstance(m, DenseLinear) and isinstance(m, Linear)}
        expected = {k: v for k, v in self.state_dict(keep_vars=True).items() if k.rpartition(".")[0] not in packed}
        wanted = {k: v for k, v in state_dict.items() if k in expected}
        missing = sorted(set(expected) - set(wanted))
        # A tied checkpoint may still carry lm_head.weight; old ones carry rotary inv_freq buffers;
        # GGUF files of Llama 3.1+ carry RoPE frequency factors (used by the RotaryEmbedding).
        ignorable = {
            k for k in state_dict if k in ("lm_head.weight", ROPE_FREQS_KEY) or k.endswith("rotary_emb.inv_freq")
        }
        unexpected = sorted(set(state_dict) - set(expected) - ignorable)
        if missing or unexpected:
            raise ModelLoadError(
                f"state dict does not match {self.config.architecture} ({self.config.num_layers} layers, "
                f"attention_bias={self.config.attention_bias}, tie_word_embeddings="
                f"{self.config.tie_word_embeddings}): missing {missing[:8]}, unexpected {unexpected[:8]}; "
                "check that the ModelConfig was read from the same checkpoint"
            )
        for name, tensor in wanted.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(expected[name].shape)}; check the ModelConfig of this checkpoint"
                )
        cast = {k: v.detach().to(device=device, dtype=dtype) for k, v in wanted.items()}
        result = self.load_state_dict(cast, strict=False, assign=True)
        # only packed projections' own tensors are left (a state_dict() per projection took ~0.4 s a model)
        inside_packed = {k for k in result.missing_keys if any(k[:i] in packed for i, c in enumerate(k) if c == ".")}
        assert not result.unexpected_keys and inside_packed == set(result.missing_keys), result

    @property
    def embed_weight(self) -> Tensor:  # [V, C]
        """The token embedding (dense in every precision)."""
        return self.model.embed_tokens.weight

    @property
    def lm_weight(self) -> Tensor:  # [V, C]
        """The LM head's weight (the embedding when tied). A packed head (int4/int8) returns its
        dequantised weights in the model's dtype, computed anew on each access."""
        head = self.lm_head
        if head is None:
            return self.model.embed_tokens.weight
        if isinstance(head, DenseLinear):
            return head.weight
        assert isinstance(head, Linear)
        return head.dequantize().to(self.dtype)

    def _move_to_cpu_kernels(self) -> None:
        """Put this bf16 / int8 / int4 CPU model, while it is being built, on verispec's kernels
        (:mod:`verispec.kernels`): dense bf16 projections move to the bf16 kernel
        (:meth:`_pack_bf16`), q/k/v and gate/up are fused into one projection each where their
        kinds allow, and the decoder layers run as one kernel call per pass where every projection
        is packed (:meth:`_native_layer_loop`), else as a short sequence of kernel calls per layer
        (:meth:`_layers_on_kernels`): RMSNorm with the residual add, RoPE and SwiGLU in
        ``csrc/vec/layer_ops.cpp``, attention one query row at a time in a fixed order
        (``csrc/vec/attention.cpp``). Every operation of a
        forward pass then computes a token's row the same way whatever else is in the pass, so a
        verification pass over ``K + 1`` tokens gives each of them the logits a one-token decode
        step gives it, bit for bit, and greedy speculative output equals greedy plain output in
        these precisions too. The packed weights then move to transparent huge pages
        (:mod:`verispec.kernels.hugepages`: the same values, read faster). fp32 models keep torch's
        kernels (they are the reference); raises :class:`~verispec.errors.ConfigError` when the
        kernels cannot run here."""
        from verispec.kernels import load
        from verispec.kernels.hugepages import move_to_huge_pages
        from verispec.kernels.linear import native_projection

        if self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return
        load()
        self._pack_bf16()
        d = self.config.head_dim
        if d % 32 or d > 256:  # the row kernels' head sizes; other models keep torch's operations
            return
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.cpu_kernels = True
        move_to_huge_pages(self)
        self._native_layers = self._native_layer_loop()
        self._native_head = None if self.lm_head is None else native_projection(self.lm_head)

    def _native_layer_loop(self) -> Any:
        """Every decoder layer as one kernel call per forward pass (``Layers.forward`` in
        ``csrc/bindings.cpp``: the same operations as :meth:`_layers_on_kernels`' loop, without
        ~12 Python calls per layer, and no torch call between its kernels: torch's code and data
        are evicted while a projection streams its weights), or None when some layer's projections
        are not all packed and fused (then the Python loop runs them)."""
        from verispec.kernels import load
        from verispec.kernels.linear import native_projection as projection

        ops = load()
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        specs = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            fused_qkv, fused_gate_up = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
            qkv = [fused_qkv] if fused_qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
            gate_up = [fused_gate_up] if fused_gate_up is not None else [mlp.gate_proj, mlp.up_proj]
            qkv_p, gate_up_p = [projection(p) for p in qkv], [projection(p) for p in gate_up]
            o, down = projection(attn.o_proj), projection(mlp.down_proj)
            if any(p is None for p in (*qkv_p, *gate_up_p, o, down)):
                return None
            after = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            specs.append((qkv_p, o, gate_up_p, down, layer.post_attention_layernorm.weight, after))
        cfg = self.config
        return ops.Layers(specs, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size,
                          cfg.rms_norm_eps)  # fmt: skip

    def _pack_bf16(self) -> int:
        """Move every dense bf16 CPU projection whose input size is a multiple of 32 (and the LM
        head, tied or not) onto :class:`verispec.kernels.Bf16Linear`, the bf16 kernel: the same
        weights, read at close to memory bandwidth and batch-invariant. The tied embedding table
        stays for the lookups (the packed head is a second copy of it). Returns the number of
        projections moved; raises :class:`~verispec.errors.ConfigError` when the kernels cannot
        run here (see :func:`verispec.kernels.load`)."""
        from verispec.kernels import Bf16Linear, load

        if self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return 0
        load()
        moved = 0
        for name, module in list(self.named_modules()):
            if isinstance(module, DenseLinear) and module.in_features % 32 == 0:
                self.set_submodule(name, Bf16Linear.from_weight(module.weight, module.bias))
                moved += 1
        embed = self.model.embed_tokens.weight
        if self.lm_head is None and embed.shape[1] % 32 == 0:
            self.lm_head = Bf16Linear.from_weight(embed)
            moved += 1
        return moved

    def _layers_on_kernels(
        self, h: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, plan: StepPlan, visible: Tensor, prefill: bool
    ) -> Tensor:  # h [B, T, C] (updated in place) -> the final norm of the last hidden states [B, T, C]
        """The decoder layers and the final norm as kernel calls (see :meth:`_move_to_cpu_kernels`): the
        same computation as the module path, every operation row by row (batch-invariant). ``prefill``
        (:meth:`forward_with_hidden`) applies to the one-call loop; the Python loop ignores it."""
        from verispec.kernels import load

        ops = load()
        b, t, c = h.shape
        cfg = self.config
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        cos2, sin2 = cos.reshape(b * t, d), sin.reshape(b * t, d)  # [M, D]
        flat = h.view(b * t, c)  # [M, C]
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        x = ops.rms_norm(flat, None, layers[0].input_layernorm.weight, eps)  # [M, C]
        if self._native_layers is not None and cache.k.dtype == torch.bfloat16:  # one call for all layers
            out = self._native_layers.forward(
                flat, x, cos2, sin2, cache.k, cache.v, plan.rows, plan.write_pos, plan.span, visible, prefill
            )  # [M, C]
            return out.view(b, t, c)  # type: ignore[no-any-return]
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = attn.project_qkv(x)  # [M, H*D], [M, Hkv*D], [M, Hkv*D]
            q = ops.rotary(q, cos2, sin2, hq, d).view(b, t, hq, d)
            k = ops.rotary(k, cos2, sin2, hkv, d).view(b, t, hkv, d)
            cache.write(i, plan, k, v.reshape(b, t, hkv, d))
            keys, values = cache.read(i, plan)  # [B, H_kv, span, D] each
            rows = ops.attention_rows(q, keys, values, visible, d**-0.5)  # [B, T, H, D]
            x = ops.rms_norm(flat, attn.o_proj(rows.view(b * t, hq * d)), layer.post_attention_layernorm.weight, eps)
            gate, up = mlp.project_gate_up(x)  # [M, F] each
            after = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            x = ops.rms_norm(flat, mlp.down_proj(ops.silu_mul(gate, up)), after, eps)
        return x.view(b, t, c)  # type: ignore[no-any-return]

    def linears(self) -> dict[str, Linear]:
        """Every projection by name (q/k/v/o, gate/up/down of each layer, then the LM head unless
        it is the tied embedding): dense or packed, see :mod:`verispec.models.linear`."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear)}

    @property
    def precision(self) -> str:
        """ "int4" when some projection is Q4_K, else "int8" when some is int8, else the dtype
        ("fp32", "bf16"). Activations, norms, embeddings and the KV cache are in :attr:`dtype`."""
        kinds = {m.kind for m in self.linears().values()}
        if "q4k" in kinds:
            return "int4"
        if "int8" in kinds:
            return "int8"
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, str(self.dtype))

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for this model (same dtype and device)."""
        return KVCache(self.config, max_batch, max_len, dtype=self.dtype, device=self.device)

    def weight_bytes(self) -> int:
        """Bytes of weights one forward pass streams from memory: every matrix once, the LM head
        included (the embedding table itself is only looked up, a few rows)."""
        embed = self.model.embed_tokens.weight
        total = sum(m.weight_bytes() for m in self.linears().values())
        norms = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
        total += sum(w.numel() * w.element_size() for w in norms)
        if self.lm_head is None:
            total += embed.numel() * embed.element_size()
        return total

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        cache: KVCache,
        attn_mask: Tensor | None = None,
        *,
        num_new: Tensor | Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        logits_at: Tensor | None = None,
        prefill: bool = False,
    ) -> Tensor:
        """Run ``T`` new tokens per row through the model, appending them to ``cache``; return
        logits ``[B, N, V]`` fp32. See :meth:`forward_with_hidden` for the arguments."""
        return self.forward_with_hidden(
            tokens, positions, cache, attn_mask, num_new=num_new, slots=slots, logits_at=logits_at, prefill=prefill
        ).logits

    def forward_with_hidden(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        cache: KVCache,
        attn_mask: Tensor | None = None,
        *,
        num_new: Tensor | Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        logits_at: Tensor | None = None,
        prefill: bool = False,
    ) -> ForwardOutput:
        """The forward pass (see the module docstring); returns logits and last hidden states.

        ``tokens`` ``[B, T]`` int64: new tokens, right-padded (any value, e.g. -1) after
        ``num_new[b]``. ``positions`` ``[B, T]`` int64: their RoPE positions; None means a chain,
        ``lengths[slot] + t``. Tree nodes take ``lengths[slot] + depth``.
        ``attn_mask`` ``[B, T, W]`` bool, ``W >= T``: visibility over a window of the ``W - T``
        cached positions just before the step and its ``T`` new tokens, ``attn_mask[b, t, s]`` =
        token ``t`` sees window position ``s`` (its ancestors; its own position is added); every
        position before the window is seen. ``W = T``: within-step visibility (a tree verified in
        one pass); ``W > T``: a tree grown level by level, its earlier levels already cached.
        None = causal.
        ``num_new`` ``[B]`` int64 (device tensor or host ints): real new tokens per row; None = T.
        Host ints keep the cache's bounds exact.
        ``slots``: cache slot of each row (host ints); None = slots ``0 .. B-1``.
        ``logits_at`` ``[B, N]`` int64: step offsets whose logits are wanted (e.g. the last real
        token, ``num_new - 1``, in prefill; saves the LM head elsewhere); None = all ``T``.
        ``prefill``: the new tokens are (a chunk of) prompts, which a compute-bound path may take:
        on the kernels' one call per pass, attention by torch's flash attention (every tier) and,
        on the amx tier, int8 and Q4_K projections on bf16 tiles (``csrc/amx/prefill.cpp``). Another
        rounding than feeding the same tokens with ``prefill=False``; a decoding step or a
        verification pass never takes it, and plain and speculative decoding feed a prompt alike
        (the engine: pieces of :data:`PREFILL_MIN_TOKENS` or more, one prompt a pass). Off the
        kernels' one call per pass it changes nothing.
        """
        if tokens.dim() != 2:
            raise InputError(f"tokens must be [B, T] int64, got shape {tuple(tokens.shape)}")
        b, t = tokens.shape
        if positions is not None and tuple(positions.shape) != (b, t):
            raise InputError(f"positions must have the shape of tokens {(b, t)}, got {tuple(positions.shape)}")
        if attn_mask is not None and (
            attn_mask.dim() != 3 or tuple(attn_mask.shape[:2]) != (b, t) or attn_mask.shape[2] < t
            or attn_mask.dtype != torch.bool
        ):  # fmt: skip
            raise InputError(
                f"attn_mask must be [B, T, W] bool with (B, T) = {(b, t)}, W >= T, got {tuple(attn_mask.shape)}"
            )
        if logits_at is not None and (logits_at.dim() != 2 or logits_at.shape[0] != b):
            raise InputError(f"logits_at must be [B, N] int64 with B={b}, got {tuple(logits_at.shape)}")
        if not prefill and not isinstance(num_new, Tensor):
            native = self._chain_natively(tokens, positions, attn_mask, cache, num_new, slots, logits_at)
            if native is not None:
                return native
        with torch.inference_mode():
            plan = cache.begin_step(slots, t, b, num_new)
            if positions is None:
                offsets = torch.arange(t, dtype=torch.int64, device=plan.lengths.device)  # [T]
                positions = plan.lengths[:, None] + offsets[None, :]  # [B, T]
            if plan.valid is not None:
                tokens = torch.where(plan.valid, tokens, 0)  # padding -> any valid id
            groups = self.config.num_heads // self.config.num_kv_heads
            visible = _visibility(plan, t, attn_mask)  # [B, T, span] bool
            cos, sin = self.rope.cos_sin(positions, self.dtype, plan.valid)  # [B, T, 1, D] each
            h = F.embedding(tokens, self.model.embed_tokens.weight)  # [B, T, C]
            if self.cpu_kernels:
                h = self._layers_on_kernels(h, cos, sin, cache, plan, visible, prefill)
            else:
                mask = _additive_mask(visible, groups, self.dtype)  # [B, 1, G*T, span]
                for i, layer in enumerate(self.model.layers):
                    assert isinstance(layer, DecoderLayer)
                    h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, cache, i, plan, mask)
                    h = h + layer.mlp(layer.post_attention_layernorm(h))
                h = self.model.norm(h)  # [B, T, C]
            cache.end_step(plan)
            return ForwardOutput(logits=self._logits(h, logits_at), hidden=h)

    def _logits(self, h: Tensor, logits_at: Tensor | None) -> Tensor:  # h [B, T, C] -> [B, N, V] fp32
        """The LM head at ``logits_at`` (see :meth:`forward_with_hidden`) of the final norm ``h``."""
        if logits_at is not None and logits_at.shape[1] == 0:  # hidden states only (a restricted draft head)
            return h.new_empty((h.shape[0], 0, self.config.vocab_size), dtype=torch.float32)
        picked = h if logits_at is None else h.gather(1, logits_at[:, :, None].expand(-1, -1, h.shape[-1]))
        head = self.lm_head
        scores = head(picked) if head is not None else dense_linear(picked, self.model.embed_tokens.weight)
        return scores.to(torch.float32)  # [B, N, V] fp32

    def _chain_natively(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        attn_mask: Tensor | None,
        cache: KVCache,
        num_new: Sequence[int] | None,
        slots: Sequence[int] | None,
        logits_at: Tensor | None,
    ) -> ForwardOutput | None:
        """:meth:`forward_with_hidden`'s pass when it is not a prompt's chunk (a chain, a tree
        verified in one pass or grown level by level) in one native call, ``Layers.chain``
        (``csrc/bindings.cpp``: the embedding, the first norm, every layer, the LM head and the
        logits' cast, with RoPE's rows from :meth:`RotaryEmbedding.table`, and the cache's
        lengths updated as ``begin_step`` / ``end_step`` update them): the same pass, bit for
        bit, without ~0.6-1 ms of Python and torch calls around the layers. None where it does
        not run (:meth:`can_draft`'s conditions, a position outside ``[0, max_len)``), or where
        the cache's host bounds say the tokens might not fit: then the general path, which looks
        at the truth."""
        if not self.can_draft(cache):
            return None
        b, t = tokens.shape
        if positions is not None:
            positions = positions.to(torch.int64).contiguous()
            if int(positions.min()) < 0 or int(positions.max()) >= cache.max_len:  # (RoPE's table: max_len rows)
                return None
        host, rows = cache.resolve_slots(slots, b)
        planned = cache.native_step_bounds(host, num_new, t)
        if planned is None:
            return None
        counts, bounds = planned
        cos, sin = self.rope.table(cache.max_len, self.dtype)  # [P, D] each
        first = self.model.layers[0]
        assert isinstance(first, DecoderLayer)
        hidden_only = logits_at is not None and logits_at.shape[1] == 0
        head = None if hidden_only else self._native_head  # (None: _logits below)
        with torch.inference_mode():
            h, logits = self._native_layers.chain(
                tokens.to(torch.int64).contiguous(), torch.tensor(counts, dtype=torch.int64), rows, cache.lengths,
                cache.step_start, torch.tensor(bounds, dtype=torch.int64), cache.k, cache.v,
                self.model.embed_tokens.weight, first.input_layernorm.weight, cos, sin, head, logits_at, positions,
                attn_mask,
            )  # fmt: skip
            cache.note_step_bounds(host, counts)
            if head is None:
                logits = self._logits(h, logits_at)
        return ForwardOutput(logits=logits, hidden=h)

    def can_draft(self, cache: KVCache) -> bool:
        """Whether :meth:`draft` (and a chain pass in one call, :meth:`_chain_natively`) runs here:
        every decoder layer in one native call, a bf16 cache and embedding table, and RoPE by
        position alone (dynamic scaling looks at the whole step)."""
        embed = self.model.embed_tokens.weight
        native = self._native_layers is not None and self.rope.kind != "dynamic"
        return native and cache.k.dtype == embed.dtype == torch.bfloat16 and embed.is_contiguous()

    def draft(
        self,
        cache: KVCache,
        pieces: Sequence[Sequence[int]],
        slots: Sequence[int],
        limits: Sequence[int],
        head: Any,
        head_ids: Tensor,
        *,
        more: Any = None,
        more_ids: Tensor | None = None,
        blocked: Tensor | None = None,
        keep: Callable[[int, int, float], bool] | None = None,
        sampling: DraftSampling | None = None,
    ) -> tuple[list[list[int]], list[int], Tensor | None]:
        """Drafting in one native call (``Layers.draft``, ``csrc/bindings.cpp``; :meth:`can_draft`
        says whether it runs). Row ``a`` appends ``pieces[a]`` (one or a few tokens) to cache slot
        ``slots[a]`` (a chain: at its length), drafts a token from the heads' scores after its last
        token and appends that one, and so on, until it has drafted ``limits[a]`` tokens, has no
        token to draft (a NaN or no finite score), or ``keep(a, i, confidence)`` (its token of pass
        ``i`` and that token's confidence) returns False. The heads are the kernels' projections
        (:func:`~verispec.kernels.linear.native_projection`) of the final norm's output: ``head``
        scoring ``head_ids`` ``[H]``, ``more`` (or None) ``more_ids`` ``[E]`` with row ``a``'s
        ``blocked[a]`` ``[E]`` at -inf (the ids ascend within each). Each pass is the one
        :meth:`forward_with_hidden` runs for these pieces (right-padded).

        Greedy (``sampling`` None): each token is ``ops.greedy_pick`` on the scores, bit for bit
        (ties to the smallest id), its confidence its probability at temperature 1. Sampled: each
        row's law on the merged ids (:class:`DraftSampling`: ``ops.sampled_pick``'s steps, or the
        point mass of a greedy row), the token drawn from it with a uniform from ``sampling.draw``;
        its confidence is its probability there. Returns each row's drafted tokens, how many
        tokens it appended (its cache length grew by that many), and the laws ``[A, L, H + E]``
        fp32 in merged column order (``L`` the largest limit; None when greedy)."""
        host, rows = cache.resolve_slots(slots, len(slots))
        if len(pieces) != len(host) or len(limits) != len(host) or min(limits, default=0) < 1:
            raise InputError("draft needs a piece and a limit >= 1 for each slot")
        if min(len(p) for p in pieces) < 1:
            raise InputError("draft needs at least one token to feed for each slot")
        bound = [cache.length_bound([s]) for s in host]  # (the host's: they set the span, as for a pass)
        adds = [len(piece) + n - 1 for piece, n in zip(pieces, limits, strict=True)]  # the most each appends
        for s, held, add in zip(host, bound, adds, strict=True):
            if held + add > cache.max_len:
                raise InputError(f"KV cache overflow: slot {s} cannot hold {add} more (max_len={cache.max_len})")
        a, t0 = len(host), max(len(p) for p in pieces)
        tokens = torch.zeros((a, t0), dtype=torch.int64)  # [A, T0], right-padded with 0 (as a pass pads)
        for row, piece in enumerate(pieces):
            tokens[row, : len(piece)] = torch.tensor(list(piece), dtype=torch.int64)
        with torch.inference_mode():
            cos, sin = self.rope.table(cache.max_len, self.dtype)  # [P, D] each: a pass's values, elementwise
            first = self.model.layers[0]
            assert isinstance(first, DecoderLayer)
            counts = torch.tensor([len(p) for p in pieces], dtype=torch.int64)  # [A]
            rules = merge = draw = None
            if sampling is not None:
                rules, merge, draw = sampling.rules, sampling.merge, sampling.draw
            drafted, fed, laws = self._native_layers.draft(
                tokens, counts, rows, cache.lengths, torch.tensor(bound, dtype=torch.int64), cache.k, cache.v,
                torch.tensor(list(limits), dtype=torch.int64), self.model.embed_tokens.weight,
                first.input_layernorm.weight, cos, sin, head, head_ids, more, more_ids, blocked, keep,
                rules, merge, draw,
            )  # fmt: skip
        appended = [int(n) for n in fed.tolist()]
        cache.advance(host, appended)
        return [[t for t in row if t >= 0] for row in drafted.tolist()], appended, laws if sampling else None


@dataclass(frozen=True)
class DraftSampling:
    """How :meth:`Transformer.draft` draws each row's tokens when they are sampled.

    ``rules`` ``[A, 4]`` float64: each row's temperature (0: greedy, its law the point mass at
    its greedy token), top_k, top_p and min_p, as :func:`~verispec.sampling.build_laws` applies
    them (no penalty or logit bias); ``merge`` ``[H + E]`` int64 (None without a second head):
    the column of ``cat(head scores, more scores)`` each merged column (ascending ids) takes;
    ``draw(i, rows)``: one uniform in [0, 1) for each row of ``rows`` (pass ``i``'s sampled rows
    that have a law, in order), drawn as :func:`~verispec.sampling.sample` draws it."""

    rules: Tensor  # [A, 4] float64
    merge: Tensor | None  # [H + E] int64
    draw: Callable[[int, list[int]], Sequence[float]]


def _visibility(plan: StepPlan, t: int, window: Tensor | None) -> Tensor:
    """``[B, T, span]`` bool: whether query ``t`` of row ``b`` may attend to buffer position ``j``.

    Real query ``t`` sees the cached prefix (``j < lengths[b]``) and the new tokens ``s`` it may
    see within the step (causal) among the real ones (``s < num_new[b]``); with a ``window``
    ``[B, T, W]``, the last ``W - T`` cached positions and the new tokens are seen where the window
    says (plus the query's own position) and the positions before them always. Padding queries see
    position 0 only (their output is discarded; this just keeps softmax finite).
    """
    lengths = plan.lengths  # [B]
    device = lengths.device
    span = max(plan.span, 1)
    j = torch.arange(span, dtype=torch.int64, device=device)  # [S]
    if window is None and plan.valid is None:  # causal, no padding: query t sees j <= lengths[b] + t
        q = torch.arange(t, dtype=torch.int64, device=device)  # [T]
        return j[None, None, :] <= (lengths[:, None] + q[None, :])[:, :, None]  # [B, T, S]
    cached = 0 if window is None else window.shape[2] - t  # window positions before the step
    rel = j[None, :] - (lengths[:, None] - cached)  # [B, S]: offset of position j within the window
    in_prefix = rel < 0  # [B, S]
    count = plan.num_new[:, None] if plan.num_new is not None else t
    in_window = (rel >= 0) & (rel < cached + count)  # [B, S]
    width = cached + t
    rel_c = rel.clamp(0, width - 1)  # [B, S]
    q = torch.arange(t, dtype=torch.int64, device=device)  # [T]
    sees = rel_c[:, None, :] <= cached + q[None, :, None]  # [B, T, S] causal
    if window is not None:
        own = torch.zeros((t, width), dtype=torch.bool, device=device)  # [T, W]: query t is column cached + t
        own[q, cached + q] = True
        sees = (window | own[None]).gather(2, rel_c[:, None, :].expand(-1, t, -1))  # [B, T, S]
    mask = in_prefix[:, None, :] | (in_window[:, None, :] & sees)  # [B, T, S]
    if plan.valid is not None:
        mask = torch.where(plan.valid[:, :, None], mask, (j == 0)[None, None, :])
    return mask


def _additive_mask(visible: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """``visible`` ``[B, T, span]`` -> ``[B, 1, G*T, span]`` additive mask in ``dtype`` (0 / -inf)
    for SDPA over the stacked query heads of a group; built once per step, since SDPA would
    otherwise convert a boolean mask in every layer."""
    b, t, span = visible.shape
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return bias[:, None, None].expand(b, 1, groups, t, span).reshape(b, 1, groups * t, span)


def tree_attention_mask(parents: Tensor) -> Tensor:
    """``parents`` ``[B, N]`` int64 (index of each node's parent among the step's tokens, -1 for a
    root) -> ``[B, N, N]`` bool: ``mask[b, i, j]`` = node ``j`` is ``i`` or an ancestor of ``i``.
    Parents must precede their children. ``depth = mask.sum(-1) - 1``; tree positions are
    ``lengths + depth``."""
    b, n = parents.shape
    if bool((parents >= torch.arange(n, device=parents.device)[None, :]).any()):
        raise InputError("tree parents must precede their children (parents[b, i] < i, or -1 for a root)")
    rows = torch.arange(b, device=parents.device)  # [B]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()  # [B, N, N]
    # Topological order: the parent's row is final when its child is reached (N small host steps).
    for i in range(n):
        parent = parents[:, i]  # [B]
        ancestors = mask[rows, parent.clamp(min=0)]  # [B, N]: the parent and its ancestors
        mask[:, i] |= ancestors & (parent >= 0)[:, None]
    return mask


def random_state_dict(
    config: ModelConfig, *, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Random weights in Hugging Face naming for tests and benchmarks: N(0, std) matrices and
    biases, norm weights 1 + N(0, 0.1). Deterministic in ``seed``; the global RNG is untouched."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float = std) -> Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype)

    def norm_weight() -> Tensor:
        return (1 + torch.randn(config.hidden_size, generator=gen) * 0.1).to(dtype)

    c, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    h, hkv = config.num_heads, config.num_kv_heads
    sd: dict[str, Tensor] = {"model.embed_tokens.weight": normal(config.vocab_size, c)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(h * d, c)
        sd[p + "self_attn.k_proj.weight"] = normal(hkv * d, c)
        sd[p + "self_attn.v_proj.weight"] = normal(hkv * d, c)
        sd[p + "self_attn.o_proj.weight"] = normal(c, h * d)
        if config.attention_bias:
            sd[p + "self_attn.q_proj.bias"] = normal(h * d)
            sd[p + "self_attn.k_proj.bias"] = normal(hkv * d)
            sd[p + "self_attn.v_proj.bias"] = normal(hkv * d)
        sd[p + "mlp.gate_proj.weight"] = normal(f, c)
        sd[p + "mlp.up_proj.weight"] = normal(f, c)
        sd[p + "mlp.down_proj.weight"] = normal(c, f)
        sd[p + "input_layernorm.weight"] = norm_weight()
        sd[p + "post_attention_layernorm.weight"] = norm_weight()
    sd["model.norm.weight"] = norm_weight()
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = normal(config.vocab_size, c)
    return sd
