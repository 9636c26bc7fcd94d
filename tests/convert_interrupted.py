"""`python -m tests.convert_interrupted --kill-after N | --stop-after N -- SRC DST [convert flags]`: the convert CLI
interrupted once N items are saved, by SIGKILL (as a crash or `kill -9` would) or SIGSTOP (a run caught midway,
its lock held, for a test to inspect and then continue)."""

import argparse
import os
import signal
import sys

from convert.__main__ import main


def interrupt_after(items: int, sig: int, once: bool):
    def on_item_saved(saved: int) -> None:
        if saved == items or (not once and saved >= items):
            os.kill(os.getpid(), sig)
    return on_item_saved


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m tests.convert_interrupted")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--kill-after", type=int)
    how.add_argument("--stop-after", type=int)
    a, rest = p.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    hook = (interrupt_after(a.kill_after, signal.SIGKILL, once=False) if a.kill_after is not None
            else interrupt_after(a.stop_after, signal.SIGSTOP, once=True))
    sys.exit(main(rest, on_item_saved=hook))
