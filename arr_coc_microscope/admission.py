"""Admission: the app takes on no more work than the machine can hold, and says so when it is full.

Gradio's queue bounds how many requests wait (`page.QUEUE_SIZE`) and how many run (`--concurrency`); a
request still unwinding after its client cancelled also holds memory, and one 80-megapixel image costs
hundreds of megabytes while it is decoded. So the handler asks `Admission.admit(pixels)` once it has read
the image's header and before decoding it: a request is refused with a "busy, try again" message when
`max_requests` are already in flight or their images together would pass `max_pixels`. A request alone
is always admitted (one image never exceeds the validator's decode limit).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from arr_coc.errors import InputError
from arr_coc.validation.limits import LIMITS


class Admission:
    def __init__(self, max_requests: int = 4, max_pixels: int = 2 * LIMITS.max_decode_pixels):
        self.max_requests = int(max_requests)
        self.max_pixels = int(max_pixels)
        self.requests = 0       # in flight now (decoding, waiting for the model, running, or unwinding)
        self.pixels = 0         # their images' pixels, as their headers declare
        self._lock = threading.Lock()

    def busy_message(self) -> str:
        return (f"The server is busy: it is answering {self.requests} request{'s' if self.requests != 1 else ''} "
                f"with {self.pixels / 1e6:.0f} megapixels of images (its limits: {self.max_requests} requests, "
                f"{self.max_pixels / 1e6:.0f} MP). Try again in a minute, or send a smaller image.")

    @contextmanager
    def admit(self, pixels: int) -> Iterator[None]:
        """Hold a place for one request with an image of `pixels` pixels; InputError("busy") when full."""
        pixels = max(0, int(pixels))
        with self._lock:
            full = self.requests >= self.max_requests or (self.requests > 0 and self.pixels + pixels > self.max_pixels)
            if full:
                raise InputError(self.busy_message(), "busy")
            self.requests += 1
            self.pixels += pixels
        try:
            yield
        finally:
            with self._lock:
                self.requests -= 1
                self.pixels -= pixels
