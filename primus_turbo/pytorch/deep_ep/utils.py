"""DeepEP's ``deep_ep.utils`` event helpers (EventHandle, EventOverlap) over torch.cuda events."""

from __future__ import annotations

import torch

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """A CUDA event recorded on the current stream at construction (a no-op without CUDA)."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's overlap helper: wraps an EventHandle; ``with`` blocks and current_stream_wait()."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.current_stream_wait()
