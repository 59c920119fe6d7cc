"""Plain decoding as a drafter: it proposes nothing.

The engine always has a drafter; with this one every step is a target pass over the pending token
alone (K = 0), the same loop, the same ``to_probs``, the same rule with an empty draft and the same
randomness as speculation (ARCHITECTURE section 1: "plain decoding is the same loop with K = 0").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from verispec.drafters.base import BatchView
from verispec.verify.base import Draft


class PlainDrafter:
    """Proposes nothing (a null object: no state, no model)."""

    name: ClassVar[str] = "none"
    proposes: ClassVar[bool] = False
    uses_target_hidden: ClassVar[bool] = False
    last_catchup_tokens: int = 0

    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        return Draft.from_lists([[] for _ in range(len(batch))])

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        pass

    def end(self, request_id: str) -> None:
        pass
