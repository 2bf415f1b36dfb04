"""Planning a job: measuring the tiers and the link, choosing a cut and share, and the plan
in force, re-planned when conditions change. Reads `pipeline`, `servers` and `config`.
"""
