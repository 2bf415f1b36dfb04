"""Samples inside shards: WebDataset `.tar` and Parquet files indexed once per version
(`indexes`), their members read by key (`members`: `shards/a.tar#KEY`, `d/x.parquet#row=N`),
shards cut short (`damage`), and an epoch's order that keeps reads within a few shards
(`order`). Nothing here knows the store facade: a member reader takes any store with
ranged reads.
"""
