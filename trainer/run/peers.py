"""A peer process that dies: one line from each survivor naming it, and a prompt exit.

JAX's runtime notices a dead process only at its heartbeat timeout (100 s), or in the middle
of a collective: a survivor printed Gloo's `Connection reset by peer` traceback, hung in JAX's
shutdown barrier and aborted with a C++ stack, or hung silently in a barrier. Each
process here holds one TCP connection to every other (nothing travels on them while the run
is healthy). The kernel closes a dead process's sockets at once, however it died (`kill
-9`, the OOM killer, a segfault), so the others see the end of its stream within
milliseconds, wherever their main thread is: in a step, a save or a barrier.

A process that leaves through Python (a finished run, an error every process raises) says
goodbye first (`_BYE`), so that only a silent end counts as a death. A survivor tells the
others which process died before it exits (`_LOST`): each would see that process's end
itself, but might see the survivor's own exit first and name the wrong one.

A whole host that vanishes closes no socket: JAX's heartbeat timeout still covers that.
"""

from __future__ import annotations

import atexit
import os
import selectors
import socket
import struct
import sys
import threading
from typing import Sequence

_BYE = b"B"
_LOST = b"L"  # followed by the dead process's id, 4 bytes
_ID = struct.Struct("!i")
CONNECT_TIMEOUT_S = 60.0  # The others are past the same collective, seconds away at most.


class PeerWatch:
  """This process's connections to the other `num_processes - 1` and the thread watching
  them: made listening, its `address` published to every process, then `connect`."""

  def __init__(self, process_id: int, num_processes: int, local_ip: str):
    self.process_id, self.num_processes = process_id, num_processes
    self.checkpoints: str | None = None  # Named in the line once the run has a workdir.
    family = socket.AF_INET6 if ":" in local_ip else socket.AF_INET
    self._listener = socket.socket(family, socket.SOCK_STREAM)
    self._listener.bind((local_ip, 0))
    self._listener.listen(num_processes)
    self.address = f"{local_ip} {self._listener.getsockname()[1]}"
    self._outgoing: list[socket.socket] = []  # What the others watch.
    self._watched: dict[socket.socket, int] = {}  # Accepted connection -> peer id.

  def connect(self, addresses: Sequence[str]) -> None:
    """Connects to every other process's listener (`addresses[k]` is process k's `address`),
    accepts theirs, and starts watching. A process publishes its address once it listens,
    and connects before it accepts, so no two processes wait for each other."""
    for peer, address in enumerate(addresses):
      if peer != self.process_id:
        host, port = address.rsplit(" ", 1)
        connection = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        connection.sendall(_ID.pack(self.process_id))
        self._outgoing.append(connection)
    self._listener.settimeout(CONNECT_TIMEOUT_S)
    for _ in range(self.num_processes - 1):
      connection, _ = self._listener.accept()
      connection.settimeout(CONNECT_TIMEOUT_S)
      self._watched[connection] = _ID.unpack(_receive(connection, _ID.size))[0]
      connection.setblocking(False)
    self._listener.close()
    # Before JAX's shutdown barrier (atexit runs the newest first): a process waiting there
    # for the others has left the run cleanly.
    atexit.register(self._say_goodbye)
    self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)
    self._thread.start()

  def wait_for_loss(self, seconds: float) -> None:
    """Gives the watch `seconds` to see a death (and exit with its line): a collective that
    failed in the main thread may be the first sign of it."""
    self._thread.join(seconds)

  def _watch(self) -> None:
    selector = selectors.DefaultSelector()
    for connection in self._watched:
      selector.register(connection, selectors.EVENT_READ)
    pending = {connection: b"" for connection in self._watched}
    while self._watched:
      for key, _ in selector.select():
        connection = key.fileobj
        peer = self._watched[connection]
        try:
          data = connection.recv(64)
        except OSError:  # Reset: the peer died with unread data on its side.
          data = b""
        if not data:
          self._lost(peer)
        pending[connection] += data
        if pending[connection].startswith(_LOST) and len(pending[connection]) > _ID.size:
          self._lost(_ID.unpack(pending[connection][1:1 + _ID.size])[0])
        if pending[connection].startswith(_BYE):
          selector.unregister(connection)
          del self._watched[connection]

  def _lost(self, peer: int) -> None:
    """Says which process died and where a re-run resumes, tells the others, and exits at
    once: every collective from here on fails or waits for ever, and JAX's shutdown barrier
    would wait for the dead process until its heartbeat timeout, then abort. The line is the
    same whether this process saw the death or was told of it."""
    line = (f"error: process {peer} of {self.num_processes} stopped answering: it was "
            f"killed, crashed or lost its host (its own output or the cluster's log says "
            f"which); process {self.process_id} stops too"
            + _where_a_rerun_resumes(self.checkpoints))
    for connection in self._outgoing:
      try:
        connection.sendall(_LOST + _ID.pack(peer))
      except OSError:
        pass  # That one is gone too.
    try:
      sys.stdout.flush()  # The last step's line, before the exit drops Python's buffers.
    except (OSError, ValueError):
      pass
    os.write(2, line.encode() + b"\n")
    os._exit(1)  # pylint: disable=protected-access

  def close(self) -> None:
    """Leaves without watching (a set-up that failed half-way): goodbye to those connected."""
    self._say_goodbye()
    for connection in [self._listener, *self._outgoing, *self._watched]:
      connection.close()

  def _say_goodbye(self) -> None:
    for connection in self._outgoing:
      try:
        connection.sendall(_BYE)
      except OSError:
        pass


def _receive(connection: socket.socket, size: int) -> bytes:
  data = b""
  while len(data) < size:
    chunk = connection.recv(size - len(data))
    if not chunk:
      raise ConnectionError("a process closed its connection while the run started")
    data += chunk
  return data


def _where_a_rerun_resumes(checkpoints: str | None) -> str:
  """Read from the directory, not the checkpointer: the main thread may be inside it. A
  directory named by its step alone is committed (Orbax renames a finished save to it)."""
  if checkpoints is None:  # Before the workdir is known: nothing is trained yet.
    return ""
  try:
    steps = sorted(int(name) for name in os.listdir(checkpoints) if name.isdigit())
  except OSError:
    steps = []
  if not steps:
    return f"; no checkpoint is committed in {checkpoints}: a re-run starts at step 0"
  return (f"; the committed checkpoints are untouched, and a re-run resumes from step "
          f"{steps[-1]} in {checkpoints}")


def local_ip(coordinator_address: str) -> str:
  """This host's address on the route to the coordinator: the one the others can reach."""
  host = coordinator_address.rsplit(":", 1)[0].strip("[]")
  family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
  with socket.socket(family, socket.SOCK_DGRAM) as probe:
    probe.connect(sockaddr)  # UDP: picks the route, sends nothing.
    return probe.getsockname()[0]
