"""Pre-runtime profiling: what the model does in one step, learned without real memory."""

from .profile import ModelProfile, ParamInfo, profile_model
from .trace import trace_unit_order

__all__ = ["trace_unit_order", "profile_model", "ModelProfile", "ParamInfo"]
