"""An image archive on the controller (``--image-archive FILE``, ``[container] archive``): a
``docker save`` / ``podman save`` tar, read for what it holds, never unpacked.

Both formats name the image's config in ``manifest.json``: ``<hex>.json`` (docker's
older format, podman's ``docker-archive``) or ``blobs/sha256/<hex>`` (docker >= 25, OCI
layout). That hex is the image's id, as ``docker``/``podman image inspect`` say it once
it is loaded: a node that already shows it has the very same image.
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass

HINT = "give a file written by docker save -o FILE IMAGE (or podman save -o FILE IMAGE)"


@dataclass(frozen=True)
class ImageArchive:
    path: str
    """Absolute, on the controller."""
    size: int
    image_id: str
    """The config's SHA-256 (hex, without ``sha256:``): the image's id once loaded."""
    tags: tuple[str, ...]
    """The names it was saved under (``RepoTags``)."""


def read_archive(path: str) -> ImageArchive:
    """What the archive at ``path`` holds; ValueError says why it is none (missing,
    unreadable, not a tar, a tar with no image)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ValueError(error.strerror or str(error)) from None
    if os.path.isdir(path):
        raise ValueError("a directory, not an archive")
    try:
        with tarfile.open(path, "r:") as tar:
            try:
                member = tar.getmember("manifest.json")
            except KeyError:
                raise ValueError("a tar without manifest.json: not a docker save / podman save archive") from None
            data = tar.extractfile(member)
            manifest = json.loads(data.read() if data is not None else b"")
    except tarfile.TarError:
        raise ValueError("not a tar archive") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"unreadable manifest.json: {error}") from None
    if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
        raise ValueError("its manifest.json names " + (f"{len(manifest)} images" if isinstance(manifest, list) else
                                                       "no image") + ", not one")
    config = str(manifest[0].get("Config", ""))
    image_id = config.rsplit("/", 1)[-1].removesuffix(".json")
    if len(image_id) != 64 or not all(char in "0123456789abcdef" for char in image_id):
        raise ValueError(f"its manifest.json names no image config ({config[:80]!r})")
    tags = manifest[0].get("RepoTags") or []
    return ImageArchive(os.path.abspath(path), size, image_id, tuple(str(tag) for tag in tags))


def short_name(reference: str) -> str:
    """A reference as docker and podman both resolve it: without the default registry's
    prefixes (``docker.io/library/``, ``localhost/``), with ``:latest`` when untagged."""
    for prefix in ("docker.io/library/", "docker.io/", "localhost/"):
        if reference.startswith(prefix):
            reference = reference[len(prefix):]
            break
    last = reference.rsplit("/", 1)[-1]
    return reference if ":" in last or "@" in last else reference + ":latest"


def holds(archive: ImageArchive, image: str) -> bool:
    """Whether loading ``archive`` gives ``image`` its name (a digest reference is taken as it is:
    an archive has no registry digest to compare)."""
    return "@" in image or short_name(image) in {short_name(tag) for tag in archive.tags}
