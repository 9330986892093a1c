"""The brokerName a RocketMQ 5.x broker in controller mode records in its store root.

Such a broker writes `<storePathRootDir>/brokerIdentity` (MessageStoreConfig.storePathBrokerIdentity; its
BrokerMetadata, `clusterName#brokerName#brokerId`) so it keeps its identity across restarts. The archive keys a
broker group's segments by that name when `archive.broker_name` is not set. Other brokers (4.x, 5.x without a
controller) record no name in the store: their group must be configured.
"""

from __future__ import annotations

from pathlib import Path

FILE_NAME = "brokerIdentity"


def parse(text: str) -> str:
    """The brokerName of a brokerIdentity file's content, '' when it is not `cluster#name#id`. Pure."""
    parts = text.strip().split("#")
    return parts[1].strip() if len(parts) == 3 and parts[1].strip() else ""


def broker_name(store_root: Path) -> str:
    """Blocking: the brokerName recorded in a store root ('' when none is, or it cannot be read)."""
    try:
        return parse((Path(store_root) / FILE_NAME).read_text(encoding="utf-8", errors="replace")[:4096])
    except OSError:
        return ""
