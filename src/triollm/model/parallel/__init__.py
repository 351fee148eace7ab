"""Tensor parallelism: a model's linear layers sharded over ranks that compute one step
together (plan.py, layers.py, group.py), the driver's runner (runner.py) and the
processes or actors that run the other ranks (mp_executor.py, ray_executor.py)."""
