"""Pre-runtime profiling: what the model does in one step, learned without real memory."""

from .trace import trace_unit_order

__all__ = ["trace_unit_order"]
