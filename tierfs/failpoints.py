"""Named failpoints for tests only: `TIERFS_FAILPOINTS=name[=action],...` in the daemon's environment.

Actions: `raise` (default; an unexpected exception at that point), `kill` (SIGKILL of the daemon itself,
for crash-consistency tests), or `sleep:SECONDS`: at hit() the thread holds that point (so a test can act while
work is in flight); at an async failpoint (`pause`) the trio loop runs other tasks meanwhile, widening a race
window. A hold is logged when it starts and when it ends ("failpoint NAME: holding"/"held"), so a test can wait
for it and check that what it did landed inside. Parsed once at import; an unset variable costs one frozenset
lookup per check.
"""

from __future__ import annotations

import logging
import os
import signal
import time

_ACTIVE: dict[str, str] = {}
for _item in filter(None, os.environ.get("TIERFS_FAILPOINTS", "").split(",")):
    _name, _, _action = _item.partition("=")
    _ACTIVE[_name.strip()] = (_action or "raise").strip()


class FailpointError(RuntimeError):
    """Raised by an armed failpoint; deliberately not an OSError so it exercises the generic error path."""


def enabled() -> bool:
    return bool(_ACTIVE)


def hit(name: str) -> None:
    action = _ACTIVE.get(name)
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("sleep:"):
        logging.getLogger("tierfs.failpoints").info("failpoint %s: holding %s s", name, action[6:])
        time.sleep(float(action[6:]))
        logging.getLogger("tierfs.failpoints").info("failpoint %s: held", name)
        return
    raise FailpointError(f"failpoint {name}")


async def pause(name: str) -> None:
    """An async failpoint: `sleep:SECONDS` yields to the trio loop that long (other tasks run meanwhile);
    other actions behave as in hit()."""
    action = _ACTIVE.get(name)
    if action is None:
        return
    if action.startswith("sleep:"):
        import trio  # noqa: PLC0415 - only tests arm failpoints

        logging.getLogger("tierfs.failpoints").info("failpoint %s: pausing %s s", name, action[6:])
        await trio.sleep(float(action[6:]))
        logging.getLogger("tierfs.failpoints").info("failpoint %s: paused", name)
        return
    hit(name)
