"""The speculative engine: the step loop, continuous batching, the draft-length policy."""

from verispec.engine.engine import Engine
from verispec.engine.policy import FixedPolicy, MeasuredPolicy
from verispec.engine.recorder import StepRecord
from verispec.engine.request import RequestOutput

__all__ = ["Engine", "FixedPolicy", "MeasuredPolicy", "RequestOutput", "StepRecord"]
