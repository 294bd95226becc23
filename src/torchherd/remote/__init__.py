"""The programs torchherd runs on the nodes, and how they travel there.

The node scripts (``supervisor.py``, ``coordinator.py``, ``stop.py``) use the
standard library and ``wire`` only, and run on the node's own Python (>= 3.8);
nothing is installed on a node. ``program(name)`` is the text to run there with
``python -c``: a short loader, then the wire module and the script, each packed.

The scripts say ``from torchherd.remote import wire``. In the checkout that is this
package's real module. On a node the loader first registers stand-ins for
``torchherd`` and ``torchherd.remote`` and the wire module itself in ``sys.modules``,
so the same import statement finds them there (even where some other torchherd is
installed), and no script needs a second way to import.
"""

from __future__ import annotations

import base64
import functools
import importlib.resources
import zlib

SCRIPTS = ("supervisor.py", "coordinator.py", "stop.py", "hangprobe.py")

# Runs on the node: no single quote in it, so shlex.quote only wraps the program.
# The sources travel zlib-compressed in base85 (about a third of their size on the
# SSH command line, and no quote or backslash for any shell to mangle); compiled
# under their own file names, so a node's traceback names the right file and line.
_LOADER = """\
import base64, sys, types, zlib
def unpack(name, packed):
    return compile(zlib.decompress(base64.b85decode(packed)), name, "exec")
for name in ("torchherd", "torchherd.remote", "torchherd.remote.wire"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["torchherd"].remote = sys.modules["torchherd.remote"]
sys.modules["torchherd.remote"].wire = sys.modules["torchherd.remote.wire"]
exec(unpack("wire.py", "{wire}"), sys.modules["torchherd.remote.wire"].__dict__)
exec(unpack("{name}", "{script}"), {{"__name__": "__main__"}})
"""


def source(name: str) -> str:
    """The text of one file of this package, as it is in the checkout."""
    return importlib.resources.files(__name__).joinpath(name).read_text("utf-8")


def _pack(text: str) -> str:
    return base64.b85encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii")


@functools.lru_cache(maxsize=None)
def program(name: str) -> str:
    """The self-contained program that runs the node script ``name`` (one of SCRIPTS)
    with ``python -c PROGRAM ARGS...``: its ``sys.argv[1:]`` are the script's."""
    if name not in SCRIPTS:
        raise ValueError(f"not a node script: {name!r} (one of {', '.join(SCRIPTS)})")
    return _LOADER.format(wire=_pack(source("wire.py")), name=name, script=_pack(source(name)))
