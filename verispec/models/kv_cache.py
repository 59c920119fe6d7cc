"""A static key/value cache built for speculative decoding.

Keys and values of every layer live in two preallocated buffers ``[L, S_max, H_kv, N + 1, D]``
(layers, sequence slots, key/value heads, ``max_len`` positions plus one scratch column, head
dim), in the model's dtype and on its device, as in gpt-fast's static cache. What a sequence
"has" is only its length: ``lengths[slot]`` entries from position 0 are valid; anything beyond is
garbage that attention masks out. Hence:

- **append** (done by :meth:`verispec.models.transformer.Transformer.forward`): new keys are written
  in place at each sequence's own offset ``lengths[slot] + t`` with one indexed write per layer;
  right-padding tokens are written to the scratch column ``N`` that no query ever reads.
- **rollback** of rejected draft tokens is O(1): :meth:`KVCache.truncate` (absolute lengths) or
  :meth:`KVCache.keep_step_prefix` (counted from the start of the last step) sets the lengths; no
  data moves (Leviathan et al. 2023 and Chen et al. 2023 verify K tokens in one pass and keep a
  prefix of them).
- **tree compaction** (SpecInfer, Miao et al. 2024; Medusa, Cai et al. 2024): a tree verification
  step writes every node; :meth:`KVCache.compact` moves the accepted root-to-leaf path into
  consecutive positions and sets the length, one gather and one scatter over all layers.
- **slots** for continuous batching: :meth:`add_sequence` claims a free slot, :meth:`remove_sequence`
  frees it; a forward pass runs over any list of slots.

Host/device split: ``lengths`` (a device tensor) is the truth the forward pass uses. The cache also
keeps, per slot, a host-side upper bound of the length, so that the forward pass can choose how many
positions to attend to and check capacity without a device synchronisation (no ``.item()``). Bounds
are exact whenever the caller passes host integers (``truncate([...])``, ``num_new=[...]``), and
:meth:`sync_bounds` makes them exact with one synchronisation.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.errors import ConfigError, InputError
from verispec.models.config import ModelConfig


@dataclass(frozen=True)
class StepPlan:
    """Where one forward step reads and writes (made by :meth:`KVCache.begin_step`).

    ``span``: positions ``[0, span)`` of the buffers the step attends to (a host upper bound of
    ``max(lengths + num_new)`` over its rows). ``num_new`` / ``valid`` are None when every row's
    ``T`` tokens are real.
    """

    rows: Tensor  # [B] int64: cache slot of each batch row
    row_slice: slice | None  # the same slots as a slice when they are consecutive
    lengths: Tensor  # [B] int64: cached tokens before the step
    num_new: Tensor | None  # [B] int64: real new tokens per row
    valid: Tensor | None  # [B, T] bool: t < num_new[b]
    write_pos: Tensor  # [B, T] int64: buffer position of each new token (scratch column for padding)
    span: int


def _machine_memory() -> int | None:
    """Bytes of physical memory, or None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(config: ModelConfig, max_batch: int, max_len: int, dtype: torch.dtype, device: str) -> None:
    """:class:`ConfigError` when a KV cache of ``max_batch`` x ``max_len`` tokens for ``config``
    would need more than the machine's memory (CPU); callers check it before loading weights."""
    shape = (config.num_layers, max_batch, config.num_kv_heads, max_len + 1, config.head_dim)
    need = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    have = _machine_memory() if torch.device(device).type == "cpu" else None
    if have is not None and need > have:
        raise ConfigError(
            f"a KV cache for {max_batch} sequences of {max_len} tokens needs {need / 1e9:.1f} GB, more than "
            f"this machine's {have / 1e9:.1f} GB of memory; lower the batch size or the context length"
        )


class KVCache:
    """Static per-layer key/value buffers plus per-slot lengths (see the module docstring).

    ``k`` / ``v``: ``[L, S_max, H_kv, max_len + 1, D]`` in ``dtype`` on ``device``; position
    ``max_len`` is the scratch column for padding. ``lengths``: ``[S_max]`` int64 on ``device``.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_batch: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_batch <= 0 or max_len <= 0:
            raise ConfigError(
                f"KVCache needs max_batch > 0 and max_len > 0, got max_batch={max_batch}, max_len={max_len}"
            )
        self.num_layers = config.num_layers
        self.max_batch = max_batch
        self.max_len = max_len
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        check_cache_fits(config, max_batch, max_len, dtype, str(self.device))
        shape = (config.num_layers, max_batch, config.num_kv_heads, max_len + 1, config.head_dim)
        # Normal (not inference-mode) tensors, even when built inside torch.inference_mode(): they
        # can then be updated in place both inside and outside inference mode.
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, S_max, H_kv, N + 1, D]
            self.v = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, S_max, H_kv, N + 1, D]
            self.lengths = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # [S_max]
            # Lengths before the last step, per slot: where a tree step's nodes start (compact()).
            self.step_start = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # [S_max]
        self._bound = [0] * max_batch  # host upper bound of lengths[slot]
        self._start_bound = [0] * max_batch  # host upper bound of step_start[slot]
        self._in_use = [False] * max_batch
        self._rows_memo: tuple[tuple[int, ...], Tensor] | None = None

    # ----------------------------------------------------------------------------------- slots
    def add_sequence(self) -> int:
        """Claim the lowest free slot, empty it (length 0) and return its index."""
        for slot, used in enumerate(self._in_use):
            if not used:
                self._in_use[slot] = True
                self._reset_slot(slot)
                return slot
        raise InputError(
            f"KVCache is full: all {self.max_batch} slots are in use; remove a finished sequence "
            "(remove_sequence) or build the cache with a larger max_batch"
        )

    def remove_sequence(self, slot: int) -> None:
        """Free ``slot`` (its entries become garbage; nothing is copied)."""
        self._check_slot(slot)
        self._in_use[slot] = False
        self._reset_slot(slot)

    @property
    def active_slots(self) -> list[int]:
        """Slots claimed by :meth:`add_sequence` and not yet removed, in increasing order."""
        return [s for s, used in enumerate(self._in_use) if used]

    def reset(self) -> None:
        """Free every slot and set every length to 0 (no buffer is cleared)."""
        with torch.inference_mode():
            self.lengths.zero_()
            self.step_start.zero_()
        self._bound = [0] * self.max_batch
        self._start_bound = [0] * self.max_batch
        self._in_use = [False] * self.max_batch

    def _reset_slot(self, slot: int) -> None:
        with torch.inference_mode():
            self.lengths[slot] = 0
            self.step_start[slot] = 0
        self._bound[slot] = 0
        self._start_bound[slot] = 0

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise InputError(f"slot {slot} is out of range for a KVCache with max_batch={self.max_batch}")

    # ------------------------------------------------------------------------------- indexing
    def resolve_slots(self, slots: Sequence[int] | None, batch_size: int) -> tuple[list[int], Tensor]:
        """Host list and device index tensor ``[B]`` int64 of the slots a batch of ``batch_size``
        rows runs on; ``None`` means slots ``0 .. B-1``."""
        host = list(range(batch_size)) if slots is None else [int(s) for s in slots]
        if len(host) != batch_size:
            raise InputError(f"{len(host)} slots given for a batch of {batch_size} rows; pass one slot per row")
        if len(set(host)) != len(host):
            raise InputError(f"slots must be distinct, got {host}")
        for s in host:
            self._check_slot(s)
        key = tuple(host)
        if self._rows_memo is None or self._rows_memo[0] != key:
            self._rows_memo = (key, torch.tensor(host, dtype=torch.int64, device=self.device))
        return host, self._rows_memo[1]

    def contiguous_range(self, host_slots: Sequence[int]) -> slice | None:
        """``slice(a, a + B)`` when the slots are consecutive increasing integers (their buffers
        can then be read as views, without a gather), else None."""
        if host_slots and list(host_slots) == list(range(host_slots[0], host_slots[0] + len(host_slots))):
            return slice(host_slots[0], host_slots[0] + len(host_slots))
        return None

    def length_bound(self, host_slots: Sequence[int]) -> int:
        """Host upper bound of ``max(lengths[slots])``."""
        return max((self._bound[s] for s in host_slots), default=0)

    def sync_bounds(self) -> None:
        """Make the host bounds exact (one device-to-host copy of ``lengths``)."""
        self._bound = [int(x) for x in self.lengths.tolist()]  # the one synchronisation, on purpose

    # ------------------------------------------------------------------------- forward steps
    def begin_step(
        self,
        slots: Sequence[int] | None,
        num_tokens: int,
        batch_size: int,
        num_new: Tensor | Sequence[int] | None = None,
    ) -> StepPlan:
        """Plan one forward step of ``T = num_tokens`` new tokens per row (right-padded to
        ``num_new[b]`` real ones): where each new key goes and how many positions to attend to.

        Checks capacity with the host bounds (synchronising once only if they say the cache
        might overflow) and records ``step_start`` for :meth:`compact`.
        """
        host, rows = self.resolve_slots(slots, batch_size)
        t = num_tokens
        if num_new is None:
            host_new = [t] * batch_size
            counts = None
        elif isinstance(num_new, Tensor):
            host_new = [t] * batch_size  # upper bound; the device tensor has the truth
            counts = num_new.to(device=self.device, dtype=torch.int64).reshape(batch_size)  # [B]
        else:
            host_new = self._host_counts(num_new, batch_size, t)
            full = all(n == t for n in host_new)  # no padding: the plan of num_new = None (no mask to build)
            counts = None if full else torch.tensor(host_new, dtype=torch.int64).to(self.device)  # [B]
        if any(self._bound[s] + n > self.max_len for s, n in zip(host, host_new, strict=True)):
            # Rare: the host bounds say the cache might overflow; look at the truth (one sync).
            self.sync_bounds()
            if counts is not None:
                host_new = [int(n) for n in counts.tolist()]
            for s, n in zip(host, host_new, strict=True):
                if self._bound[s] + n > self.max_len:
                    raise InputError(
                        f"KV cache overflow: slot {s} holds {self._bound[s]} tokens and {n} more do not "
                        f"fit in max_len={self.max_len}; build the cache with a larger max_len or stop "
                        "the sequence earlier"
                    )
        with torch.inference_mode():
            lengths = self.lengths.index_select(0, rows)  # [B] int64
            self.step_start.index_copy_(0, rows, lengths)
            offsets = torch.arange(t, dtype=torch.int64, device=self.device)[None, :]  # [1, T]
            write_pos = lengths[:, None] + offsets  # [B, T]
            valid = None if counts is None else offsets < counts[:, None]  # [B, T] bool
            if valid is not None:
                write_pos = torch.where(valid, write_pos, self.max_len)  # padding -> scratch column
        self.note_step_bounds(host, host_new)
        span = min(self.max_len, self.length_bound(host))
        return StepPlan(
            rows=rows,
            row_slice=self.contiguous_range(host),
            lengths=lengths,
            num_new=counts,
            valid=valid,
            write_pos=write_pos,
            span=span,
        )

    @staticmethod
    def _host_counts(num_new: Sequence[int], batch_size: int, num_tokens: int) -> list[int]:
        """``num_new`` as host ints, each in ``[0, num_tokens]`` (else :class:`InputError`)."""
        counts = [int(n) for n in num_new]
        if len(counts) != batch_size or any(not 0 <= n <= num_tokens for n in counts):
            raise InputError(f"num_new must hold {batch_size} counts in [0, {num_tokens}], got {counts}")
        return counts

    def native_step_bounds(
        self, host_slots: Sequence[int], num_new: Sequence[int] | None, num_tokens: int
    ) -> tuple[list[int], list[int]] | None:
        """For a step that a native call plans itself (``Transformer``'s pass in one call: it
        updates ``lengths`` and ``step_start`` as :meth:`begin_step` and :meth:`end_step` do): each
        row's count of new tokens (``num_new``, None: all ``num_tokens``; checked as
        :meth:`begin_step` checks it) and the host bounds of the slots' lengths, or None when those
        say the tokens might not fit (then :meth:`begin_step` looks at the truth)."""
        counts = [num_tokens] * len(host_slots) if num_new is None else self._host_counts(
            num_new, len(host_slots), num_tokens
        )  # fmt: skip
        if any(self._bound[s] + n > self.max_len for s, n in zip(host_slots, counts, strict=True)):
            return None
        return counts, [self._bound[s] for s in host_slots]

    def note_step_bounds(self, host_slots: Sequence[int], counts: Sequence[int]) -> None:
        """The host bounds after a step of ``counts[i]`` new tokens in slot ``host_slots[i]``
        (:meth:`begin_step`'s, or a native call's that planned the step itself)."""
        for s, n in zip(host_slots, counts, strict=True):
            self._start_bound[s] = self._bound[s]
            self._bound[s] += n

    def write(self, layer: int, plan: StepPlan, k_new: Tensor, v_new: Tensor) -> None:
        """Store the step's keys/values ``[B, T, H_kv, D]`` of ``layer`` at ``plan.write_pos``
        (in place, one indexed write each; padding lands in the scratch column)."""
        rows, pos = plan.rows[:, None], plan.write_pos  # [B, 1], [B, T]
        # Advanced indices on dims 0 and 2 address [B, T, H_kv, D] elements: one in-place index_put_.
        self.k[layer][rows, :, pos] = k_new.to(self.dtype)
        self.v[layer][rows, :, pos] = v_new.to(self.dtype)

    def read(self, layer: int, plan: StepPlan) -> tuple[Tensor, Tensor]:
        """Keys and values ``[B, H_kv, span, D]`` of ``layer`` for the step's rows: views when
        the slots are consecutive, else a gather."""
        if plan.row_slice is not None:
            return (
                self.k[layer, plan.row_slice, :, : plan.span],
                self.v[layer, plan.row_slice, :, : plan.span],
            )
        k = self.k[layer, :, :, : plan.span].index_select(0, plan.rows)
        v = self.v[layer, :, :, : plan.span].index_select(0, plan.rows)
        return k, v

    def end_step(self, plan: StepPlan) -> None:
        """Commit the step: ``lengths[rows] += num_new``."""
        added = plan.num_new if plan.num_new is not None else torch.full_like(plan.lengths, plan.write_pos.shape[1])
        self.lengths.index_copy_(0, plan.rows, plan.lengths + added)

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """``lengths[slots[i]] += counts[i]``: the tokens a native loop wrote at the ends of those
        slots, each at its length (:meth:`~verispec.models.transformer.Transformer.draft`);
        the host bounds follow. ``step_start`` stays where the last :meth:`begin_step` put it."""
        host, rows = self.resolve_slots(slots, len(slots))
        added = [int(n) for n in counts]
        if len(added) != len(host) or any(n < 0 for n in added):
            raise InputError(f"advance needs {len(host)} counts >= 0, got {added}")
        with torch.inference_mode():
            self.lengths.index_add_(0, rows, torch.tensor(added, dtype=torch.int64).to(self.device))
        for s, n in zip(host, added, strict=True):
            self._bound[s] += n

    # ---------------------------------------------------------------------------- positions
    def next_positions(self, num_tokens: int, slots: Sequence[int] | None = None, batch_size: int = 1) -> Tensor:
        """``[B, T]`` int64: positions of a chain of ``T = num_tokens`` new tokens per row,
        ``lengths[slot] + t`` (the usual positions of prefill, decode and chain verification)."""
        b = len(slots) if slots is not None else batch_size
        _, rows = self.resolve_slots(slots, b)
        offsets = torch.arange(num_tokens, dtype=torch.int64, device=self.device)  # [T]
        return self.lengths.index_select(0, rows)[:, None] + offsets[None, :]

    # ----------------------------------------------------------------------------- rollback
    def truncate(self, new_lengths: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None:
        """Roll back to ``new_lengths`` ``[B]`` (one per slot of ``slots``; all slots when None):
        O(1), no data moves. Lengths only shrink: a value above the current length leaves that
        slot as it is. Host integers keep the host bounds exact; a device tensor avoids a
        synchronisation but leaves the bounds as they were (an overestimate only costs a few
        masked positions of attention; :meth:`sync_bounds` fixes it)."""
        host, rows = self.resolve_slots(
            slots if slots is not None else range(self.max_batch),
            len(slots) if slots is not None else self.max_batch,
        )
        if isinstance(new_lengths, Tensor):
            new = new_lengths.to(device=self.device, dtype=torch.int64).reshape(-1)  # [B] int64
            values = None
        else:
            values = [int(x) for x in new_lengths]
            if any(x < 0 for x in values):
                raise InputError(f"truncate: lengths must be >= 0, got {values}")
            new = torch.tensor(values, dtype=torch.int64).to(self.device)  # [B] int64
        if new.shape[0] != len(host):
            raise InputError(f"truncate got {new.shape[0]} lengths for {len(host)} slots; pass one per slot")
        with torch.inference_mode():
            self.lengths.index_copy_(0, rows, torch.minimum(new, self.lengths.index_select(0, rows)))
        if values is not None:
            for s, n in zip(host, values, strict=True):
                self._bound[s] = min(self._bound[s], n)

    def keep_step_prefix(self, num_keep: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None:
        """Chain rollback relative to the last step: keep its first ``num_keep[b]`` entries (e.g.
        1 + accepted draft tokens, when the step fed the last committed token then the draft), i.e.
        ``lengths = step_start + num_keep``. O(1), like :meth:`truncate`."""
        host = list(range(self.max_batch)) if slots is None else [int(s) for s in slots]
        _, rows = self.resolve_slots(host, len(host))
        start = self.step_start.index_select(0, rows)  # [B]
        if isinstance(num_keep, Tensor):
            self.truncate(start + num_keep.to(device=self.device, dtype=torch.int64).reshape(-1), host)
            return
        keep = [int(n) for n in num_keep]
        if len(keep) != len(host) or any(n < 0 for n in keep):
            raise InputError(f"keep_step_prefix needs {len(host)} counts >= 0, got {keep}")
        with torch.inference_mode():
            new = start + torch.tensor(keep, dtype=torch.int64).to(self.device)  # [B]
            self.lengths.index_copy_(0, rows, torch.minimum(new, self.lengths.index_select(0, rows)))
        for s, n in zip(host, keep, strict=True):
            self._bound[s] = min(self._bound[s], self._start_bound[s] + n)

    def compact(
        self,
        slots: int | Sequence[int],
        keep_indices: Tensor,
        num_keep: Tensor | Sequence[int] | None = None,
    ) -> None:
        """Keep only some of the entries written by the last forward step, moved into place.

        ``keep_indices``: ``[M]`` int64 for one slot, or ``[B, M]`` for a list of slots: offsets,
        counted from where the last step started (``step_start``), of the entries to keep, strictly
        increasing (e.g. ``[0, 1 + accepted tree nodes...]`` for a step that fed the last committed
        token then the tree). Entry ``step_start + keep[j]`` moves to ``step_start + j`` in every
        layer and the length becomes ``step_start + num_keep``. ``num_keep`` ``[B]`` (default ``M``)
        lets rows keep fewer entries; columns ``j >= num_keep[b]`` are ignored. Host integers for
        ``num_keep`` keep the host bounds exact.
        """
        host = [slots] if isinstance(slots, int) else [int(s) for s in slots]
        _, rows = self.resolve_slots(host, len(host))
        keep = keep_indices.to(device=self.device, dtype=torch.int64)
        keep = keep[None, :] if keep.dim() == 1 else keep  # [B, M]
        b, m = keep.shape
        if b != len(host) or m == 0:
            raise InputError(f"compact got keep_indices of shape {tuple(keep.shape)} for {len(host)} slots")
        host_counts: list[int] | None = None
        if isinstance(num_keep, Tensor):
            counts = num_keep.to(device=self.device, dtype=torch.int64).reshape(b)  # [B]
        else:
            host_counts = [m] * b if num_keep is None else [int(x) for x in num_keep]
            if len(host_counts) != b or any(not 0 <= c <= m for c in host_counts):
                raise InputError(f"num_keep must hold {b} counts in [0, {m}], got {host_counts}")
            counts = torch.tensor(host_counts, dtype=torch.int64).to(self.device)  # [B]
        with torch.inference_mode():
            start = self.step_start.index_select(0, rows)  # [B]
            j = torch.arange(m, dtype=torch.int64, device=self.device)[None, :]  # [1, M]
            live = j < counts[:, None]  # [B, M] bool
            # Dead columns copy the last kept entry onto its own destination again: harmless.
            last = (counts - 1).clamp(min=0)[:, None]  # [B, 1]
            src = start[:, None] + torch.where(live, keep, keep.gather(1, last))  # [B, M]
            dst = start[:, None] + torch.where(live, j, last)  # [B, M]
            src, dst = src.clamp(0, self.max_len - 1), dst.clamp(0, self.max_len - 1)
            row_idx = rows[:, None].expand(b, m)  # [B, M]
            for buf in (self.k, self.v):
                moved = buf[:, row_idx, :, src]  # [B, M, L, H_kv, D]: a copy, sources and targets overlap
                buf[:, row_idx, :, dst] = moved
            self.lengths.index_copy_(0, rows, torch.minimum(start + counts, self.lengths.index_select(0, rows)))
        if host_counts is not None:
            for s, c in zip(host, host_counts, strict=True):
                self._bound[s] = min(self._bound[s], self._start_bound[s] + c)

    # ----------------------------------------------------------------------------- reporting
    def memory_bytes(self) -> int:
        """Bytes held by the key and value buffers (the lengths are negligible)."""
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_per_token(self) -> int:
        """Bytes one cached token takes across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, max_batch={self.max_batch}, max_len={self.max_len}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device}, memory={self.memory_bytes() / 2**20:.1f} MiB)"
        )
