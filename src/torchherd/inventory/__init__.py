"""The host inventory: TOML in, frozen dataclasses out.

The file is parsed and validated once (``parse``, reading each table with ``reader``);
nothing downstream sees raw dicts. Every error names the file and the key, says what
was expected, and how to fix it. ``model``: the dataclasses; ``rules``: what a value must
be, whichever door it came through; ``hostspec``: hosts without a TOML file (``-H``,
``--nodelist``, hostfiles, ``--include``/``--exclude``); ``nodeset``: ``gpu[01-16]``;
``writer``: the ``hosts.toml`` that ``torchherd init`` writes; ``tables``: how a
scheduler's own table is read, as the scheduler declares it. This package re-exports
the model, the rules and the parser, as the one module it was did.
"""

from __future__ import annotations

from torchherd.inventory.model import (
    DEFAULT_REPLICATE_BANDWIDTH,
    DEFAULT_REPLICATE_PER_CORE,
    DEFAULT_REPLICATE_SHARE,
    Bandwidth,
    ChecksSettings,
    Cluster,
    ContainerSettings,
    Host,
    Inventory,
    Recovery,
    SyncSettings,
    UvSettings,
)
from torchherd.inventory.parse import (
    CHECKS_KEYS,
    CLUSTER_KEYS,
    CONTAINER_KEYS,
    HOST_KEYS,
    NODE_KEYS,
    RECOVERY_KEYS,
    STEP_KEYS,
    SYNC_KEYS,
    TOP_KEYS,
    UV_KEYS,
    load,
    loads,
    parse,
    read,
    with_container,
    with_spares,
)
from torchherd.inventory.rules import (
    ADDRESS_PATTERN,
    BANDWIDTH,
    BANDWIDTH_HINT,
    C_SPACE,
    CHECKPOINT_HINT,
    CONTROL,
    ENV_NAME,
    HEARTBEAT_HINT,
    HEARTBEAT_RANGE,
    HOST_NAME_PATTERN,
    LOCAL_ADDR,
    MAX_INVENTORY_BYTES,
    MAX_NPROC,
    MAX_REPLICAS,
    MAX_RETRIES,
    MAX_SECONDS,
    MIN_LOST_AFTER,
    MISSES_RANGE,
    NPROC_WORDS,
    RATE,
    RATE_UNITS,
    RDZV_BACKENDS,
    SHELL_HOST_CHARS,
    SHELL_USER_CHARS,
    USER_HINT,
    checkpoint_problem,
    heartbeat_problem,
    parse_bandwidth,
    parse_rate,
    valid_hostname,
    valid_ruser,
)
from torchherd.inventory.tables import Schedulers, SchedulerTable, TableSettings

__all__ = ["ADDRESS_PATTERN", "BANDWIDTH", "BANDWIDTH_HINT", "Bandwidth", "CHECKPOINT_HINT", "CHECKS_KEYS",
           "CLUSTER_KEYS", "CONTAINER_KEYS", "CONTROL", "C_SPACE", "ChecksSettings", "Cluster", "ContainerSettings",
           "DEFAULT_REPLICATE_BANDWIDTH", "DEFAULT_REPLICATE_PER_CORE", "DEFAULT_REPLICATE_SHARE", "ENV_NAME",
           "HEARTBEAT_HINT", "HEARTBEAT_RANGE", "HOST_KEYS", "HOST_NAME_PATTERN", "Host", "Inventory", "LOCAL_ADDR",
           "MAX_INVENTORY_BYTES", "MAX_NPROC", "MAX_REPLICAS", "MAX_RETRIES", "MAX_SECONDS", "MIN_LOST_AFTER",
           "MISSES_RANGE", "NODE_KEYS", "NPROC_WORDS", "RATE", "RATE_UNITS", "RDZV_BACKENDS", "RECOVERY_KEYS",
           "Recovery", "SHELL_HOST_CHARS", "SHELL_USER_CHARS",
           "STEP_KEYS", "SYNC_KEYS", "SchedulerTable", "Schedulers", "SyncSettings", "TableSettings", "TOP_KEYS", "USER_HINT", "UV_KEYS", "UvSettings",
           "checkpoint_problem", "heartbeat_problem", "load", "loads", "parse", "parse_bandwidth", "parse_rate",
           "read", "valid_hostname", "valid_ruser", "with_container", "with_spares"]
