"""torchherd image archives, on a node: which image a node holds, and one link of the
chain that relays a ``docker save`` / ``podman save`` archive node to node and loads it.

Standard library only, Python >= 3.8, Linux. Run as ``PYTHON -I -S -u -c PROGRAM MODE
RUNTIME IMAGE [DIR]`` (``remote.command``); RUNTIME is "auto" or an OCI runtime's name
(``container.OCI_RUNTIMES``). MODE:

``have``: prints ``{"runtime": NAME or null, "id": HEX or null}``: the runtime this node
  uses (null: none installed) and the id of IMAGE there (null: not there).

``relay``: one link of the chain (``relay.py`` has the protocol; the first receiver's
  upstream is the controller, on stdin). The controller's first line adds ``"expect":
  {"sha256": HEX, "size": BYTES, "id": HEX}``. The archive is written to a new private
  file in DIR (``~`` is the node's home; made 0700), passed on to the next node as it
  comes, its SHA-256 checked against ``expect``; then, with ``"load": true``, the program
  prints ``{"loading": true}``, runs ``RUNTIME load -i FILE`` and checks that IMAGE is now
  the image ``expect`` names. The file is removed in every ending. Its last line is ``{"ok":
  true, "bytes": N, "seconds": S, "id": HEX}`` or ``{"error": TEXT}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from torchherd.remote import container as containers
from torchherd.remote import relay as chain

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

LOAD_SECONDS = 1800.0
"""The most a ``load`` may take (tens of GB on a slow disk)."""
TEMPORARY = ".torchherd-image-"

CLEANUP: List[str] = []
CHILDREN: List[subprocess.Popen] = []  # type: ignore[type-arg]


def cleanup() -> None:
    """Removes the archive being received or loaded, and ends a load in progress."""
    for child in CHILDREN:
        if child.poll() is None:
            child.kill()
    for path in CLEANUP:
        if os.path.lexists(path):
            os.unlink(path)


def runtime_of(wanted: str) -> Optional[str]:
    found = containers.resolve_runtime(wanted)
    return found if found in containers.OCI_RUNTIMES else None


def image_id(runtime: str, image: str) -> Optional[str]:
    """The image's id here without ``sha256:`` (docker writes it, podman does not); None: not here."""
    result = subprocess.run(containers.RUNTIME[runtime].inspect_argv(image), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=120)
    text = result.stdout.decode("utf-8", "replace").strip()
    if result.returncode != 0 or not text:
        return None
    return text.splitlines()[0].split(":")[-1]


def have(wanted: str, image: str) -> Dict[str, Any]:
    runtime = runtime_of(wanted)
    return {"runtime": runtime, "id": image_id(runtime, image) if runtime else None}


def load(runtime: str, path: str, image: str, expect: str) -> str:
    """Loads the archive; the image's id after it (ValueError when it is not ``expect``)."""
    child = subprocess.Popen(containers.RUNTIME[runtime].load_argv(path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    CHILDREN.append(child)
    output, _ = child.communicate(timeout=LOAD_SECONDS)
    if child.returncode != 0:
        last = output.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{runtime} load failed (exit {child.returncode}): {last[0][:300]}")
    found = image_id(runtime, image)
    if found != expect:
        raise ValueError(f"after {runtime} load, {image} is {str(found)[:12]}, not the archive's {expect[:12]}")
    return found


def relay(wanted: str, image: str, folder: str, config: Dict[str, Any], stdin: chain.Link) -> Dict[str, Any]:
    token = str(config["token"]).encode("ascii")
    expect = config["expect"]
    runtime = runtime_of(wanted)
    if config.get("load") and runtime is None:
        raise ValueError(f"no {'docker or podman' if wanted == 'auto' else wanted} on this node to load the image with")
    folder = os.path.expanduser(folder)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"{TEMPORARY}{os.urandom(6).hex()}.tar")
    CLEANUP.append(path)
    listener = chain.listen(config)
    started = time.monotonic()
    downstream = None
    upstream = None
    try:
        upstream = chain.upstream(token, stdin)
        if upstream is not stdin:
            chain.watch_controller(cleanup)
        raw = upstream.signed_line(b"header")
        files = json.loads(raw)["files"]
        if len(files) != 1 or int(files[0][1]) != int(expect["size"]):
            raise ValueError(f"expected one archive of {expect['size']} bytes, the upstream sends {files}")
        downstream = chain.accept(listener, token) if listener is not None else None
        with chain.write_file(path) as output:
            hashes, received, _ = chain.pass_on(upstream, downstream, raw,
                                                [(path, int(expect["size"]), 0.0, output)], bool(config.get("progress")))
        if hashes[0][2] != expect["sha256"]:
            raise ValueError(f"the archive received has SHA-256 {hashes[0][2][:12]}..., not the "
                             f"{str(expect['sha256'])[:12]}... sent (did it change on the way?)")
        if upstream is stdin:
            chain.watch_controller(cleanup)  # the stream is in; stdin's end now means the controller left
        loaded = None
        if config.get("load") and runtime is not None:
            chain.emit({"loading": True})
            loaded = load(runtime, path, image, str(expect["id"]))
        return {"ok": True, "bytes": received, "seconds": round(time.monotonic() - started, 3), "id": loaded}
    finally:
        cleanup()
        if listener is not None:
            listener.close()
        if downstream is not None:
            downstream.close()
        if upstream is not None:
            upstream.close()


def main() -> int:
    mode, wanted, image = sys.argv[1:4]
    try:
        if mode == "have":
            chain.emit(have(wanted, image))
            return 0
        return chain.serve(lambda config, stdin: relay(wanted, image, sys.argv[4], config, stdin))
    except (OSError, ValueError, EOFError, KeyError, TypeError, subprocess.SubprocessError) as error:
        chain.emit({"error": str(error) or type(error).__name__})
        return 1


if __name__ == "__main__":
    sys.exit(main())
