"""The server's memory: its budget and the limits it must fit under, what a session's
batches cost, and the scheduler that keeps running batches within the budget.

It imports nothing else of `hapi.server`. Nothing is re-exported, so that reading a
budget (`budget`, `limits`) does not import torch.
"""
