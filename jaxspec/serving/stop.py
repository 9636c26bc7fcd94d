"""Stop strings over streamed text: text is released only once no stop string can still begin in it."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # a tail that may be the start of a stop string

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to release, whether a stop string ended the output); the stop string itself is dropped."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        # only a prefix no longer than the text can end it: a client's stop string may be megabytes long, and trying
        # every prefix of it on each push would take time in its length squared, on the server's event loop
        hold = max((n for s in self.stops for n in range(1, min(len(s), len(buf) + 1)) if buf.endswith(s[:n])),
                   default=0)
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
