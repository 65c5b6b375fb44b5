"""Pictures: pipeline timelines (PNG and Chrome trace). See :mod:`.timeline`."""

from .timeline import bubble_of, chrome_trace, draw_timeline, write_chrome_trace

__all__ = ["bubble_of", "chrome_trace", "draw_timeline", "write_chrome_trace"]
