"""Results store: each measured point's samples (Parquet) and its generation cache.

`store`: where files go (a local root or `s3://bucket/prefix`, one fsspec code path) and how they
are named; `tables`: the Parquet schemas and row conversions; `cache`: the generation cache key
(snapshot digest, dataset digest, sampling parameters, chat template). No Prefect import here.
"""
