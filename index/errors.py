"""The errors raised when an index on disk cannot be used (`index.store`, `index.table`)."""

from training.cli import UserError


class IndexStoreError(UserError):
    """Base of the errors raised when an index on disk cannot be used."""


class IndexNotFoundError(IndexStoreError):
    """No index at the given folder."""


class IndexCorruptError(IndexStoreError):
    """The index files are incomplete or disagree with each other."""


class IndexMismatchError(IndexStoreError):
    """The index was built from a different checkpoint."""


class IndexLockedError(IndexStoreError):
    """Another process is writing the index folder."""
