"""What a `ModelRepo` does with its store and catalog: push, fetch, heads, diff, usage,
gc and fsck. Built on `hapi.repo.storage` and `hapi.repo.index`."""
