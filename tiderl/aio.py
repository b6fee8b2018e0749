"""asyncio helpers shared by background loops (engine client, buffer, scheduler)."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has stopped (its CancelledError is absorbed)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
