"""Ordering the comm thread's work against the compute stream (NCCL hazard 5).

Our own algorithms (``--collectives ring|tree|auto``) run on one comm thread
(:class:`shardwise.comm.ops._CommThread`). On an accelerator, kernels are queued on a stream,
not run when the Python call returns: a comm thread that launched its copies and sends on the
compute stream's neighbour without ordering would read a gradient bucket before the backward
kernel that writes it has run, and the compute stream would read the result before the comm
kernels wrote it. The rule (what ``ProcessGroupNCCL`` does for its own collectives):

1. ``ready = before()`` on the caller's thread: an event recorded on the *current* (compute)
   stream after the kernels that produce the input;
2. ``run(fn, ready)`` on the comm thread: the comm stream waits for ``ready``, ``fn`` runs with
   the comm stream current, and an event ``done`` is recorded on it;
3. ``after(done)`` on the caller's thread when the handle is waited: the compute stream waits for
   ``done`` before any later kernel reads the output.

Written once, device-agnostically, with ``torch.Stream`` / ``torch.Event`` of the device type
(``torch.accelerator``; CUDA, XPU, …). On CPU there is no stream (torch: "cpu backend doesn't
support events") and kernels run when called: :class:`StreamOrder` takes ``stream=None`` and
every step above is the same call that does nothing, so CPU runs this same code path. A test
(``tests/test_nccl_hazards.py``) drives it with recording fake streams and events and checks
the order 1 → 2 → 3.
"""

from __future__ import annotations

import contextlib

import torch

_COMM_STREAMS: dict[str, object] = {}  # device → its comm stream (one per process and device)


def comm_stream(device: torch.device):
    """The comm thread's own stream on ``device``, or None on CPU (no streams)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    key = str(device)
    if key not in _COMM_STREAMS:
        _COMM_STREAMS[key] = torch.Stream(device=device)
    return _COMM_STREAMS[key]


class StreamOrder:
    """Orders one collective on ``stream`` (the comm stream, None on CPU) against the current
    stream of ``device``. ``current``/``event``: how to get the current stream and make an
    event (defaults: ``torch.accelerator.current_stream``, ``torch.Event``; tests pass fakes)."""

    def __init__(self, device, stream=None, current=None, event=None):
        self.device = torch.device(device)
        self.stream = stream
        self._current = current or (lambda: torch.accelerator.current_stream(self.device))
        self._event = event or (lambda: torch.Event(device=self.device))

    @classmethod
    def for_device(cls, device) -> "StreamOrder":
        return cls(device, comm_stream(device))

    def before(self):
        """Caller's thread: an event after the compute stream's work so far (None on CPU)."""
        if self.stream is None:
            return None
        ready = self._event()
        ready.record(self._current())
        return ready

    def run(self, fn, ready):
        """Comm thread: ``fn()`` on the comm stream after ``ready``; returns (fn's result, the
        event recorded after it, None on CPU)."""
        if self.stream is None:
            return fn(), None
        self.stream.wait_event(ready)
        with self.stream if hasattr(self.stream, "__enter__") else contextlib.nullcontext():
            out = fn()
        done = self._event()
        done.record(self.stream)
        return out, done

    def after(self, done) -> None:
        """Caller's thread: later compute-stream work waits for ``done`` (nothing on CPU)."""
        if done is not None:
            self._current().wait_event(done)
