"""The DflashError family: every failure a user can cause or fix, each with a message that says what to do."""
from __future__ import annotations

__all__ = [
    "DflashError",
    "InputError",
    "ConfigError",
    "StoreError",
    "StoreUnavailable",
    "ClaimLost",
    "ManifestMismatch",
    "CorruptShard",
    "AssetError",
    "ServerError",
    "ResourceError",
    "PeerError",
]


class DflashError(Exception):
    """Base of every error dflash reports to its user; the CLI prints the message alone and exits 2.

    A message names the path, what was expected, what was found, and the command that fixes it.
    """

    exit_code = 2


class InputError(DflashError):
    """Bad user input: a data file, a model folder, a command-line value."""


class ConfigError(InputError):
    """A configuration value outside what is allowed."""


class StoreError(DflashError):
    """A feature store that cannot be opened, written or trusted."""


class StoreUnavailable(StoreError):
    """A store that cannot be reached or accessed (an endpoint, credentials, a bucket): never taken for "no store"."""


class ClaimLost(StoreError):
    """A writer whose shard claim was taken over (it stalled past the claim's lease): it must not commit the shard."""


class ManifestMismatch(StoreError):
    """A store (or checkpoint) was made with different settings than the ones asked for now."""


class CorruptShard(StoreError):
    """A committed shard whose bytes no longer match its commit record."""


class AssetError(DflashError):
    """A bundled asset (the embedded model, the prompts) is missing or unusable."""


class ServerError(DflashError):
    """A serving endpoint (`dflash generate --server`) that cannot be reached or refuses what is asked."""


class ResourceError(DflashError):
    """Work that does not fit the machine (a row too long for the device's memory), with the options that help."""


class PeerError(DflashError):
    """A rank of a sharded target lost its peers in a collective (one killed, hung, or failed first)."""
