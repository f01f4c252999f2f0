"""The optimizer the user holds (``ElixirOptimizer``) and fp16 loss scaling."""
