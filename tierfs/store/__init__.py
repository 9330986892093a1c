"""RocketMQ store knowledge as pure functions: path classification and byte codecs. No I/O here."""
