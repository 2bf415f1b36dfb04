"""A job's configuration: `JobConfig` and its parts, one frozen dataclass per concern.

The bottom of the client: every other client package may read it, it reads none of them.
"""
