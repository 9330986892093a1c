"""`python -m tierfs.spark --job-dir DIR`: run the pipeline job described by DIR/input.json (see job.py)."""

import sys

from tierfs.spark.job import main

if __name__ == "__main__":
    sys.exit(main())
