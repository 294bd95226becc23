"""The programs torchherd runs on the nodes, and how they travel there.

The node programs (``supervisor.py``, ``coordinator.py``, ``stop.py``, ``hangprobe.py``,
``receive.py``, ``venv.py``, ``checkpoint.py``, ``image.py``, ``zygote.py``) and the modules they share
(``container``, ``wire``, ``relay``, ``framing``, ``proctable``, ``ranks``, ``flight``, ``checkpoint``,
``savewatch``, ``pace``, ``uvlock``)
use the standard library only, and run on the node's own Python (>= 3.8); nothing is
installed on a node. ``program(name)`` is the text to run there with ``python -c``: a short
loader and, in one packed blob, the modules the program imports, then the program.
``command(name)`` is how every one of them is started: ``-I -S -u -c PROGRAM``.

The modules say ``from torchherd.remote import wire`` (or ``...framing import X``). In
the checkout that is this package's real module. On a node the loader first registers
stand-ins for ``torchherd``, ``torchherd.remote`` and each shipped module in
``sys.modules``, so the same import statement finds them there (even where some other
torchherd is installed), and no module needs a second way to import.
"""

from __future__ import annotations

import binascii
import functools
import importlib.resources
import marshal
import shlex
import zlib

PROGRAMS: dict[str, tuple[str, ...]] = {
    "supervisor.py": ("container.py", "wire.py", "framing.py", "proctable.py", "ranks.py", "flight.py", "relay.py",
                      "pace.py", "checkpoint.py", "savewatch.py"),
    "coordinator.py": ("container.py", "wire.py"),
    "stop.py": ("container.py", "wire.py", "proctable.py"),
    "hangprobe.py": ("flight.py",),
    "receive.py": (),
    "venv.py": ("receive.py", "uvlock.py"),
    "checkpoint.py": ("relay.py", "pace.py"),
    "image.py": ("container.py", "relay.py"),
    "zygote.py": (),
}
"""Each node program and the modules it imports, in the order they are loaded (a module
after those it imports)."""
SCRIPTS = tuple(PROGRAMS)

FLAGS = ("-I", "-S", "-u")
"""How every node program starts. ``-I``: isolated, so neither the directory it starts in
(the job's workdir, where a project's ``base64.py`` or ``json.py`` would replace the
standard module) nor ``PYTHONPATH``/``PYTHON*`` variables nor the user's site-packages
reach it; the job it starts still gets the environment as it is (``-I`` leaves
``os.environ`` alone). ``-S``: no site-packages, whose ``.pth`` files cost CPU at every
start and which a standard-library program never needs. ``-u``: records are never held
in a buffer."""

MARSHAL_VERSION = 4
"""Read by every Python >= 3.4: the controller's Python may be newer than the node's."""

# Runs on the node: no single quote or backslash in it, so shlex.quote only wraps it. The
# sources travel as one zlib-compressed blob (about a third of their size on the SSH
# command line) in base64, which binascii decodes in C: base64.b85decode is pure Python
# (17 ms for 10 KB on Python 3.8) and ``import base64`` costs more than the decoding.
# Each is compiled under its own file name, so a node's traceback names the right file.
# The start directory ("" in sys.path) goes first, should a program ever be started
# without -I: the loader's own imports must not find a project's base64.py either.
DROP_START_DIRECTORY = "import sys; sys.path[:] = [path for path in sys.path if path]\n"
"""A ``python -c`` program's first line: ``-c`` puts the start directory first on sys.path."""
_LOADER = DROP_START_DIRECTORY + """\
import binascii, marshal, types, zlib
*modules, (name, text) = marshal.loads(zlib.decompress(binascii.a2b_base64("{packed}")))
for package in ("torchherd", "torchherd.remote"):
    sys.modules[package] = types.ModuleType(package)
sys.modules["torchherd"].remote = sys.modules["torchherd.remote"]
for module_file, module_text in modules:
    module = types.ModuleType("torchherd.remote." + module_file[:-3])
    sys.modules[module.__name__] = module
    setattr(sys.modules["torchherd.remote"], module_file[:-3], module)
    exec(compile(module_text, module_file, "exec"), module.__dict__)
exec(compile(text, name, "exec"), {{"__name__": "__main__"}})
"""


def source(name: str) -> str:
    """The text of one file of this package, as it is in the checkout."""
    return importlib.resources.files(__name__).joinpath(name).read_text("utf-8")


def _pack(files: tuple[tuple[str, str], ...]) -> str:
    return binascii.b2a_base64(zlib.compress(marshal.dumps(files, MARSHAL_VERSION), 9), newline=False).decode("ascii")


def shipped(name: str, text: str, modules: tuple[str, ...]) -> str:
    """The self-contained program that loads ``modules`` of this package, then runs ``text``
    (the file ``name``) as ``__main__``: how every node program travels, this package's own
    (``program``) and the checks' scripts (``torchherd.checks.gather.node_program``)."""
    return _LOADER.format(packed=_pack((*((module, source(module)) for module in modules), (name, text))))


@functools.lru_cache(maxsize=None)
def program(name: str) -> str:
    """The self-contained program that runs the node program ``name`` (one of SCRIPTS)
    with ``python -c PROGRAM ARGS...``: its ``sys.argv[1:]`` are the program's."""
    if name not in PROGRAMS:
        raise ValueError(f"not a node program: {name!r} (one of {', '.join(SCRIPTS)})")
    return shipped(name, source(name), PROGRAMS[name])


def argv(name: str) -> tuple[str, ...]:
    """The interpreter's arguments that run node program ``name``; its own arguments follow."""
    return (*FLAGS, "-c", program(name))


@functools.lru_cache(maxsize=None)
def command(name: str) -> str:
    """``argv(name)`` as shell words: ``PYTHON {command(name)} ARGS...`` runs the program."""
    return " ".join(shlex.quote(word) for word in argv(name))
