"""The PySpark pipeline (DESIGN §10), run out of process: `python -m tierfs.spark --job-dir DIR`.

It rewrites tiered segments as lz4c objects, builds compacted IndexFile sidecars and archives messages to Parquet,
talking only to the object store; the daemon verifies the results and swaps its catalog entries.
"""
