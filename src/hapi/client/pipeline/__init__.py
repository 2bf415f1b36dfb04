"""The chunk pipeline: keys -> route -> fetch (through the cache tiers) -> rebatch -> prefetch.

`FeatureLoader` runs one epoch of it over the servers. The pipeline reads a plan (cut and
share) from whoever owns it and never chooses one itself. Reads `servers` and `config`.
"""
