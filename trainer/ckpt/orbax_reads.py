"""Orbax's reads, patched on import so that a read that fails leaves no task behind.

Without it, a damaged checkpoint's one error line is followed, at exit, by a traceback for
every shard read Orbax abandoned (see `_run_sync_leaving_no_tasks`).
"""

import asyncio

from orbax.checkpoint._src import asyncio_utils


def _run_sync_leaving_no_tasks(coro):
  """Orbax's `asyncio_utils._run_sync_via_new_loop`, except that on a failure the tasks the
  coroutine leaves behind are cancelled and awaited before the loop closes.

  Orbax reads an array's shards under `asyncio.gather`: the first that fails (a damaged file)
  raises, and Orbax's own closes the loop with the other reads pending. Their TensorStore
  callbacks then meet a closed loop, and each dropped read prints a traceback with its
  TensorStore spec at exit: thousands of lines after the one that says what is wrong."""
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    try:
      return loop.run_until_complete(coro)
    except BaseException:
      leftovers = asyncio.all_tasks(loop)
      for task in leftovers:
        task.cancel()
      # Awaited with their exceptions retrieved: none is reported as never retrieved.
      loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
      raise
  finally:
    asyncio.set_event_loop(None)
    loop.close()


asyncio_utils._run_sync_via_new_loop = _run_sync_leaving_no_tasks  # What its `run_sync` calls.
