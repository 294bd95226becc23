"""Says whether torch was imported before this rank's script began: a rank forked from its
node's warm Python has it already; one started cold has not."""

import os
import sys

print(f"rank {os.environ['RANK']} torch imported before the script: {'torch' in sys.modules}", flush=True)
