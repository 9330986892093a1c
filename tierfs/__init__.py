"""tierfs: a FUSE filesystem that keeps a RocketMQ store's sealed segments in object storage."""

__version__ = "0.1.0"
