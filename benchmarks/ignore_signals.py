"""Teardown payload: ignores SIGINT and SIGTERM, so only SIGKILL stops it."""

import signal
import time

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(1)
