"""A session and its chunk pipeline: reading, computing and sending a chunk's batches, the
feature cache a chunk's keys are looked up in, and the order its streams are sent in.

It imports `hapi.server.memory` (budget and scheduler) and nothing above it.
"""
