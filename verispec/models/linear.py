"""The linear layers of the runtime: one module per projection, dense or packed, called as ``proj(x)``.

Every projection of :class:`~verispec.models.transformer.Transformer` (q/k/v/o, gate/up/down, the
LM head) is one of:

- :class:`DenseLinear`: a floating-point weight in the model's dtype (fp32 or bf16), with the
  CPU fast path of :func:`dense_linear` for the few-row passes of decoding and verification;
- :class:`verispec.kernels.Q4KLinear`: GGUF Q4_K blocks used exactly (the "int4" precision);
- :class:`verispec.kernels.Int8Linear`: per-output-channel int8 (the "int8" precision, and the
  tensors of an "int4" model that the GGUF does not store as Q4_K);
- :class:`verispec.kernels.Bf16Linear`: bf16 weights repacked for verispec's kernels (the "bf16"
  precision on CPUs whose kernel tier is a vector one: a
  :class:`~verispec.models.transformer.Transformer` built with ``cpu_kernels=True``).

They share the :class:`Linear` protocol, so the transformer never branches on the kind. In a state
dict a projection ``P`` is ``P.weight`` (+ ``P.bias``) when dense, ``P.q4k`` (+ ``P.bias``) for
Q4_K, ``P.int8`` + ``P.int8_scale`` (+ ``P.bias``) for int8, ``P.bf16`` (+ ``P.bias``) for the bf16
kernel: :func:`packed_linear` builds the module the keys describe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Up to this many rows, CPU matmuls run as ``weight @ x.T`` (see dense_linear).
SKINNY_ROWS = 64
#: State-dict suffixes of packed projections, and the kind each one marks.
PACKED_SUFFIXES = {"q4k": "q4k", "q6k": "q6k", "int8": "int8", "int8_scale": "int8", "bf16": "bf16"}


@runtime_checkable
class Linear(Protocol):
    """What the transformer needs of a projection: ``y = x @ W.T + b``."""

    kind: ClassVar[str]  # "dense", "q4k", "int8", "bf16"
    in_features: int
    out_features: int

    def __call__(self, x: Tensor) -> Tensor: ...  # [..., in] -> [..., out], x's dtype

    def dequantize(self) -> Tensor: ...  # [out, in] fp32: the weights the layer multiplies by

    def weight_bytes(self) -> int: ...  # bytes a forward pass streams


def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[..., in]`` and ``weight`` ``[out, in]``.

    On CPU, few rows (decode and verification passes) go through ``torch.mv`` (one row) or
    ``weight @ x.T`` (up to ``SKINNY_ROWS``): with the weight as the row-major left operand the
    BLAS kernels stream it at close to memory bandwidth, while ``F.linear``'s path is 25-40% slower
    for bf16 at these shapes (measured with benchmarks/runtime_speed.py). Many rows (prefill) and
    other devices use ``F.linear``.
    """
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > SKINNY_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])  # [M, in]
    # [M, out]; for M > 1 the transpose copy is M * out elements, small next to the weight.
    y = torch.mv(weight, x2[0])[None, :] if rows == 1 else torch.mm(weight, x2.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


class DenseLinear(nn.Module):
    """A floating-point projection: ``weight`` ``[out, in]`` and optional ``bias`` ``[out]``, in
    the model's dtype (the state-dict names of ``nn.Linear``)."""

    kind: ClassVar[str] = "dense"

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        return dense_linear(x, self.weight, self.bias)

    def dequantize(self) -> Tensor:  # [out, in] fp32
        return self.weight.to(torch.float32)

    def weight_bytes(self) -> int:
        total = self.weight.numel() * self.weight.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_prefixes(state_dict: Mapping[str, Tensor]) -> dict[str, str]:
    """``{projection prefix: kind}`` of the packed projections a state dict holds."""
    out = {}
    for name in state_dict:
        prefix, _, suffix = name.rpartition(".")
        if suffix in PACKED_SUFFIXES:
            out[prefix] = PACKED_SUFFIXES[suffix]
    return out


def packed_linear(prefix: str, kind: str, state_dict: Mapping[str, Tensor], out_features: int,
                  in_features: int) -> tuple[nn.Module, list[str]]:  # fmt: skip
    """The packed module the keys ``prefix.*`` of ``state_dict`` describe, and the keys it used."""
    from verispec.kernels import Bf16Linear, Int8Linear, Q4KLinear, Q6KLinear

    bias = state_dict.get(prefix + ".bias")
    used = [prefix + ".bias"] if bias is not None else []
    module: nn.Module
    if kind == "q4k":
        module = Q4KLinear(state_dict[prefix + ".q4k"], out_features, in_features, bias)
        used.append(prefix + ".q4k")
    elif kind == "q6k":
        module = Q6KLinear(state_dict[prefix + ".q6k"], out_features, in_features, bias)
        used.append(prefix + ".q6k")
    elif kind == "bf16":
        module = Bf16Linear(state_dict[prefix + ".bf16"], out_features, in_features, bias)
        used.append(prefix + ".bf16")
    else:
        module = Int8Linear(state_dict[prefix + ".int8"], state_dict[prefix + ".int8_scale"], out_features,
                            in_features, bias)  # fmt: skip
        used += [prefix + ".int8", prefix + ".int8_scale"]
    return module, used
